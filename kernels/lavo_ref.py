"""Naive dense references of the LAVO ops ``vision_priors.kernels.lavo.lavo_global`` / ``lavo_local`` (same signatures).

Written straight from the paper (Zhang et al., arXiv:2312.11135), independently of the ops' factorisations
(for tests; the ops' own PyTorch backend is the blocked O(L w) / cumulative-sum path of ``lavo_torch.py``):

* ``lavo_global_reference``: the running mean ``H_t = (1/n_t) sum_{valid s <= t} B z_s`` (or one mean over
  all valid s) as a dense (L x L) averaging matrix, the slots ``X~_t = diag(H_t) B`` materialised as
  (L, r, d), and ``softmax(scale q_t X~_t^T) X~_t`` (Eqs. 3-4).
* ``lavo_local_reference``: dense (L x L) scores ``scale q_i . k_j + P[j - i + w - 1]`` restricted to the
  window (Secs. 3.2-3.3).
* ``lavo_local_2d_reference``: the same on a row-major (gh x gw) patch grid, scores
  ``scale q_i . k_j + P[(dy + w - 1) (2w - 1) + dx + w - 1]`` for ``|dy|, |dx| <= w - 1`` (or the own
  ``w x w`` tile), the 2D reading of Sec. 3.3's embedded relative positions.

Padding: ``key_mask`` (B, L) bool, True = valid key. ``backend`` is accepted for signature parity and
ignored. Both compute in the inputs' dtype (float64 for tests) and are differentiable by autograd.

This module does not import Triton; it also holds the argument checks the ops share.
"""
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._backend import check_key_mask

__all__ = ['LOCAL_MODES', 'check_lavo_global_args', 'check_lavo_local_2d_args', 'check_lavo_local_args',
           'lavo_global_reference', 'lavo_local_2d_reference', 'lavo_local_reference']

LOCAL_MODES = ('sliding', 'block')


def _check_qkv(names: List[str], tensors: List[Tensor]) -> None:
    ref_name, ref = names[0], tensors[0]
    if ref.dim() != 4:
        raise ValueError(f'{ref_name} must be (B, heads, L, head_dim), got shape {tuple(ref.shape)}')
    if not ref.is_floating_point():
        raise TypeError(f'{ref_name} must be a floating tensor, got dtype {ref.dtype}')
    for n, t in zip(names[1:], tensors[1:]):
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f'{n} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(t.shape)}')
        if t.dtype != ref.dtype:
            raise TypeError(f'{n} has dtype {t.dtype} but {ref_name} has {ref.dtype}')
        if t.device != ref.device:
            raise ValueError(f'{n} is on {t.device} but {ref_name} is on {ref.device}')


def check_lavo_global_args(q: Tensor, z: Tensor, basis: Tensor, key_mask: Optional[Tensor]) -> None:
    """Checks of ``lavo_global`` and its reference; every error names the offending argument."""
    _check_qkv(['q', 'z'], [q, z])
    bsz, nh, length, d = q.shape
    if basis.dim() != 3 or basis.shape[0] != nh or basis.shape[2] != d or basis.shape[1] < 1:
        raise ValueError(f'basis must be (heads, r, head_dim) = ({nh}, r, {d}) with r >= 1, got {tuple(basis.shape)}')
    if basis.device != q.device:
        raise ValueError(f'basis is on {basis.device} but q is on {q.device}')
    check_key_mask(key_mask, bsz, length, device=q.device)
    if length == 0:
        raise ValueError('lavo_global needs L >= 1 tokens, got L = 0')


def _check_window_args(q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], window: int, mode: str,
                       key_mask: Optional[Tensor], dims: int) -> None:
    """The checks ``lavo_local`` (dims 1) and ``lavo_local_2d`` (dims 2) share: q / k / v, window, mode, a
    relative-bias table of (2 window - 1) ** dims entries on q's device, the key mask."""
    _check_qkv(['q', 'k', 'v'], [q, k, v])
    bsz, _, length, _ = q.shape
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f'window must be an int >= 1, got {window!r}')
    if mode not in LOCAL_MODES:
        raise ValueError(f'mode must be one of {LOCAL_MODES}, got {mode!r}')
    if rel_bias is not None:
        size = (2 * window - 1) ** dims
        if rel_bias.dim() != 1 or rel_bias.numel() != size:
            shape = '(2 * window - 1,)' if dims == 1 else '((2 * window - 1) ** 2,)'
            raise ValueError(f'rel_bias must have shape {shape} = ({size},), got {tuple(rel_bias.shape)}')
        if rel_bias.device != q.device:
            raise ValueError(f'rel_bias is on {rel_bias.device} but q is on {q.device}')
    check_key_mask(key_mask, bsz, length, device=q.device)


def check_lavo_local_args(q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], window: int, mode: str,
                          key_mask: Optional[Tensor]) -> None:
    """Checks of ``lavo_local`` and its reference; every error names the offending argument."""
    _check_window_args(q, k, v, rel_bias, window, mode, key_mask, dims=1)
    if q.shape[2] == 0:
        raise ValueError('lavo_local needs L >= 1 tokens, got L = 0')


def check_lavo_local_2d_args(q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], grid_size: Sequence[int],
                             window: int, mode: str, key_mask: Optional[Tensor]) -> Tuple[int, int]:
    """Checks of ``lavo_local_2d`` and its reference; every error names the offending argument.

    Returns:
        (gh, gw) as ints.
    """
    _check_window_args(q, k, v, rel_bias, window, mode, key_mask, dims=2)
    ok = isinstance(grid_size, (tuple, list)) and len(grid_size) == 2 and all(
        isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in grid_size)
    if not ok:
        raise ValueError(f'grid_size must be two ints (rows, cols) >= 1, got {grid_size!r}')
    gh, gw = int(grid_size[0]), int(grid_size[1])
    if gh * gw != q.shape[2]:
        raise ValueError(f'grid_size={tuple(grid_size)} describes {gh * gw} patches, but q has L={q.shape[2]}')
    return gh, gw


def _window_softmax_read(s: Tensor, allowed: Tensor, key_mask: Optional[Tensor], v: Tensor) -> Tensor:
    """softmax of the scores ``s`` over the (L x L) ``allowed`` pairs that hold a valid key, times v; a query
    without any such key reads 0 (the local references' common end)."""
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
    p = s.softmax(dim=-1) * allowed.any(dim=-1, keepdim=True)
    return p @ v


def lavo_global_reference(q: Tensor, z: Tensor, basis: Tensor, scale: float, key_mask: Optional[Tensor] = None,
                          causal: bool = True, backend: str = 'auto') -> Tensor:
    """Dense CODE branch (Eqs. 3-4) with materialised slots; arguments as ``lavo_global``.

    Returns:
        (B, heads, L, d) in the inputs' dtype.
    """
    del backend
    check_lavo_global_args(q, z, basis, key_mask)
    bsz, _, length, _ = q.shape
    valid = (torch.ones(bsz, length, dtype=torch.bool, device=q.device) if key_mask is None else key_mask)
    weight = valid[:, None, :].to(q.dtype).expand(bsz, length, length)  # [t, s] = m_s
    if causal:
        weight = weight.tril()  # s <= t
    weight = weight / weight.sum(-1, keepdim=True).clamp(min=1)  # 1 / n_t over the valid s
    h = torch.einsum('bts,bhsd,hrd->bhtr', weight, z, basis)  # H_t = (1/n_t) sum_s m_s B z_s
    slots = h[..., None] * basis[None, :, None]  # X~_t = diag(H_t) B, (B, heads, L, r, d)
    attn = torch.softmax(scale * torch.einsum('bhtd,bhtrd->bhtr', q, slots), dim=-1)
    return torch.einsum('bhtr,bhtrd->bhtd', attn, slots)


def lavo_local_reference(q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], scale: float, window: int,
                         causal: bool = True, mode: str = 'sliding', key_mask: Optional[Tensor] = None,
                         backend: str = 'auto') -> Tensor:
    """Dense (L x L) local branch with the embedded relative position bias; arguments as ``lavo_local``.

    Returns:
        (B, heads, L, d) in the inputs' dtype; a query without any valid key in its window outputs 0.
    """
    del backend
    check_lavo_local_args(q, k, v, rel_bias, window, mode, key_mask)
    length = q.shape[2]
    idx = torch.arange(length, device=q.device)
    rel = idx[None, :] - idx[:, None]  # j - i
    if mode == 'sliding':
        allowed = (rel >= -(window - 1)) & (rel <= (0 if causal else window - 1))
    else:
        allowed = (idx[None, :] // window) == (idx[:, None] // window)
        if causal:
            allowed = allowed & (rel <= 0)
    s = (q @ k.transpose(-1, -2)) * scale
    if rel_bias is not None:
        s = s + rel_bias[(rel + window - 1).clamp(0, 2 * window - 2)]
    return _window_softmax_read(s, allowed, key_mask, v)


def lavo_local_2d_reference(q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], scale: float,
                            grid_size: Sequence[int], window: int, key_mask: Optional[Tensor] = None,
                            mode: str = 'sliding', backend: str = 'auto') -> Tensor:
    """Dense (L x L) 2D local window with the embedded relative position bias; arguments as ``lavo_local_2d``.

    Patch i = (y_i, x_i) of the row-major grid attends to patch j with logit
    ``scale q_i . k_j + P[(dy + w - 1) (2w - 1) + dx + w - 1]``, ``(dy, dx) = (y_j - y_i, x_j - x_i)``,
    where ``|dy|, |dx| <= w - 1`` (``mode='sliding'``) or both lie in the same ``w x w`` tile
    (``mode='block'``) and the key is valid (Sec. 3.3 on a grid).

    Returns:
        (B, heads, gh * gw, d) in the inputs' dtype; a query without any valid key in its window outputs 0.
    """
    del backend
    gh, gw = check_lavo_local_2d_args(q, k, v, rel_bias, grid_size, window, mode, key_mask)
    idx = torch.arange(gh * gw, device=q.device)
    y, x = idx // gw, idx % gw
    dy, dx = y[None, :] - y[:, None], x[None, :] - x[:, None]  # [i, j]: offset of key j from query i
    if mode == 'sliding':
        allowed = (dy.abs() <= window - 1) & (dx.abs() <= window - 1)
    else:
        ty, tx = y // window, x // window  # the w x w tile of each patch
        allowed = (ty[None, :] == ty[:, None]) & (tx[None, :] == tx[:, None])
    s = (q @ k.transpose(-1, -2)) * scale
    if rel_bias is not None:
        kw = 2 * window - 1
        s = s + rel_bias[((dy + window - 1) * kw + dx + window - 1).clamp(0, kw * kw - 1)]
    return _window_softmax_read(s, allowed, key_mask, v)
