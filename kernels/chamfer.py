"""Chamfer distance between point sets: nearest neighbours both ways, with a Triton forward.

``chamfer_nn(x, y)`` returns, for clouds ``x`` (B, N, D) and ``y`` (B, M, D), the distance from every
point of x to its nearest point of y and that point's index, and the same from y to x::

    dist_x[b, i] = min_j ||x_bi - y_bj||^p,   idx_x[b, i] = argmin_j (first index among ties)
    dist_y[b, j] = min_i ||y_bj - x_bi||^p,   idx_y[b, j] = argmin_i

with p = 2 (``squared=True``) or p = 1. Padded (invalid) points, given as ``*_lengths`` (B,) or bool
``*_mask`` (B, N), are never anyone's neighbour; their own entries are distance 0 and index -1. A valid
point whose other cloud has no valid point gets distance +inf and index -1. Every point, padded ones
included, must be finite: a NaN point would be every point's nearest neighbour (and a NaN in the padding
still poisons the gradients), so NaN / inf points are a ValueError naming the first one.

The Triton kernel tiles x against y and keeps a running (min, argmin) per row, computing the squared
distance coordinate by coordinate as ``sum_k (x_k - y_k)^2`` (no ``|x|^2 + |y|^2 - 2 x.y``
cancellation, so duplicate points give exactly 0). It is launched twice (x->y and y->x). Its backward
pass (an ``autograd.Function``, in PyTorch) only gathers and scatter-adds along the indices:
``d||x - y||^2 / dx = 2 (x - y)``, ``d||x - y|| / dx = (x - y) / ||x - y||`` (0 at distance 0); the
PyTorch path differentiates its dense minimum to the same gradients.

``chamfer_distance(x, y, squared=True, reduction='mean')`` is the loss / metric, per cloud::

    squared=True  (CD-L2):  mean_i ||x_i - NN_y(x_i)||^2 + mean_j ||y_j - NN_x(y_j)||^2
    squared=False (CD-L1):  (mean_i ||x_i - NN_y(x_i)|| + mean_j ||y_j - NN_x(y_j)||) / 2

This is the convention of the point-completion benchmarks that report PCN (the PCN / GRNet / PoinTr
evaluation code: CD-L1 averages the two unsquared means, CD-L2 adds the two squared means). Papers
also write the unsquared CD as the plain sum (no 1/2), so check a table's convention before comparing
numbers; tables usually quote the value x 1e3 (scale it at the call site). Means run over valid
points only; ``reduction`` then averages ('mean'), sums ('sum') or keeps ('none', shape (B,)) the
per-cloud values. A cloud without any valid point (length 0) has no Chamfer distance: 'none' gives nan
for that sample alone, while 'mean' and 'sum' raise a ValueError naming the sample rather than turn the
whole batch into nan.

Backend choice: ``backend='triton'|'torch'`` > env ``VISION_PRIORS_KERNELS`` > 'auto' (Triton on CUDA);
on CPU tensors 'triton' runs in Triton's interpreter (``TRITON_INTERPRET=1`` before triton's import).
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ._backend import HAS_TRITON, TORCH_TO_TRITON, empty, nonfinite_message, resolve_backend

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ['ChamferResult', 'chamfer_nn', 'chamfer_nn_reference', 'chamfer_distance', 'chamfer_config',
           'aot_specs']

_REDUCTIONS = ('mean', 'sum', 'none')


class ChamferResult(NamedTuple):
    """Nearest neighbours both ways; distances are squared or not as requested."""
    dist_x: Tensor  # (B, N) distance from x_i to its nearest valid y
    idx_x: Tensor   # (B, N) int64 index into y (-1: padded x_i, or no valid y)
    dist_y: Tensor  # (B, M)
    idx_y: Tensor   # (B, M) int64 index into x


def chamfer_config(dtype: torch.dtype, dim: int) -> Dict[str, int]:
    """Tile sizes and launch options of the nearest-neighbour kernel (shared by the runtime and aot_specs).

    Args:
        dtype: Point dtype (fp16 / bf16 / fp32; distances are accumulated in fp32).
        dim: D, coordinates per point (unrolled in the kernel).
    """
    del dtype, dim
    return dict(BLOCK_N=64, BLOCK_M=64, num_warps=4, num_stages=2)


if HAS_TRITON:

    @triton.jit
    def _nn_kernel(
            X, Y, YMASK, DIST, IDX, N, M,
            stride_xb, stride_xn, stride_xd, stride_yb, stride_ym, stride_yd, stride_mb,
            DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_YMASK: tl.constexpr):
        """For BLOCK_N points of x: squared distance to, and index of, the nearest valid point of y."""
        pid_n = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        x_base = X + b * stride_xb + offs_n * stride_xn
        best = tl.full([BLOCK_N], float('inf'), dtype=tl.float32)
        best_idx = tl.full([BLOCK_N], -1, dtype=tl.int32)
        for start in range(0, M, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            mmask = offs_m < M
            y_base = Y + b * stride_yb + offs_m * stride_ym
            d2 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for k in tl.static_range(DIM):
                xk = tl.load(x_base + k * stride_xd, mask=nmask, other=0.).to(tl.float32)
                yk = tl.load(y_base + k * stride_yd, mask=mmask, other=0.).to(tl.float32)
                diff = xk[:, None] - yk[None, :]
                d2 += diff * diff
            ok = mmask
            if HAS_YMASK:
                ok = ok & (tl.load(YMASK + b * stride_mb + offs_m, mask=mmask, other=0) != 0)
            d2 = tl.where(ok[None, :], d2, float('inf'))
            tile_min, tile_arg = tl.min(d2, axis=1, return_indices=True, return_indices_tie_break_left=True)
            better = tile_min < best  # strict: an earlier tile keeps ties
            best_idx = tl.where(better, tile_arg + start, best_idx)
            best = tl.where(better, tile_min, best)
        out = b * N + offs_n
        tl.store(DIST + out, best, mask=nmask)
        tl.store(IDX + out, best_idx.to(tl.int64), mask=nmask)


def _nn_triton(x: Tensor, y: Tensor, y_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Squared distance (float32) and index (int64, -1 if none) of each x's nearest valid y."""
    bsz, n, dim = x.shape
    m = y.shape[1]
    cfg = chamfer_config(x.dtype, dim)
    dist = empty(bsz, n, device=x.device, dtype=torch.float32)
    idx = empty(bsz, n, device=x.device, dtype=torch.int64)
    ymask = y_mask.contiguous().view(torch.uint8) if y_mask is not None else None
    if n == 0:
        return dist, idx
    _nn_kernel[(triton.cdiv(n, cfg['BLOCK_N']), bsz)](
        x, y, ymask if ymask is not None else dist, dist, idx, n, m,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        ymask.stride(0) if ymask is not None else 0,
        DIM=dim, BLOCK_N=cfg['BLOCK_N'], BLOCK_M=cfg['BLOCK_M'], HAS_YMASK=ymask is not None,
        num_warps=cfg['num_warps'], num_stages=cfg['num_stages'])
    return dist, idx


def _nn_torch(x: Tensor, y: Tensor, y_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Dense (B, N, M) version of :func:`_nn_triton` in the inputs' dtype (float64 stays float64)."""
    d2 = ((x[:, :, None, :] - y[:, None, :, :]) ** 2).sum(-1)
    if y_mask is not None:
        d2 = d2.masked_fill(~y_mask[:, None, :], float('inf'))
    if y.shape[1] == 0:
        return (torch.full(x.shape[:2], float('inf'), dtype=x.dtype, device=x.device),
                torch.full(x.shape[:2], -1, dtype=torch.int64, device=x.device))
    dist, idx = d2.min(dim=2)  # first index among ties
    return dist, torch.where(torch.isinf(dist), -1, idx)


def _safe_sqrt(d2: Tensor) -> Tensor:
    """sqrt with gradient 0 (not inf / nan) at 0."""
    pos = d2 > 0
    return torch.where(pos, torch.where(pos, d2, 1.).sqrt(), 0.)


def _finish(dist2: Tensor, idx: Tensor, valid: Optional[Tensor], squared: bool) -> Tuple[Tensor, Tensor]:
    if valid is not None:
        dist2 = dist2.masked_fill(~valid, 0.)
        idx = idx.masked_fill(~valid, -1)
    return (dist2 if squared else _safe_sqrt(dist2)), idx


class _ChamferFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor, x_mask: Optional[Tensor], y_mask: Optional[Tensor],
                squared: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        dx2, ix = _nn_triton(x, y, y_mask)
        dy2, iy = _nn_triton(y, x, x_mask)
        dist_x, ix = _finish(dx2, ix, x_mask, squared)
        dist_y, iy = _finish(dy2, iy, y_mask, squared)
        dist_x, dist_y = dist_x.to(x.dtype), dist_y.to(x.dtype)
        ctx.save_for_backward(x, y, ix, iy, dist_x, dist_y)
        ctx.squared = squared
        ctx.mark_non_differentiable(ix, iy)
        return dist_x, ix, dist_y, iy

    @staticmethod
    def backward(ctx: Any, g_x: Tensor, _gi: Any, g_y: Tensor, _gj: Any):
        x, y, ix, iy, dist_x, dist_y = ctx.saved_tensors
        gx, gy = _nn_backward(x, y, ix, iy, dist_x, dist_y, g_x, g_y, ctx.squared)
        return gx, gy, None, None, None


def _nn_backward(x: Tensor, y: Tensor, ix: Tensor, iy: Tensor, dist_x: Tensor, dist_y: Tensor, g_x: Tensor,
                 g_y: Tensor, squared: bool) -> Tuple[Tensor, Tensor]:
    """Gradients of ``sum g_x dist_x + g_y dist_y`` w.r.t. x and y through the neighbour indices."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf, yf = x.to(acc), y.to(acc)
    gx = torch.zeros_like(xf)
    gy = torch.zeros_like(yf)
    for src, dst, idx, dist, g, g_src, g_dst in ((xf, yf, ix, dist_x, g_x, gx, gy), (yf, xf, iy, dist_y, g_y, gy, gx)):
        if g is None:
            continue
        ok = idx >= 0
        nb = torch.gather(dst, 1, idx.clamp(min=0)[..., None].expand(-1, -1, dst.shape[-1]))
        diff = src - nb
        if squared:
            w = 2. * g.to(acc)
        else:
            dd = dist.to(acc)
            w = torch.where(dd > 0, g.to(acc) / torch.where(dd > 0, dd, 1.), 0.)
        contrib = diff * (w * ok)[..., None]
        g_src.add_(contrib)
        g_dst.scatter_add_(1, idx.clamp(min=0)[..., None].expand(-1, -1, dst.shape[-1]), -contrib)
    return gx.to(x.dtype), gy.to(y.dtype)


def _check_clouds(x: Tensor, y: Tensor, x_mask: Optional[Tensor], y_mask: Optional[Tensor],
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


def _masks(x: Tensor, y: Tensor, x_lengths: Optional[Tensor], y_lengths: Optional[Tensor],
           x_mask: Optional[Tensor], y_mask: Optional[Tensor],
           reduction: Optional[str] = None) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Validates the clouds (shapes, padding, finite points; see :func:`_check_clouds` for ``reduction``)
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
            if mask.dtype != torch.bool or tuple(mask.shape) != (bsz, n):
                raise ValueError(f'{name}_mask must be a bool tensor of shape ({bsz}, {n}), got '
                                 f'{mask.dtype} {tuple(mask.shape)}')
            if mask.device != pts.device:
                raise ValueError(f'{name}_mask is on {mask.device} but {name} is on {pts.device}')
        out.append(mask)
    _check_clouds(x, y, out[0], out[1], reduction)
    return out[0], out[1]


def chamfer_nn_reference(x: Tensor, y: Tensor, x_lengths: Optional[Tensor] = None,
                         y_lengths: Optional[Tensor] = None, x_mask: Optional[Tensor] = None,
                         y_mask: Optional[Tensor] = None, squared: bool = True) -> ChamferResult:
    """Dense PyTorch nearest neighbours both ways (the reference of :func:`chamfer_nn`, same arguments
    less ``backend``); differentiable by autograd, in the inputs' dtype."""
    x_mask, y_mask = _masks(x, y, x_lengths, y_lengths, x_mask, y_mask)
    dx2, ix = _nn_torch(x, y, y_mask)
    dy2, iy = _nn_torch(y, x, x_mask)
    dist_x, ix = _finish(dx2, ix, x_mask, squared)
    dist_y, iy = _finish(dy2, iy, y_mask, squared)
    return ChamferResult(dist_x, ix, dist_y, iy)


def chamfer_nn(x: Tensor, y: Tensor, x_lengths: Optional[Tensor] = None, y_lengths: Optional[Tensor] = None,
               x_mask: Optional[Tensor] = None, y_mask: Optional[Tensor] = None, squared: bool = True,
               backend: str = 'auto') -> ChamferResult:
    """Nearest neighbours between two batches of point clouds, both ways (see the module docstring).

    Args:
        x: (B, N, D) points (any small D; fp16 / bf16 / fp32 for Triton, any float for PyTorch).
        y: (B, M, D) points.
        x_lengths, y_lengths: Optional (B,) integer counts of valid (leading) points per cloud (their
            range is checked when they are on the CPU; CUDA lengths are not read back).
        x_mask, y_mask: Optional (B, N) / (B, M) bool, True = valid point (instead of lengths).
        squared: Squared Euclidean distances (True) or Euclidean distances.
        backend: 'auto', 'triton' or 'torch'.

    Raises:
        ValueError: bad shapes / padding, or a NaN / inf point, named with its position
            (e.g. 'y must be finite: y[1, 7, 0] = nan'); the finiteness test reads one flag back from
            the device.

    Returns:
        :class:`ChamferResult` (dist_x, idx_x, dist_y, idx_y); distances in x's dtype, differentiable in
        x and y (a padded point or one without any valid partner gets zero gradient).
    """
    x_mask, y_mask = _masks(x, y, x_lengths, y_lengths, x_mask, y_mask)
    return _chamfer_nn(x, y, x_mask, y_mask, squared, backend)


def _chamfer_nn(x: Tensor, y: Tensor, x_mask: Optional[Tensor], y_mask: Optional[Tensor], squared: bool,
                backend: str) -> ChamferResult:
    if resolve_backend(backend, x, y, x_mask, y_mask) == 'torch':
        dx2, ix = _nn_torch(x, y, y_mask)
        dy2, iy = _nn_torch(y, x, x_mask)
        dist_x, ix = _finish(dx2, ix, x_mask, squared)
        dist_y, iy = _finish(dy2, iy, y_mask, squared)
        return ChamferResult(dist_x, ix, dist_y, iy)
    if x.dtype not in TORCH_TO_TRITON:
        raise TypeError(f"backend='triton' supports float16, bfloat16 and float32 points, got {x.dtype}")
    return ChamferResult(*_ChamferFn.apply(x, y, x_mask, y_mask, bool(squared)))


def chamfer_distance(x: Tensor, y: Tensor, squared: bool = True, reduction: str = 'mean',
                     x_lengths: Optional[Tensor] = None, y_lengths: Optional[Tensor] = None,
                     x_mask: Optional[Tensor] = None, y_mask: Optional[Tensor] = None,
                     backend: str = 'auto') -> Tensor:
    """Chamfer distance, the PCN loss and metric: CD-L2 (``squared=True``) or CD-L1 (see the module docstring).

    Args:
        x: (B, N, D) predicted points.
        y: (B, M, D) target points.
        squared: CD-L2 = mean squared NN distance x->y + y->x; else CD-L1 = the average of the two
            mean NN distances.
        reduction: 'mean' (over clouds), 'sum' or 'none' (per cloud, shape (B,)).
        x_lengths, y_lengths, x_mask, y_mask: Optional padding (see :func:`chamfer_nn`); means run over
            valid points.
        backend: 'auto', 'triton' or 'torch'.

    Returns:
        Scalar (or (B,) for 'none') in x's dtype. With 'none', a sample whose x or y cloud has no valid
        point gets nan (the other samples are unaffected).

    Raises:
        ValueError: as :func:`chamfer_nn`, and, for 'mean' / 'sum', a cloud without any valid point
            (naming the cloud and the samples), which would otherwise make the whole result nan.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f'reduction must be one of {_REDUCTIONS}, got {reduction!r}')
    x_mask, y_mask = _masks(x, y, x_lengths, y_lengths, x_mask, y_mask, reduction)
    res = _chamfer_nn(x, y, x_mask, y_mask, squared, backend)

    def mean(dist: Tensor, mask: Optional[Tensor]) -> Tensor:
        if mask is None:
            return dist.mean(dim=1)
        return dist.sum(dim=1) / mask.sum(dim=1).to(dist.dtype)

    cd = mean(res.dist_x, x_mask) + mean(res.dist_y, y_mask)
    if not squared:
        cd = cd / 2
    if reduction == 'mean':
        return cd.mean()
    if reduction == 'sum':
        return cd.sum()
    return cd


_AOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def aot_specs() -> List[Dict[str, Any]]:
    """One spec per dtype for 3D points (the dispatcher's only tile choice; other D compile on demand)."""
    if not HAS_TRITON:
        return []
    specs = []
    i32 = 'i32'
    for dtype in _AOT_DTYPES:
        ty = TORCH_TO_TRITON[dtype]
        cfg = chamfer_config(dtype, 3)
        specs.append(dict(
            name=f'chamfer_nn_{ty}_D3', fn=_nn_kernel,
            signature=dict(X=f'*{ty}', Y=f'*{ty}', YMASK='*u8', DIST='*fp32', IDX='*i64', N=i32, M=i32,
                           stride_xb=i32, stride_xn=i32, stride_xd=i32, stride_yb=i32, stride_ym=i32,
                           stride_yd=i32, stride_mb=i32),
            constexprs=dict(DIM=3, BLOCK_N=cfg['BLOCK_N'], BLOCK_M=cfg['BLOCK_M'], HAS_YMASK=False),
            num_warps=cfg['num_warps'], num_stages=cfg['num_stages']))
    return specs
