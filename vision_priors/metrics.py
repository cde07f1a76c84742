"""Point-cloud completion metrics with PoinTr's definitions (PCN benchmark; LAVO Table 7).

For a predicted cloud P (N points) and a ground truth G (M points), with the squared nearest-neighbour
distances ``d1_i = min_j ||p_i - g_j||^2`` (P -> G) and ``d2_j = min_i ||g_j - p_i||^2`` (G -> P)::

    CD-L1 = (mean_i sqrt(d1_i) + mean_j sqrt(d2_j)) / 2        (PoinTr ChamferDistanceL1)
    CD-L2 =  mean_i d1_i       + mean_j d2_j                    (PoinTr ChamferDistanceL2)
    precision = share of P with sqrt(d1_i) < th,  recall = share of G with sqrt(d2_j) < th
    F-score@th = 2 P R / (P + R), 0 when P + R = 0               (PoinTr utils/metrics.py, th = 0.01)

These are PoinTr's ``extensions/chamfer_dist`` and ``utils/metrics.py`` (which report both Chamfer
distances x 1000, :func:`completion_metrics` does the same). The threshold comparison is strict
(``d < th``) on unsquared distances, as in PoinTr (open3d's ``compute_point_cloud_distance``).

Differences from PoinTr, all deliberate:

* Values are per sample, shape (B,); PoinTr's modules average over the batch (``torch.mean`` over
  all B * N distances, the same number when every cloud of the batch has the same size).
* PoinTr's evaluation modules use ``ignore_zeros=True``: with batch size 1 they drop every point whose
  coordinate *sum* is exactly 0 (meant for zero padding). Nothing is dropped here; pass unpadded clouds.
* PoinTr's CD-L1 backward divides by sqrt(0) for an exact duplicate (nan); here that gradient is 0.

Every nearest-neighbour search goes through the package op :func:`vision_priors.kernels.chamfer_nn`
(Triton on CUDA, PyTorch elsewhere). The search runs without autograd; the distances are then
recomputed from the neighbour indices, ``||p_i - g_idx(i)||^2``, which autograd differentiates with the
gradient of the minimum, so the backward pass is O(B (N + M) D) in memory on every backend; the op's
PyTorch search is itself tiled (``TORCH_TILE_PAIRS`` point pairs at a time), so 16,384 x 16,384 clouds
stay memory-bounded.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import Tensor

from vision_priors.kernels import chamfer_nn

__all__ = ['chamfer_l1', 'chamfer_l2', 'f_score', 'completion_metrics', 'nearest_sq_distances']


def _check_pair(pred: Tensor, gt: Tensor) -> None:
    if not isinstance(pred, Tensor) or not isinstance(gt, Tensor):
        raise TypeError(f'pred and gt must be tensors, got {type(pred).__name__} and {type(gt).__name__}')
    if pred.dim() != 3 or gt.dim() != 3:
        raise ValueError(f'pred and gt must be (B, N, D) and (B, M, D), got {tuple(pred.shape)} and '
                         f'{tuple(gt.shape)}')
    if pred.shape[0] != gt.shape[0]:
        raise ValueError(f'batch sizes differ: pred has {pred.shape[0]}, gt has {gt.shape[0]}')
    if pred.shape[2] != gt.shape[2]:
        raise ValueError(f'point dimensions differ: pred has D={pred.shape[2]}, gt has D={gt.shape[2]}')
    if pred.shape[1] == 0 or gt.shape[1] == 0:
        raise ValueError(f'empty cloud: pred has {pred.shape[1]} points, gt has {gt.shape[1]}; the '
                         f'Chamfer distance needs at least one point in each')
    if not pred.is_floating_point() or pred.dtype != gt.dtype:
        raise TypeError(f'pred and gt must share one floating dtype, got {pred.dtype} and {gt.dtype}')


@torch.no_grad()
def _nn_indices(x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
    """Index of each x's nearest y (B, N) and of each y's nearest x (B, M), via ``chamfer_nn``."""
    res = chamfer_nn(x, y)
    return res.idx_x, res.idx_y


def _sq_dist_to(src: Tensor, dst: Tensor, idx: Tensor) -> Tensor:
    nb = torch.gather(dst, 1, idx[..., None].expand(-1, -1, dst.shape[-1]))
    return ((src - nb) ** 2).sum(-1)


def nearest_sq_distances(pred: Tensor, gt: Tensor) -> Tuple[Tensor, Tensor]:
    """Squared nearest-neighbour distances both ways, differentiable in ``pred`` and ``gt``.

    Args:
        pred: (B, N, D) predicted points.
        gt: (B, M, D) ground-truth points (same B, D and dtype; N, M >= 1; finite).

    Returns:
        ``(d1, d2)``: d1 (B, N) from each predicted point to the nearest ground-truth point, d2 (B, M)
        the other way, in the inputs' dtype.

    Raises:
        ValueError / TypeError: mismatched shapes or dtypes, an empty cloud, a non-finite point.
    """
    _check_pair(pred, gt)
    idx_p, idx_g = _nn_indices(pred.detach(), gt.detach())
    return _sq_dist_to(pred, gt, idx_p), _sq_dist_to(gt, pred, idx_g)


def _safe_sqrt(d2: Tensor) -> Tensor:
    """sqrt with gradient 0 (not inf / nan) at 0."""
    pos = d2 > 0
    return torch.where(pos, torch.where(pos, d2, torch.ones_like(d2)).sqrt(), torch.zeros_like(d2))


def _cd_l1(d1: Tensor, d2: Tensor) -> Tensor:
    return (_safe_sqrt(d1).mean(dim=1) + _safe_sqrt(d2).mean(dim=1)) / 2


def _cd_l2(d1: Tensor, d2: Tensor) -> Tensor:
    return d1.mean(dim=1) + d2.mean(dim=1)


def _f_score(d1: Tensor, d2: Tensor, threshold: float) -> Tensor:
    with torch.no_grad():
        precision = (_safe_sqrt(d1) < threshold).to(d1.dtype).mean(dim=1)
        recall = (_safe_sqrt(d2) < threshold).to(d2.dtype).mean(dim=1)
        denom = precision + recall
        return torch.where(denom > 0, 2 * precision * recall / torch.where(denom > 0, denom, 1.), 0.)


def chamfer_l1(pred: Tensor, gt: Tensor) -> Tensor:
    """CD-L1 per sample, ``(mean sqrt d1 + mean sqrt d2) / 2`` (PoinTr ``ChamferDistanceL1``), unscaled.

    Args:
        pred: (B, N, D) predicted points.
        gt: (B, M, D) ground truth.

    Returns:
        (B,) in the inputs' dtype, differentiable (zero gradient at an exact duplicate point).
    """
    return _cd_l1(*nearest_sq_distances(pred, gt))


def chamfer_l2(pred: Tensor, gt: Tensor) -> Tensor:
    """CD-L2 per sample, ``mean d1 + mean d2`` of squared distances (PoinTr ``ChamferDistanceL2``), unscaled.

    Args:
        pred: (B, N, D) predicted points.
        gt: (B, M, D) ground truth.

    Returns:
        (B,) in the inputs' dtype, differentiable.
    """
    return _cd_l2(*nearest_sq_distances(pred, gt))


def f_score(pred: Tensor, gt: Tensor, threshold: float = 0.01) -> Tensor:
    """F-score per sample at ``threshold`` on unsquared NN distances (PoinTr ``_get_f_score``).

    precision = share of predicted points with a ground-truth point closer than ``threshold`` (strict),
    recall = share of ground-truth points with a predicted point closer than ``threshold``;
    ``F = 2 P R / (P + R)``, 0 when both are 0.

    Args:
        pred: (B, N, D) predicted points.
        gt: (B, M, D) ground truth.
        threshold: Distance threshold (PCN: 0.01 on clouds normalised to the unit cube).

    Returns:
        (B,) in the inputs' dtype, without gradient (a step function).
    """
    if not threshold > 0:
        raise ValueError(f'threshold must be > 0, got {threshold}')
    with torch.no_grad():
        return _f_score(*nearest_sq_distances(pred, gt), threshold)


def completion_metrics(pred: Tensor, gt: Tensor, threshold: float = 0.01) -> Dict[str, Tensor]:
    """PCN table metrics per sample from one nearest-neighbour search.

    Args:
        pred: (B, N, D) completed clouds.
        gt: (B, M, D) ground truth.
        threshold: F-score threshold.

    Returns:
        ``{'cd_l1': CD-L1 x 1000, 'cd_l2': CD-L2 x 1000, 'f_score': F-score@threshold}``, each (B,)
        (PoinTr reports CD-L1 / CD-L2 x 1000; average over samples for a table).
    """
    if not threshold > 0:
        raise ValueError(f'threshold must be > 0, got {threshold}')
    d1, d2 = nearest_sq_distances(pred, gt)
    return {'cd_l1': _cd_l1(d1, d2) * 1000, 'cd_l2': _cd_l2(d1, d2) * 1000, 'f_score': _f_score(d1, d2, threshold)}
