"""Naive dense reference of ``vision_priors.kernels.flash_prior.flash_prior_attention`` (same signature).

Written straight from the papers' equations, independently of the kernel's factorisation:

* GOAT (Sec. 4, Eqs. 11, 12, 20): ``z_ij = scale q_i . k_j + sum_a sum_r [alpha_har cos(w_ar (p_ia - p_ja))
  + beta_har sin(w_ar (p_ia - p_ja))] + u_h(j)``, the double sum only over pairs of non-prefix tokens
  (prefix tokens carry no relative features, ``GoatPrior``); loops over axes and modes on the dense
  offset matrix p_i - p_j.
* PoPE (Eqs. 3-6): complex ``q~_tc = softplus(q_tc) e^{i phi_tc}``, ``k~_sc = softplus(k_sc)
  e^{i (phi_sc + delta_hc)}``, ``z_ts = scale Re sum_c q~_tc conj(k~_sc)``; phi = 0 and no delta for
  prefix tokens; channel c rotates with axis ``c // (d / D)`` at ``freqs[axis, c % (d / D)]``.
* plain: ``z_ij = scale q_i . k_j``.

Masking: ``causal`` keeps j <= i; ``key_mask`` (B, N) bool, True = valid key (the package's one key-mask
convention, ``_backend.check_key_mask``). A row with no valid key outputs zeros. Computes in float64 for
float64 inputs, else float32, and returns the input dtype. ``input_precision`` is accepted for signature parity and
ignored.

This module does not import Triton; it also holds the argument checks the kernel op shares.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._backend import check_key_mask

__all__ = ['MODES', 'check_flash_prior_args', 'flash_prior_attention_ref']

MODES = ('plain', 'goat', 'pope')


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_flash_prior_args(
        q: Tensor, k: Tensor, v: Tensor, mode: str, causal: bool, key_mask: Optional[Tensor],
        coords: Optional[Tensor], freqs: Optional[Tensor], num_prefix_tokens: int,
        alpha: Optional[Tensor], beta: Optional[Tensor], key_default: Optional[Tensor],
        phase_bias: Optional[Tensor], allowed_dtypes: Tuple[torch.dtype, ...]) -> None:
    """Argument checks shared by the op and its reference; every error names the offending value.

    Raises:
        ValueError: bad mode, shape, dtype, device, or a tensor given to a mode that does not use it.
        TypeError: a ``key_mask`` that is not a bool tensor (the message states the convention).
    """
    _check(mode in MODES, f'mode must be one of {MODES}, got {mode!r}')
    for name, t in (('q', q), ('k', k), ('v', v)):
        _check(isinstance(t, Tensor) and t.dim() == 4, f'{name} must be a (B, H, N, d) tensor, got '
               f'{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}')
        _check(t.dtype in allowed_dtypes, f'{name} has dtype {t.dtype}; supported: {allowed_dtypes}')
    _check(k.dtype == q.dtype and v.dtype == q.dtype,
           f'q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}')
    _check(k.device == q.device and v.device == q.device,
           f'q, k, v must share a device, got {q.device}, {k.device}, {v.device}')
    _check(q.shape == k.shape, f'q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape')
    _check(v.shape[:3] == q.shape[:3], f'v {tuple(v.shape)} must match q {tuple(q.shape)} in (B, H, N)')
    B, H, N, d = q.shape
    _check(isinstance(causal, bool), f'causal must be a bool, got {causal!r}')
    check_key_mask(key_mask, B, N, device=q.device)
    given = dict(coords=coords, freqs=freqs, alpha=alpha, beta=beta, key_default=key_default,
                 phase_bias=phase_bias)
    needed = {'plain': (), 'goat': ('coords', 'freqs', 'alpha', 'beta', 'key_default'),
              'pope': ('coords', 'freqs', 'phase_bias')}[mode]
    for name, t in given.items():
        if name in needed:
            _check(t is not None, f"mode='{mode}' needs {name}")
            _check(isinstance(t, Tensor), f'{name} must be a tensor, got {type(t).__name__}')
            _check(t.device == q.device, f'{name} is on {t.device}, q on {q.device}')
            _check(t.is_floating_point(), f'{name} must be floating point, got {t.dtype}')
        else:
            _check(t is None, f"{name} is not used by mode='{mode}'; pass None")
    if mode == 'plain':
        _check(num_prefix_tokens == 0, f"num_prefix_tokens is not used by mode='plain', got {num_prefix_tokens}")
        return
    _check(0 <= num_prefix_tokens <= N, f'num_prefix_tokens must be in [0, {N}], got {num_prefix_tokens}')
    M = N - num_prefix_tokens
    _check(coords.dim() in (2, 3) and coords.shape[-2] == M and (coords.dim() == 2 or coords.shape[0] in (1, B)),
           f'coords must be (N - P, D) = ({M}, D) or ({B}, {M}, D), got {tuple(coords.shape)}')
    D = coords.shape[-1]
    _check(D in (1, 2), f'coords must have 1 or 2 spatial dims, got {D}')
    _check(freqs.dim() == 2 and freqs.shape[0] == D, f'freqs must be (D, R) = ({D}, R), got {tuple(freqs.shape)}')
    R = freqs.shape[1]
    if mode == 'goat':
        for name, t in (('alpha', alpha), ('beta', beta)):
            _check(tuple(t.shape) == (H, D, R), f'{name} must be (H, D, R) = ({H}, {D}, {R}), got {tuple(t.shape)}')
        _check(tuple(key_default.shape[-2:]) == (H, N)
               and (key_default.dim() == 2 or (key_default.dim() == 3 and key_default.shape[0] in (1, B))),
               f'key_default must be (H, N) = ({H}, {N}) or ({B}, {H}, {N}), got {tuple(key_default.shape)}')
    else:
        _check(v.shape[-1] == d, f"mode='pope' needs v of the q/k width {d}, got {v.shape[-1]}")
        _check(D * R == d, f'pope freqs {tuple(freqs.shape)} must cover the head dim: D * R = {D * R} != d = {d}')
        _check(tuple(phase_bias.shape) == (H, d),
               f'phase_bias must be (H, d) = ({H}, {d}), got {tuple(phase_bias.shape)}')


def flash_prior_attention_ref(
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
    """Dense attention with the GOAT / PoPE / no prior; arguments as ``flash_prior_attention``.

    Returns:
        (B, H, N, d_v) in the input dtype; differentiable in every tensor argument.
    """
    check_flash_prior_args(q, k, v, mode, causal, key_mask, coords, freqs, num_prefix_tokens, alpha,
                           beta, key_default, phase_bias,
                           (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, N, d = q.shape
    P = num_prefix_tokens
    scale = d ** -0.5 if scale is None else scale
    qf, kf, vf = q.to(cdt), k.to(cdt), v.to(cdt)

    if mode == 'pope':
        pos = (coords if coords.dim() == 3 else coords.unsqueeze(0)).to(cdt)  # (Bc, M, D)
        D = pos.shape[-1]
        per_axis = d // D
        channel = torch.arange(d, device=q.device)
        axis = channel // per_axis
        omega = freqs.to(cdt)[axis, channel % per_axis]  # (d,)
        phase = F.pad(pos[:, :, axis] * omega, (0, 0, P, 0))  # (Bc, N, d); prefix tokens: 0
        positioned = (torch.arange(N, device=q.device) >= P).to(cdt)  # delta only on non-prefix keys
        key_phase = phase[:, None] + phase_bias.to(cdt)[None, :, None, :] * positioned[None, None, :, None]
        q_c = F.softplus(qf) * torch.exp(1j * phase[:, None])
        k_c = F.softplus(kf) * torch.exp(1j * key_phase)
        logits = torch.einsum('bhtc,bhsc->bhts', q_c, k_c.conj()).real * scale
    else:
        logits = torch.einsum('bhid,bhjd->bhij', qf, kf) * scale

    if mode == 'goat':
        pos = (coords if coords.dim() == 3 else coords.unsqueeze(0)).to(cdt)  # (Bc, M, D)
        w, a_, b_ = freqs.to(cdt), alpha.to(cdt), beta.to(cdt)
        rel = torch.zeros(pos.shape[0], H, N - P, N - P, dtype=cdt, device=q.device)
        for ax in range(pos.shape[-1]):
            offset = pos[:, :, None, ax] - pos[:, None, :, ax]  # p_i - p_j, (Bc, M, M)
            for r in range(w.shape[1]):
                phase = (w[ax, r] * offset)[:, None]
                rel = rel + a_[None, :, ax, r, None, None] * torch.cos(phase) \
                    + b_[None, :, ax, r, None, None] * torch.sin(phase)
        u = key_default.to(cdt)
        u = u[None, :, None, :] if u.dim() == 2 else u[:, :, None, :]
        logits = logits + F.pad(rel, (P, 0, P, 0)) + u

    valid = torch.ones(B, 1, N, N, dtype=torch.bool, device=q.device)
    if causal:
        valid = valid & torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    if key_mask is not None:
        valid = valid & key_mask[:, None, None, :]
    row_any = valid.any(-1, keepdim=True)
    # empty rows: finite logits (no NaN in forward or backward), zero output
    logits = logits.masked_fill(~valid, float('-inf')).masked_fill(~row_any, 0.0)
    probs = logits.softmax(-1) * row_any
    return (probs @ vf).to(q.dtype)
