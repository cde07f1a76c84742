"""Rotary positions for an averaged context (``vision_priors.layers.rotary``): the table turns each channel pair by
its axis angle (float64), and LAVO's CODE memory, a mean, keeps the layout of rotated tokens but not of added
positions."""
import math

import pytest
import torch

from vision_priors.layers import grid_coords
from vision_priors.layers.lavo import LavoCrossAttention
from vision_priors.layers.rotary import rotary_coordinate_table, rotate_by_coords
from vision_priors.models.spatial_vqa_fusion import coordinate_features


def test_rotary_coordinate_table_turns_each_pair_by_its_axis_angle():
    """Float64, odd coordinates: pair p of the rotated tokens is the 2x2 rotation of the input pair by w_k x
    (p = k < dim / 4) or w_k y (p = dim / 4 + k), w_k the geometric ladder from max_freq to min_freq; norms kept."""
    coords = torch.tensor([[0., 0.], [3., 1.], [-2.5, 7.25]], dtype=torch.float64)
    dim, lo, hi = 12, 0.2, 3.0
    tokens = torch.randn(3, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = rotate_by_coords(tokens, coords, lo, hi)
    steps = dim // 4
    for i in range(3):
        for p in range(dim // 2):
            axis, k = divmod(p, steps)
            angle = hi * (lo / hi) ** (k / (steps - 1)) * coords[i, axis].item()
            a, b = tokens[i, 2 * p].item(), tokens[i, 2 * p + 1].item()
            expected = (a * math.cos(angle) - b * math.sin(angle), a * math.sin(angle) + b * math.cos(angle))
            assert abs(out[i, 2 * p].item() - expected[0]) < 1e-12
            assert abs(out[i, 2 * p + 1].item() - expected[1]) < 1e-12
    torch.testing.assert_close(out.norm(dim=-1), tokens.norm(dim=-1), rtol=1e-12, atol=0)
    torch.testing.assert_close(rotate_by_coords(tokens, coords * 0, lo, hi), tokens, rtol=0, atol=0)
    # 1D (sequence positions): every pair turns by w_k t, the ladder over dim / 2 pairs
    positions = torch.tensor([[0.], [5.], [11.]], dtype=torch.float64)
    table = rotary_coordinate_table(positions, 8, lo, hi)
    angles = torch.stack([hi * (lo / hi) ** (k / 3) * positions[:, 0] for k in range(4)], -1).repeat_interleave(2, -1)
    torch.testing.assert_close(table, torch.cat([angles.sin(), angles.cos()], -1), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match='divisible by 4'):
        rotary_coordinate_table(coords, 10, lo, hi)
    with pytest.raises(ValueError, match='need 0 < min_freq <= max_freq'):
        rotary_coordinate_table(coords, dim, 0., hi)


def test_lavo_memory_sees_the_layout_through_rotary_positions_only(one_thread):
    """LAVO's CODE memory is a mean over the context (Eq. 3): two images holding the same tokens at swapped places
    have the same memory when positions are added to the tokens ('sincos'), different memories when the tokens are
    rotated by their coordinates ('rotary')."""
    torch.manual_seed(0)
    dim, coords = 16, grid_coords((4, 4), dtype=torch.float64)
    tokens = torch.randn(1, 16, dim, dtype=torch.float64)
    swapped = tokens[:, torch.randperm(16)]  # the same tokens at other coordinates
    lavo = LavoCrossAttention(dim, num_heads=2, num_slots=8).double()
    added = [lavo.compress(t + coordinate_features(coords, dim)) for t in (tokens, swapped)]
    torch.testing.assert_close(added[0], added[1], rtol=1e-12, atol=1e-12)
    rotated = [lavo.compress(rotate_by_coords(t, coords, math.pi / 16)) for t in (tokens, swapped)]
    assert (rotated[0] - rotated[1]).abs().max() > 1e-3
