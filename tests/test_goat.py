"""GOAT attention: the single-SDPA fast path against a float64 reference written from the paper.

Reference (GOAT paper, Sec. 4): z_ij = q_c,i.k_c,j / sqrt(d_c) + sum_a sum_r [alpha cos(w (p_i - p_j))
+ beta sin(w (p_i - p_j))] + u_h(j), u_h(j) = lambda_h p_j + g_h(phi_abs(p_j)) + b_h 1{p_j = 0};
prefix tokens: no relative term, key default = their learned prefix bias. Built with explicit loops over
heads, axes and modes, independent of the layer's coordinate factorisation.

Tolerances: float64 forward 1e-10, gradients 1e-9 (both paths are exact algebra; only rounding differs);
float32 fused vs dense 2e-5.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vision_priors.layers import GoatAttention, grid_coords, sequence_coords
from grad_check import assert_grads_match


def _randomize(layer: GoatAttention, seed: int = 0) -> None:
    """Give every prior parameter a non-trivial value so each term of the equation is exercised."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.prior.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.7)


def goat_reference(layer: GoatAttention, x: torch.Tensor, coords: torch.Tensor, causal: bool) -> torch.Tensor:
    """Float64 GOAT attention straight from Eqs. 11-22 (loops over heads, axes, modes)."""
    prior = layer.prior
    x = x.double()
    coords = coords.double()
    B, N, C = x.shape
    H, dc, dh = layer.num_heads, layer.content_dim, layer.head_dim
    P = layer.num_prefix_tokens
    qkv = F.linear(x, layer.qkv.weight.double(), None if layer.qkv.bias is None else layer.qkv.bias.double())
    q, k, v = qkv.split([H * dc, H * dc, H * dh], dim=-1)
    q = q.reshape(B, N, H, dc).transpose(1, 2)
    k = k.reshape(B, N, H, dc).transpose(1, 2)
    v = v.reshape(B, N, H, dh).transpose(1, 2)
    content = torch.einsum('bhid,bhjd->bhij', q, k) / math.sqrt(dc)

    if prior.log_freqs is not None:  # learned frequencies
        freqs = prior.log_freqs.double().exp()
    else:  # the fixed ladder w_r = max_freq * base^(-r / R), same for every axis
        ladder = [prior.max_freq * prior.freq_base ** (-r / prior.num_modes) for r in range(prior.num_modes)]
        freqs = torch.tensor([ladder] * coords.shape[1], dtype=torch.float64)
    alpha, beta = prior.alpha.double(), prior.beta.double()
    D = coords.shape[1]
    rel = torch.zeros(H, N, N, dtype=torch.float64)
    for h in range(H):
        for a in range(D):
            diff = coords[:, a][:, None] - coords[:, a][None, :]  # p_i - p_j
            for r in range(prior.num_modes):
                w = freqs[a, r]
                rel[h, P:, P:] += alpha[h, a, r] * torch.cos(w * diff) + beta[h, a, r] * torch.sin(w * diff)

    # key default u_h(j)
    u = torch.zeros(H, N, dtype=torch.float64)
    if prior.key_mlp is not None:
        feats = []
        for a in range(D):
            p = coords[:, a]
            nus = torch.tensor([100.0 ** (-m / prior.abs_num_freqs) for m in range(prior.abs_num_freqs)],
                               dtype=torch.float64)
            feats += [torch.sin(p[:, None] * nus[None]), torch.cos(p[:, None] * nus[None]),
                      (p / prior.abs_pos_scale)[:, None]]
        # the layer orders features per axis as [sin..., cos..., scaled]
        phi = torch.cat(feats, dim=1)
        l1, l2 = prior.key_mlp[0], prior.key_mlp[2]
        hidden = F.silu(phi @ l1.weight.double().T + l1.bias.double())
        u[:, P:] += (hidden @ l2.weight.double().T + l2.bias.double()).T
    if prior.key_slope is not None:
        u[:, P:] += prior.key_slope.double()[:, None] * coords[:, 0][None, :]
    if prior.key_slope_raw is not None:  # lambda_h = softplus(rho_h) = log(1 + e^rho_h), the authors' code
        slope = torch.log1p(torch.exp(prior.key_slope_raw.double()))
        u[:, P:] += slope[:, None] * coords[:, 0][None, :]
    if prior.first_key_bias is not None:
        u[:, P:] += prior.first_key_bias.double()[:, None] * (coords == 0).all(-1).double()[None, :]
    if P:
        u[:, :P] = prior.prefix_bias.double()

    logits = content + rel[None] + u[None, :, None, :]
    if causal:
        mask = torch.ones(N, N, dtype=torch.bool).tril()
        logits = logits.masked_fill(~mask, float('-inf'))
    probs = logits.softmax(-1)
    out = (probs @ v).transpose(1, 2).reshape(B, N, H * dh)
    return F.linear(out, layer.proj.weight.double(), layer.proj.bias.double())


CASES = {
    # name: (layer kwargs, num tokens (incl. prefix), coords factory, causal)
    '1d_bidirectional': (dict(dim=64, num_heads=2, num_spatial_dims=1, num_modes=3), 13,
                         lambda m: sequence_coords(m), False),
    '1d_causal': (dict(dim=48, num_heads=2, num_spatial_dims=1, num_modes=2, key_linear=True), 17,
                  lambda m: sequence_coords(m), True),
    '1d_causal_softplus_slope': (dict(dim=48, num_heads=3, num_spatial_dims=1, num_modes=2, key_linear=True,
                                      key_slope_param='softplus', prior_init='alibi'), 19,
                                 lambda m: sequence_coords(m, offset=5), True),
    '2d_class_token': (dict(dim=96, num_heads=3, num_spatial_dims=2, num_modes=3, num_prefix_tokens=1), 16,
                       lambda m: grid_coords((3, 5)), False),
    '2d_vit_ladder_odd_grid': (dict(dim=70, num_heads=2, num_spatial_dims=2, num_modes=4, max_freq=0.4,
                                    key_mlp_hidden=0), 35, lambda m: grid_coords((5, 7)), False),
    '2d_arbitrary_coords': (dict(dim=64, num_heads=2, num_spatial_dims=2, num_modes=2, num_prefix_tokens=2,
                                 learn_freqs=True, qkv_bias=True), 11,
                            lambda m: torch.randn(m, 2, generator=torch.Generator().manual_seed(3)) * 4, False),
    '1d_odd_causal_prefix': (dict(dim=40, num_heads=1, num_spatial_dims=1, num_modes=5, num_prefix_tokens=1,
                                  key_linear=True), 7, lambda m: sequence_coords(m, offset=3), True),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_fast_path_matches_float64_reference(case):
    kwargs, num_tokens, make_coords, causal = CASES[case]
    torch.manual_seed(0)
    layer = GoatAttention(**kwargs).double()
    _randomize(layer)
    coords = make_coords(num_tokens - layer.num_prefix_tokens).double()
    x = torch.randn(2, num_tokens, kwargs['dim'], dtype=torch.float64, requires_grad=True)

    out = layer(x, coords=coords, is_causal=causal)
    ref = goat_reference(layer, x, coords, causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)

    assert len(assert_grads_match(layer, x, out, ref)) >= 6


@pytest.mark.parametrize('case', sorted(CASES))
def test_fused_matches_dense_float32(case):
    kwargs, num_tokens, make_coords, causal = CASES[case]
    torch.manual_seed(1)
    layer = GoatAttention(**kwargs)
    _randomize(layer, seed=1)
    coords = make_coords(num_tokens - layer.num_prefix_tokens)
    x = torch.randn(3, num_tokens, kwargs['dim'])
    fused = layer(x, coords=coords, is_causal=causal)
    dense, probs = layer(x, coords=coords, is_causal=causal, return_attn=True)
    torch.testing.assert_close(fused, dense, rtol=0, atol=2e-5)
    assert probs.shape == (3, layer.num_heads, num_tokens, num_tokens)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, layer.num_heads, num_tokens))


BATCHED_CASES = {
    # per-sample coordinates (B, N, D): each sample its own permutation / arbitrary points
    '2d_scan_orders': (dict(dim=96, num_heads=3, num_spatial_dims=2, num_modes=3), 12, False),
    '2d_prefix_learned_freqs': (dict(dim=64, num_heads=2, num_spatial_dims=2, num_modes=2, num_prefix_tokens=2,
                                     learn_freqs=True, qkv_bias=True), 9, False),
    '1d_causal_key_linear': (dict(dim=48, num_heads=2, num_spatial_dims=1, num_modes=2, key_linear=True,
                                  num_prefix_tokens=1), 8, True),
}


def _per_sample_coords(batch: int, num_tokens: int, dims: int, seed: int) -> torch.Tensor:
    """Sample b: a permutation of grid / sequence points, sample 1 arbitrary real points (float64)."""
    gen = torch.Generator().manual_seed(seed)
    base = grid_coords((3, num_tokens // 3)) if dims == 2 and num_tokens % 3 == 0 else sequence_coords(num_tokens)
    base = base[:, :dims] if base.shape[1] >= dims else base.expand(-1, dims)
    rows = [base[torch.randperm(num_tokens, generator=gen)] for _ in range(batch)]
    rows[1] = torch.randn(num_tokens, dims, generator=gen) * 3
    return torch.stack(rows).double()


@pytest.mark.parametrize('case', sorted(BATCHED_CASES))
def test_per_sample_coords_match_float64_reference(case):
    """(B, N, D) coordinates: sample b equals the float64 reference run with coords[b], forward and backward."""
    kwargs, num_tokens, causal = BATCHED_CASES[case]
    torch.manual_seed(6)
    layer = GoatAttention(**kwargs).double()
    _randomize(layer, seed=6)
    batch = 3
    coords = _per_sample_coords(batch, num_tokens - layer.num_prefix_tokens, kwargs['num_spatial_dims'], seed=7)
    assert not torch.equal(coords[0], coords[2])
    x = torch.randn(batch, num_tokens, kwargs['dim'], dtype=torch.float64, requires_grad=True)
    out = layer(x, coords=coords, is_causal=causal)
    ref = torch.cat([goat_reference(layer, x[b:b + 1], coords[b], causal) for b in range(batch)])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    dense = layer(x, coords=coords, is_causal=causal, return_attn=True)[0]
    torch.testing.assert_close(dense, ref, rtol=0, atol=1e-10)

    assert len(assert_grads_match(layer, x, out, ref)) >= 6
    # a batch whose rows are all equal gives the same result as the shared (N, D) coordinates
    same = coords[:1].expand(batch, -1, -1)
    torch.testing.assert_close(layer(x, coords=same, is_causal=causal), layer(x, coords=coords[0], is_causal=causal),
                               rtol=0, atol=1e-12)
    prior = layer.prior_logits(coords)
    assert prior.shape == (batch, layer.num_heads, num_tokens, num_tokens)
    torch.testing.assert_close(prior[2], layer.prior_logits(coords[2]), rtol=0, atol=1e-12)


def test_per_sample_coords_errors():
    layer = GoatAttention(64, 2, num_spatial_dims=2, num_modes=2)
    with pytest.raises(ValueError, match=r'3 rows for a batch of 2 samples; expected \(2, 6, 2\)'):
        layer(torch.randn(2, 6, 64), coords=torch.zeros(3, 6, 2))
    with pytest.raises(ValueError, match=r'coords has shape \(2, 5, 2\), expected \(6, 2\) .* or \(B, 6, 2\)'):
        layer(torch.randn(2, 6, 64), coords=torch.zeros(2, 5, 2))


def test_bool_attention_mask_matches_reference_masking():
    torch.manual_seed(2)
    layer = GoatAttention(64, 2, num_spatial_dims=1, num_modes=2).double()
    _randomize(layer)
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    keep = torch.rand(2, 1, 9, 9) > 0.3
    keep[..., 0] = True
    fused = layer(x, attn_mask=keep)
    dense, probs = layer(x, attn_mask=keep, return_attn=True)
    torch.testing.assert_close(fused, dense, rtol=0, atol=1e-10)
    assert (probs.masked_select(~keep.expand_as(probs)) == 0).all()


def test_identical_tokens_attend_by_the_prior_alone():
    """Theorem 5.1 with zero content contrast: p_i = softmax(prior row i)."""
    torch.manual_seed(3)
    layer = GoatAttention(96, 3, num_spatial_dims=2, num_modes=3, num_prefix_tokens=1, grid_size=(4, 4)).double()
    _randomize(layer)
    x = torch.randn(1, 1, 96, dtype=torch.float64).expand(2, 17, 96)
    _, probs = layer(x, return_attn=True)
    expected = layer.prior_logits().softmax(-1)
    torch.testing.assert_close(probs, expected.expand_as(probs), rtol=0, atol=1e-12)


def test_relative_prior_depends_only_on_coordinate_differences():
    torch.manual_seed(4)
    layer = GoatAttention(96, 3, num_spatial_dims=2, num_modes=4, key_mlp_hidden=0).double()
    _randomize(layer)
    coords = torch.rand(10, 2, dtype=torch.float64) * 9
    shifted = coords + torch.tensor([3.5, -2.25], dtype=torch.float64)
    torch.testing.assert_close(layer.prior_logits(coords), layer.prior_logits(shifted), rtol=0, atol=1e-10)
    # 1D: Toeplitz in (i - j)
    layer1d = GoatAttention(64, 2, num_spatial_dims=1, num_modes=3, key_mlp_hidden=0, first_key_bias=False).double()
    _randomize(layer1d)
    prior = layer1d.prior_logits(num_tokens=12)
    for offset in range(-11, 12):
        diag = torch.diagonal(prior, offset=offset, dim1=-2, dim2=-1)
        torch.testing.assert_close(diag, diag[:, :1].expand_as(diag), rtol=0, atol=1e-10)


def test_prefix_tokens_get_no_relative_term():
    layer = GoatAttention(64, 2, num_spatial_dims=2, num_modes=2, num_prefix_tokens=2, key_mlp_hidden=0).double()
    _randomize(layer)
    prior = layer.prior_logits(grid_coords((3, 3), dtype=torch.float64))
    # a prefix key's logit is its learned bias for every query; a prefix query sees only key defaults
    torch.testing.assert_close(prior[:, :, :2], layer.prior.prefix_bias.double()[:, None, :].expand(-1, 11, -1))
    torch.testing.assert_close(prior[:, 0, 2:], torch.zeros(2, 9, dtype=torch.float64))


def test_initialisations():
    zero = GoatAttention(64, 4, num_spatial_dims=1, num_modes=3)
    assert zero.prior_logits(num_tokens=8).abs().max() == 0  # uniform prior at init
    rand_a = GoatAttention(64, 4, num_spatial_dims=1, num_modes=3, prior_init='random', init_seed=5)
    rand_b = GoatAttention(64, 4, num_spatial_dims=1, num_modes=3, prior_init='random', init_seed=5)
    torch.testing.assert_close(rand_a.prior.alpha, rand_b.prior.alpha)
    assert rand_a.prior.alpha.abs().min() > 0
    causal = GoatAttention(64, 4, num_spatial_dims=1, num_modes=3, prior_init='alibi', key_linear=True)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / 4) for h in range(4)])
    torch.testing.assert_close(causal.prior.key_slope.detach(), slopes)
    # non-causal 2D: cosine fit of -m |d| decreases away from zero offset along each axis
    vision = GoatAttention(96, 2, num_spatial_dims=2, num_modes=6, prior_init='alibi', key_mlp_hidden=0)
    prior = vision.prior_logits(grid_coords((1, 9)))[:, 4]  # query in the middle of a row
    left, right = prior[:, :5], prior[:, 4:]
    assert (left[:, 1:] - left[:, :-1] > 0).all() and (right[:, 1:] - right[:, :-1] < 0).all()


def test_learned_frequencies_receive_gradient():
    layer = GoatAttention(64, 2, num_spatial_dims=1, num_modes=2, learn_freqs=True, prior_init='random')
    out = layer(torch.randn(2, 6, 64))
    out.square().sum().backward()
    assert layer.prior.log_freqs.grad is not None and layer.prior.log_freqs.grad.abs().max() > 0


def test_clear_errors():
    with pytest.raises(ValueError, match=r'head dim 16 .* d_p = 2\*4\*2\+2 = 18'):
        GoatAttention(32, 2, num_spatial_dims=2, num_modes=4)
    layer = GoatAttention(64, 2, num_spatial_dims=2, num_modes=2, num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r'coords has shape \(6, 3\), expected \(6, 2\)'):
        layer(torch.randn(1, 7, 64), coords=torch.zeros(6, 3))
    with pytest.raises(ValueError, match=r'coords has shape \(5, 2\), expected \(6, 2\)'):
        layer(torch.randn(1, 7, 64), coords=torch.zeros(5, 2))
    with pytest.raises(ValueError, match='floating'):
        layer(torch.randn(1, 7, 64), coords=torch.zeros(6, 2, dtype=torch.long))
    with pytest.raises(ValueError, match='grid_size=None'):
        layer(torch.randn(1, 7, 64))
    with pytest.raises(ValueError, match='not both'):
        layer(torch.randn(1, 7, 64), coords=torch.zeros(6, 2), attn_mask=torch.ones(7, 7, dtype=torch.bool),
              is_causal=True)
    with pytest.raises(ValueError, match='prior_init'):
        GoatAttention(64, 2, prior_init='gaussian')


@pytest.mark.parametrize('bad', [float('nan'), float('inf'), -float('inf')])
def test_non_finite_coords_are_errors(bad):
    """NaN / inf coordinates would make the sample's output and every gradient NaN: a ValueError naming the
    first one, for shared and per-sample coords, on the forward and prior_logits paths."""
    layer = GoatAttention(64, 2, num_spatial_dims=2, num_modes=2, num_prefix_tokens=1)
    x = torch.randn(2, 7, 64)
    shared = torch.rand(6, 2)
    shared[3, 1] = bad
    per_sample = torch.rand(2, 6, 2)
    per_sample[1, 4, 0] = bad
    per_sample[1, 5, 1] = bad  # the first non-finite one is named
    value = str(bad).replace('+', r'\+')
    with pytest.raises(ValueError, match=rf'coords must be finite: coords\[3, 1\] = {value}$'):
        layer(x, coords=shared)
    with pytest.raises(ValueError, match=rf'coords must be finite: coords\[1, 4, 0\] = {value}$'):
        layer(x, coords=per_sample)
    with pytest.raises(ValueError, match=rf'coords must be finite: coords\[1, 4, 0\] = {value}$'):
        layer.prior_logits(per_sample)
    with pytest.raises(ValueError, match=rf'coords\[3, 1\] = {value}$'):
        layer(x, coords=shared, return_attn=True)
    layer1d = GoatAttention(48, 2, num_spatial_dims=1, num_modes=2)
    with pytest.raises(ValueError, match=rf'coords must be finite: coords\[2\] = {value}$'):
        layer1d(torch.randn(1, 5, 48), coords=torch.tensor([0., 1., bad, 3., 4.]))  # (N,): the caller's layout


def test_coords_check_under_script_fx_and_meta():
    """TorchScript compiles the layer (the check stands aside there); a torch.fx graph runs
    resolve_token_coords as a leaf on concrete values, so the check still happens; meta tensors (no values,
    as in timm's config tests) pass."""
    layer = GoatAttention(64, 2, num_spatial_dims=2, num_modes=2).eval()
    x = torch.randn(2, 6, 64)
    coords = torch.rand(6, 2)
    bad = coords.clone()
    bad[0, 0] = float('nan')
    scripted = torch.jit.script(layer)
    torch.testing.assert_close(scripted(x, coords), layer(x, coords=coords), rtol=0, atol=1e-6)
    traced = torch.fx.symbolic_trace(layer, concrete_args=dict(attn_mask=None, is_causal=False, return_attn=False,
                                                                       key_mask=None))
    torch.testing.assert_close(traced(x, coords), layer(x, coords=coords), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r'coords must be finite: coords\[0, 0\] = nan'):
        traced(x, bad)
    assert layer.to('meta')(x.to('meta'), coords=coords.to('meta')).shape == (2, 6, 64)


@pytest.mark.parametrize('grid_size,match', [
    ((2.5, 3), r'\(2\.5, 3\): rows = 2\.5 \(float\)$'),
    ((3, 2.0), r'\(3, 2\.0\): cols = 2\.0 \(float\)$'),
    ((True, 3), r'\(True, 3\): rows = True \(bool\)$'),
    ((torch.tensor(True), 3), r'.*: rows = tensor\(True\) \(Tensor\)$'),
    ((np.float32(2), 3), r'.*: rows = (np\.float32\()?2\.0\)? \(float32\)$'),
    ((0, 3), r'\(0, 3\): rows = 0 \(int\)$'),
    ((3, -1), r'\(3, -1\): cols = -1 \(int\)$'),
    ((3, 4, 5), r'\(3, 4, 5\)$'),
    (4, r'4$'),
])
def test_grid_coords_needs_two_positive_integers(grid_size, match):
    with pytest.raises(ValueError, match=r'^grid_size must be \(rows, cols\), two positive integers, got ' + match):
        grid_coords(grid_size)


def test_grid_coords_accepts_numpy_and_torch_integers():
    expected = grid_coords((2, 3))
    assert expected.tolist() == [[0, 0], [1, 0], [2, 0], [0, 1], [1, 1], [2, 1]]
    for size in [(np.int64(2), np.int32(3)), (torch.tensor(2), torch.tensor(3, dtype=torch.int32)), torch.Size([2, 3]),
                 [2, 3]]:
        assert torch.equal(grid_coords(size), expected)
    assert torch.equal(torch.jit.script(grid_coords)((2, 3)), expected)
    with pytest.raises(Exception, match='grid_size must be two positive integers'):
        torch.jit.script(grid_coords)((0, 3))
