"""Naive dense reference of ``vision_priors.kernels.chamfer.chamfer_nn`` (same signature), and the checks it shares.

``chamfer_nn_reference`` builds the full (B, N, M) matrix of squared distances ``sum_k (x_k - y_k)^2`` and
takes its row / column minima (first index among ties); autograd differentiates the minimum. It is for
tests: the op's own PyTorch backend (``backend='torch'``) computes the same neighbours in bounded memory
(tiles of points, ``chamfer.py``). Padding: ``*_lengths`` (B,) or bool ``*_mask`` (B, N), True = valid
point (checked by ``_backend.check_key_mask``, the package's one mask check).

This module does not import Triton; it also holds the argument checks every entry point shares.
"""
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ._backend import check_key_mask, nonfinite_message

__all__ = ['ChamferResult', 'check_clouds', 'chamfer_nn_reference', 'finish_nn', 'nn_dense', 'safe_sqrt']


class ChamferResult(NamedTuple):
    """Nearest neighbours both ways; distances are squared or not as requested."""
    dist_x: Tensor  # (B, N) distance from x_i to its nearest valid y
    idx_x: Tensor   # (B, N) int64 index into y (-1: padded x_i, or no valid y)
    dist_y: Tensor  # (B, M)
    idx_y: Tensor   # (B, M) int64 index into x


def _check_values(x: Tensor, y: Tensor, x_mask: Optional[Tensor], y_mask: Optional[Tensor],
                  reduction: Optional[str]) -> None:
    """Rejects NaN / inf points (padded ones included) and, for ``reduction`` 'mean' / 'sum', clouds
    without a valid point. One reduction and one host sync when all is well; the messages are only built
    on failure. Skipped under torch.compile (the sync would break the graph) and for meta tensors (no values)."""
    if torch.compiler.is_compiling() or x.is_meta:
        return
    clouds = (('x', x, x_mask), ('y', y, y_mask))
    ok = torch.isfinite(x).all() & torch.isfinite(y).all()
    filled: List[Tensor] = []  # per cloud: (B,) whether it has a valid point
    if reduction in ('mean', 'sum'):
        filled = [m.any(dim=1) if m is not None else torch.full((p.shape[0],), p.shape[1] > 0, device=p.device)
                  for _, p, m in clouds]
        ok = ok & filled[0].all() & filled[1].all()
    if bool(ok):
        return
    for name, pts, mask in clouds:
        msg = nonfinite_message(pts, name)
        if msg:
            raise ValueError(msg + (' (padded points must be finite too)' if mask is not None else ''))
    for (name, _, _), has_points in zip(clouds, filled):
        empty_samples = (~has_points).nonzero().flatten().tolist()
        if empty_samples:
            raise ValueError(
                f'cloud {name} has no valid point in sample(s) {empty_samples}: its Chamfer distance is undefined '
                f"and reduction={reduction!r} would make the whole result nan; drop those samples, or use "
                f"reduction='none' (nan for them)")


def check_clouds(x: Tensor, y: Tensor, x_lengths: Optional[Tensor], y_lengths: Optional[Tensor],
                 x_mask: Optional[Tensor], y_mask: Optional[Tensor],
                 reduction: Optional[str] = None) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Validates the clouds (shapes, padding, finite points; see :func:`_check_values` for ``reduction``)
    and turns lengths into (B, N) / (B, M) bool masks. The one check of every entry point and backend."""
    if x.dim() != 3 or y.dim() != 3:
        raise ValueError(f'x and y must be (B, N, D) and (B, M, D), got {tuple(x.shape)} and {tuple(y.shape)}')
    if x.shape[0] != y.shape[0]:
        raise ValueError(f'batch sizes differ: x has {x.shape[0]}, y has {y.shape[0]}')
    if x.shape[2] != y.shape[2]:
        raise ValueError(f'point dimensions differ: x has D={x.shape[2]}, y has D={y.shape[2]}')
    if x.shape[2] < 1:
        raise ValueError(f'points need D >= 1 coordinates, got D={x.shape[2]}')
    if not x.is_floating_point() or x.dtype != y.dtype:
        raise TypeError(f'x and y must share one floating dtype, got {x.dtype} and {y.dtype}')
    if x.device != y.device:
        raise ValueError(f'x is on {x.device} but y is on {y.device}')
    out = []
    for name, pts, lengths, mask in (('x', x, x_lengths, x_mask), ('y', y, y_lengths, y_mask)):
        bsz, n = pts.shape[0], pts.shape[1]
        if lengths is not None and mask is not None:
            raise ValueError(f'give {name}_lengths or {name}_mask, not both')
        if lengths is not None:
            if lengths.shape != (bsz,) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
                raise ValueError(f'{name}_lengths must be an integer tensor of shape ({bsz},), got '
                                 f'{lengths.dtype} {tuple(lengths.shape)}')
            if not lengths.is_cuda and ((lengths < 0) | (lengths > n)).any():
                raise ValueError(f'{name}_lengths must lie in [0, {n}], got {lengths.tolist()}')
            mask = torch.arange(n, device=pts.device)[None, :] < lengths.to(pts.device)[:, None]
        elif mask is not None:
            check_key_mask(mask, bsz, n, name=f'{name}_mask', device=pts.device, valid='point')
        out.append(mask)
    _check_values(x, y, out[0], out[1], reduction)
    return out[0], out[1]


def nn_dense(x: Tensor, y: Tensor, y_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Squared distance and index (int64, -1 if none) of each x's nearest valid y, from the dense (B, N, M)
    distance matrix, in the inputs' dtype (float64 stays float64); first index among ties."""
    d2 = ((x[:, :, None, :] - y[:, None, :, :]) ** 2).sum(-1)
    if y_mask is not None:
        d2 = d2.masked_fill(~y_mask[:, None, :], float('inf'))
    if y.shape[1] == 0:
        return (torch.full(x.shape[:2], float('inf'), dtype=x.dtype, device=x.device),
                torch.full(x.shape[:2], -1, dtype=torch.int64, device=x.device))
    dist, idx = d2.min(dim=2)  # first index among ties
    return dist, torch.where(torch.isinf(dist), -1, idx)


def safe_sqrt(d2: Tensor) -> Tensor:
    """sqrt with gradient 0 (not inf / nan) at 0."""
    pos = d2 > 0
    return torch.where(pos, torch.where(pos, d2, 1.).sqrt(), 0.)


def finish_nn(dist2: Tensor, idx: Tensor, valid: Optional[Tensor], squared: bool) -> Tuple[Tensor, Tensor]:
    """Padded points get distance 0 and index -1; the distance is squared or not as requested."""
    if valid is not None:
        dist2 = dist2.masked_fill(~valid, 0.)
        idx = idx.masked_fill(~valid, -1)
    return (dist2 if squared else safe_sqrt(dist2)), idx


def chamfer_nn_reference(x: Tensor, y: Tensor, x_lengths: Optional[Tensor] = None,
                         y_lengths: Optional[Tensor] = None, x_mask: Optional[Tensor] = None,
                         y_mask: Optional[Tensor] = None, squared: bool = True,
                         backend: str = 'auto') -> ChamferResult:
    """Dense PyTorch nearest neighbours both ways: the reference of ``chamfer_nn`` (same signature;
    ``backend`` is ignored). Differentiable by autograd, in the inputs' dtype; memory O(B N M D)."""
    del backend
    x_mask, y_mask = check_clouds(x, y, x_lengths, y_lengths, x_mask, y_mask)
    dx2, ix = nn_dense(x, y, y_mask)
    dy2, iy = nn_dense(y, x, x_mask)
    dist_x, ix = finish_nn(dx2, ix, x_mask, squared)
    dist_y, iy = finish_nn(dy2, iy, y_mask, squared)
    return ChamferResult(dist_x, ix, dist_y, iy)
