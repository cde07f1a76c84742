"""Position interpolation onto a reference grid: ``grid_coords(ref_grid_size=...)``, LAVO's rescaled 2D window
(``rescale_window_2d``, against a float64 reference), the GOAT / PoPE / LAVO ViTs' ``ref_feat_shape`` and
``interpolate_positions`` for timm's RoPE and absolute-embedding ViTs."""
import copy
import math

import pytest
import timm
import torch

import vision_priors  # noqa: F401  (registers the models)
from vision_priors.layers import LavoAttention, grid_coords
from vision_priors.layers.lavo import rescale_window_2d
from vision_priors.models import RotaryEmbeddingMixedOnGrid, interpolate_positions, rescale_coords_kwargs
from timm.layers.pos_embed_sincos import get_mixed_freqs

SMALL = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=2, num_classes=3, init_values=1.0,
             class_token=False, global_pool='avg')  # the main job's layout


def _perturbed(name: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    """A small model whose positional parameters are moved off their start, so positions change outputs."""
    torch.manual_seed(seed)
    model = timm.create_model(name, **dict(SMALL, **kwargs)).eval()
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if 'attn' in name_ or 'rope' in name_:
                p.add_(0.3 * torch.randn_like(p))
    return model


def test_grid_coords_on_a_reference_grid():
    coords = grid_coords((2, 3), dtype=torch.float64, ref_grid_size=(4, 2))
    # token r * 3 + c sits at (c * 2 / 3, r * 4 / 2)
    expected = torch.tensor([[c * 2 / 3, r * 2.0] for r in range(2) for c in range(3)], dtype=torch.float64)
    assert torch.equal(coords, expected)
    assert torch.equal(grid_coords((5, 7), ref_grid_size=(5, 7)), grid_coords((5, 7)))
    for bad, message in (((0, 3), 'rows = 0'), ((2, 2.5), 'cols = 2.5'), ((2,), 'got \\(2,\\)')):
        with pytest.raises(ValueError, match=f'ref_grid_size must be \\(rows, cols\\).*{message}'):
            grid_coords((2, 3), ref_grid_size=bad)


@pytest.mark.parametrize('name', ['vit_tiny_patch16_goat_224', 'vit_tiny_patch16_pope_224'])
def test_prior_vit_ref_feat_shape_rescales_the_coordinates_its_blocks_see(name):
    model = _perturbed(name, ref_feat_shape=(4, 4))
    native = _perturbed(name)
    assert model.ref_feat_shape == (4, 4) and native.ref_feat_shape is None
    small, large = torch.randn(2, 3, 32, 32), torch.randn(2, 3, 40, 64)  # 4 x 4 (training) and 5 x 8 grids
    with torch.no_grad():
        assert torch.equal(model(small), native(small))  # on the reference grid: the same positions
        assert (model(large) - native(large)).abs().max() > 1e-3  # elsewhere: other positions
        # the blocks get (c * 4 / 8, r * 4 / 5), written out here, not taken from the model
        x = model.patch_embed(large)
        rows, cols = x.shape[1], x.shape[2]
        coords = torch.tensor([[c * 4 / cols, r * 4 / rows] for r in range(rows) for c in range(cols)])
        x = x.reshape(x.shape[0], rows * cols, -1)
        for blk in model.blocks:
            x = blk(x, coords, [rows, cols])
        by_hand = model.forward_head(model.norm(x))
        assert torch.allclose(model(large), by_hand, atol=1e-6, rtol=1e-5)
        scripted = torch.jit.script(model)
        assert torch.allclose(scripted(large), model(large), atol=1e-6, rtol=1e-5)
        model.set_ref_feat_shape(None)
        assert model.ref_feat_shape is None and torch.equal(model(large), native(large))


def _window_reference(w2, table, grid, ref):
    """The rescaled window written out offset by offset in float64: radius floor((w2 - 1) min s); the bias of
    (dy, dx) is the bilinear interpolation of the trained table at (dy / s_y, dx / s_x)."""
    sy, sx = grid[0] / ref[0], grid[1] / ref[1]
    radius = math.floor((w2 - 1) * min(sy, sx) + 1e-9)
    kw = 2 * w2 - 1
    t = table.double().reshape(kw, kw)
    out = []
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            u, v = dy / sy, dx / sx
            assert abs(u) <= w2 - 1 + 1e-9 and abs(v) <= w2 - 1 + 1e-9  # within the trained window
            i, j = u + w2 - 1, v + w2 - 1
            i0, j0 = math.floor(i), math.floor(j)
            i1, j1 = min(i0 + 1, kw - 1), min(j0 + 1, kw - 1)
            fi, fj = i - i0, j - j0
            out.append((1 - fi) * ((1 - fj) * t[i0, j0] + fj * t[i0, j1])
                       + fi * ((1 - fj) * t[i1, j0] + fj * t[i1, j1]))
    return radius + 1, torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize('grid, ref', [((8, 8), (4, 4)), ((6, 8), (4, 4)), ((5, 3), (4, 4)), ((2, 2), (4, 4)),
                                       ((9, 9), (4, 4))])
def test_rescale_window_2d_against_a_float64_reference(grid, ref):
    torch.manual_seed(0)
    table = torch.randn(49, dtype=torch.float64)
    w2, rescaled = rescale_window_2d(4, table, grid, ref)
    w2_ref, expected = _window_reference(4, table, grid, ref)
    assert w2 == w2_ref and rescaled.shape == ((2 * w2 - 1) ** 2,)
    assert torch.allclose(rescaled, expected, atol=1e-12, rtol=0)
    if grid == (8, 8):  # twice the grid: even offsets are the trained entries, the window 13 x 13
        assert w2 == 7 and torch.equal(rescaled.reshape(13, 13)[::2, ::2], table.reshape(7, 7))
    if grid == (6, 8):  # scales 1.5 and 2: the one square window follows the smaller (reach 4.5 -> 4 patches)
        assert w2 == 5
    assert rescale_window_2d(4, None, grid, ref) == (w2, None)  # no EPE: only the window changes


@pytest.mark.parametrize('dissection', ['block', 'sliding'])
@pytest.mark.parametrize('key_mask', [False, True])  # True takes the tiled path instead of the dense mask
def test_lavo_layer_on_a_reference_grid_equals_the_rescaled_window(dissection, key_mask):
    torch.manual_seed(1)
    layer = LavoAttention(32, num_heads=2, num_slots=8, causal=False, num_spatial_dims=2, window_2d=3,
                          dissection=dissection).double()
    with torch.no_grad():
        layer.rel_bias_2d.normal_()
    by_hand = copy.deepcopy(layer)
    grid, ref = (7, 9), (3, 4)
    x = torch.randn(2, 1 + 63, 32, dtype=torch.float64)
    mask = torch.ones(2, 64, dtype=torch.bool) if key_mask else None
    layer.set_ref_grid_size(ref)
    out = layer(x, key_mask=mask, grid_size=[7, 9], num_prefix_tokens=1)
    w2, table = rescale_window_2d(3, layer.rel_bias_2d, grid, ref)
    by_hand.window_2d = w2
    by_hand.rel_bias_2d = torch.nn.Parameter(table.detach())
    assert torch.allclose(out, by_hand(x, key_mask=mask, grid_size=[7, 9], num_prefix_tokens=1), atol=1e-12)
    out.square().sum().backward()  # the trained table gets the gradient through the rescaling
    assert layer.rel_bias_2d.grad is not None and layer.rel_bias_2d.grad.abs().sum() > 0
    x_ref = torch.randn(2, 1 + 12, 32, dtype=torch.float64)  # on the reference grid: the plain layer
    plain = copy.deepcopy(layer)
    plain.set_ref_grid_size(None)
    assert torch.equal(layer(x_ref, grid_size=[3, 4], num_prefix_tokens=1),
                       plain(x_ref, grid_size=[3, 4], num_prefix_tokens=1))
    with pytest.raises(ValueError, match=r'ref_grid_size must be \(rows, cols\), two positive integers, got \(0, 4\)'):
        layer.set_ref_grid_size((0, 4))


def test_lavo_vit_ref_feat_shape():
    model = _perturbed('vit_tiny_patch16_lavo_224', ref_feat_shape=(4, 4))
    native = _perturbed('vit_tiny_patch16_lavo_224')
    small, large = torch.randn(2, 3, 32, 32), torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(model(small), native(small))
        assert (model(large) - native(large)).abs().max() > 1e-3
        assert all(blk.attn._ref_grid == [4, 4] for blk in model.blocks)
        scripted = torch.jit.script(model)
        assert torch.allclose(scripted(large), model(large), atol=1e-6, rtol=1e-5)
        interpolate_positions(native, (4, 4))
        assert torch.equal(native(large), model(large))


def test_prior_vit_ref_feat_shape_errors():
    goat = timm.create_model('vit_tiny_patch16_goat_224', **SMALL)
    with pytest.raises(ValueError, match=r'ref_feat_shape must be \(rows, cols\).*rows = 0'):
        goat.set_ref_feat_shape((0, 4))
    with pytest.raises(ValueError, match=r'ref_feat_shape must be .*cols = 3.5'):
        goat.set_ref_feat_shape((4, 3.5))
    assert goat.ref_feat_shape is None  # unchanged by the refused calls


def test_axial_rope_interpolation_equals_timms_own_ref_feat_shape():
    kwargs = dict(dynamic_img_size=True)
    model = _perturbed('vit_small_patch16_rope_224', **kwargs)
    reference = timm.create_model('vit_small_patch16_rope_224', **SMALL, **kwargs, ref_feat_shape=(4, 4)).eval()
    reference.load_state_dict(model.state_dict())
    large = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        features = model.forward_features  # timm's Eva heads start near zero: compare the features
        assert (features(large) - reference.forward_features(large)).abs().max() > 1e-3
        interpolate_positions(model, (4, 4))
        assert torch.equal(features(large), reference.forward_features(large))


def test_mixed_rope_interpolation_rescales_its_grid():
    model = _perturbed('vit_small_patch16_rope_mixed_224', dynamic_img_size=True)
    keys = list(model.state_dict())
    small, large = torch.randn(2, 3, 32, 32), torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        features = model.forward_features  # timm's Eva heads start near zero: compare the features
        before_small, before_large = features(small), features(large)
        interpolate_positions(model, (4, 4))
        assert isinstance(model.rope, RotaryEmbeddingMixedOnGrid) and list(model.state_dict()) == keys
        assert torch.equal(features(small), before_small)
        assert (features(large) - before_large).abs().max() > 1e-3
        # 8 x 6 grid: column c at c * 4 / 6, row r at r * 4 / 8 ('xy' grid: x first)
        rows, cols = torch.meshgrid(torch.arange(8.), torch.arange(6.), indexing='ij')
        expected = get_mixed_freqs(model.rope.freqs, (cols * 4 / 6).reshape(-1), (rows * 4 / 8).reshape(-1))
        assert torch.allclose(model.rope.get_embed(shape=[8, 6]), expected, atol=1e-6)


def test_absolute_embedding_is_already_interpolated_and_other_models_are_refused():
    model = _perturbed('vit_tiny_patch16_224', dynamic_img_size=True)
    large = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        before = model(large)
        interpolate_positions(model, (4, 4))
        assert torch.equal(model(large), before)
    fixed = timm.create_model('vit_tiny_patch16_224', **SMALL)
    with pytest.raises(ValueError, match='without dynamic_img_size=True'):
        interpolate_positions(fixed, (4, 4))
    no_positions = timm.create_model('vit_tiny_patch16_224', **SMALL, dynamic_img_size=True, pos_embed='none')
    with pytest.raises(ValueError, match='has no position scheme interpolate_positions knows'):
        interpolate_positions(no_positions, (4, 4))


@pytest.mark.parametrize('name', ['vit_tiny_patch16_goat_224', 'vit_tiny_patch16_pope_224'])
def test_rescale_coords_scales_the_training_coordinates_only(name, monkeypatch):
    """rescale_coords (timm's DINOv3 augmentation, timm's own function): in training one log-uniform factor in
    [1/r, r] per forward multiplies the coordinates the blocks see; in eval the coordinates are the grid's."""
    from vision_priors.models import vision_transformer_priors as vit
    model = _perturbed(name, rescale_coords=2.0)
    seen = []
    real_block_forward = type(model.blocks[0]).forward
    monkeypatch.setattr(type(model.blocks[0]), 'forward',
                        lambda self, x, coords=None, *a, **k: seen.append(coords) or real_block_forward(
                            self, x, coords, *a, **k))
    grid = vit.patch_grid_coords(4, 4, torch.device('cpu'))
    x = torch.randn(2, 3, 32, 32)
    model.train()
    for seed in range(6):
        torch.manual_seed(seed)
        model(x)
    nonzero = grid != 0
    factors = [c[nonzero] / grid[nonzero] for c in seen[::2]]  # one factor per forward, shared by every block
    assert all(torch.allclose(f, f[:1].expand_as(f)) for f in factors)
    values = torch.stack([f[0] for f in factors])
    assert ((values >= 0.5) & (values <= 2.0)).all() and values.std() > 0.05  # drawn, not fixed
    assert all(torch.equal(a, b) for a, b in zip(seen[::2], seen[1::2]))  # both blocks see the same coordinates
    seen.clear()
    model.eval()
    model(x)
    assert torch.equal(seen[0], grid)


def test_rescale_coords_kwargs_per_family():
    assert rescale_coords_kwargs(timm.create_model('vit_tiny_patch16_goat_224', **SMALL), 2) == {'rescale_coords': 2.0}
    assert rescale_coords_kwargs(timm.create_model('vit_tiny_patch16_pope_224', **SMALL), 2) == {'rescale_coords': 2.0}
    rope = timm.create_model('vit_small_patch16_rope_mixed_224', **SMALL, dynamic_img_size=True)
    assert rescale_coords_kwargs(rope, 1.5) == {'rope_rescale_coords': 1.5}
    assert rescale_coords_kwargs(timm.create_model('vit_tiny_patch16_lavo_224', **SMALL), 2) == {}
    assert rescale_coords_kwargs(timm.create_model('vit_tiny_patch16_224', **SMALL), 2) == {}
    assert rescale_coords_kwargs(rope, None) == {}
    with pytest.raises(ValueError, match='not supported by LAVO ViTs'):
        timm.create_model('vit_tiny_patch16_lavo_224', **SMALL, rescale_coords=2.0)
    with pytest.raises(ValueError, match='rescale_coords must be finite and >= 1'):
        timm.create_model('vit_tiny_patch16_goat_224', **SMALL, rescale_coords=0.5)
