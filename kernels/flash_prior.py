"""Positional flash attention: one Triton kernel family for plain, GOAT and PoPE attention (issue 6).

Online-softmax (flash) attention, forward and backward, whose logits carry a positional prior
computed inside the kernel from small per-position tables, so the widened q'/k' coordinates of the
layers' single-SDPA paths are never written to memory:

* ``mode='plain'``: ``z_ij = scale q_i . k_j``.
* ``mode='goat'`` (GOAT, Sec. 4, Eqs. 11-22): ``z_ij = scale q_c,i . k_c,j + K_rel(p_i - p_j) + u(j)``
  with ``K_rel(d) = sum_a sum_r alpha[h,a,r] cos(w_ar d_a) + beta[h,a,r] sin(w_ar d_a)`` (Eqs. 12, 20).
  Using ``cos w(i-j) = cos wi cos wj + sin wi sin wj`` and ``sin w(i-j) = sin wi cos wj - cos wi sin wj``
  (Eqs. 13-19) the kernel reads one table row ``T_n = [cos(w p_n) | sin(w p_n)]`` (width 2DR) per
  token, builds the query side ``alpha2 * T_i + beta2 * swap(T_i)`` with ``alpha2 = [alpha, alpha]``,
  ``beta2 = [beta, -beta]`` in registers once per query tile, and adds ``(that) . T_j + u_j`` to the
  content logits. Prefix tokens have an all-zero table row (no relative term); their key default is
  whatever ``key_default`` holds in their column.
* ``mode='pope'`` (PoPE, Eqs. 3-6): ``z_ts = scale sum_c mu_q,tc mu_k,sc cos(phi_tc - phi_sc - delta_hc)``
  with ``mu = softplus``, ``phi = pos * w_c``. Each q tile (``mu cos phi``, ``mu sin phi``) and each k
  tile (``mu cos(phi + delta)``, ``mu sin(phi + delta)``) is built once per load from the raw q/k and
  a per-position ``[cos phi | sin phi]`` table; the score is two dots of width d. Prefix tokens have
  phase 0 and (as keys) no delta. In 2D the first d/2 channels use x, the rest y.

The three kernels (forward; backward dK / dV per key tile; backward dQ per query tile) build their
per-mode tiles with the same ``@triton.jit`` helpers (``_query_tile``, ``_key_tile``, ``_logits``).

Masks: ``causal`` (key j <= query i, self-attention) and ``key_mask`` (B, N) bool, **True = valid key**
(the package's one key-mask convention, ``_backend.check_key_mask``); variable lengths are right- (or
any-) padded batches with such a mask. A query row with no valid key outputs zeros and receives zero
gradient. Padded *query* rows are computed normally (the caller ignores them).

Gradients: q, k, v; GOAT: alpha, beta, key_default, and the tables (hence the learned frequencies
and coordinates, by PyTorch autograd through the O(N D R) table construction) when they require
grad; PoPE: the phase bias delta (PoPE positions and frequencies are constants: passing ones that
require grad is an error). alpha/beta/delta gradients are reduced per tile inside the kernel (a few
floats per tile, summed in PyTorch); table gradients need per-row partials (B, H, N, 2DR) and are
only computed when the tables require grad.

Precision: q/k/v fp16, bf16 or fp32; dots take the input dtype (the positional features are cast to
it; PoPE's phase table is stored in it), accumulation, softmax statistics, GOAT's tables and all
gradients of the positional parameters are fp32. ``tl.dot``'s precision follows the one rule of
``_backend.dot_precision`` ('ieee' for fp32 unless PyTorch allows TF32 matmuls; 'ieee' in the
interpreter); ``input_precision`` overrides it per call.

Optional tensors (the key mask, the table-gradient outputs, the tensors a mode does not use) are passed
as None: ``@triton.heuristics`` derive the ``HAS_KEY_MASK`` / ``TAB_GRAD`` flags from them, and
``aot_specs`` derives the kernels' signatures from their parameter lists (``_backend.aot_signature``).

The naive dense reference with the same signature is
``vision_priors.kernels.flash_prior_ref.flash_prior_attention_ref``.
"""
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _backend
from ._backend import (TORCH_TO_TRITON, aot_signature, empty, gpu_dot_precision, interpreting, kernel_function,
                       next_power_of_2)
from .flash_prior_ref import MODES, check_flash_prior_args

__all__ = ['MODES', 'FlashPriorConfig', 'KernelConfig', 'aot_specs', 'choose_config', 'flash_prior_attention',
           'goat_tables', 'pope_tables']

_MODE_ID = {'plain': 0, 'goat': 1, 'pope': 2}
_LOG2E = tl.constexpr(1.4426950408889634)
_MAX_HEAD_DIM = 128


# ----------------------------------------------------------------------------------------------
# Triton device helpers
# ----------------------------------------------------------------------------------------------

@triton.jit
def _softplus(x):
    """log(1 + e^x) without overflow; log1p replaced by its series below 1e-4 (no libdevice)."""
    e = tl.exp(-tl.abs(x))
    return tl.maximum(x, 0.0) + tl.where(e < 1e-4, e * (1.0 - 0.5 * e), tl.log(1.0 + e))


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _load_rows(base, stride_n, offs_n, offs_d, N, D):
    """(len(offs_n), len(offs_d)) tile of a row-major [N, D] slab, zero outside."""
    mask = (offs_n[:, None] < N) & (offs_d[None, :] < D)
    return tl.load(base + offs_n[:, None] * stride_n + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _pope_mag_tables(x_base, stride_xn, tab_base, stride_tn, offs_n, offs_d, N, D):
    """softplus(x) (zero outside) and the position table's cos / sin phi for a tile (fp32)."""
    mask = (offs_n[:, None] < N) & (offs_d[None, :] < D)
    x = tl.load(x_base + offs_n[:, None] * stride_xn + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    mu = tl.where(mask, _softplus(x), 0.0)
    cos_t = tl.load(tab_base + offs_n[:, None] * stride_tn + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    sin_t = tl.load(tab_base + offs_n[:, None] * stride_tn + D + offs_d[None, :], mask=mask,
                    other=0.0).to(tl.float32)
    return mu, cos_t, sin_t


@triton.jit
def _pope_key_rotation(cos_t, sin_t, cos_d, sin_d, offs_n, NUM_PREFIX):
    """cos / sin of (phi + delta) for keys; prefix keys keep phi = 0 and get no delta (PopePhases)."""
    c = cos_t * cos_d[None, :] - sin_t * sin_d[None, :]
    s = sin_t * cos_d[None, :] + cos_t * sin_d[None, :]
    is_prefix = (offs_n < NUM_PREFIX)[:, None]
    return tl.where(is_prefix, cos_t, c), tl.where(is_prefix, sin_t, s)


@triton.jit
def _goat_tables(tab_base, stride_tn, offs_n, offs_p, N, NP):
    """Table tile T = [cos | sin] (width 2 NP) and its half-swapped copy [sin | cos] (fp32)."""
    mask = (offs_n[:, None] < N) & (offs_p[None, :] < 2 * NP)
    swapped = tl.where(offs_p < NP, offs_p + NP, offs_p - NP)
    t = tl.load(tab_base + offs_n[:, None] * stride_tn + offs_p[None, :], mask=mask, other=0.0)
    t_sw = tl.load(tab_base + offs_n[:, None] * stride_tn + swapped[None, :], mask=mask, other=0.0)
    return t, t_sw


@triton.jit
def _pope_phase_bias(DELTA, h, offs_d, D):
    """cos / sin of head h's learned phase bias delta, (BLOCK_D,) each."""
    delta = tl.load(DELTA + h * D + offs_d, mask=offs_d < D, other=0.0)
    return tl.cos(delta), tl.sin(delta)


@triton.jit
def _pope_query_features(q_base, stride_qn, tab_base, stride_tn, offs_m, offs_d, N, D):
    """A query tile's real PoPE features softplus(q) [cos phi, sin phi] as two halves, in q's dtype."""
    mu, cos_t, sin_t = _pope_mag_tables(q_base, stride_qn, tab_base, stride_tn, offs_m, offs_d, N, D)
    dt = q_base.dtype.element_ty
    return (mu * cos_t).to(dt), (mu * sin_t).to(dt)


@triton.jit
def _pope_key_features(k_base, stride_kn, tab_base, stride_tn, offs_n, offs_d, N, D, cos_d, sin_d, NUM_PREFIX):
    """A key tile's real PoPE features softplus(k) [cos(phi + delta), sin(phi + delta)], in k's dtype."""
    mu, cos_t, sin_t = _pope_mag_tables(k_base, stride_kn, tab_base, stride_tn, offs_n, offs_d, N, D)
    c, s = _pope_key_rotation(cos_t, sin_t, cos_d, sin_d, offs_n, NUM_PREFIX)
    dt = k_base.dtype.element_ty
    return (mu * c).to(dt), (mu * s).to(dt)


@triton.jit
def _goat_mode_weights(ALPHA2, BETA2, h, offs_p, NP):
    """Head h's doubled mode weights alpha2, beta2 (width 2 NP, zero outside)."""
    p_ok = offs_p < 2 * NP
    alpha2 = tl.load(ALPHA2 + h * 2 * NP + offs_p, mask=p_ok, other=0.0)
    beta2 = tl.load(BETA2 + h * 2 * NP + offs_p, mask=p_ok, other=0.0)
    return alpha2, beta2


@triton.jit
def _goat_key_prior(tab_base, stride_tn, u_base, offs_n, offs_p, N, NP, dt: tl.constexpr):
    """A key tile's table rows T (in dtype dt) and key-only default u (zero outside)."""
    n_ok = offs_n < N
    t_k = tl.load(tab_base + offs_n[:, None] * stride_tn + offs_p[None, :],
                  mask=n_ok[:, None] & (offs_p[None, :] < 2 * NP), other=0.0).to(dt)
    u = tl.load(u_base + offs_n, mask=n_ok, other=0.0)
    return t_k, u


@triton.jit
def _offset(PTR, offset, USED: tl.constexpr):
    """``PTR + offset`` for a tensor the launch uses; ``PTR`` itself (None) otherwise."""
    base = PTR
    if USED:
        base = PTR + offset
    return base


@triton.jit
def _key_valid(KEY_MASK, row_offset, offs_n, N, HAS_KEY_MASK: tl.constexpr):
    """Keys inside the sequence and, with a key mask (True = valid), marked valid."""
    ok = offs_n < N
    if HAS_KEY_MASK:
        valid = tl.load(KEY_MASK + row_offset + offs_n, mask=ok, other=0)
        ok = ok & (valid != 0)
    return ok


@triton.jit
def _head_constants(ALPHA2, BETA2, DELTA, h, offs_d, offs_p, D_QK, NP, MODE: tl.constexpr):
    """Head h's constants of the prior: GOAT's doubled mode weights (alpha2, beta2; zero outside 2 NP) and
    PoPE's (cos delta, sin delta). The ones a mode does not use are placeholders."""
    alpha2 = offs_p
    beta2 = offs_p
    cos_d = offs_d
    sin_d = offs_d
    if MODE == 1:
        alpha2, beta2 = _goat_mode_weights(ALPHA2, BETA2, h, offs_p, NP)
    if MODE == 2:
        cos_d, sin_d = _pope_phase_bias(DELTA, h, offs_d, D_QK)
    return alpha2, beta2, cos_d, sin_d


@triton.jit
def _query_tile(q_base, stride_qn, tab_base, stride_tn, offs_m, offs_d, offs_p, N, D_QK, NP, alpha2, beta2,
                MODE: tl.constexpr):
    """A query tile's features in q's dtype: ``qa`` (plain / GOAT: q; PoPE: softplus(q) cos phi), ``qb``
    (PoPE: softplus(q) sin phi) and ``q_rel`` (GOAT: alpha2 * T + beta2 * swap(T)); placeholders otherwise."""
    if MODE == 2:
        qa, qb = _pope_query_features(q_base, stride_qn, tab_base, stride_tn, offs_m, offs_d, N, D_QK)
    else:
        qa = _load_rows(q_base, stride_qn, offs_m, offs_d, N, D_QK)
        qb = qa
    q_rel = qa
    if MODE == 1:
        t_q, t_sw = _goat_tables(tab_base, stride_tn, offs_m, offs_p, N, NP)
        q_rel = (alpha2[None, :] * t_q + beta2[None, :] * t_sw).to(q_base.dtype.element_ty)
    return qa, qb, q_rel


@triton.jit
def _key_tile(k_base, stride_kn, tab_base, stride_tn, u_base, offs_n, offs_d, offs_p, N, D_QK, NP, cos_d, sin_d,
              NUM_PREFIX, MODE: tl.constexpr):
    """A key tile's features in k's dtype: ``ka`` (plain / GOAT: k; PoPE: softplus(k) cos(phi + delta)),
    ``kb`` (PoPE: softplus(k) sin(phi + delta)), GOAT's table rows ``t_k`` and key defaults ``u`` (fp32);
    placeholders otherwise."""
    if MODE == 2:
        ka, kb = _pope_key_features(k_base, stride_kn, tab_base, stride_tn, offs_n, offs_d, N, D_QK,
                                    cos_d, sin_d, NUM_PREFIX)
    else:
        ka = _load_rows(k_base, stride_kn, offs_n, offs_d, N, D_QK)
        kb = ka
    t_k = ka
    u = offs_n
    if MODE == 1:
        t_k, u = _goat_key_prior(tab_base, stride_tn, u_base, offs_n, offs_p, N, NP, k_base.dtype.element_ty)
    return ka, kb, t_k, u


@triton.jit
def _logits(a1, a2, a_rel, b1, b2, b_rel, u, qk_scale, MODE: tl.constexpr, U_ON_ROWS: tl.constexpr,
            INPUT_PRECISION: tl.constexpr):
    """Base-2 logits of one tile between row features ``a`` and column features ``b`` (queries x keys, or
    keys x queries in the dK / dV kernel): ``scale (a1 . b1 [+ PoPE: a2 . b2]) [+ GOAT: a_rel . b_rel + u]``,
    times log2(e); ``u`` (the keys' defaults) runs along the rows if ``U_ON_ROWS``, else the columns."""
    s = tl.dot(a1, tl.trans(b1), input_precision=INPUT_PRECISION)
    if MODE == 2:
        s = tl.dot(a2, tl.trans(b2), s, input_precision=INPUT_PRECISION)
    s = s * qk_scale
    if MODE == 1:
        prior = tl.dot(a_rel, tl.trans(b_rel), input_precision=INPUT_PRECISION)
        if U_ON_ROWS:
            prior = prior + u[:, None]
        else:
            prior = prior + u[None, :]
        s += prior * _LOG2E
    return s


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

@triton.heuristics({'HAS_KEY_MASK': lambda args: args['KEY_MASK'] is not None})
@triton.jit
def _flash_prior_fwd(
        Q, K, V, OUT, LSE, KEY_MASK, TAB, ALPHA2, BETA2, U, DELTA,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_on,
        stride_mb, stride_tb, stride_tn, stride_ub, stride_uh,
        H, N, D_QK, D_V, NP, NUM_PREFIX, sm_scale,
        MODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_P: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One (query tile, batch * head): O = softmax(z) V and the base-2 log-sum-exp of every row."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    DT = Q.dtype.element_ty
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    tab_base = _offset(TAB, b * stride_tb, MODE != 0)
    u_base = _offset(U, b * stride_ub + h * stride_uh, MODE == 1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_p = tl.arange(0, BLOCK_P)
    qk_scale = sm_scale * _LOG2E

    # query-side features, built once for this tile
    alpha2, beta2, cos_d, sin_d = _head_constants(ALPHA2, BETA2, DELTA, h, offs_dq, offs_p, D_QK, NP, MODE)
    qa, qb, q_rel = _query_tile(q_base, stride_qn, tab_base, stride_tn, offs_m, offs_dq, offs_p, N, D_QK, NP,
                                alpha2, beta2, MODE)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    else:
        hi = N
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_nb
        ka, kb, t_k, u = _key_tile(k_base, stride_kn, tab_base, stride_tn, u_base, offs_n, offs_dq, offs_p, N,
                                   D_QK, NP, cos_d, sin_d, NUM_PREFIX, MODE)
        s = _logits(qa, qb, q_rel, ka, kb, t_k, u, qk_scale, MODE, False, INPUT_PRECISION)
        valid = _key_valid(KEY_MASK, b * stride_mb, offs_n, N, HAS_KEY_MASK)[None, :]
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        s = tl.where(valid, s, float('-inf'))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        corr = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * corr + tl.sum(p, 1)
        v = _load_rows(v_base, stride_vn, offs_n, offs_dv, N, D_V)
        acc = acc * corr[:, None]
        acc = tl.dot(p.to(DT), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float('inf'))
    m_ok = offs_m < N
    o_ptr = OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_dv[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & (offs_dv[None, :] < D_V))
    tl.store(LSE + pid_bh.to(tl.int64) * N + offs_m, lse, mask=m_ok)


# ----------------------------------------------------------------------------------------------
# Backward: dK, dV (and du, key-side table grads, delta partials) per key tile
# ----------------------------------------------------------------------------------------------

@triton.heuristics({'HAS_KEY_MASK': lambda args: args['KEY_MASK'] is not None,
                    'TAB_GRAD': lambda args: args['GK'] is not None})
@triton.jit
def _flash_prior_bwd_dkdv(
        Q, K, V, DO, LSE, DSUM, DK, DV, DU, GK, DDELTA, KEY_MASK, TAB, ALPHA2, BETA2, U, DELTA,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_don,
        stride_dkb, stride_dkh, stride_dkn,
        stride_dvb, stride_dvh, stride_dvn,
        stride_mb, stride_tb, stride_tn, stride_ub, stride_uh,
        H, N, D_QK, D_V, NP, NUM_PREFIX, NUM_NT, sm_scale,
        MODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, TAB_GRAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_P: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One (key tile, batch * head): dV = P^T dO, dK = scale dS^T Q, plus the prior's key-side grads."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    DT = Q.dtype.element_ty
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    do_base = DO + b * stride_dob + h * stride_doh
    tab_base = _offset(TAB, b * stride_tb, MODE != 0)
    u_base = _offset(U, b * stride_ub + h * stride_uh, MODE == 1)
    row_base = pid_bh.to(tl.int64) * N

    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_p = tl.arange(0, BLOCK_P)
    n_ok = offs_n < N
    qk_scale = sm_scale * _LOG2E

    alpha2, beta2, cos_d, sin_d = _head_constants(ALPHA2, BETA2, DELTA, h, offs_dq, offs_p, D_QK, NP, MODE)
    ka, kb, t_k, u = _key_tile(k_base, stride_kn, tab_base, stride_tn, u_base, offs_n, offs_dq, offs_p, N,
                               D_QK, NP, cos_d, sin_d, NUM_PREFIX, MODE)
    if MODE == 2:
        dkb = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    if MODE == 1:
        g_k = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)
        d_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    v = _load_rows(v_base, stride_vn, offs_n, offs_dv, N, D_V)
    k_ok = _key_valid(KEY_MASK, b * stride_mb, offs_n, N, HAS_KEY_MASK)
    dka = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    for start_m in range(lo, N, BLOCK_M):
        offs_m = start_m + offs_mb
        m_ok = offs_m < N
        qa, qb, q_rel = _query_tile(q_base, stride_qn, tab_base, stride_tn, offs_m, offs_dq, offs_p, N, D_QK, NP,
                                    alpha2, beta2, MODE)
        s_t = _logits(ka, kb, t_k, qa, qb, q_rel, u, qk_scale, MODE, True, INPUT_PRECISION)
        lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=float('inf'))
        dsum = tl.load(DSUM + row_base + offs_m, mask=m_ok, other=0.0)
        valid = k_ok[:, None] & m_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
        p_t = tl.where(valid, tl.exp2(s_t - lse[None, :]), 0.0)
        do = _load_rows(do_base, stride_don, offs_m, offs_dv, N, D_V)
        dv = tl.dot(p_t.to(DT), do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - dsum[None, :])  # dL/dz^T in natural-log units
        ds_lo = ds_t.to(DT)
        dka = tl.dot(ds_lo, qa, dka, input_precision=INPUT_PRECISION)
        if MODE == 2:
            dkb = tl.dot(ds_lo, qb, dkb, input_precision=INPUT_PRECISION)
        if MODE == 1:
            g_k = tl.dot(ds_lo, q_rel, g_k, input_precision=INPUT_PRECISION)
            d_u += tl.sum(ds_t, 1)

    dv_ptr = DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :]
    tl.store(dv_ptr, dv.to(DV.dtype.element_ty), mask=n_ok[:, None] & (offs_dv[None, :] < D_V))
    dk_ptr = DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dkn + offs_dq[None, :]
    dk_mask = n_ok[:, None] & (offs_dq[None, :] < D_QK)
    if MODE == 2:
        # z depends on k through mu_k * [cos(phi + delta), sin(phi + delta)] (Eq. 10's real features)
        # recomputed here (cheap) rather than kept live across the loop
        mu_k, cos_k, sin_k = _pope_mag_tables(k_base, stride_kn, tab_base, stride_tn, offs_n, offs_dq, N, D_QK)
        c_k, s_k = _pope_key_rotation(cos_k, sin_k, cos_d, sin_d, offs_n, NUM_PREFIX)
        dka = dka * sm_scale
        dkb = dkb * sm_scale
        d_mu = dka * c_k + dkb * s_k
        k_raw = _load_rows(k_base, stride_kn, offs_n, offs_dq, N, D_QK).to(tl.float32)
        tl.store(dk_ptr, (d_mu * _sigmoid(k_raw)).to(DK.dtype.element_ty), mask=dk_mask)
        d_phase = mu_k * (dkb * c_k - dka * s_k)
        d_phase = tl.where((offs_n >= NUM_PREFIX)[:, None], d_phase, 0.0)
        tl.store(DDELTA + (pid_bh.to(tl.int64) * NUM_NT + pid_n) * D_QK + offs_dq, tl.sum(d_phase, 0),
                 mask=offs_dq < D_QK)
    else:
        tl.store(dk_ptr, (dka * sm_scale).to(DK.dtype.element_ty), mask=dk_mask)
    if MODE == 1:
        tl.store(DU + row_base + offs_n, d_u, mask=n_ok)
        if TAB_GRAD:
            gk_ptr = GK + (row_base + offs_n[:, None]) * (2 * NP) + offs_p[None, :]
            tl.store(gk_ptr, g_k, mask=n_ok[:, None] & (offs_p < 2 * NP)[None, :])


# ----------------------------------------------------------------------------------------------
# Backward: dQ (and alpha / beta partials, query-side table grads) per query tile
# ----------------------------------------------------------------------------------------------

@triton.heuristics({'HAS_KEY_MASK': lambda args: args['KEY_MASK'] is not None,
                    'TAB_GRAD': lambda args: args['GQ'] is not None})
@triton.jit
def _flash_prior_bwd_dq(
        Q, K, V, DO, LSE, DSUM, DQ, GQ, DAB, KEY_MASK, TAB, ALPHA2, BETA2, U, DELTA,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_don,
        stride_dqb, stride_dqh, stride_dqn,
        stride_mb, stride_tb, stride_tn, stride_ub, stride_uh,
        H, N, D_QK, D_V, NP, NUM_PREFIX, NUM_MT, sm_scale,
        MODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, TAB_GRAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_P: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One (query tile, batch * head): dQ = scale dS K, plus alpha / beta partial sums of this tile."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    DT = Q.dtype.element_ty
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    tab_base = _offset(TAB, b * stride_tb, MODE != 0)
    u_base = _offset(U, b * stride_ub + h * stride_uh, MODE == 1)
    row_base = pid_bh.to(tl.int64) * N

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_p = tl.arange(0, BLOCK_P)
    m_ok = offs_m < N
    qk_scale = sm_scale * _LOG2E

    alpha2, beta2, cos_d, sin_d = _head_constants(ALPHA2, BETA2, DELTA, h, offs_dq, offs_p, D_QK, NP, MODE)
    qa, qb, q_rel = _query_tile(q_base, stride_qn, tab_base, stride_tn, offs_m, offs_dq, offs_p, N, D_QK, NP,
                                alpha2, beta2, MODE)
    if MODE == 2:
        dqb = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    if MODE == 1:
        g_q = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=float('inf'))
    dsum = tl.load(DSUM + row_base + offs_m, mask=m_ok, other=0.0)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, stride_don, offs_m, offs_dv, N, D_V)
    dqa = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)

    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    else:
        hi = N
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_nb
        ka, kb, t_k, u = _key_tile(k_base, stride_kn, tab_base, stride_tn, u_base, offs_n, offs_dq, offs_p, N,
                                   D_QK, NP, cos_d, sin_d, NUM_PREFIX, MODE)
        s = _logits(qa, qb, q_rel, ka, kb, t_k, u, qk_scale, MODE, False, INPUT_PRECISION)
        valid = _key_valid(KEY_MASK, b * stride_mb, offs_n, N, HAS_KEY_MASK)[None, :] & m_ok[:, None]
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        v = _load_rows(v_base, stride_vn, offs_n, offs_dv, N, D_V)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = (p * (dp - dsum[:, None])).to(DT)
        dqa = tl.dot(ds, ka, dqa, input_precision=INPUT_PRECISION)
        if MODE == 2:
            dqb = tl.dot(ds, kb, dqb, input_precision=INPUT_PRECISION)
        if MODE == 1:
            g_q = tl.dot(ds, t_k, g_q, input_precision=INPUT_PRECISION)

    dq_ptr = DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_dq[None, :]
    dq_mask = m_ok[:, None] & (offs_dq[None, :] < D_QK)
    if MODE == 2:
        mu_q, cos_q, sin_q = _pope_mag_tables(q_base, stride_qn, tab_base, stride_tn, offs_m, offs_dq, N, D_QK)
        d_mu = (dqa * cos_q + dqb * sin_q) * sm_scale
        q_raw = _load_rows(q_base, stride_qn, offs_m, offs_dq, N, D_QK).to(tl.float32)
        tl.store(dq_ptr, (d_mu * _sigmoid(q_raw)).to(DQ.dtype.element_ty), mask=dq_mask)
    else:
        tl.store(dq_ptr, (dqa * sm_scale).to(DQ.dtype.element_ty), mask=dq_mask)
    if MODE == 1:
        # q_rel = alpha2 * T + beta2 * swap(T): this tile's share of dL/dalpha2 and dL/dbeta2
        p_ok = offs_p < 2 * NP
        t_q, t_sw = _goat_tables(tab_base, stride_tn, offs_m, offs_p, N, NP)
        dab_base = DAB + (pid_bh.to(tl.int64) * NUM_MT + pid_m) * (4 * NP)
        tl.store(dab_base + offs_p, tl.sum(g_q * t_q, 0), mask=p_ok)
        tl.store(dab_base + 2 * NP + offs_p, tl.sum(g_q * t_sw, 0), mask=p_ok)
        if TAB_GRAD:
            gq_ptr = GQ + (row_base + offs_m[:, None]) * (2 * NP) + offs_p[None, :]
            tl.store(gq_ptr, g_q, mask=m_ok[:, None] & p_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Configuration (shared by the runtime and aot_specs)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class FlashPriorConfig:
    """Launch parameters of the three kernels of one (head dim, dtype, mode, device) case."""
    fwd: KernelConfig
    bwd_dkdv: KernelConfig
    bwd_dq: KernelConfig
    input_precision: str


_OTHER_FORM: Dict[bool, Any] = {}


def _kernels(interpret: bool) -> Tuple[Any, Any, Any]:
    """(fwd, bwd_dkdv, bwd_dq) in interpreter or compiler form, whichever mode this module was imported in.

    ``@triton.jit`` picks its form at import, and these kernels call helper ``@triton.jit`` functions
    that must be in the same form; when the current mode differs from the import mode (e.g. the
    module was imported with TRITON_INTERPRET unset and a test sets it later), a private copy of this
    file is loaded once under the wanted mode. The interpreter also needs Triton itself (its
    ``tl`` library functions) imported with TRITON_INTERPRET=1: otherwise a clear error.
    """
    from triton.runtime.interpreter import InterpretedFunction
    if interpret and not interpreting():
        raise RuntimeError('TRITON_INTERPRET=1 was set after triton was imported in compiler mode; Triton\'s '
                           'interpreter needs it set before the first `import triton` of the process')
    module: Any = sys.modules[__name__]
    if isinstance(kernel_function(_flash_prior_fwd), InterpretedFunction) != interpret:
        if interpret not in _OTHER_FORM:
            name = f'{__name__}__{"interpreted" if interpret else "compiled"}'
            spec = importlib.util.spec_from_file_location(name, __file__)
            copy = importlib.util.module_from_spec(spec)
            sys.modules[name] = copy  # triton.jit reads the source through the module
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = interpret
                spec.loader.exec_module(copy)
            _OTHER_FORM[interpret] = copy
        module = _OTHER_FORM[interpret]
    return module._flash_prior_fwd, module._flash_prior_bwd_dkdv, module._flash_prior_bwd_dq


# Default GPU launch parameters (sm_80 and sm_90 alike) per (mode, padded head dim) for 16-bit
# inputs: (fwd, bwd_dkdv, bwd_dq) as KernelConfig(block_m, block_n, num_warps, num_stages). Chosen
# with ``ptxas -v`` (Triton 3.8's bundled ptxas; all 108 aot_specs x sm_80 / sm_90): no register
# spills, shared memory within a block's limit. Comments: registers per thread, max over fp16 / bf16
# and causal or not, sm_80 / sm_90. Head dim 16 uses the 32 row. PoPE carries two feature tiles per
# operand (an effective width 2d), hence its smaller tiles. Not tuned on a GPU: on an H200 (README, Results / GPU)
# the plain kernel reached 0.6x of SDPA's flash backend with them at 16K tokens. (*) GOAT d64 dQ: one
# stage since the kernels build their tiles with the shared helpers (two stages spilled 32 B on sm_80).
_K = KernelConfig
_GPU_TILES: Dict[Tuple[str, int], Tuple[KernelConfig, KernelConfig, KernelConfig]] = {
    ('plain', 32): (_K(128, 64, 4, 3), _K(64, 64, 4, 2), _K(64, 64, 4, 2)),  # 185/168, 166/162, 185/145
    ('plain', 64): (_K(128, 64, 8, 3), _K(32, 64, 4, 2), _K(64, 64, 4, 2)),  # 181/122, 185/157, 194/180
    ('plain', 128): (_K(128, 64, 8, 3), _K(64, 64, 8, 2), _K(64, 64, 8, 2)),  # 199/170, 178/218, 179/190
    ('goat', 32): (_K(64, 64, 4, 3), _K(32, 64, 4, 2), _K(64, 32, 4, 2)),  # 188/163, 181/152, 186/149
    ('goat', 64): (_K(128, 64, 8, 3), _K(32, 64, 8, 2), _K(64, 64, 8, 1)),  # 221/223, 255/177, 255/238 (*)
    ('goat', 128): (_K(128, 32, 8, 3), _K(32, 32, 8, 1), _K(64, 32, 8, 2)),  # 255/191, 193/194, 255/186
    ('pope', 32): (_K(64, 64, 4, 3), _K(32, 64, 8, 2), _K(64, 32, 4, 2)),  # 181/143, 182/144, 255/188
    ('pope', 64): (_K(128, 64, 8, 2), _K(64, 32, 8, 2), _K(32, 32, 4, 2)),  # 184/200, 177/179, 228/225
    ('pope', 128): (_K(128, 32, 8, 2), _K(32, 32, 8, 1), _K(32, 32, 8, 1)),  # 213/213, 211/195, 250/249
}


# fp32 inputs (rare on GPU: autocast gives 16-bit). With IEEE dots (the one rule, ``_backend.dot_precision``)
# tl.dot runs on FMA units and holds both operands in registers, so the tiles are small. ptxas:
# no spills for head dims 32 and 64; at 128 the backward dQ kernel still spills (about 200-500 B per
# thread in every tile tried down to 16 x 16): correct but slow, use 16-bit inputs there.
_GPU_TILES_FP32: Dict[Tuple[str, int], Tuple[KernelConfig, KernelConfig, KernelConfig]] = {}
for _mode in MODES:
    _GPU_TILES_FP32[(_mode, 32)] = (_K(32, 32, 4, 1), _K(32, 16, 4, 1), _K(16, 32, 4, 1))
    _GPU_TILES_FP32[(_mode, 64)] = (_K(32, 32, 4, 1), _K(16, 32, 4, 1),
                                    _K(16, 16, 4, 1) if _mode == 'goat' else _K(16, 32, 4, 1))
    _GPU_TILES_FP32[(_mode, 128)] = (_K(32, 16, 8, 1), _K(16, 32, 8, 1), _K(16, 32, 8, 1))
del _mode


def choose_config(head_dim: int, dtype: torch.dtype, mode: str,
                  device: Union[torch.device, str]) -> FlashPriorConfig:
    """Tiles, warps, stages and dot precision the runtime uses on ``device`` (and ``aot_specs`` lists).

    Args:
        head_dim: The wider of the q/k and v head widths (GOAT: d_h; PoPE / plain: d).
        dtype: Input dtype (fp16, bf16 or fp32).
        mode: 'plain', 'goat' or 'pope'.
        device: Device of the inputs; CPU means the Triton interpreter (16 x 16 tiles, 'ieee').
    """
    if mode not in MODES:
        raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
    device = torch.device(device)
    width = next_power_of_2(head_dim)
    if width > _MAX_HEAD_DIM:
        raise ValueError(f'head dim {head_dim} exceeds the supported maximum {_MAX_HEAD_DIM}')
    if device.type != 'cuda':
        small = KernelConfig(16, 16, 1, 1)
        return FlashPriorConfig(small, small, small, 'ieee')
    fwd, dkdv, dq = _GPU_TILES[(mode, max(32, width))]
    if dtype == torch.float32:  # fp32 operands: twice the bytes per tile element
        fwd, dkdv, dq = _GPU_TILES_FP32.get((mode, max(32, width)), (fwd, dkdv, dq))
    # the one rule of every kernel: fp32 'ieee' unless PyTorch allows TF32 matmuls; 16-bit operands ignore it
    return FlashPriorConfig(fwd, dkdv, dq, gpu_dot_precision(dtype, torch.backends.cuda.matmul.allow_tf32))


# ----------------------------------------------------------------------------------------------
# Python side: tables, validation, autograd
# ----------------------------------------------------------------------------------------------

def _with_prefix_rows(rows: Tensor, num_prefix: int, fill: float) -> Tensor:
    if num_prefix == 0:
        return rows
    pad = torch.full((*rows.shape[:-2], num_prefix, rows.shape[-1]), fill, dtype=rows.dtype, device=rows.device)
    return torch.cat([pad, rows], dim=-2)


def goat_tables(coords: Tensor, freqs: Tensor, num_prefix_tokens: int = 0) -> Tensor:
    """Per-token GOAT table rows ``[cos(w_ar p_a) | sin(w_ar p_a)]`` (index a * R + r), width 2DR.

    Args:
        coords: (M, D) or (B, M, D) coordinates of the non-prefix tokens.
        freqs: (D, R) mode frequencies w_ar.
        num_prefix_tokens: P leading tokens without coordinates: all-zero rows (no relative term).

    Returns:
        (1 or B, P + M, 2 D R) float32, differentiable in ``coords`` and ``freqs``.
    """
    if coords.dim() == 2:
        coords = coords.unsqueeze(0)
    phase = (coords.unsqueeze(-1) * freqs).flatten(-2).float()  # (B, M, D * R)
    return _with_prefix_rows(torch.cat([phase.cos(), phase.sin()], dim=-1), num_prefix_tokens, 0.0)


def pope_tables(coords: Tensor, freqs: Tensor, num_prefix_tokens: int = 0) -> Tensor:
    """Per-token PoPE table rows ``[cos phi | sin phi]``, phi_c = p_{axis(c)} w_c, width 2d.

    Channel c belongs to axis ``c // (d / D)`` and uses ``freqs[axis, c % (d / D)]`` (PopePhases).
    Prefix tokens get phase 0 (rows [1..1 | 0..0]).

    Returns:
        (1 or B, P + M, 2 d) float32.
    """
    if coords.dim() == 2:
        coords = coords.unsqueeze(0)
    phase = (coords.unsqueeze(-1) * freqs).flatten(-2).float()  # (B, M, d)
    table = torch.cat([phase.cos(), phase.sin()], dim=-1)
    if num_prefix_tokens:
        d = phase.shape[-1]
        pad = torch.cat([torch.ones(d), torch.zeros(d)]).to(table)
        table = torch.cat([pad.expand(*table.shape[:-2], num_prefix_tokens, 2 * d), table], dim=-2)
    return table


def _bhn_strides(x: Tensor) -> Tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _pos_strides(key_mask: Optional[Tensor], table: Optional[Tensor],
                 u: Optional[Tensor]) -> Tuple[int, int, int, int, int]:
    """Batch / row strides of the key mask, the (1 or B, N, 2 NP) table and the (H, N) / (B, H, N) key
    default; a broadcast batch dimension gets stride 0; absent tensors get zeros."""
    return (key_mask.stride(0) if key_mask is not None else 0,
            table.stride(0) if table is not None and table.shape[0] > 1 else 0,
            table.stride(1) if table is not None else 0,
            u.stride(0) if u is not None and u.dim() == 3 and u.shape[0] > 1 else 0,
            u.stride(-2) if u is not None else 0)


def _block_p(mode: str, half_width: int) -> int:
    return next_power_of_2(2 * half_width) if mode == 'goat' else 16


class _FlashPriorFunction(torch.autograd.Function):
    """Autograd wrapper of the three kernels (positional inputs: fp32, PoPE table in the input dtype;
    None where a mode does not use them)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, table: Optional[Tensor], alpha2: Optional[Tensor],
                beta2: Optional[Tensor], u: Optional[Tensor], delta: Optional[Tensor], key_mask: Optional[Tensor],
                mode: str, causal: bool, scale: float, num_prefix: int, half_width: int,
                config: FlashPriorConfig) -> Tensor:
        B, H, N, d_qk = q.shape
        d_v = v.shape[-1]
        out = empty(B, H, N, d_v, dtype=q.dtype, device=q.device)
        lse = empty(B, H, N, dtype=torch.float32, device=q.device)
        fc = config.fwd
        grid = (triton.cdiv(N, fc.block_m), B * H)
        fwd_kernel = _kernels(interpreting())[0]
        fwd_kernel[grid](
            q, k, v, out, lse, key_mask, table, alpha2, beta2, u, delta,
            *_bhn_strides(q), *_bhn_strides(k), *_bhn_strides(v), *_bhn_strides(out),
            *_pos_strides(key_mask, table, u),
            H, N, d_qk, d_v, half_width, num_prefix, scale,
            MODE=_MODE_ID[mode], CAUSAL=causal,
            BLOCK_M=fc.block_m, BLOCK_N=fc.block_n, BLOCK_DQK=next_power_of_2(d_qk),
            BLOCK_DV=next_power_of_2(d_v), BLOCK_P=_block_p(mode, half_width),
            INPUT_PRECISION=config.input_precision, num_warps=fc.num_warps, num_stages=fc.num_stages)
        ctx.save_for_backward(q, k, v, out, lse, table, alpha2, beta2, u, delta, key_mask)
        ctx.meta = (mode, causal, scale, num_prefix, half_width, config)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor):
        q, k, v, out, lse, table, alpha2, beta2, u, delta, key_mask = ctx.saved_tensors
        mode, causal, scale, num_prefix, half_width, config = ctx.meta
        B, H, N, d_qk = q.shape
        d_v = v.shape[-1]
        dev = q.device
        grad_out = grad_out.contiguous()
        dsum = (grad_out.float() * out.float()).sum(-1).contiguous()  # rowsum(dO * O), (B, H, N)
        tab_grad = mode == 'goat' and ctx.needs_input_grad[3]
        np2 = 2 * half_width
        dq = empty(q.shape, dtype=q.dtype, device=dev)
        dk = empty(k.shape, dtype=k.dtype, device=dev)
        dv = empty(v.shape, dtype=v.dtype, device=dev)
        common = dict(MODE=_MODE_ID[mode], CAUSAL=causal, BLOCK_DQK=next_power_of_2(d_qk),
                      BLOCK_DV=next_power_of_2(d_v), BLOCK_P=_block_p(mode, half_width),
                      INPUT_PRECISION=config.input_precision)
        pos_strides = _pos_strides(key_mask, table, u)

        kc = config.bwd_dkdv
        num_nt = triton.cdiv(N, kc.block_n)
        du = empty(B, H, N, dtype=torch.float32, device=dev) if mode == 'goat' else None
        gk = empty(B, H, N, np2, dtype=torch.float32, device=dev) if tab_grad else None
        ddelta = empty(B, H, num_nt, d_qk, dtype=torch.float32, device=dev) if mode == 'pope' else None
        _, dkdv_kernel, dq_kernel = _kernels(interpreting())
        dkdv_kernel[(num_nt, B * H)](
            q, k, v, grad_out, lse, dsum, dk, dv, du, gk, ddelta, key_mask, table, alpha2, beta2, u, delta,
            *_bhn_strides(q), *_bhn_strides(k), *_bhn_strides(v), *_bhn_strides(grad_out),
            *_bhn_strides(dk), *_bhn_strides(dv), *pos_strides,
            H, N, d_qk, d_v, half_width, num_prefix, num_nt, scale,
            BLOCK_M=kc.block_m, BLOCK_N=kc.block_n, num_warps=kc.num_warps, num_stages=kc.num_stages, **common)

        qc = config.bwd_dq
        num_mt = triton.cdiv(N, qc.block_m)
        gq = empty(B, H, N, np2, dtype=torch.float32, device=dev) if tab_grad else None
        dab = empty(B, H, num_mt, 2, np2, dtype=torch.float32, device=dev) if mode == 'goat' else None
        dq_kernel[(num_mt, B * H)](
            q, k, v, grad_out, lse, dsum, dq, gq, dab, key_mask, table, alpha2, beta2, u, delta,
            *_bhn_strides(q), *_bhn_strides(k), *_bhn_strides(v), *_bhn_strides(grad_out),
            *_bhn_strides(dq), *pos_strides,
            H, N, d_qk, d_v, half_width, num_prefix, num_mt, scale,
            BLOCK_M=qc.block_m, BLOCK_N=qc.block_n, num_warps=qc.num_warps, num_stages=qc.num_stages, **common)

        d_table = d_alpha2 = d_beta2 = d_u = d_delta = None
        if mode == 'goat':
            d_alpha2 = dab[:, :, :, 0].sum(dim=(0, 2))
            d_beta2 = dab[:, :, :, 1].sum(dim=(0, 2))
            d_u = du if u.dim() == 3 and u.shape[0] == B else du.sum(0).reshape(u.shape)
            if tab_grad:
                # key role: T_j directly; query role: alpha2 * T_i + beta2 * swap(T_i)
                q_side = gq * alpha2[None, :, None, :]
                q_swapped = gq * beta2[None, :, None, :]
                q_side = q_side + torch.cat([q_swapped[..., half_width:], q_swapped[..., :half_width]], dim=-1)
                d_table = (gk + q_side).sum(1)
                if table.shape[0] == 1:
                    d_table = d_table.sum(0, keepdim=True)
        if mode == 'pope':
            d_delta = ddelta.sum(dim=(0, 2))
        return (dq, dk, dv, d_table, d_alpha2, d_beta2, d_u, d_delta,
                None, None, None, None, None, None, None)


def flash_prior_attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mode: str = 'plain',
        causal: bool = False,
        key_mask: Optional[Tensor] = None,
        scale: Optional[float] = None,
        coords: Optional[Tensor] = None,
        freqs: Optional[Tensor] = None,
        num_prefix_tokens: int = 0,
        alpha: Optional[Tensor] = None,
        beta: Optional[Tensor] = None,
        key_default: Optional[Tensor] = None,
        phase_bias: Optional[Tensor] = None,
        input_precision: Optional[str] = None,
) -> Tensor:
    """Flash attention with an in-kernel positional prior (plain / GOAT Eqs. 11-22 / PoPE Eqs. 3-6).

    Args:
        q, k: (B, H, N, d_qk) queries / keys (GOAT: the content part, width d_c; PoPE: pre-softplus).
            Any strides with a unit last stride.
        v: (B, H, N, d_v) values (GOAT: d_v = d_h; PoPE: d_v = d_qk).
        mode: 'plain', 'goat' or 'pope'.
        causal: Key j attends only to queries i >= j.
        key_mask: (B, N) bool, True = valid key (the package's one key-mask convention); False keys are
            ignored.
        scale: Content-logit scale; default d_qk ** -0.5.
        coords: GOAT / PoPE: (N - P, D) or (B, N - P, D) coordinates of the non-prefix tokens.
        freqs: GOAT: (D, R) mode frequencies (may require grad: learned frequencies). PoPE: (D, d / D)
            per-axis channel ladders (constant).
        num_prefix_tokens: P leading tokens without coordinates.
        alpha, beta: GOAT: (H, D, R) Fourier coefficients.
        key_default: GOAT: (H, N) or (B, H, N) key-only default u_h(j) of all N keys (prefix columns
            included); gradient flows back to it.
        phase_bias: PoPE: (H, d) delta (any real value; cos is periodic).
        input_precision: ``tl.dot`` precision for fp32 inputs ('ieee', 'tf32', 'tf32x3'); default the one
            rule of ``_backend.dot_precision``.

    Returns:
        (B, H, N, d_v) in the input dtype. A query with no valid key gets zeros.

    Raises:
        ValueError: a bad mode, shape, dtype or device (naming the offending argument), a head dim
            over 128, CPU tensors without the interpreter (``_backend.interpreting``: TRITON_INTERPRET=1 set
            before Triton's first import), PoPE positions that require grad.
        TypeError: a ``key_mask`` that is not a bool tensor.
    """
    check_flash_prior_args(q, k, v, mode, causal, key_mask, coords, freqs, num_prefix_tokens, alpha, beta,
                           key_default, phase_bias, (torch.float16, torch.bfloat16, torch.float32))
    if next_power_of_2(max(q.shape[-1], v.shape[-1])) > _MAX_HEAD_DIM:
        raise ValueError(f'head dims q/k {q.shape[-1]}, v {v.shape[-1]} exceed the supported maximum {_MAX_HEAD_DIM}')
    if q.device.type != 'cuda' and not interpreting():
        raise ValueError(f'flash_prior_attention needs CUDA tensors (got {q.device}); on CPU set '
                         f'TRITON_INTERPRET=1 before importing triton, or use flash_prior_attention_ref')
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    d_qk = q.shape[-1]
    config = choose_config(max(d_qk, v.shape[-1]), q.dtype, mode, q.device)
    precision = input_precision if input_precision is not None else _backend.dot_precision(q.dtype)
    config = FlashPriorConfig(config.fwd, config.bwd_dkdv, config.bwd_dq, precision)
    scale = float(d_qk ** -0.5 if scale is None else scale)
    mask_u8 = key_mask.contiguous().view(torch.uint8) if key_mask is not None else None
    table = alpha2 = beta2 = u = delta = None
    half_width = 0
    if mode == 'goat':
        table = goat_tables(coords, freqs, num_prefix_tokens).contiguous()
        half_width = table.shape[-1] // 2
        a, b_ = alpha.float().flatten(1), beta.float().flatten(1)  # (H, D R), index a * R + r
        alpha2 = torch.cat([a, a], dim=1).contiguous()
        beta2 = torch.cat([b_, -b_], dim=1).contiguous()
        u = key_default.float().contiguous()
    elif mode == 'pope':
        if coords.requires_grad or freqs.requires_grad:
            raise ValueError("mode='pope' treats coords and freqs as constants; detach them (only delta is learned)")
        # in the input dtype, as the layer's phase table (halves the tile traffic in 16 bits)
        table = pope_tables(coords, freqs, num_prefix_tokens).to(q.dtype).contiguous()
        half_width = d_qk
        delta = phase_bias.float().contiguous()
    return _FlashPriorFunction.apply(q, k, v, table, alpha2, beta2, u, delta, mask_u8, mode, causal, scale,
                                     num_prefix_tokens, half_width, config)


# ----------------------------------------------------------------------------------------------
# Ahead-of-time specs (for tools/aot.py): signatures derived from the kernels' parameter lists
# ----------------------------------------------------------------------------------------------

_IO_PTRS = ('Q', 'K', 'V', 'OUT', 'DO', 'DQ', 'DK', 'DV')
_POS_STRIDES = ('stride_mb', 'stride_tb', 'stride_tn', 'stride_ub', 'stride_uh')
# tensors a mode does not use (passed as None), per kernel parameter
_UNUSED_BY_MODE = {'plain': ('TAB', 'ALPHA2', 'BETA2', 'U', 'DELTA', 'DU', 'GK', 'GQ', 'DAB', 'DDELTA'),
                   'goat': ('DELTA', 'DDELTA'),
                   'pope': ('ALPHA2', 'BETA2', 'U', 'DU', 'GK', 'GQ', 'DAB')}


def _divisible_args(signature: Dict[str, str], mode: str) -> List[str]:
    """Arguments a typical launch has as multiples of 16 (what the runtime JIT specialises on):
    pointers, the q/k/v-like strides (head dims 32/64/128), the table row stride and the head widths
    (GOAT's content width d_c is generally not a multiple of 16)."""
    out = [n for n, t in signature.items() if t.startswith('*')]
    out += [n for n in signature if n.startswith('stride_') and n not in _POS_STRIDES]
    return out + ['stride_tn', 'D_V'] + ([] if mode == 'goat' else ['D_QK'])


def aot_specs(head_dims: Tuple[int, ...] = (32, 64, 128),
              dtypes: Tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16),
              modes: Tuple[str, ...] = MODES,
              causal_flags: Tuple[bool, ...] = (False, True),
              variants: str = 'default',
              goat_half_width: int = 8) -> List[Dict[str, Any]]:
    """Every GPU configuration ``choose_config`` can pick, as ASTSource-ready dicts.

    Each dict: ``name``, ``fn`` (the kernel, compiler form), ``signature`` ({arg: '*fp16' | 'i32' | 'fp32' |
    'constexpr'}, derived from the kernel by ``_backend.aot_signature``), ``constexprs`` ({arg: value},
    the heuristics' flags included), ``num_warps``, ``num_stages``, ``divisibility``. One spec per
    mode x kernel (fwd, bwd_dkdv, bwd_dq) x head dim x dtype x causal flag. q/k and v widths are both
    the head dim (GOAT's content width d_c is padded up to it). ``variants='all'`` adds the key-mask and
    (GOAT) table-gradient variants. ``goat_half_width`` is D R (8: 2D, R = 4).
    """
    if variants not in ('default', 'all'):
        raise ValueError(f"variants must be 'default' or 'all', got {variants!r}")
    fwd, dkdv, dq = _kernels(interpret=False)
    kernels = (('fwd', fwd), ('bwd_dkdv', dkdv), ('bwd_dq', dq))
    specs = []
    for mode in modes:
        for d in head_dims:
            for dtype in dtypes:
                ty = TORCH_TO_TRITON[dtype]
                cfg = choose_config(d, dtype, mode, 'cuda')
                pointer_types = {n: f'*{ty}' for n in _IO_PTRS}
                pointer_types['KEY_MASK'] = '*u8'
                if mode == 'pope':
                    pointer_types['TAB'] = f'*{ty}'
                for causal in causal_flags:
                    for kname, fn in kernels:
                        params = set(kernel_function(fn).arg_names)
                        kc = getattr(cfg, kname)
                        extra = [(False, False)]
                        if variants == 'all':
                            extra = [(km, tg) for km in (False, True)
                                     for tg in ((False, True) if mode == 'goat' and kname != 'fwd' else (False,))]
                        for has_key_mask, tab_grad in extra:
                            absent = set(_UNUSED_BY_MODE[mode]) | ({'GK', 'GQ'} if not tab_grad else set())
                            if not has_key_mask:
                                absent.add('KEY_MASK')
                            signature, constexprs = aot_signature(
                                fn, pointer_types, absent=absent & params, constexprs=dict(
                                    MODE=_MODE_ID[mode], CAUSAL=causal, BLOCK_M=kc.block_m, BLOCK_N=kc.block_n,
                                    BLOCK_DQK=next_power_of_2(d), BLOCK_DV=next_power_of_2(d),
                                    BLOCK_P=_block_p(mode, goat_half_width), INPUT_PRECISION=cfg.input_precision))
                            name = (f'flash_prior_{mode}_{kname}_d{d}_{ty}{"_causal" if causal else ""}'
                                    f'{"_keymask" if has_key_mask else ""}{"_tabgrad" if tab_grad else ""}')
                            specs.append(dict(name=name, fn=fn, signature=signature, constexprs=constexprs,
                                              num_warps=kc.num_warps, num_stages=kc.num_stages,
                                              divisibility=_divisible_args(signature, mode)))
    return specs
