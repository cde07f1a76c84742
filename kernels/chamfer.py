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
``d||x - y||^2 / dx = 2 (x - y)``, ``d||x - y|| / dx = (x - y) / ||x - y||`` (0 at distance 0).

The PyTorch backend (``backend='torch'``, or CPU tensors under 'auto') is exact and memory-bounded: it
searches the neighbours tile by tile (at most :data:`TORCH_TILE_PAIRS` point pairs at a time, the same
coordinate-by-coordinate squared distance, strict '<' across tiles so the first index wins ties), then
recomputes each point's distance to its neighbour by a gather, which autograd differentiates to the same
gradients. The dense O(B N M) reference with the same signature is ``chamfer_ref.chamfer_nn_reference``.

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

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ._backend import HAS_TRITON, TORCH_TO_TRITON, aot_signature, empty, resolve_backend
from .chamfer_ref import ChamferResult, check_clouds, finish_nn
from .chamfer_ref import chamfer_nn_reference  # noqa: F401  (also importable from here)

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ['ChamferResult', 'TORCH_TILE_PAIRS', 'chamfer_nn', 'chamfer_distance', 'chamfer_config', 'aot_specs']

_REDUCTIONS = ('mean', 'sum', 'none')


def chamfer_config(dtype: torch.dtype, dim: int) -> Dict[str, int]:
    """Tile sizes and launch options of the nearest-neighbour kernel (shared by the runtime and aot_specs).

    Args:
        dtype: Point dtype (fp16 / bf16 / fp32; distances are accumulated in fp32).
        dim: D, coordinates per point (unrolled in the kernel).
    """
    del dtype, dim
    return dict(BLOCK_N=64, BLOCK_M=64, num_warps=4, num_stages=2)


if HAS_TRITON:

    @triton.heuristics({'HAS_YMASK': lambda args: args['YMASK'] is not None})
    @triton.jit
    def _nn_kernel(
            X, Y, YMASK, DIST, IDX,
            stride_xb, stride_xn, stride_xd, stride_yb, stride_ym, stride_yd, stride_mb, N, M,
            DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_YMASK: tl.constexpr):
        """For BLOCK_N points of x: squared distance to, and index of, the nearest valid point of y (YMASK:
        optional validity of y's points, nonzero = valid)."""
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
        x, y, ymask, dist, idx,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        ymask.stride(0) if ymask is not None else 0, n, m,
        DIM=dim, BLOCK_N=cfg['BLOCK_N'], BLOCK_M=cfg['BLOCK_M'],
        num_warps=cfg['num_warps'], num_stages=cfg['num_stages'])
    return dist, idx


# PyTorch backend: point pairs per tile of the neighbour search ((B, tile_n, tile_m) distances at a time)
TORCH_TILE_PAIRS = 2 ** 22
_TORCH_TILE_M = 4096


def _sq_dist(x: Tensor, y: Tensor) -> Tensor:
    """(B, n, m) squared distances ``sum_k (x_k - y_k)^2``, coordinate by coordinate (as the kernel)."""
    d2 = x[:, :, None, 0] - y[:, None, :, 0]
    d2.mul_(d2)
    for k in range(1, x.shape[-1]):
        diff = x[:, :, None, k] - y[:, None, :, k]
        d2.add_(diff.mul_(diff))  # square, then add: no fused multiply-add, the kernel's and reference's rounding
    return d2


@torch.no_grad()
def _nn_search_torch(x: Tensor, y: Tensor, x_mask: Optional[Tensor], y_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Indices (int64, -1 if none) of each x's nearest valid y and of each y's nearest valid x, from ONE pass over
    the (x, y) pairs, tile by tile in bounded memory: each tile's squared distances serve both directions
    (``(x - y)^2 == (y - x)^2`` exactly in floating point, so both equal the one-way searches bit for bit).
    First index among ties both ways: ``min`` keeps the first index of a tile, strict '<' keeps earlier tiles."""
    bsz, n, _ = x.shape
    m = y.shape[1]
    acc = torch.promote_types(x.dtype, torch.float32)
    idx_x = torch.full((bsz, n), -1, dtype=torch.int64, device=x.device)
    idx_y = torch.full((bsz, m), -1, dtype=torch.int64, device=x.device)
    if n == 0 or m == 0 or bsz == 0:
        return idx_x, idx_y
    best_x = torch.full((bsz, n), float('inf'), dtype=acc, device=x.device)
    best_y = torch.full((bsz, m), float('inf'), dtype=acc, device=x.device)
    tile_m = min(m, _TORCH_TILE_M)
    tile_n = max(1, min(n, TORCH_TILE_PAIRS // (bsz * tile_m)))
    xf, yf = x.to(acc), y.to(acc)
    for ns in range(0, n, tile_n):
        ne = min(n, ns + tile_n)
        for ms in range(0, m, tile_m):
            me = min(m, ms + tile_m)
            d2 = _sq_dist(xf[:, ns:ne], yf[:, ms:me])
            if y_mask is not None:  # invalid y: never a neighbour of x; as rows of the y search, ignored below
                d2 = d2.masked_fill(~y_mask[:, None, ms:me], float('inf'))
            tile_min, tile_arg = d2.min(dim=2)
            better = tile_min < best_x[:, ns:ne]
            best_x[:, ns:ne] = torch.where(better, tile_min, best_x[:, ns:ne])
            idx_x[:, ns:ne] = torch.where(better, tile_arg + ms, idx_x[:, ns:ne])
            if x_mask is not None:
                d2 = d2.masked_fill(~x_mask[:, ns:ne, None], float('inf'))
            tile_min, tile_arg = d2.min(dim=1)
            better = tile_min < best_y[:, ms:me]
            best_y[:, ms:me] = torch.where(better, tile_min, best_y[:, ms:me])
            idx_y[:, ms:me] = torch.where(better, tile_arg + ns, idx_y[:, ms:me])
    return idx_x, idx_y


def _sq_dist_at(x: Tensor, y: Tensor, idx: Tensor) -> Tensor:
    """Squared distance (differentiable, float32 or float64) from each x to ``y[idx]`` (inf where idx < 0), in
    the search's arithmetic and order."""
    acc = torch.promote_types(x.dtype, torch.float32)
    if y.shape[1] == 0:
        return torch.full(idx.shape, float('inf'), dtype=acc, device=x.device)
    nb = torch.gather(y.to(acc), 1, idx.clamp(min=0)[..., None].expand(-1, -1, y.shape[-1]))
    xa = x.to(acc)
    d2 = (xa[..., 0] - nb[..., 0]) ** 2
    for k in range(1, x.shape[-1]):
        d2 = d2 + (xa[..., k] - nb[..., k]) ** 2
    return torch.where(idx >= 0, d2, float('inf'))


class _ChamferFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor, x_mask: Optional[Tensor], y_mask: Optional[Tensor],
                squared: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        dx2, ix = _nn_triton(x, y, y_mask)
        dy2, iy = _nn_triton(y, x, x_mask)
        dist_x, ix = finish_nn(dx2, ix, x_mask, squared)
        dist_y, iy = finish_nn(dy2, iy, y_mask, squared)
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


def chamfer_nn(x: Tensor, y: Tensor, x_lengths: Optional[Tensor] = None, y_lengths: Optional[Tensor] = None,
               x_mask: Optional[Tensor] = None, y_mask: Optional[Tensor] = None, squared: bool = True,
               backend: str = 'auto') -> ChamferResult:
    """Nearest neighbours between two batches of point clouds, both ways (see the module docstring).

    Args:
        x: (B, N, D) points (any small D; fp16 / bf16 / fp32 for Triton, any float for PyTorch).
        y: (B, M, D) points.
        x_lengths, y_lengths: Optional (B,) integer counts of valid (leading) points per cloud (their
            range is checked when they are on the CPU; CUDA lengths are not read back).
        x_mask, y_mask: Optional (B, N) / (B, M) bool, True = valid point (instead of lengths; checked by
            the package's one mask check, ``_backend.check_key_mask``).
        squared: Squared Euclidean distances (True) or Euclidean distances.
        backend: 'auto', 'triton' or 'torch' (the exact tiled search, memory bounded by
            :data:`TORCH_TILE_PAIRS`).

    Raises:
        ValueError: bad shapes / padding, or a NaN / inf point, named with its position
            (e.g. 'y must be finite: y[1, 7, 0] = nan'); the finiteness test reads one flag back from
            the device.
        TypeError: a mask that is not a bool tensor.

    Returns:
        :class:`ChamferResult` (dist_x, idx_x, dist_y, idx_y); distances in x's dtype, differentiable in
        x and y (a padded point or one without any valid partner gets zero gradient).
    """
    x_mask, y_mask = check_clouds(x, y, x_lengths, y_lengths, x_mask, y_mask)
    return _chamfer_nn(x, y, x_mask, y_mask, squared, backend)


def _chamfer_nn(x: Tensor, y: Tensor, x_mask: Optional[Tensor], y_mask: Optional[Tensor], squared: bool,
                backend: str) -> ChamferResult:
    if resolve_backend(backend, x, y, x_mask, y_mask) == 'torch':
        ix, iy = _nn_search_torch(x, y, x_mask, y_mask)
        dx2, dy2 = _sq_dist_at(x, y, ix), _sq_dist_at(y, x, iy)
        dist_x, ix = finish_nn(dx2, ix, x_mask, squared)
        dist_y, iy = finish_nn(dy2, iy, y_mask, squared)
        return ChamferResult(dist_x.to(x.dtype), ix, dist_y.to(x.dtype), iy)
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
    x_mask, y_mask = check_clouds(x, y, x_lengths, y_lengths, x_mask, y_mask, reduction)
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
    """One spec per dtype for 3D points without a mask (the dispatcher's only tile choice; other D compile on
    demand); signatures derived from the kernel's parameter list (``_backend.aot_signature``)."""
    if not HAS_TRITON:
        return []
    specs = []
    for dtype in _AOT_DTYPES:
        ty = TORCH_TO_TRITON[dtype]
        cfg = chamfer_config(dtype, 3)
        signature, constexprs = aot_signature(
            _nn_kernel, {'X': f'*{ty}', 'Y': f'*{ty}', 'IDX': '*i64'}, absent={'YMASK'},
            constexprs=dict(DIM=3, BLOCK_N=cfg['BLOCK_N'], BLOCK_M=cfg['BLOCK_M']))
        specs.append(dict(name=f'chamfer_nn_{ty}_D3', fn=_nn_kernel, signature=signature, constexprs=constexprs,
                          num_warps=cfg['num_warps'], num_stages=cfg['num_stages']))
    return specs
