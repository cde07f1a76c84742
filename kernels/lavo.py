"""Triton kernels of LAVO attention (Zhang et al., arXiv:2312.11135), forward and backward.

Three ops, each an ``autograd.Function`` that runs Triton on CUDA tensors (or on CPU tensors in Triton's
interpreter: ``TRITON_INTERPRET=1`` set before triton is first imported). Their PyTorch backend
(``backend='torch'``, or CPU tensors under 'auto') is the exact blocked / cumulative-sum path of
``lavo_torch.py``, which ``LavoAttention`` also runs; the dense references with the same signatures are
in ``lavo_ref.py``.

``lavo_global(q, z, basis, scale, key_mask=None, causal=True)`` -- the CODE branch (Eqs. 3-4).
    ``H_t = (1/n_t) sum_{s<=t} m_s B z_s`` (causal; ``n_t`` = valid tokens up to t, at least 1) or
    ``H = (1/n) sum_s m_s B z_s`` (non-causal), then with slots ``diag(H_t) B``::

        out_t = softmax(scale * (q_t B^T) * H_t) (H_t * .) B,   i.e.  (p_t * H_t) @ B,

    over the r slots (padded slots never enter). The sequence is cut into chunks of ``BLOCK_T``
    tokens: a pre-pass writes each chunk's masked sum of ``B z`` (``(B, heads, L / BLOCK_T, r)``,
    float32); their exclusive prefix sums are the only running state stored in HBM, and the kernels
    rebuild ``H_t`` inside a chunk as a product with a lower-triangular ones matrix
    (``_code_chunk_state``, shared by the forward and both backward kernels). Neither ``H`` (L x r) nor
    any ``(L, r, d)`` state is written. Backward recomputes a chunk's forward in two kernels: the first
    writes dq and the chunk sums of ``dL/dH_t / n_t``, whose exclusive suffix sums carry the reverse
    cumulative sum across chunks into the second, which writes dz. Only when the basis needs a gradient
    do they also write three (L, r) float32 intermediates, and
    ``dB = sum_t (dL/d(q_t B^T))^T q_t + (p_t H_t)^T dO_t + (dL/d(B z_t))^T z_t`` is three batched GEMMs.

``lavo_local(q, k, v, rel_bias, scale, window, causal=True, mode='sliding', key_mask=None)`` -- the
    local branch with embedded relative positions (Secs. 3.2-3.3): query i attends to key j with
    logit ``scale * q_i . k_j + P[j - i + w - 1]`` (``P`` = ``rel_bias`` of 2w-1 entries, or none),
    restricted to ``-(w-1) <= j - i <= 0`` (causal) or ``|j - i| <= w - 1`` (``mode='sliding'``), or to
    the query's own block of w tokens ``j // w == i // w`` (and ``j <= i`` if causal; ``mode='block'``,
    the context-dissection aggregate). Invalid keys are dropped; a query with no valid key gets 0.
    Flash-style: online softmax over key tiles inside the window band, log-sum-exp saved; backward
    in two kernels (dk/dv over query tiles; dq and the bias gradient over key tiles).

``lavo_local_2d(q, k, v, rel_bias, scale, grid_size, window, key_mask=None, mode='sliding')`` -- the same
    local branch on a row-major (gh x gw) patch grid (``LavoAttention`` with ``grid_size``): the embedded
    relative positions of Sec. 3.3 become a (2w - 1)^2 table, logit ``scale q_i . k_j + P[(dy + w - 1) (2w - 1)
    + dx + w - 1]`` for ``|dy|, |dx| <= w - 1`` (``mode='sliding'``) or within the query's own w x w tile
    (``mode='block'``). A program takes a row segment of queries and walks the key row segments within the
    halo, so each tile has one dy and the 1D diagonal trick gives the bias gradient; the window test and the
    bias index come from the coordinates, never from (2w - 1)^2 copies.

Padding: ``key_mask`` (B, L) bool, True = valid key (``_backend.check_key_mask``). The kernels apply no
dropout. Accumulation is float32 (inputs fp16 / bf16 / fp32); ``tl.dot`` precision follows the one rule
of ``_backend.dot_precision`` ('ieee' for float32 unless PyTorch allows TF32; 'ieee' in the interpreter).
Backend choice: ``backend='triton'|'torch'`` > env ``VISION_PRIORS_KERNELS`` > 'auto' (Triton on CUDA).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._backend import (HAS_TRITON, TORCH_TO_TRITON, aot_signature, dot_precision, empty, gpu_dot_precision,
                       next_power_of_2, resolve_backend)
from .lavo_ref import check_lavo_global_args, check_lavo_local_2d_args, check_lavo_local_args
from .lavo_ref import lavo_global_reference, lavo_local_2d_reference, lavo_local_reference  # noqa: F401
from .lavo_torch import lavo_global_torch, lavo_local_2d_torch, lavo_local_torch

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover - platform without Triton: the kernels below are never defined or launched
    triton = None

__all__ = ['lavo_global', 'lavo_local', 'lavo_local_2d', 'global_config', 'local_config', 'local_2d_config',
           'aot_specs']


# ------------------------------------------------------------------------------------------------
# configurations (the runtime and aot_specs use the same functions)

def global_config(dtype: torch.dtype, head_dim: int, num_slots: int) -> Dict[str, int]:
    """Tile sizes and launch options of the ``lavo_global`` kernels (chosen so ptxas reports no spills).

    Args:
        dtype: Input dtype; float32 inputs use IEEE float32 products on a GPU (``dot_precision``): smaller
            tiles.
        head_dim: d.
        num_slots: r.

    Returns:
        ``BLOCK_T`` (chunk length), ``BLOCK_D`` (head-dim slice of the basis products), ``BLOCK_R``
        (r padded to a power of two >= 16), ``num_warps``, ``num_stages``.
    """
    br = next_power_of_2(num_slots)
    block_t = 16 if dtype == torch.float32 or br <= 32 else 32
    return dict(BLOCK_T=block_t, BLOCK_D=min(next_power_of_2(head_dim), 32), BLOCK_R=br,
                num_warps=8 if br >= 64 else 4, num_stages=1)


def local_config(dtype: torch.dtype, head_dim: int, window: int) -> Dict[str, int]:
    """Tile sizes and launch options of the ``lavo_local`` kernels (chosen so ptxas reports no spills).

    Args:
        dtype: Input dtype; float32 inputs use IEEE float32 products on a GPU (``dot_precision``), whose
            operands stay in registers: smaller tiles.
        head_dim: d.
        window: w (sets ``BLOCK_W``, the power of two >= 2w - 1 holding the bias gradient).

    Returns:
        ``BLOCK_M`` (queries), ``BLOCK_N`` (keys), ``BLOCK_D`` (d padded to a power of two >= 16),
        ``BLOCK_W``, ``BLOCK_DIAG`` (power of two >= BLOCK_M + BLOCK_N - 1: the diagonals of a score
        tile), ``num_warps``, ``num_stages``.
    """
    bd = next_power_of_2(head_dim)
    if dtype == torch.float32:  # IEEE dots, measured with ptxas: 4 warps spill at d = 32 and d = 128
        tile, warps = 16, 8 if bd <= 32 or bd > 64 else 4
    else:
        tile, warps = 32, 8 if bd > 64 else 4
    return dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_D=bd, BLOCK_W=next_power_of_2(2 * window - 1),
                BLOCK_DIAG=next_power_of_2(2 * tile - 1), num_warps=warps, num_stages=2)


def local_2d_config(dtype: torch.dtype, head_dim: int, window: int) -> Dict[str, int]:
    """Tile sizes and launch options of the ``lavo_local_2d`` kernels (pinned: one configuration per problem).

    Row segments of 16 patches (grid rows are short: 14 on a ViT-B/16 224 x 224 grid) and 8 warps, one stage:
    the configuration that ptxas compiles without spills for fp16 and fp32 inputs at d = 32, 64 and 128 on
    sm_80 and sm_90 (4 warps, two stages or 32-patch segments spill a few bytes in some of these).

    Args:
        dtype: Input dtype (kept for the signature of the other config functions; the tiles do not depend on it).
        head_dim: d.
        window: w (the bias table has (2w - 1)^2 entries: ``BLOCK_KW2``).

    Returns:
        ``BLOCK_M`` (query row segment), ``BLOCK_N`` (key row segment), ``BLOCK_D`` (d padded to a power of two
        >= 16), ``BLOCK_KW2`` (power of two >= (2w - 1)^2: the bias gradient), ``BLOCK_DIAG`` (power of two
        >= BLOCK_M + BLOCK_N - 1), ``num_warps``, ``num_stages``.
    """
    del dtype
    tile, kw = 16, 2 * window - 1
    return dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_D=next_power_of_2(head_dim), BLOCK_KW2=next_power_of_2(kw * kw),
                BLOCK_DIAG=next_power_of_2(2 * tile - 1), num_warps=8, num_stages=1)


# ------------------------------------------------------------------------------------------------
# Triton kernels: CODE global branch

if HAS_TRITON:

    @triton.jit
    def _chunk_mask(MASK, b, stride_mb, offs_t, tmask, HAS_MASK: tl.constexpr):
        """The chunk's validity m_t as float32 (1 = valid key), or a placeholder without a mask."""
        m = offs_t
        if HAS_MASK:
            m = tl.load(MASK + b.to(tl.int64) * stride_mb + offs_t, mask=tmask, other=0).to(tl.float32)
        return m

    @triton.jit
    def _lower_triangle(BLOCK_T: tl.constexpr):
        """(BLOCK_T, BLOCK_T) float32 ones on and below the diagonal: in-chunk prefix sums as a product."""
        offs_tt = tl.arange(0, BLOCK_T)
        return (offs_tt[:, None] >= offs_tt[None, :]).to(tl.float32)

    @triton.heuristics({'HAS_MASK': lambda args: args['MASK'] is not None})
    @triton.jit
    def _code_chunk_sums_kernel(
            Z, BASIS, MASK, S,
            stride_zb, stride_zh, stride_zl, stride_mb,
            L, D, R, NH, NC,
            BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_MASK: tl.constexpr):
        """S[bh, c] = sum_{t in chunk c} m_t B z_t = B (sum_t m_t z_t) (float32, r entries)."""
        c = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // NH
        hh = bh % NH
        offs_t = c * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_dd = tl.arange(0, BLOCK_D)
        offs_r = tl.arange(0, BLOCK_R)
        tmask = offs_t < L
        rmask = offs_r < R
        z_ptrs = Z + b.to(tl.int64) * stride_zb + hh.to(tl.int64) * stride_zh + offs_t[:, None] * stride_zl
        m = _chunk_mask(MASK, b, stride_mb, offs_t, tmask, HAS_MASK)
        s = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_D):
            offs_d = k0 + offs_dd
            dmask = offs_d < D
            z = tl.load(z_ptrs + offs_d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.).to(tl.float32)
            if HAS_MASK:
                z = z * m[:, None]
            zsum = tl.sum(z, axis=0)
            bas = tl.load(BASIS + hh * R * D + offs_r[:, None] * D + offs_d[None, :],
                          mask=rmask[:, None] & dmask[None, :], other=0.)
            s += tl.sum(bas * zsum[None, :], axis=1)
        tl.store(S + (bh.to(tl.int64) * NC + c) * R + offs_r, s, mask=rmask)

    # The three kernels below share one recomputation of the chunk's forward quantities, _code_chunk_state.
    # Products with the basis run over head-dim slices of BLOCK_D, so an operand tile never holds all d
    # columns (a (BLOCK_T, d) dot operand is replicated in every warp: at d = 128 it alone would spill).

    @triton.jit
    def _code_chunk_state(q_ptrs, z_ptrs, do_ptrs, b_ptrs, m, STATE, CNT0, b, bh, c, D, R, NC, offs_t, offs_dd,
                          offs_r, tmask, rmask, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                          CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, WITH_DO: tl.constexpr,
                          INPUT_PRECISION: tl.constexpr):
        """A chunk's ``q_t B^T``, (WITH_DO) ``dO_t B^T``, the memory ``H_t`` and the counts ``n_t``.

        Causal (Eq. 4): ``H_t = (prefix_c + sum_{s <= t in chunk} m_s B z_s) / n_t`` with the exclusive
        prefix sum ``prefix_c`` of the chunk sums (STATE (bh, NC, r)), the in-chunk sum a product with the
        lower-triangular ones matrix (tensor cores; a tl.cumsum over a dot-layout tile costs layout
        conversions and registers), and ``n_t`` = valid tokens up to t (CNT0: valid tokens before each chunk,
        with a mask), at least 1. Non-causal: the mean H (STATE (bh, r)); ``n_t`` is a placeholder.
        """
        qb = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        proj = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        du = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)  # dL/d(p * H) = dO B^T
        for k0 in range(0, D, BLOCK_D):
            offs_d = k0 + offs_dd
            dmask = offs_d < D
            td_mask = tmask[:, None] & dmask[None, :]
            bas = tl.load(b_ptrs + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.)
            q = tl.load(q_ptrs + offs_d[None, :], mask=td_mask, other=0.)
            qb += tl.dot(q.to(tl.float32), tl.trans(bas), input_precision=INPUT_PRECISION)  # q_t . b_i
            if WITH_DO:
                do = tl.load(do_ptrs + offs_d[None, :], mask=td_mask, other=0.)
                du += tl.dot(do.to(tl.float32), tl.trans(bas), input_precision=INPUT_PRECISION)
            if CAUSAL:
                z = tl.load(z_ptrs + offs_d[None, :], mask=td_mask, other=0.)
                proj += tl.dot(z.to(tl.float32), tl.trans(bas), input_precision=INPUT_PRECISION)  # B z_t
        if CAUSAL:
            if HAS_MASK:
                proj = proj * m[:, None]
                cnt = tl.load(CNT0 + b * NC + c) + tl.cumsum(m, axis=0)
            else:
                cnt = (offs_t + 1).to(tl.float32)
            cnt = tl.maximum(cnt, 1.)
            prefix = tl.load(STATE + (bh.to(tl.int64) * NC + c) * R + offs_r, mask=rmask, other=0.)
            h = (tl.dot(_lower_triangle(BLOCK_T), proj, input_precision=INPUT_PRECISION)
                 + prefix[None, :]) / cnt[:, None]  # Eq. 4
        else:
            hmean = tl.load(STATE + bh.to(tl.int64) * R + offs_r, mask=rmask, other=0.)
            h = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32) + hmean[None, :]
            cnt = tl.full([BLOCK_T], 1., dtype=tl.float32)
        return qb, du, h, cnt

    @triton.heuristics({'HAS_MASK': lambda args: args['MASK'] is not None})
    @triton.jit
    def _code_fwd_kernel(
            Q, Z, BASIS, MASK, STATE, CNT0, OUT, scale, L, D, R, NH, NC,
            stride_qb, stride_qh, stride_ql, stride_zb, stride_zh, stride_zl,
            stride_ob, stride_oh, stride_ol, stride_mb,
            BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
            CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """One chunk of ``out_t = softmax(scale q_t B^T * H_t) (H_t * .) B`` (Eqs. 3-4).

        STATE: causal, the exclusive prefix sums (bh, NC, r) of the chunk sums; non-causal, the mean H
        (bh, r). CNT0: causal with a mask, the valid tokens before each chunk (b, NC).
        """
        c = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // NH
        hh = bh % NH
        offs_t = c * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_dd = tl.arange(0, BLOCK_D)
        offs_r = tl.arange(0, BLOCK_R)
        tmask = offs_t < L
        rmask = offs_r < R
        q_ptrs = Q + b.to(tl.int64) * stride_qb + hh.to(tl.int64) * stride_qh + offs_t[:, None] * stride_ql
        z_ptrs = Z + b.to(tl.int64) * stride_zb + hh.to(tl.int64) * stride_zh + offs_t[:, None] * stride_zl
        b_ptrs = BASIS + hh * R * D + offs_r[:, None] * D
        m = _chunk_mask(MASK, b, stride_mb, offs_t, tmask, HAS_MASK)
        qb, _, h, _ = _code_chunk_state(q_ptrs, z_ptrs, q_ptrs, b_ptrs, m, STATE, CNT0, b, bh, c, D, R, NC, offs_t,
                                        offs_dd, offs_r, tmask, rmask, BLOCK_T, BLOCK_D, BLOCK_R, CAUSAL, HAS_MASK,
                                        False, INPUT_PRECISION)
        logits = tl.where(rmask[None, :], qb * h * scale, float('-inf'))
        mx = tl.max(logits, axis=1)
        e = tl.exp(logits - mx[:, None])
        u = e / tl.sum(e, axis=1)[:, None] * h  # p_i H_i
        o_ptrs = OUT + b.to(tl.int64) * stride_ob + hh.to(tl.int64) * stride_oh + offs_t[:, None] * stride_ol
        for k0 in range(0, D, BLOCK_D):
            offs_d = k0 + offs_dd
            dmask = offs_d < D
            bas = tl.load(b_ptrs + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.)
            out = tl.dot(u, bas, input_precision=INPUT_PRECISION)  # sum_i p_i H_i b_i
            tl.store(o_ptrs + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=tmask[:, None] & dmask[None, :])

    @triton.heuristics({'HAS_MASK': lambda args: args['MASK'] is not None,
                        'WRITE_AUX': lambda args: args['DQB'] is not None})
    @triton.jit
    def _code_bwd_dq_kernel(
            Q, Z, BASIS, MASK, STATE, CNT0, DO, DQ, G, DQB, U, scale, L, D, R, NH, NC,
            stride_qb, stride_qh, stride_ql, stride_zb, stride_zh, stride_zl,
            stride_dob, stride_doh, stride_dol, stride_mb,
            BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
            CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, WRITE_AUX: tl.constexpr,
            INPUT_PRECISION: tl.constexpr):
        """Backward of one chunk, first pass: dq, and G[bh, c] = sum_{t in c} dL/dH_t / n_t (causal) or
        sum_t dL/dH_t (non-causal). With WRITE_AUX (DQB and U given), also dL/d(q B^T) and p * H
        (bh, L, r) for dB.

        DQ is contiguous like DO.
        """
        c = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // NH
        hh = bh % NH
        offs_t = c * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_dd = tl.arange(0, BLOCK_D)
        offs_r = tl.arange(0, BLOCK_R)
        tmask = offs_t < L
        rmask = offs_r < R
        q_ptrs = Q + b.to(tl.int64) * stride_qb + hh.to(tl.int64) * stride_qh + offs_t[:, None] * stride_ql
        z_ptrs = Z + b.to(tl.int64) * stride_zb + hh.to(tl.int64) * stride_zh + offs_t[:, None] * stride_zl
        do_ptrs = DO + b.to(tl.int64) * stride_dob + hh.to(tl.int64) * stride_doh + offs_t[:, None] * stride_dol
        dq_ptrs = DQ + b.to(tl.int64) * stride_dob + hh.to(tl.int64) * stride_doh + offs_t[:, None] * stride_dol
        b_ptrs = BASIS + hh * R * D + offs_r[:, None] * D
        m = _chunk_mask(MASK, b, stride_mb, offs_t, tmask, HAS_MASK)
        qb, du, h, cnt = _code_chunk_state(q_ptrs, z_ptrs, do_ptrs, b_ptrs, m, STATE, CNT0, b, bh, c, D, R, NC,
                                           offs_t, offs_dd, offs_r, tmask, rmask, BLOCK_T, BLOCK_D, BLOCK_R, CAUSAL,
                                           HAS_MASK, True, INPUT_PRECISION)
        logits = tl.where(rmask[None, :], qb * h * scale, float('-inf'))
        mx = tl.max(logits, axis=1)
        e = tl.exp(logits - mx[:, None])
        p = e / tl.sum(e, axis=1)[:, None]
        dp = du * h
        ds = p * (dp - tl.sum(p * dp, axis=1)[:, None])  # softmax backward
        dqb = ds * h * scale
        dh = du * p + ds * qb * scale
        if CAUSAL:
            dh = dh / cnt[:, None]
        tl.store(G + (bh.to(tl.int64) * NC + c) * R + offs_r, tl.sum(dh, axis=0), mask=rmask)
        if WRITE_AUX:
            aux = (bh.to(tl.int64) * L + offs_t[:, None]) * R + offs_r[None, :]
            tr_mask = tmask[:, None] & rmask[None, :]
            tl.store(DQB + aux, dqb, mask=tr_mask)
            tl.store(U + aux, p * h, mask=tr_mask)
        for k0 in range(0, D, BLOCK_D):
            offs_d = k0 + offs_dd
            dmask = offs_d < D
            bas = tl.load(b_ptrs + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.)
            dq = tl.dot(dqb, bas, input_precision=INPUT_PRECISION)
            tl.store(dq_ptrs + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=tmask[:, None] & dmask[None, :])

    @triton.heuristics({'HAS_MASK': lambda args: args['MASK'] is not None,
                        'WRITE_AUX': lambda args: args['DPROJ'] is not None})
    @triton.jit
    def _code_bwd_dz_kernel(
            Q, Z, BASIS, MASK, STATE, CNT0, DO, CARRY, DZ, DPROJ, scale, L, D, R, NH, NC,
            stride_qb, stride_qh, stride_ql, stride_zb, stride_zh, stride_zl,
            stride_dob, stride_doh, stride_dol, stride_mb,
            BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
            CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, WRITE_AUX: tl.constexpr,
            INPUT_PRECISION: tl.constexpr):
        """Backward of one chunk, second pass: dz_s = m_s (sum_{t >= s} dL/dH_t / n_t) B (causal; CARRY holds
        the exclusive suffix sums of G over chunks) or m_s (dL/dH / n) B (non-causal; CARRY (bh, r)).
        With WRITE_AUX (DPROJ given), also dL/d(B z) (bh, L, r) for dB. DZ is contiguous like DO.
        """
        c = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // NH
        hh = bh % NH
        offs_t = c * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_dd = tl.arange(0, BLOCK_D)
        offs_r = tl.arange(0, BLOCK_R)
        tmask = offs_t < L
        rmask = offs_r < R
        b_ptrs = BASIS + hh * R * D + offs_r[:, None] * D
        m = _chunk_mask(MASK, b, stride_mb, offs_t, tmask, HAS_MASK)
        if CAUSAL:
            q_ptrs = Q + b.to(tl.int64) * stride_qb + hh.to(tl.int64) * stride_qh + offs_t[:, None] * stride_ql
            z_ptrs = Z + b.to(tl.int64) * stride_zb + hh.to(tl.int64) * stride_zh + offs_t[:, None] * stride_zl
            do_ptrs = DO + b.to(tl.int64) * stride_dob + hh.to(tl.int64) * stride_doh + offs_t[:, None] * stride_dol
            qb, du, h, cnt = _code_chunk_state(q_ptrs, z_ptrs, do_ptrs, b_ptrs, m, STATE, CNT0, b, bh, c, D, R, NC,
                                               offs_t, offs_dd, offs_r, tmask, rmask, BLOCK_T, BLOCK_D, BLOCK_R,
                                               CAUSAL, HAS_MASK, True, INPUT_PRECISION)
            logits = tl.where(rmask[None, :], qb * h * scale, float('-inf'))
            mx = tl.max(logits, axis=1)
            e = tl.exp(logits - mx[:, None])
            p = e / tl.sum(e, axis=1)[:, None]
            dp = du * h
            ds = p * (dp - tl.sum(p * dp, axis=1)[:, None])
            dnum = (du * p + ds * qb * scale) / cnt[:, None]
            carry = tl.load(CARRY + (bh.to(tl.int64) * NC + c) * R + offs_r, mask=rmask, other=0.)
            dproj = (tl.dot(tl.trans(_lower_triangle(BLOCK_T)), dnum, input_precision=INPUT_PRECISION)
                     + carry[None, :])  # sum_{t >= s}
        else:
            dmean = tl.load(CARRY + bh.to(tl.int64) * R + offs_r, mask=rmask, other=0.)
            dproj = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32) + dmean[None, :]
        if HAS_MASK:
            dproj = dproj * m[:, None]
        if WRITE_AUX:
            tl.store(DPROJ + (bh.to(tl.int64) * L + offs_t[:, None]) * R + offs_r[None, :], dproj,
                     mask=tmask[:, None] & rmask[None, :])
        dz_ptrs = DZ + b.to(tl.int64) * stride_dob + hh.to(tl.int64) * stride_doh + offs_t[:, None] * stride_dol
        for k0 in range(0, D, BLOCK_D):
            offs_d = k0 + offs_dd
            dmask = offs_d < D
            bas = tl.load(b_ptrs + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.)
            dz = tl.dot(dproj, bas, input_precision=INPUT_PRECISION)
            tl.store(dz_ptrs + offs_d[None, :], dz.to(DZ.dtype.element_ty), mask=tmask[:, None] & dmask[None, :])

    # --------------------------------------------------------------------------------------------
    # Triton kernels: local window branch

    @triton.jit
    def _query_tile_key_range(m0, L, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                              BLOCK_MODE: tl.constexpr):
        """[lo, hi) of the keys any query of the tile starting at m0 may see (lo aligned to BLOCK_N)."""
        m_last = tl.minimum(m0 + BLOCK_M, L) - 1
        if BLOCK_MODE:
            lo = (m0 // W) * W
            hi = m_last + 1 if CAUSAL else (m_last // W) * W + W
        else:
            lo = m0 - (W - 1)
            hi = m_last + 1 if CAUSAL else m_last + W
        lo = (tl.maximum(lo, 0) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(hi, L)
        return lo, hi

    @triton.jit
    def _window_scores(q, k, offs_m, offs_n, ok, scale, BIAS, W, CAUSAL: tl.constexpr, BLOCK_MODE: tl.constexpr,
                       HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """Scaled scores of a (query, key) tile plus the bias P[j - i + w - 1], and ``ok`` (the valid pairs
        given) narrowed to the window (sliding |j - i| <= w - 1, or the same block) and, if causal, j <= i."""
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale
        rel = offs_n[None, :] - offs_m[:, None]
        if BLOCK_MODE:
            ok = ok & ((offs_n[None, :] // W) == (offs_m[:, None] // W))
        else:
            ok = ok & (rel >= 1 - W)
            if not CAUSAL:
                ok = ok & (rel <= W - 1)
        if CAUSAL:
            ok = ok & (rel <= 0)
        if HAS_BIAS:
            s += tl.load(BIAS + rel + (W - 1), mask=ok, other=0.)
        return s, ok

    @triton.jit
    def _load_key_tile(k_base, v_base, MASK, mask_row, offs_n, nmask, offs_d, dmask, mmask, stride_kl, stride_vl,
                       HAS_MASK: tl.constexpr):
        """k, v rows ``offs_n`` (0 where ``nmask`` is off) and the (query, key) pairs that may attend: both in
        range and, with a mask, a valid key (1D and 2D windows)."""
        k = tl.load(k_base + offs_n[:, None] * stride_kl + offs_d[None, :],
                    mask=nmask[:, None] & dmask[None, :], other=0.)
        v = tl.load(v_base + offs_n[:, None] * stride_vl + offs_d[None, :],
                    mask=nmask[:, None] & dmask[None, :], other=0.)
        ok = nmask[None, :] & mmask[:, None]
        if HAS_MASK:
            kv = tl.load(MASK + mask_row + offs_n, mask=nmask, other=0)
            ok = ok & (kv != 0)[None, :]
        return k, v, ok

    @triton.jit
    def _online_softmax_step(s, ok, v, m_i, l_i, acc, INPUT_PRECISION: tl.constexpr):
        """One key tile of the online softmax: running max ``m_i``, sum ``l_i`` and output ``acc``."""
        s = tl.where(ok, s, float('-inf'))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float('-inf'), 0., m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _online_softmax_result(acc, m_i, l_i):
        """Output and log-sum-exp; a query without any valid key gets 0 and lse = +inf."""
        has = l_i > 0.
        out = acc / tl.where(has, l_i, 1.)[:, None]
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.)), float('inf'))
        return out, lse

    @triton.jit
    def _score_grads(s, ok, lse, delta, do, v, INPUT_PRECISION: tl.constexpr):
        """Probabilities p from the saved lse and the score gradient ds = p (dO v^T - delta)."""
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        return p, p * (dp - delta[:, None])

    @triton.jit
    def _load_query_tile(Q, b, hh, offs_m, mmask, offs_d, dmask, stride_qb, stride_qh, stride_ql):
        """q rows ``offs_m`` of head (b, hh) (0 outside ``mmask``) and the (rows, head dim) mask."""
        md_mask = mmask[:, None] & dmask[None, :]
        q = tl.load(Q + b.to(tl.int64) * stride_qb + hh.to(tl.int64) * stride_qh
                    + offs_m[:, None] * stride_ql + offs_d[None, :], mask=md_mask, other=0.)
        return q, md_mask

    @triton.jit
    def _head_bases(K, V, b, hh, stride_kb, stride_kh, stride_vb, stride_vh):
        """Pointers to head (b, hh) of K and V."""
        return (K + b.to(tl.int64) * stride_kb + hh.to(tl.int64) * stride_kh,
                V + b.to(tl.int64) * stride_vb + hh.to(tl.int64) * stride_vh)

    @triton.jit
    def _own_key_tile(K, V, MASK, b, hh, offs_n, nmask, nd_mask, offs_d, stride_kb, stride_kh, stride_kl, stride_vb,
                      stride_vh, stride_vl, stride_mb, HAS_MASK: tl.constexpr):
        """The dk / dv kernels' own key tile: k, v and which keys are valid."""
        k = tl.load(K + b.to(tl.int64) * stride_kb + hh.to(tl.int64) * stride_kh
                    + offs_n[:, None] * stride_kl + offs_d[None, :], mask=nd_mask, other=0.)
        v = tl.load(V + b.to(tl.int64) * stride_vb + hh.to(tl.int64) * stride_vh
                    + offs_n[:, None] * stride_vl + offs_d[None, :], mask=nd_mask, other=0.)
        if HAS_MASK:
            kvalid = tl.load(MASK + b.to(tl.int64) * stride_mb + offs_n, mask=nmask, other=0) != 0
        else:
            kvalid = nmask
        return k, v, kvalid & nmask

    @triton.jit
    def _store_dkdv(DK, DV, dk, dv, b, hh, offs_n, offs_d, nd_mask, stride_dob, stride_doh, stride_dol):
        out_off = (b.to(tl.int64) * stride_dob + hh.to(tl.int64) * stride_doh + offs_n[:, None] * stride_dol
                   + offs_d[None, :])
        tl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=nd_mask)
        tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=nd_mask)

    @triton.jit
    def _key_window_tile(q, k_base, v_base, MASK, mask_row, offs_m, offs_n, offs_d, dmask, mmask, L, scale, BIAS, W,
                         stride_kl, stride_vl, CAUSAL: tl.constexpr, BLOCK_MODE: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """A key tile of a query tile's window: k, v, the scores (bias added) and the valid (query, key) pairs:
        inside the sequence, valid keys (with a mask), inside the window."""
        k, v, ok = _load_key_tile(k_base, v_base, MASK, mask_row, offs_n, offs_n < L, offs_d, dmask, mmask, stride_kl,
                                  stride_vl, HAS_MASK)
        s, ok = _window_scores(q, k, offs_m, offs_n, ok, scale, BIAS, W, CAUSAL, BLOCK_MODE, HAS_BIAS,
                               INPUT_PRECISION)
        return k, v, s, ok

    @triton.heuristics({'HAS_BIAS': lambda args: args['BIAS'] is not None,
                        'HAS_MASK': lambda args: args['MASK'] is not None})
    @triton.jit
    def _local_fwd_kernel(
            Q, K, V, BIAS, MASK, OUT, LSE, scale, L, D, W, NH,
            stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
            stride_vb, stride_vh, stride_vl, stride_ob, stride_oh, stride_ol, stride_mb,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            CAUSAL: tl.constexpr, BLOCK_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
            INPUT_PRECISION: tl.constexpr):
        """Windowed softmax attention with bias P[j - i + w - 1] for BLOCK_M queries (Sec. 3.3)."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // NH
        hh = bh % NH
        m0 = pid_m * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        q, md_mask = _load_query_tile(Q, b, hh, offs_m, offs_m < L, offs_d, dmask, stride_qb, stride_qh, stride_ql)
        k_base, v_base = _head_bases(K, V, b, hh, stride_kb, stride_kh, stride_vb, stride_vh)
        lo, hi = _query_tile_key_range(m0, L, W, BLOCK_M, BLOCK_N, CAUSAL, BLOCK_MODE)
        m_i = tl.full([BLOCK_M], float('-inf'), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k, v, s, ok = _key_window_tile(q, k_base, v_base, MASK, b.to(tl.int64) * stride_mb, offs_m, offs_n,
                                           offs_d, dmask, offs_m < L, L, scale, BIAS, W, stride_kl, stride_vl,
                                           CAUSAL, BLOCK_MODE, HAS_BIAS, HAS_MASK, INPUT_PRECISION)
            m_i, l_i, acc = _online_softmax_step(s, ok, v, m_i, l_i, acc, INPUT_PRECISION)
        out, lse = _online_softmax_result(acc, m_i, l_i)
        tl.store(OUT + b.to(tl.int64) * stride_ob + hh.to(tl.int64) * stride_oh
                 + offs_m[:, None] * stride_ol + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=md_mask)
        tl.store(LSE + bh.to(tl.int64) * L + offs_m, lse, mask=offs_m < L)

    @triton.heuristics({'HAS_BIAS': lambda args: args['BIAS'] is not None,
                        'HAS_MASK': lambda args: args['MASK'] is not None})
    @triton.jit
    def _local_bwd_dkdv_kernel(
            Q, K, V, BIAS, MASK, DO, LSE, DELTA, DK, DV, scale, L, D, W, NH,
            stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
            stride_vb, stride_vh, stride_vl, stride_dob, stride_doh, stride_dol, stride_mb,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            CAUSAL: tl.constexpr, BLOCK_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
            INPUT_PRECISION: tl.constexpr):
        """dk, dv of BLOCK_N keys, looping over the query tiles whose windows hold them. DK / DV like DO."""
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // NH
        hh = bh % NH
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        nmask = offs_n < L
        nd_mask = nmask[:, None] & dmask[None, :]
        k, v, kvalid = _own_key_tile(K, V, MASK, b, hh, offs_n, nmask, nd_mask, offs_d, stride_kb, stride_kh, stride_kl,
                                     stride_vb, stride_vh, stride_vl, stride_mb, HAS_MASK)
        q_base = Q + b.to(tl.int64) * stride_qb + hh.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + hh.to(tl.int64) * stride_doh
        n_last = tl.minimum(n0 + BLOCK_N, L) - 1
        if BLOCK_MODE:
            lo = n0 if CAUSAL else (n0 // W) * W
            hi = (n_last // W) * W + W
        else:
            lo = n0 if CAUSAL else n0 - (W - 1)
            hi = n_last + W
        lo = (tl.maximum(lo, 0) // BLOCK_M) * BLOCK_M
        hi = tl.minimum(hi, L)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            mmask = offs_m < L
            md_mask = mmask[:, None] & dmask[None, :]
            q = tl.load(q_base + offs_m[:, None] * stride_ql + offs_d[None, :], mask=md_mask, other=0.)
            do = tl.load(do_base + offs_m[:, None] * stride_dol + offs_d[None, :], mask=md_mask, other=0.)
            lse = tl.load(LSE + bh.to(tl.int64) * L + offs_m, mask=mmask, other=float('inf'))
            delta = tl.load(DELTA + bh.to(tl.int64) * L + offs_m, mask=mmask, other=0.)
            ok = kvalid[None, :] & mmask[:, None]
            s, ok = _window_scores(q, k, offs_m, offs_n, ok, scale, BIAS, W, CAUSAL, BLOCK_MODE, HAS_BIAS,
                                   INPUT_PRECISION)
            p, ds = _score_grads(s, ok, lse, delta, do, v, INPUT_PRECISION)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=INPUT_PRECISION)
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=INPUT_PRECISION)
        _store_dkdv(DK, DV, dk * scale, dv, b, hh, offs_n, offs_d, nd_mask, stride_dob, stride_doh, stride_dol)

    @triton.heuristics({'HAS_BIAS': lambda args: args['BIAS'] is not None,
                        'HAS_MASK': lambda args: args['MASK'] is not None,
                        'COMPUTE_DBIAS': lambda args: args['DBIAS'] is not None})
    @triton.jit
    def _local_bwd_dq_kernel(
            Q, K, V, BIAS, MASK, DO, LSE, DELTA, DQ, DBIAS, scale, L, D, W, NH,
            stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
            stride_vb, stride_vh, stride_vl, stride_dob, stride_doh, stride_dol, stride_mb,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_W: tl.constexpr, BLOCK_DIAG: tl.constexpr,
            CAUSAL: tl.constexpr, BLOCK_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
            COMPUTE_DBIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """dq of BLOCK_M queries and their partial bias gradient sum_i dS[i, i + o - (w-1)] (bh, m-tile, o)."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // NH
        hh = bh % NH
        m0 = pid_m * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        mmask = offs_m < L
        q, md_mask = _load_query_tile(Q, b, hh, offs_m, mmask, offs_d, dmask, stride_qb, stride_qh, stride_ql)
        do_off = (b.to(tl.int64) * stride_dob + hh.to(tl.int64) * stride_doh + offs_m[:, None] * stride_dol
                  + offs_d[None, :])
        do = tl.load(DO + do_off, mask=md_mask, other=0.)
        lse = tl.load(LSE + bh.to(tl.int64) * L + offs_m, mask=mmask, other=float('inf'))
        delta = tl.load(DELTA + bh.to(tl.int64) * L + offs_m, mask=mmask, other=0.)
        k_base, v_base = _head_bases(K, V, b, hh, stride_kb, stride_kh, stride_vb, stride_vh)
        lo, hi = _query_tile_key_range(m0, L, W, BLOCK_M, BLOCK_N, CAUSAL, BLOCK_MODE)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dbias = tl.zeros([BLOCK_W], dtype=tl.float32)
        offs_o = tl.arange(0, BLOCK_W)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k, v, s, ok = _key_window_tile(q, k_base, v_base, MASK, b.to(tl.int64) * stride_mb, offs_m, offs_n,
                                           offs_d, dmask, mmask, L, scale, BIAS, W, stride_kl, stride_vl,
                                           CAUSAL, BLOCK_MODE, HAS_BIAS, HAS_MASK, INPUT_PRECISION)
            _, ds = _score_grads(s, ok, lse, delta, do, v, INPUT_PRECISION)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)
            if COMPUTE_DBIAS:
                # Diagonal sums of ds (fixed j - i), then shifted to table index o = j - i + w - 1. The
                # (BLOCK_M, BLOCK_DIAG) index tile is rebuilt here: kept across iterations it costs registers.
                rows = tl.arange(0, BLOCK_M)
                col = rows[:, None] + tl.arange(0, BLOCK_DIAG)[None, :] - (BLOCK_M - 1)  # column of diagonal t
                col_ok = (col >= 0) & (col < BLOCK_N)
                col = tl.minimum(tl.maximum(col, 0), BLOCK_N - 1)
                diag_sum = tl.sum(tl.where(col_ok, tl.gather(ds, col, 1), 0.), axis=0)
                t_idx = offs_o - (start - m0) + (BLOCK_M - 1) - (W - 1)
                t_ok = (t_idx >= 0) & (t_idx < BLOCK_DIAG)
                t_idx = tl.minimum(tl.maximum(t_idx, 0), BLOCK_DIAG - 1)
                dbias += tl.where(t_ok, tl.gather(diag_sum, t_idx, 0), 0.)
        dq = dq * scale
        tl.store(DQ + do_off, dq.to(DQ.dtype.element_ty), mask=md_mask)
        if COMPUTE_DBIAS:
            nm = tl.num_programs(0)
            tl.store(DBIAS + (bh.to(tl.int64) * nm + pid_m) * BLOCK_W + offs_o, dbias)

    # --------------------------------------------------------------------------------------------
    # Triton kernels: 2D local window over a row-major patch grid
    #
    # A query tile is a segment of BLOCK_M patches of one grid row; its keys are the segments of the grid rows
    # within the halo (the same row segment widened by w - 1 columns each side), so every (query, key) tile
    # has one row offset dy, and the column offset dx = kx - qx runs along the tile's diagonals as in 1D.
    # The in-window test and the bias index (dy + w - 1) (2w - 1) + dx + w - 1 are computed per tile from the
    # coordinates: no (2w - 1)^2 copies of keys, values, masks or biases are made.

    @triton.jit
    def _grid_segment(pid, NXT, GW, BLOCK: tl.constexpr):
        """Program ``pid``'s row segment of the grid (NXT segments of BLOCK patches per row): its row, first
        column, column offsets, in-grid mask and flat patch indices."""
        y = pid // NXT
        x0 = (pid % NXT) * BLOCK
        offs_x = x0 + tl.arange(0, BLOCK)
        return y, x0, offs_x, offs_x < GW, y * GW + offs_x

    @triton.jit
    def _grid_partner_range(y, x0, GH, GW, W, BLOCK: tl.constexpr, BLOCK_MODE: tl.constexpr):
        """Rows [y_lo, y_hi) and columns [x_lo, x_hi) of the patches that a segment (row y, columns
        x0 .. x0 + BLOCK - 1) may pair with: within w - 1 rows / columns, or (BLOCK_MODE) in the same w x w tiles.
        The relation is symmetric: keys of a query segment, or queries of a key segment."""
        x_last = tl.minimum(x0 + BLOCK, GW) - 1
        if BLOCK_MODE:
            y_lo = (y // W) * W
            y_hi = y_lo + W
            x_lo = (x0 // W) * W
            x_hi = (x_last // W) * W + W
        else:
            y_lo = y - (W - 1)
            y_hi = y + W
            x_lo = x0 - (W - 1)
            x_hi = x_last + W
        return tl.maximum(y_lo, 0), tl.minimum(y_hi, GH), tl.maximum(x_lo, 0), tl.minimum(x_hi, GW)

    @triton.jit
    def _grid_scores(q, k, qy, ky, offs_qx, offs_kx, ok, scale, BIAS, W, BLOCK_MODE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """Scaled scores of a (query row segment, key row segment) tile plus the bias
        P[(dy + w - 1) (2w - 1) + dx + w - 1], and ``ok`` narrowed to |dx| <= w - 1 (or the same tile column).
        The rows qy, ky come from ``_grid_partner_range``, which already keeps |dy| <= w - 1 (same tile row)."""
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale
        dx = offs_kx[None, :] - offs_qx[:, None]
        if BLOCK_MODE:
            ok = ok & ((offs_kx[None, :] // W) == (offs_qx[:, None] // W))
        else:
            ok = ok & (dx >= 1 - W) & (dx <= W - 1)
        if HAS_BIAS:
            s += tl.load(BIAS + (ky - qy + W - 1) * (2 * W - 1) + (W - 1) + dx, mask=ok, other=0.)
        return s, ok

    @triton.jit
    def _grid_key_tile(q, k_base, v_base, MASK, mask_row, qy, ky, offs_qx, offs_kx, offs_d, dmask, mmask, GW, scale,
                       BIAS, W, stride_kl, stride_vl, BLOCK_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """A key row segment of a query row segment's window: k, v, the scores (bias added) and the valid pairs:
        inside the grid, valid keys (with a mask), inside the window."""
        k, v, ok = _load_key_tile(k_base, v_base, MASK, mask_row, ky * GW + offs_kx, offs_kx < GW, offs_d, dmask, mmask,
                                  stride_kl, stride_vl, HAS_MASK)
        s, ok = _grid_scores(q, k, qy, ky, offs_qx, offs_kx, ok, scale, BIAS, W, BLOCK_MODE, HAS_BIAS,
                             INPUT_PRECISION)
        return k, v, s, ok

    @triton.heuristics({'HAS_BIAS': lambda args: args['BIAS'] is not None,
                        'HAS_MASK': lambda args: args['MASK'] is not None})
    @triton.jit
    def _local2d_fwd_kernel(
            Q, K, V, BIAS, MASK, OUT, LSE, scale, GH, GW, D, W, NH, NXT,
            stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
            stride_vb, stride_vh, stride_vl, stride_ob, stride_oh, stride_ol, stride_mb,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_MODE: tl.constexpr,
            HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """2D windowed softmax attention with the bias of Sec. 3.3 for a row segment of BLOCK_M patches
        (program (row * NXT + segment, batch * head)); online softmax over the key row segments."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // NH
        hh = bh % NH
        qy, qx0, offs_qx, mmask, offs_m = _grid_segment(pid, NXT, GW, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        q, md_mask = _load_query_tile(Q, b, hh, offs_m, mmask, offs_d, dmask, stride_qb, stride_qh, stride_ql)
        k_base, v_base = _head_bases(K, V, b, hh, stride_kb, stride_kh, stride_vb, stride_vh)
        ky_lo, ky_hi, kx_lo, kx_hi = _grid_partner_range(qy, qx0, GH, GW, W, BLOCK_M, BLOCK_MODE)
        m_i = tl.full([BLOCK_M], float('-inf'), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        n_cx = tl.cdiv(kx_hi - kx_lo, BLOCK_N)
        for it in range(0, (ky_hi - ky_lo) * n_cx):  # one flat loop over (key row, column segment)
            ky = ky_lo + it // n_cx
            offs_kx = kx_lo + (it % n_cx) * BLOCK_N + tl.arange(0, BLOCK_N)
            k, v, s, ok = _grid_key_tile(q, k_base, v_base, MASK, b.to(tl.int64) * stride_mb, qy, ky, offs_qx,
                                         offs_kx, offs_d, dmask, mmask, GW, scale, BIAS, W, stride_kl, stride_vl,
                                         BLOCK_MODE, HAS_BIAS, HAS_MASK, INPUT_PRECISION)
            m_i, l_i, acc = _online_softmax_step(s, ok, v, m_i, l_i, acc, INPUT_PRECISION)
        out, lse = _online_softmax_result(acc, m_i, l_i)
        tl.store(OUT + b.to(tl.int64) * stride_ob + hh.to(tl.int64) * stride_oh
                 + offs_m[:, None] * stride_ol + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=md_mask)
        tl.store(LSE + bh.to(tl.int64) * GH * GW + offs_m, lse, mask=mmask)

    @triton.heuristics({'HAS_BIAS': lambda args: args['BIAS'] is not None,
                        'HAS_MASK': lambda args: args['MASK'] is not None})
    @triton.jit
    def _local2d_bwd_dkdv_kernel(
            Q, K, V, BIAS, MASK, DO, LSE, DELTA, DK, DV, scale, GH, GW, D, W, NH, NXT,
            stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
            stride_vb, stride_vh, stride_vl, stride_dob, stride_doh, stride_dol, stride_mb,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_MODE: tl.constexpr,
            HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """dk, dv of a row segment of BLOCK_N keys (NXT segments per row), looping over the query row segments
        whose windows hold them. DK / DV like DO."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // NH
        hh = bh % NH
        ky, kx0, offs_kx, nmask, offs_n = _grid_segment(pid, NXT, GW, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        nd_mask = nmask[:, None] & dmask[None, :]
        k, v, kvalid = _own_key_tile(K, V, MASK, b, hh, offs_n, nmask, nd_mask, offs_d, stride_kb, stride_kh, stride_kl,
                                     stride_vb, stride_vh, stride_vl, stride_mb, HAS_MASK)
        q_base = Q + b.to(tl.int64) * stride_qb + hh.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + hh.to(tl.int64) * stride_doh
        row_base = bh.to(tl.int64) * GH * GW
        qy_lo, qy_hi, qx_lo, qx_hi = _grid_partner_range(ky, kx0, GH, GW, W, BLOCK_N, BLOCK_MODE)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        n_cx = tl.cdiv(qx_hi - qx_lo, BLOCK_M)
        for it in range(0, (qy_hi - qy_lo) * n_cx):  # one flat loop over (query row, column segment)
            qy = qy_lo + it // n_cx
            offs_qx = qx_lo + (it % n_cx) * BLOCK_M + tl.arange(0, BLOCK_M)
            mmask = offs_qx < GW
            offs_m = qy * GW + offs_qx
            md_mask = mmask[:, None] & dmask[None, :]
            q = tl.load(q_base + offs_m[:, None] * stride_ql + offs_d[None, :], mask=md_mask, other=0.)
            do = tl.load(do_base + offs_m[:, None] * stride_dol + offs_d[None, :], mask=md_mask, other=0.)
            lse = tl.load(LSE + row_base + offs_m, mask=mmask, other=float('inf'))
            delta = tl.load(DELTA + row_base + offs_m, mask=mmask, other=0.)
            ok = kvalid[None, :] & mmask[:, None]
            s, ok = _grid_scores(q, k, qy, ky, offs_qx, offs_kx, ok, scale, BIAS, W, BLOCK_MODE, HAS_BIAS,
                                 INPUT_PRECISION)
            p, ds = _score_grads(s, ok, lse, delta, do, v, INPUT_PRECISION)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=INPUT_PRECISION)
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=INPUT_PRECISION)
        _store_dkdv(DK, DV, dk * scale, dv, b, hh, offs_n, offs_d, nd_mask, stride_dob, stride_doh, stride_dol)

    @triton.heuristics({'HAS_BIAS': lambda args: args['BIAS'] is not None,
                        'HAS_MASK': lambda args: args['MASK'] is not None,
                        'COMPUTE_DBIAS': lambda args: args['DBIAS'] is not None})
    @triton.jit
    def _local2d_bwd_dq_kernel(
            Q, K, V, BIAS, MASK, DO, LSE, DELTA, DQ, DBIAS, scale, GH, GW, D, W, NH, NXT,
            stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
            stride_vb, stride_vh, stride_vl, stride_dob, stride_doh, stride_dol, stride_mb,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KW2: tl.constexpr,
            BLOCK_DIAG: tl.constexpr, BLOCK_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
            COMPUTE_DBIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """dq of a row segment of BLOCK_M queries and its partial bias gradient (bh, program, (2w - 1)^2 table
        entries padded to BLOCK_KW2): entry (dy, dx) sums dS over the pairs with that offset."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // NH
        hh = bh % NH
        qy, qx0, offs_qx, mmask, offs_m = _grid_segment(pid, NXT, GW, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        q, md_mask = _load_query_tile(Q, b, hh, offs_m, mmask, offs_d, dmask, stride_qb, stride_qh, stride_ql)
        do_off = (b.to(tl.int64) * stride_dob + hh.to(tl.int64) * stride_doh + offs_m[:, None] * stride_dol
                  + offs_d[None, :])
        do = tl.load(DO + do_off, mask=md_mask, other=0.)
        lse = tl.load(LSE + bh.to(tl.int64) * GH * GW + offs_m, mask=mmask, other=float('inf'))
        delta = tl.load(DELTA + bh.to(tl.int64) * GH * GW + offs_m, mask=mmask, other=0.)
        k_base, v_base = _head_bases(K, V, b, hh, stride_kb, stride_kh, stride_vb, stride_vh)
        ky_lo, ky_hi, kx_lo, kx_hi = _grid_partner_range(qy, qx0, GH, GW, W, BLOCK_M, BLOCK_MODE)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dbias = tl.zeros([BLOCK_KW2], dtype=tl.float32)
        offs_o = tl.arange(0, BLOCK_KW2)  # table entry (dy + w - 1) (2w - 1) + dx + w - 1
        o_row = offs_o // (2 * W - 1)
        o_dx = offs_o - o_row * (2 * W - 1) - (W - 1)
        o_ok = offs_o < (2 * W - 1) * (2 * W - 1)
        n_cx = tl.cdiv(kx_hi - kx_lo, BLOCK_N)
        for it in range(0, (ky_hi - ky_lo) * n_cx):  # one flat loop over (key row, column segment)
            ky = ky_lo + it // n_cx
            start = kx_lo + (it % n_cx) * BLOCK_N
            offs_kx = start + tl.arange(0, BLOCK_N)
            k, v, s, ok = _grid_key_tile(q, k_base, v_base, MASK, b.to(tl.int64) * stride_mb, qy, ky, offs_qx,
                                         offs_kx, offs_d, dmask, mmask, GW, scale, BIAS, W, stride_kl, stride_vl,
                                         BLOCK_MODE, HAS_BIAS, HAS_MASK, INPUT_PRECISION)
            _, ds = _score_grads(s, ok, lse, delta, do, v, INPUT_PRECISION)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)
            if COMPUTE_DBIAS:
                # One row offset dy = ky - qy per tile; dx = (start - qx0) + c - a runs along the diagonals
                # c - a = t - (BLOCK_M - 1) of ds (as in the 1D dq kernel): diagonal sums, then gathered to the
                # table entries of row dy + w - 1 (ds is 0 outside the window).
                rows = tl.arange(0, BLOCK_M)
                col = rows[:, None] + tl.arange(0, BLOCK_DIAG)[None, :] - (BLOCK_M - 1)
                col_ok = (col >= 0) & (col < BLOCK_N)
                col = tl.minimum(tl.maximum(col, 0), BLOCK_N - 1)
                diag_sum = tl.sum(tl.where(col_ok, tl.gather(ds, col, 1), 0.), axis=0)
                t_idx = o_dx - (start - qx0) + (BLOCK_M - 1)
                t_ok = o_ok & (o_row == ky - qy + W - 1) & (t_idx >= 0) & (t_idx < BLOCK_DIAG)
                t_idx = tl.minimum(tl.maximum(t_idx, 0), BLOCK_DIAG - 1)
                dbias += tl.where(t_ok, tl.gather(diag_sum, t_idx, 0), 0.)
        dq = dq * scale
        tl.store(DQ + do_off, dq.to(DQ.dtype.element_ty), mask=md_mask)
        if COMPUTE_DBIAS:
            nm = tl.num_programs(0)
            tl.store(DBIAS + (bh.to(tl.int64) * nm + pid) * BLOCK_KW2 + offs_o, dbias)

# ------------------------------------------------------------------------------------------------
# input checks (the shared ones are in lavo_ref.py)

def _check_triton_dtype(t: Tensor, name: str) -> None:
    if t.dtype not in TORCH_TO_TRITON:
        raise TypeError(f"backend='triton' supports float16, bfloat16 and float32; {name} has dtype {t.dtype}")


def _last_contig(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _mask_u8(key_mask: Tensor) -> Tensor:
    return key_mask.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------------------
# CODE global branch: autograd Function, public op

class _LavoGlobalFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, q: Tensor, z: Tensor, basis: Tensor, scale: float, key_mask: Optional[Tensor],
                causal: bool) -> Tensor:
        bsz, nh, length, d = q.shape
        r = basis.shape[1]
        cfg = global_config(q.dtype, d, r)
        bt = cfg['BLOCK_T']
        nc = triton.cdiv(length, bt)
        q, z = _last_contig(q), _last_contig(z)
        basis32 = basis.detach().to(torch.float32).contiguous()
        dev = q.device
        mask = _mask_u8(key_mask) if key_mask is not None else None
        sums = empty(bsz * nh, nc, r, device=dev, dtype=torch.float32)
        smb = mask.stride(0) if mask is not None else 0
        _code_chunk_sums_kernel[(nc, bsz * nh)](
            z, basis32, mask, sums, z.stride(0), z.stride(1), z.stride(2), smb, length, d, r, nh, nc,
            BLOCK_T=bt, BLOCK_D=cfg['BLOCK_D'], BLOCK_R=cfg['BLOCK_R'],
            num_warps=cfg['num_warps'], num_stages=cfg['num_stages'])
        if key_mask is not None:
            mf = key_mask.to(torch.float32)
        if causal:
            state = torch.cat([torch.zeros_like(sums[:, :1]), sums.cumsum(dim=1)[:, :-1]], dim=1).contiguous()
            if key_mask is not None:
                chunk_cnt = F.pad(mf, (0, nc * bt - length)).reshape(bsz, nc, bt).sum(-1)
                cnt0 = torch.cat([torch.zeros_like(chunk_cnt[:, :1]), chunk_cnt.cumsum(1)[:, :-1]], 1).contiguous()
            else:
                cnt0 = None
            total_cnt = None
        else:
            total_cnt = (mf.sum(1).clamp(min=1) if key_mask is not None
                         else torch.full((bsz,), float(length), device=dev))
            state = (sums.sum(dim=1).reshape(bsz, nh, r) / total_cnt[:, None, None]).reshape(bsz * nh, r).contiguous()
            cnt0 = None
        out = empty(*q.shape, device=dev, dtype=q.dtype)
        prec = dot_precision(q.dtype)
        _code_fwd_kernel[(nc, bsz * nh)](
            q, z, basis32, mask, state, cnt0, out, float(scale), length, d, r, nh, nc,
            q.stride(0), q.stride(1), q.stride(2), z.stride(0), z.stride(1), z.stride(2),
            out.stride(0), out.stride(1), out.stride(2), smb,
            BLOCK_T=bt, BLOCK_D=cfg['BLOCK_D'], BLOCK_R=cfg['BLOCK_R'], CAUSAL=causal,
            INPUT_PRECISION=prec, num_warps=cfg['num_warps'], num_stages=cfg['num_stages'])
        ctx.save_for_backward(q, z, basis32, mask, state, cnt0, total_cnt)
        ctx.scale, ctx.causal, ctx.cfg, ctx.prec, ctx.basis_dtype = float(scale), causal, cfg, prec, basis.dtype
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor):
        q, z, basis32, mask, state, cnt0, total_cnt = ctx.saved_tensors
        cfg, causal, prec = ctx.cfg, ctx.causal, ctx.prec
        bsz, nh, length, d = q.shape
        r = basis32.shape[1]
        bt = cfg['BLOCK_T']
        nc = triton.cdiv(length, bt)
        dev = q.device
        do = dout.contiguous()
        smb = mask.stride(0) if mask is not None else 0
        common = dict(BLOCK_T=bt, BLOCK_D=cfg['BLOCK_D'], BLOCK_R=cfg['BLOCK_R'], CAUSAL=causal, INPUT_PRECISION=prec,
                      num_warps=cfg['num_warps'], num_stages=cfg['num_stages'])
        compute_db = bool(ctx.needs_input_grad[2])
        gsum = empty(bsz * nh, nc, r, device=dev, dtype=torch.float32)
        dq = empty(*do.shape, device=dev, dtype=q.dtype)
        dz = empty(*do.shape, device=dev, dtype=z.dtype)
        if compute_db:  # dL/d(q B^T), p * H and dL/d(B z), (B * heads, L, r) float32
            dqb, u, dproj = (empty(bsz * nh, length, r, device=dev, dtype=torch.float32) for _ in range(3))
        else:  # the kernels' WRITE_AUX is off
            dqb = u = dproj = None
        strides = (q.stride(0), q.stride(1), q.stride(2), z.stride(0), z.stride(1), z.stride(2),
                   do.stride(0), do.stride(1), do.stride(2), smb)
        _code_bwd_dq_kernel[(nc, bsz * nh)](
            q, z, basis32, mask, state, cnt0, do, dq, gsum, dqb, u, ctx.scale, length, d, r, nh, nc,
            *strides, **common)
        if causal:  # exclusive suffix sums over chunks: sum_{c' > c} G[c']
            rev = gsum.flip(1).cumsum(1).flip(1)
            carry = torch.cat([rev[:, 1:], torch.zeros_like(rev[:, :1])], dim=1).contiguous()
        else:
            carry = (gsum.sum(1).reshape(bsz, nh, r) / total_cnt[:, None, None]).reshape(bsz * nh, r).contiguous()
        _code_bwd_dz_kernel[(nc, bsz * nh)](
            q, z, basis32, mask, state, cnt0, do, carry, dz, dproj, ctx.scale, length, d, r, nh, nc,
            *strides, **common)
        dbasis = None
        if compute_db:  # dB = sum_t dqb_t^T q_t + u_t^T dO_t + dproj_t^T z_t (cuBLAS, float32)
            def t_(x: Tensor) -> Tensor:
                return x.reshape(bsz, nh, length, r).transpose(0, 1).reshape(nh, bsz * length, r).transpose(1, 2)

            def f_(x: Tensor) -> Tensor:
                return x.to(torch.float32).transpose(0, 1).reshape(nh, bsz * length, d)

            dbasis = (t_(dqb) @ f_(q) + t_(u) @ f_(do) + t_(dproj) @ f_(z)).to(ctx.basis_dtype)
        return dq, dz, dbasis, None, None, None


def lavo_global(q: Tensor, z: Tensor, basis: Tensor, scale: float, key_mask: Optional[Tensor] = None,
                causal: bool = True, backend: str = 'auto') -> Tensor:
    """LAVO's CODE branch: read the r slots ``diag(H_t) B`` of the (running) mean of ``B z`` (Eqs. 3-4).

    Args:
        q: Queries (B, heads, L, d).
        z: Features compressed into the memory, (B, heads, L, d) (values, or their local aggregates
            under context dissection).
        basis: Orthogonal basis B, (heads, r, d), r <= d in the layer (not required here).
        scale: Logit scale.
        key_mask: Optional (B, L) bool, True = valid key (the package's one convention); False tokens are
            left out of the mean and its count.
        causal: Running mean ``H_t`` over ``s <= t`` (Eq. 4), else one mean over all valid tokens.
        backend: 'auto', 'triton' or 'torch' (the exact cumulative-sum path ``lavo_torch.lavo_global_torch``).

    Returns:
        ``softmax(scale (q_t B^T) * H_t) (H_t * .) B``, (B, heads, L, d), dtype of q. Differentiable in
        q, z and basis.
    """
    check_lavo_global_args(q, z, basis, key_mask)
    if resolve_backend(backend, q, z, basis, key_mask) == 'torch':
        return lavo_global_torch(q, z, basis, float(scale), key_mask, bool(causal))
    _check_triton_dtype(q, 'q')
    _check_triton_dtype(basis, 'basis')
    return _LavoGlobalFn.apply(q, z, basis, float(scale), key_mask, bool(causal))


# ------------------------------------------------------------------------------------------------
# local window branch: autograd Function, public op

class _LavoLocalFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], key_mask: Optional[Tensor],
                scale: float, window: int, causal: bool, block: bool) -> Tensor:
        bsz, nh, length, d = q.shape
        cfg = local_config(q.dtype, d, window)
        q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
        dev = q.device
        mask = _mask_u8(key_mask) if key_mask is not None else None
        bias = rel_bias.detach().to(torch.float32).contiguous() if rel_bias is not None else None
        out = empty(*q.shape, device=dev, dtype=q.dtype)
        lse = empty(bsz * nh, length, device=dev, dtype=torch.float32)
        prec = dot_precision(q.dtype)
        grid = (triton.cdiv(length, cfg['BLOCK_M']), bsz * nh)
        _local_fwd_kernel[grid](
            q, k, v, bias, mask, out, lse,
            float(scale), length, d, window, nh,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            mask.stride(0) if mask is not None else 0,
            BLOCK_M=cfg['BLOCK_M'], BLOCK_N=cfg['BLOCK_N'], BLOCK_D=cfg['BLOCK_D'], CAUSAL=causal,
            BLOCK_MODE=block, INPUT_PRECISION=prec, num_warps=cfg['num_warps'], num_stages=cfg['num_stages'])
        ctx.save_for_backward(q, k, v, bias, mask, out, lse)
        ctx.scale, ctx.window, ctx.causal, ctx.block, ctx.cfg, ctx.prec = float(scale), window, causal, block, cfg, prec
        ctx.bias_dtype = rel_bias.dtype if rel_bias is not None else None
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor):
        q, k, v, bias, mask, out, lse = ctx.saved_tensors
        cfg, w = ctx.cfg, ctx.window
        bsz, nh, length, d = q.shape
        dev = q.device
        do = dout.contiguous()
        delta = (do.to(torch.float32) * out.to(torch.float32)).sum(-1).reshape(bsz * nh, length).contiguous()
        dq = empty(*do.shape, device=dev, dtype=q.dtype)
        dk = empty(*do.shape, device=dev, dtype=k.dtype)
        dv = empty(*do.shape, device=dev, dtype=v.dtype)
        smb = mask.stride(0) if mask is not None else 0
        strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2), smb)
        flags = dict(BLOCK_M=cfg['BLOCK_M'], BLOCK_N=cfg['BLOCK_N'], BLOCK_D=cfg['BLOCK_D'], CAUSAL=ctx.causal,
                     BLOCK_MODE=ctx.block, INPUT_PRECISION=ctx.prec, num_warps=cfg['num_warps'],
                     num_stages=cfg['num_stages'])
        _local_bwd_dkdv_kernel[(triton.cdiv(length, cfg['BLOCK_N']), bsz * nh)](
            q, k, v, bias, mask, do, lse, delta, dk, dv, ctx.scale, length, d, w, nh, *strides, **flags)
        n_m = triton.cdiv(length, cfg['BLOCK_M'])
        compute_dbias = bias is not None and bool(ctx.needs_input_grad[3])
        dbias_part = (empty(bsz * nh, n_m, cfg['BLOCK_W'], device=dev, dtype=torch.float32)
                      if compute_dbias else None)  # None: the kernel's COMPUTE_DBIAS is off
        _local_bwd_dq_kernel[(n_m, bsz * nh)](
            q, k, v, bias, mask, do, lse, delta, dq, dbias_part, ctx.scale, length, d, w, nh, *strides,
            BLOCK_W=cfg['BLOCK_W'], BLOCK_DIAG=cfg['BLOCK_DIAG'], **flags)
        dbias = dbias_part.sum(dim=(0, 1))[:2 * w - 1].to(ctx.bias_dtype) if compute_dbias else None
        return dq, dk, dv, dbias, None, None, None, None, None


def lavo_local(q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], scale: float, window: int,
               causal: bool = True, mode: str = 'sliding', key_mask: Optional[Tensor] = None,
               backend: str = 'auto') -> Tensor:
    """LAVO's local branch: 1D windowed softmax attention with the learned relative bias (Secs. 3.2-3.3).

    Args:
        q, k, v: (B, heads, L, d), one dtype and device.
        rel_bias: P, (2w - 1,), logit bias ``P[j - i + w - 1]`` (the causal window uses P[0 .. w-1]);
            None for no bias.
        scale: Logit scale on ``q . k``.
        window: w >= 1.
        causal: Causal window (keys ``j <= i``).
        mode: 'sliding' (the local branch F_local) or 'block' (own non-overlapping window of w tokens:
            the context-dissection aggregate).
        key_mask: Optional (B, L) bool, True = valid key (the package's one convention); queries with no
            valid key in the window get 0.
        backend: 'auto', 'triton' or 'torch' (the exact blocked O(L w) path ``lavo_torch.lavo_local_torch``).

    Returns:
        (B, heads, L, d), dtype of q; differentiable in q, k, v and rel_bias.
    """
    check_lavo_local_args(q, k, v, rel_bias, window, mode, key_mask)
    if resolve_backend(backend, q, k, v, rel_bias, key_mask) == 'torch':
        return lavo_local_torch(q, k, v, rel_bias, float(scale), window, bool(causal), mode, key_mask)
    _check_triton_dtype(q, 'q')
    if rel_bias is not None:
        _check_triton_dtype(rel_bias, 'rel_bias')
    return _LavoLocalFn.apply(q, k, v, rel_bias, key_mask, float(scale), window, bool(causal), mode == 'block')


# ------------------------------------------------------------------------------------------------
# 2D local window branch: autograd Function, public op

class _LavoLocal2dFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], key_mask: Optional[Tensor],
                scale: float, grid_h: int, grid_w: int, window: int, block: bool) -> Tensor:
        bsz, nh, length, d = q.shape
        cfg = local_2d_config(q.dtype, d, window)
        q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
        dev = q.device
        mask = _mask_u8(key_mask) if key_mask is not None else None
        bias = rel_bias.detach().to(torch.float32).contiguous() if rel_bias is not None else None
        out = empty(*q.shape, device=dev, dtype=q.dtype)
        lse = empty(bsz * nh, length, device=dev, dtype=torch.float32)
        prec = dot_precision(q.dtype)
        nxt = triton.cdiv(grid_w, cfg['BLOCK_M'])
        _local2d_fwd_kernel[(grid_h * nxt, bsz * nh)](
            q, k, v, bias, mask, out, lse,
            float(scale), grid_h, grid_w, d, window, nh, nxt,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            mask.stride(0) if mask is not None else 0,
            BLOCK_M=cfg['BLOCK_M'], BLOCK_N=cfg['BLOCK_N'], BLOCK_D=cfg['BLOCK_D'], BLOCK_MODE=block,
            INPUT_PRECISION=prec, num_warps=cfg['num_warps'], num_stages=cfg['num_stages'])
        ctx.save_for_backward(q, k, v, bias, mask, out, lse)
        ctx.scale, ctx.grid, ctx.window, ctx.block, ctx.cfg, ctx.prec = (float(scale), (grid_h, grid_w), window,
                                                                         block, cfg, prec)
        ctx.bias_dtype = rel_bias.dtype if rel_bias is not None else None
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor):
        q, k, v, bias, mask, out, lse = ctx.saved_tensors
        cfg, w = ctx.cfg, ctx.window
        gh, gw = ctx.grid
        bsz, nh, length, d = q.shape
        dev = q.device
        do = dout.contiguous()
        delta = (do.to(torch.float32) * out.to(torch.float32)).sum(-1).reshape(bsz * nh, length).contiguous()
        dq = empty(*do.shape, device=dev, dtype=q.dtype)
        dk = empty(*do.shape, device=dev, dtype=k.dtype)
        dv = empty(*do.shape, device=dev, dtype=v.dtype)
        smb = mask.stride(0) if mask is not None else 0
        strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2), smb)
        flags = dict(BLOCK_M=cfg['BLOCK_M'], BLOCK_N=cfg['BLOCK_N'], BLOCK_D=cfg['BLOCK_D'], BLOCK_MODE=ctx.block,
                     INPUT_PRECISION=ctx.prec, num_warps=cfg['num_warps'], num_stages=cfg['num_stages'])
        nxn = triton.cdiv(gw, cfg['BLOCK_N'])
        _local2d_bwd_dkdv_kernel[(gh * nxn, bsz * nh)](
            q, k, v, bias, mask, do, lse, delta, dk, dv, ctx.scale, gh, gw, d, w, nh, nxn, *strides, **flags)
        nxt = triton.cdiv(gw, cfg['BLOCK_M'])
        compute_dbias = bias is not None and bool(ctx.needs_input_grad[3])
        dbias_part = (empty(bsz * nh, gh * nxt, cfg['BLOCK_KW2'], device=dev, dtype=torch.float32)
                      if compute_dbias else None)  # None: the kernel's COMPUTE_DBIAS is off
        _local2d_bwd_dq_kernel[(gh * nxt, bsz * nh)](
            q, k, v, bias, mask, do, lse, delta, dq, dbias_part, ctx.scale, gh, gw, d, w, nh, nxt, *strides,
            BLOCK_KW2=cfg['BLOCK_KW2'], BLOCK_DIAG=cfg['BLOCK_DIAG'], **flags)
        kw = 2 * w - 1
        dbias = dbias_part.sum(dim=(0, 1))[:kw * kw].to(ctx.bias_dtype) if compute_dbias else None
        return dq, dk, dv, dbias, None, None, None, None, None, None


def lavo_local_2d(q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], scale: float,
                  grid_size: Sequence[int], window: int, key_mask: Optional[Tensor] = None, mode: str = 'sliding',
                  backend: str = 'auto') -> Tensor:
    """LAVO's local branch on a row-major patch grid: 2D windowed softmax attention with the embedded relative
    position bias of Sec. 3.3 (Secs. 3.2-3.3 read on a grid, as ``LavoAttention`` with ``grid_size``).

    Patch i = (y_i, x_i) attends to patch j with logit ``scale q_i . k_j + P[(dy + w - 1) (2w - 1) + dx + w - 1]``,
    ``(dy, dx) = (y_j - y_i, x_j - x_i)``, for ``|dy|, |dx| <= w - 1`` (``mode='sliding'``) or for j in the
    query's own non-overlapping ``w x w`` tile (``mode='block'``, the context-dissection aggregate). Invalid
    keys are dropped; a query with no valid key gets 0. The Triton kernels take a row segment of queries against
    the key rows within the halo and compute the in-window test and the bias index from the coordinates
    (flash-style online softmax, log-sum-exp saved; backward in two kernels as ``lavo_local``).

    Args:
        q, k, v: (B, heads, gh * gw, d) row-major patches, one dtype and device.
        rel_bias: P, ((2w - 1)^2,) (the layer's ``rel_bias_2d``), or None for no bias.
        scale: Logit scale on ``q . k``.
        grid_size: (gh, gw) ints.
        window: w >= 1 (the layer's ``window_2d``): half-width w - 1.
        key_mask: Optional (B, gh * gw) bool, True = valid key (the package's one convention).
        mode: 'sliding' or 'block'.
        backend: 'auto', 'triton' or 'torch' (the layer's own blocked path ``lavo_torch.lavo_local_2d_torch``).

    Returns:
        (B, heads, gh * gw, d), dtype of q; differentiable in q, k, v and rel_bias.
    """
    gh, gw = check_lavo_local_2d_args(q, k, v, rel_bias, grid_size, window, mode, key_mask)
    if resolve_backend(backend, q, k, v, rel_bias, key_mask) == 'torch':
        return lavo_local_2d_torch(q, k, v, rel_bias, float(scale), (gh, gw), window, key_mask, mode)
    _check_triton_dtype(q, 'q')
    if rel_bias is not None:
        _check_triton_dtype(rel_bias, 'rel_bias')
    return _LavoLocal2dFn.apply(q, k, v, rel_bias, key_mask, float(scale), gh, gw, window, mode == 'block')


# ------------------------------------------------------------------------------------------------
# ahead-of-time compilation specs

_AOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_AOT_HEAD_DIMS = (32, 64, 128)
_AOT_WINDOW = 64  # the layer's default w (sets BLOCK_W of the dq kernel only)
# 2D window (CI budget: one head dim, fp16 and fp32; the layer's default w2 = 4)
_AOT_2D_DTYPES = (torch.float16, torch.float32)
_AOT_2D_HEAD_DIM, _AOT_2D_WINDOW = 64, 4


def aot_specs() -> List[Dict[str, Any]]:
    """One spec per configuration the dispatcher picks on a GPU (dtype x head_dim), per kernel.

    The flags (CAUSAL, BLOCK_MODE, the optional tensors behind HAS_MASK / HAS_BIAS / WRITE_AUX /
    COMPUTE_DBIAS) are properties of the problem, not tuning choices; the specs compile the representative
    causal sliding-window case with bias and its gradient, the basis gradient, no mask, and r = min(64, d).
    The 2D window kernels (``lavo_local2d_*``) are compiled for d = 64 in fp16 and fp32 only (CI time), with
    w2 = 4 and the bias gradient.
    Signatures are derived from the kernels' parameter lists (``_backend.aot_signature``): q / k / v / z and
    their outputs and gradients in the input dtype, the mask u8, everything else float32.
    """
    if not HAS_TRITON:
        return []
    specs: List[Dict[str, Any]] = []
    for dtype in _AOT_DTYPES:
        ty = TORCH_TO_TRITON[dtype]
        io = {n: f'*{ty}' for n in ('Q', 'K', 'V', 'Z', 'OUT', 'DO', 'DQ', 'DK', 'DV', 'DZ')}
        io['MASK'] = '*u8'
        prec = gpu_dot_precision(dtype, allow_tf32=False)  # the runtime's choice under torch's defaults
        for d in _AOT_HEAD_DIMS:
            # -------- global (CODE) kernels: no mask (MASK, and CNT0 with it, are None)
            gc = global_config(dtype, d, min(64, d))
            tiles = dict(BLOCK_T=gc['BLOCK_T'], BLOCK_D=gc['BLOCK_D'], BLOCK_R=gc['BLOCK_R'])
            launch = dict(num_warps=gc['num_warps'], num_stages=gc['num_stages'])
            flags = dict(tiles, CAUSAL=True, INPUT_PRECISION=prec)
            for name, fn, absent, consts in (
                    ('lavo_code_chunk_sums', _code_chunk_sums_kernel, {'MASK'}, tiles),
                    ('lavo_code_fwd', _code_fwd_kernel, {'MASK', 'CNT0'}, flags),
                    ('lavo_code_bwd_dq', _code_bwd_dq_kernel, {'MASK', 'CNT0'}, flags),
                    ('lavo_code_bwd_dz', _code_bwd_dz_kernel, {'MASK', 'CNT0'}, flags)):
                signature, constexprs = aot_signature(fn, io, absent=absent, constexprs=consts)
                specs.append(dict(name=f'{name}_{ty}_d{d}', fn=fn, signature=signature, constexprs=constexprs,
                                  **launch))
            # -------- local window kernels: bias (and its gradient), no mask
            lc = local_config(dtype, d, _AOT_WINDOW)
            lflags = dict(BLOCK_M=lc['BLOCK_M'], BLOCK_N=lc['BLOCK_N'], BLOCK_D=lc['BLOCK_D'], CAUSAL=True,
                          BLOCK_MODE=False, INPUT_PRECISION=prec)
            llaunch = dict(num_warps=lc['num_warps'], num_stages=lc['num_stages'])
            for name, fn, consts in (
                    ('lavo_local_fwd', _local_fwd_kernel, lflags),
                    ('lavo_local_bwd_dkdv', _local_bwd_dkdv_kernel, lflags),
                    ('lavo_local_bwd_dq', _local_bwd_dq_kernel,
                     dict(lflags, BLOCK_W=lc['BLOCK_W'], BLOCK_DIAG=lc['BLOCK_DIAG']))):
                signature, constexprs = aot_signature(fn, io, absent={'MASK'}, constexprs=consts)
                specs.append(dict(name=f'{name}_{ty}_d{d}', fn=fn, signature=signature, constexprs=constexprs,
                                  **llaunch))
        # -------- 2D local window kernels: sliding window, bias (and its gradient), no mask
        if dtype in _AOT_2D_DTYPES:
            d = _AOT_2D_HEAD_DIM
            c2 = local_2d_config(dtype, d, _AOT_2D_WINDOW)
            flags2 = dict(BLOCK_M=c2['BLOCK_M'], BLOCK_N=c2['BLOCK_N'], BLOCK_D=c2['BLOCK_D'], BLOCK_MODE=False,
                          INPUT_PRECISION=prec)
            for name, fn, consts in (
                    ('lavo_local2d_fwd', _local2d_fwd_kernel, flags2),
                    ('lavo_local2d_bwd_dkdv', _local2d_bwd_dkdv_kernel, flags2),
                    ('lavo_local2d_bwd_dq', _local2d_bwd_dq_kernel,
                     dict(flags2, BLOCK_KW2=c2['BLOCK_KW2'], BLOCK_DIAG=c2['BLOCK_DIAG']))):
                signature, constexprs = aot_signature(fn, io, absent={'MASK'}, constexprs=consts)
                specs.append(dict(name=f'{name}_{ty}_d{d}', fn=fn, signature=signature, constexprs=constexprs,
                                  num_warps=c2['num_warps'], num_stages=c2['num_stages']))
    return specs
