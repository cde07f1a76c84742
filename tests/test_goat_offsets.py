"""GOAT's 'offsets' start for 2D priors: each head a bump at its own key offset (checked against the formula)."""
import math

import pytest
import torch

from vision_priors.layers import GoatAttention, grid_coords
from vision_priors.layers.goat import GoatPrior


def _offsets_reference(coords: torch.Tensor, freqs: torch.Tensor, centres: torch.Tensor, amplitude: float):
    """A sum_a sum_r cos(w_{a,r} (p_j - p_i - delta_h)_a), written out per head / query / key: (H, N, N)."""
    heads, n = centres.shape[0], coords.shape[0]
    out = torch.zeros(heads, n, n, dtype=torch.float64)
    for h in range(heads):
        for i in range(n):
            for j in range(n):
                d = coords[j] - coords[i] - centres[h]
                out[h, i, j] = amplitude * sum(math.cos(freqs[a, r] * d[a]) for a in range(2)
                                               for r in range(freqs.shape[1]))
    return out


@pytest.mark.parametrize('heads,modes,grid,radius,amplitude,max_freq', [
    (3, 3, (3, 5), math.sqrt(2), 3.0, 1.0), (5, 2, (4, 3), 2.5, 0.7, 0.4), (1, 1, (2, 3), 0.0, 2.0, 1.0)])
def test_offsets_start_equals_the_formula(heads, modes, grid, radius, amplitude, max_freq):
    prior = GoatPrior(heads, 2, num_modes=modes, prior_init='offsets', offset_radius=radius,
                      offset_amplitude=amplitude, max_freq=max_freq, key_mlp_hidden=8).double()
    coords = grid_coords(grid).double()
    angles = [math.pi / 4 + 2 * math.pi * h / heads for h in range(heads)]
    centres = torch.tensor([[radius * math.cos(t), radius * math.sin(t)] for t in angles], dtype=torch.float64)
    torch.testing.assert_close(prior.offset_centres(), centres, rtol=0, atol=1e-12)
    freqs = prior.frequencies(torch.float64, torch.device('cpu'))
    # the key-default MLP starts at zero, so the prior logits are the relative bumps alone (float64 params:
    # the init is computed in float64 and stored in the module's dtype)
    expected = _offsets_reference(coords, freqs, centres, amplitude)
    torch.testing.assert_close(prior.prior_logits(coords), expected, rtol=1e-5, atol=1e-5)


def test_four_heads_start_on_the_four_diagonal_neighbours():
    """Each head's most likely key for a query in the middle of a 7 x 7 grid is the neighbour at its offset."""
    layer = GoatAttention(64, 4, num_spatial_dims=2, num_modes=2, prior_init='offsets')
    coords = grid_coords((7, 7))
    query = 3 * 7 + 3
    with torch.no_grad():
        best = layer.prior.prior_logits(coords)[:, query].argmax(-1)
    offsets = (coords[best] - coords[query]).tolist()
    assert offsets == [[1.0, 1.0], [-1.0, 1.0], [-1.0, -1.0], [1.0, -1.0]]


def test_offsets_start_survives_reinitialisation_and_breaks_axis_symmetry():
    layer = GoatAttention(64, 4, num_spatial_dims=2, num_modes=2, prior_init='offsets')
    alpha, beta = layer.prior.alpha.detach().clone(), layer.prior.beta.detach().clone()
    with torch.no_grad():
        layer.prior.alpha.zero_()
        layer.prior.beta.zero_()
    layer.prior.init_weights()  # timm's init hook re-applies the start
    torch.testing.assert_close(layer.prior.alpha, alpha, rtol=0, atol=0)
    torch.testing.assert_close(layer.prior.beta, beta, rtol=0, atol=0)
    # heads 1 and 3 look along (-1, 1) / (1, -1): their x and y coefficients differ (a zero start has them equal)
    assert (layer.prior.beta[1, 0] - layer.prior.beta[1, 1]).abs().max() > 0.1


@pytest.mark.parametrize('kwargs,match', [
    (dict(num_spatial_dims=1), r"prior_init='offsets' is a start for 2D priors .* num_spatial_dims=1"),
    (dict(num_spatial_dims=2, offset_amplitude=0.0), 'offset_amplitude > 0'),
    (dict(num_spatial_dims=2, offset_radius=float('nan')), 'offset_radius >= 0'),
    (dict(num_spatial_dims=2, offset_amplitude=float('inf')), 'offset_amplitude > 0'),
])
def test_offsets_start_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GoatPrior(2, num_modes=2, prior_init='offsets', **kwargs)
