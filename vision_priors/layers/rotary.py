"""Rotary positions for a context that is averaged (LAVO's CODE memory; RoFormer Sec. 3.3).

LAVO compresses a context into ``H = B (W_x mean_t(c_t) + b_x)`` (Eq. 3): a position *added* to the tokens only
shifts the mean by a constant, so the memory cannot tell where anything was. Turning each token's channel pairs by
angles of its coordinates instead (the rotary position RoFormer uses for linear attention, whose keys are summed)
makes the mean ``sum_t exp(i w_k p_t) c_t`` a set of Fourier coefficients of the features over the coordinates,
which keeps the layout. The rotation itself is timm's ``apply_rot_embed_cat``.
"""
import math

import torch
from torch import Tensor
from timm.layers.pos_embed_sincos import apply_rot_embed_cat

__all__ = ['rotary_coordinate_table', 'rotate_by_coords']


def rotary_coordinate_table(coords: Tensor, dim: int, min_freq: float, max_freq: float = math.pi) -> Tensor:
    """Axial rotary table (..., 2 dim) = [sin, cos] for ``apply_rot_embed_cat`` at D-dimensional ``coords`` (..., D).

    Channel pair p = (2p, 2p + 1) turns by w_k times coordinate a, for p = a dim / (2 D) + k (axis a takes the a-th
    block of dim / (2 D) pairs: in 2D x, then y), with the geometric ladder
    w_k = max_freq (min_freq / max_freq)^(k / (dim / (2 D) - 1)) rad per unit of the coordinates (max_freq alone for
    one pair per axis). Angles in float64, the table in ``coords``' dtype.
    """
    axes = coords.shape[-1]
    if axes < 1 or dim % (2 * axes):
        raise ValueError(f'rotary coordinates over {axes} axes need a width divisible by {2 * axes}, got {dim}')
    if not 0 < min_freq <= max_freq:
        raise ValueError(f'need 0 < min_freq <= max_freq, got {min_freq}, {max_freq}')
    steps = dim // (2 * axes)
    ratio = torch.arange(steps, dtype=torch.float64, device=coords.device) / max(steps - 1, 1)
    freqs = max_freq * (min_freq / max_freq) ** ratio
    angles = (coords.to(torch.float64)[..., :, None] * freqs).flatten(-2)  # (..., dim / 2): axis 0 pairs, axis 1 ...
    angles = angles.repeat_interleave(2, dim=-1)
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(coords.dtype)


def rotate_by_coords(x: Tensor, coords: Tensor, min_freq: float, max_freq: float = math.pi) -> Tensor:
    """``x`` (..., N, C) with token n's channel pairs turned by its coordinates ``coords`` ((N, D) or (..., N, D));
    see :func:`rotary_coordinate_table`. Norms of every token are kept; the origin is the identity."""
    table = rotary_coordinate_table(coords.to(torch.float64), x.shape[-1], min_freq, max_freq)
    return apply_rot_embed_cat(x, table.to(x.dtype))
