"""GOAT's 'alibi' start (paper Table 5): an ALiBi-shaped prior in every configuration it accepts, checked
against -m |i - j| on the lags it claims to fit; configurations it cannot fit are refused."""
import pytest
import torch

from vision_priors.layers import GoatAttention, grid_coords, sequence_coords
from vision_priors.layers.goat import ALIBI_FIT_TOLERANCE, alibi_slopes


def test_causal_key_linear_start_is_exactly_alibi_on_causal_lags():
    layer = GoatAttention(64, 4, num_spatial_dims=1, num_modes=3, prior_init='alibi', key_linear=True)
    logits = layer.prior_logits(num_tokens=40).double()  # (H, N, N)
    slopes = alibi_slopes(4).double()
    i, j = torch.meshgrid(torch.arange(40), torch.arange(40), indexing='ij')
    causal = j <= i
    expected = -slopes[:, None, None] * (i - j).double()
    relative = logits - logits.diagonal(dim1=1, dim2=2)[..., None]  # drop the row constant
    torch.testing.assert_close(relative[:, causal], expected[:, causal], rtol=0, atol=1e-5)


@pytest.mark.parametrize('dims, modes, extent', [(2, 4, None), (2, 2, None), (2, 6, 8.0), (1, 8, None), (1, 16, None),
                                                 (1, 6, 32.0), (1, 4, 16.0)])
def test_symmetric_fit_is_monotone_and_close_to_the_alibi_line(dims, modes, extent):
    layer = GoatAttention(96, 2, num_spatial_dims=dims, num_modes=modes, prior_init='alibi', alibi_extent=extent,
                          key_mlp_hidden=0, first_key_bias=False)
    reach = int(layer.prior.alibi_extent)
    slopes = alibi_slopes(2).double()
    coords = grid_coords((1, 2 * reach + 1)) if dims == 2 else sequence_coords(2 * reach + 1)
    logits = layer.prior_logits(coords).double()[:, reach]  # query in the middle of the row: (H, 2 * reach + 1)
    lags = (torch.arange(2 * reach + 1) - reach).abs().double()
    curve = logits - logits[:, reach:reach + 1]
    target = -slopes[:, None] * lags / dims  # 2D: along one axis, the mean over the two axes of -m |d|
    scale = slopes[:, None] * reach / dims
    assert ((curve - target).abs() / scale).max() <= ALIBI_FIT_TOLERANCE
    right, left = curve[:, reach:], curve[:, :reach + 1].flip(-1)
    for side in (right, left):  # monotone: never rises away from the query
        assert (side[:, 1:] <= side[:, :-1] + 1e-9).all()
    assert (curve[:, 0] < -0.5 * slopes * reach / dims).all()  # and it really decays


@pytest.mark.parametrize('dims, modes, extent', [(1, 4, None), (1, 2, None), (1, 3, None), (2, 1, None)])
def test_configurations_that_cannot_fit_are_refused(dims, modes, extent):
    with pytest.raises(ValueError, match=r"prior_init='alibi': .* cannot fit the ALiBi line .* key_linear=True"):
        GoatAttention(64, 2, num_spatial_dims=dims, num_modes=modes, prior_init='alibi', alibi_extent=extent)
    # the causal form is always available
    GoatAttention(64, 2, num_spatial_dims=dims, num_modes=modes, prior_init='alibi', alibi_extent=extent,
                  key_linear=True)
