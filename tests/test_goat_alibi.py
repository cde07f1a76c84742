"""GOAT's 'alibi' start (paper Table 5): an ALiBi-shaped prior in every configuration it accepts, checked
against -m |i - j| on the lags it claims to fit; configurations it cannot fit are refused."""
import pytest
import torch

from vision_priors.layers import GoatAttention, grid_coords, sequence_coords
from vision_priors.layers.goat import ALIBI_FIT_TOLERANCE, alibi_slopes


@pytest.mark.parametrize('key_slope_param', ['linear', 'softplus'])
def test_causal_key_linear_start_is_exactly_alibi_on_causal_lags(key_slope_param):
    layer = GoatAttention(64, 4, num_spatial_dims=1, num_modes=3, prior_init='alibi', key_linear=True,
                          key_slope_param=key_slope_param)
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


def test_softplus_slope_zero_start_is_neutral_and_stays_nonnegative():
    """key_slope_param='softplus' (the GOAT authors' code): lambda_h = softplus(rho_h) >= 0. The zero start puts
    rho_h at -30 (lambda_h ~ 1e-13: no recency), and no update can make a slope negative."""
    layer = GoatAttention(64, 4, num_spatial_dims=1, num_modes=3, key_linear=True, key_slope_param='softplus')
    prior = layer.prior
    assert prior.key_slope is None and prior.key_slope_raw is not None
    assert float(prior.key_slopes().max()) < 1e-12
    with torch.no_grad():
        prior.key_slope_raw.copy_(torch.tensor([-40.0, -2.0, 0.0, 3.0]))
    slopes = prior.key_slopes().double()
    torch.testing.assert_close(slopes, torch.log1p(torch.exp(torch.tensor([-40.0, -2.0, 0.0, 3.0]))).double())
    assert bool((slopes >= 0).all())


def test_softplus_slope_moves_by_a_factor_under_adam():
    """Why the parametrisation matters: Adam moves every parameter by about lr per step (exactly lr with betas 0,
    sign descent), so a softplus slope near zero changes by a factor of about e^lr per step, while a linear slope
    changes by lr. After 200 steps of the same push at lr 1e-2 the slow ALiBi head (1/256) is about 7 times
    steeper with softplus (softplus(rho + 2)), and about 2 per position with the linear parametrisation."""
    grown = {}
    for param in ('linear', 'softplus'):
        layer = GoatAttention(64, 2, num_spatial_dims=1, num_modes=2, prior_init='alibi', key_linear=True,
                              key_slope_param=param)
        weights = [layer.prior.key_slope if param == 'linear' else layer.prior.key_slope_raw]
        optimizer = torch.optim.Adam(weights, lr=1e-2, betas=(0.0, 0.0))
        for _ in range(200):
            optimizer.zero_grad()
            (-layer.prior.key_slopes().sum()).backward()  # always push the slopes up
            optimizer.step()
        grown[param] = layer.prior.key_slopes().detach()[1].item()
    assert 1 / 256 * 5 < grown['softplus'] < 1 / 256 * 10
    assert 1.9 < grown['linear'] < 2.1


def test_unknown_key_slope_param_is_refused():
    with pytest.raises(ValueError, match="key_slope_param must be one of"):
        GoatAttention(64, 2, num_spatial_dims=1, key_linear=True, key_slope_param='exp')
