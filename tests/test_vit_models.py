"""Our ViTs against timm's model contract, offline (timm's own suite runs in test_timm_suite.py)."""
import math

import pytest
import torch
import timm
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names
from timm.models import get_notrace_functions, get_notrace_modules

import vision_priors  # noqa: F401  (registers the models)
from vision_priors.models import PriorVisionTransformer

OUR_MODELS = [
    f'vit_{size}_patch16_{kind}_224' for kind in ('goat', 'pope', 'lavo') for size in ('tiny', 'small', 'base')]
TINY = ['vit_tiny_patch16_goat_224', 'vit_tiny_patch16_pope_224', 'vit_tiny_patch16_lavo_224']


def _small(name: str, **kwargs):
    """A 2-block variant: the contract does not depend on depth, and tests stay fast."""
    return timm.create_model(name, **dict(dict(depth=2), **kwargs))


def test_all_models_registered_with_default_cfgs():
    assert sorted(timm.list_models(['*goat*', '*pope*', '*lavo*'])) == sorted(OUR_MODELS)
    for name in OUR_MODELS:
        cfg = timm.models.get_pretrained_cfg(name)
        assert cfg.input_size == (3, 224, 224) and cfg.fixed_input_size is False


@pytest.mark.parametrize('name', OUR_MODELS)
def test_every_model_builds_and_runs(name):
    model = timm.create_model(name, num_classes=7).eval()
    assert isinstance(model, PriorVisionTransformer) and model.pos_embed is None
    with torch.no_grad():
        out = model(torch.randn(1, 3, 64, 96))
    assert out.shape == (1, 7) and torch.isfinite(out).all()


@pytest.mark.parametrize('name', TINY)
def test_unseen_resolutions_without_interpolation(name):
    model = _small(name).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x224 = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        ref = model(x224)
        for size in [(160, 160), (288, 288), (384, 384), (512, 512), (224, 320), (320, 160)]:
            out = model(torch.randn(2, 3, *size))
            assert out.shape == (2, 1000) and torch.isfinite(out).all(), size
        # the per-grid coordinate cache was rebuilt for every size and 224 still gives the same result
        torch.testing.assert_close(model(x224), ref, rtol=0, atol=0)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # nothing was resampled


@pytest.mark.parametrize('name', TINY)
def test_fixed_size_mode_and_set_input_size(name):
    model = _small(name, dynamic_img_size=False).eval()
    with pytest.raises(AssertionError, match=r"Input height \(160\) doesn't match model \(224\)"):
        model(torch.randn(1, 3, 160, 160))
    x = torch.randn(1, 3, 288, 256)
    dynamic = _small(name).eval()
    dynamic.load_state_dict(model.state_dict())
    model.set_input_size(img_size=(288, 256))
    if 'lavo' not in name:  # LAVO gets the grid per call; GOAT / PoPE keep a default grid
        assert model.blocks[0].attn.grid_size == (18, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), dynamic(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize('name', TINY)
def test_image_not_divisible_by_patch(name):
    model = _small(name).eval()
    with pytest.raises(AssertionError, match=r'Input height \(230\) should be divisible by patch size \(16\)'):
        model(torch.randn(1, 3, 230, 224))
    padded = _small(name, dynamic_img_pad=True).eval()
    with torch.no_grad():
        assert padded(torch.randn(1, 3, 230, 224)).shape == (1, 1000)


@pytest.mark.parametrize('name', TINY)
def test_features_head_intermediates(name):
    model = _small(name, depth=3, global_pool='avg', reg_tokens=2).eval()
    x = torch.randn(2, 3, 96, 64)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (2, 3 + 24, model.embed_dim)
        torch.testing.assert_close(model.forward_head(feats), model(x))
        assert model.forward_head(feats, pre_logits=True).shape == (2, model.embed_dim)
        final, inter = model.forward_intermediates(x, indices=[0, 2])
        torch.testing.assert_close(final, feats)
        assert [t.shape for t in inter] == [(2, model.embed_dim, 6, 4)] * 2
        only = model.forward_intermediates(x, indices=2, output_fmt='NLC', intermediates_only=True)
        assert only[-1].shape == (2, 24, model.embed_dim)
    kept = model.prune_intermediate_layers(indices=[1], prune_head=True)
    assert kept == [1] and len(model.blocks) == 2
    features = _small(name, depth=3, features_only=True, out_indices=(1, 2)).eval()
    with torch.no_grad():
        maps = features(torch.randn(1, 3, 64, 64))
    assert [m.shape for m in maps] == [(1, model.embed_dim, 4, 4)] * 2


@pytest.mark.parametrize('name', TINY)
def test_classifier_checkpointing_weight_decay(name):
    model = _small(name, drop_path_rate=0.1)
    model.reset_classifier(5, global_pool='avg')
    assert model.head.out_features == 5 and model.global_pool == 'avg'
    model.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
    model.set_grad_checkpointing(True)
    model.train()
    torch.manual_seed(0)
    model(x).sum().backward()  # checkpointed backward runs
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref)
    skip = model.no_weight_decay()
    assert 'cls_token' in skip
    prior_names = [n for n, _ in model.named_parameters() if '.attn.prior.' in n or '.attn.phases.' in n]
    assert set(prior_names) <= skip
    assert prior_names or 'lavo' in name


@pytest.mark.parametrize('name', ['vit_tiny_patch16_goat_224', 'vit_tiny_patch16_pope_224'])
def test_lavo_global_pool_on_prior_models(name):
    model = _small(name, global_pool='lavo', num_classes=4).eval()
    assert type(model.attn_pool).__name__ == 'LavoPool' and model.global_pool == 'lavo'
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        out = model(x)
        pooled = model.forward_head(model.forward_features(x), pre_logits=True)
    assert out.shape == (2, 4) and pooled.shape == (2, model.embed_dim)
    # the pooled vector depends on the patch tokens only through the LAVO cross-attention pool
    model.reset_classifier(3, 'avg')
    assert model.attn_pool is None and model(x).shape == (2, 3)
    model.reset_classifier(3, 'lavo')
    assert type(model.attn_pool).__name__ == 'LavoPool' and model(x).shape == (2, 3)


def test_lavo_vit_rejects_dense_masks():
    model = _small('vit_tiny_patch16_lavo_224').eval()
    with pytest.raises(ValueError, match='non-causal'):
        model(torch.randn(1, 3, 32, 32), is_causal=True)


def test_timm_init_keeps_uniform_goat_prior():
    model = _small('vit_tiny_patch16_goat_224')
    for blk in model.blocks:
        assert blk.attn.prior_logits().abs().max() == 0


@pytest.mark.parametrize('name', TINY)
def test_torchscript_and_fx_match_eager(name):
    model = _small(name).eval()
    x = torch.randn(1, 3, 64, 80)
    with torch.no_grad():
        ref = model(x)
        scripted = torch.jit.script(model)
        torch.testing.assert_close(scripted(x), ref, rtol=1e-5, atol=1e-5)
    tracer_kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())
    _, eval_nodes = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)
    fx_model = create_feature_extractor(model, return_nodes=[eval_nodes[-1]], tracer_kwargs=tracer_kwargs)
    with torch.no_grad():
        fx_out = list(fx_model(x).values())[0]
        torch.testing.assert_close(fx_out, ref, rtol=1e-5, atol=1e-5)
        # traced with the grid as data, not baked in: another size still matches eager
        x2 = torch.randn(1, 3, 96, 48)
        torch.testing.assert_close(list(fx_model(x2).values())[0], model(x2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('name', TINY)
def test_safetensors_roundtrip_through_pretrained_cfg_overlay(name, tmp_path):
    from safetensors.torch import save_file
    model = _small(name, num_classes=10).eval()
    path = tmp_path / 'weights.safetensors'
    save_file(model.state_dict(), str(path))
    loaded = timm.create_model(
        name, depth=2, num_classes=10, pretrained=True,
        pretrained_cfg_overlay=dict(file=str(path), num_classes=10)).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_bad_model_options():
    with pytest.raises(ValueError, match="pos_embed must be 'none'"):
        timm.create_model('vit_tiny_patch16_goat_224', pos_embed='learn')
    with pytest.raises(ValueError, match='patch_drop_rate'):
        timm.create_model('vit_tiny_patch16_pope_224', patch_drop_rate=0.5)
    with pytest.raises(ValueError, match='head dim 64 .* = 66'):
        timm.create_model('vit_tiny_patch16_goat_224', attn_kwargs=dict(num_modes=16))


@pytest.mark.parametrize('name', TINY)
def test_training_after_inference_mode_at_a_new_size(name):
    """Coordinates cached while evaluating under torch.inference_mode must not poison later training
    (an inference tensor cannot be saved for backward): evaluate at a size no other test uses, then train
    there with and without grad checkpointing."""
    model = _small(name, img_size=64, dynamic_img_size=True)
    x = torch.randn(2, 3, 80, 48)  # a 5 x 3 patch grid
    model.eval()
    with torch.inference_mode():
        ref = model(x)
    model.train()
    for checkpointing in (False, True):
        model.set_grad_checkpointing(checkpointing)
        model.zero_grad()
        model(x).sum().backward()
        assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith('blocks.0.'))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref)


@pytest.mark.parametrize('img_size,patch_size,side', [(32, 8, 4), (32, 4, 8), (48, 8, 6), (224, 16, 14),
                                                     ((32, 64), 8, 8), ((40, 24), 8, 5)])
def test_goat_vit_top_frequency_follows_the_training_grid(img_size, patch_size, side):
    """max_freq = 0.4 * 7 / (2 G - 1) for a G-patch longer side: the top mode turns 2.8 rad (< pi) over the
    largest offset of a grid twice the training one, so no offset up to 2x aliases; 0.4 exactly on 4 x 4."""
    from vision_priors.models.vision_transformer_priors import vit_goat_max_freq
    model = timm.create_model('vit_tiny_patch16_goat_224', embed_dim=48, depth=1, num_heads=2, img_size=img_size,
                              patch_size=patch_size, num_classes=0)
    assert model.goat_max_freq == model.blocks[0].attn.prior.max_freq == vit_goat_max_freq((side, side))
    assert model.goat_max_freq == pytest.approx(2.8 / (2 * side - 1), rel=1e-12)
    assert model.goat_max_freq * (2 * side - 1) < math.pi  # the 2x grid's largest offset does not alias
    assert vit_goat_max_freq((4, 4)) == 0.4
    model.set_input_size(img_size=(patch_size * 3 * side, patch_size * 3 * side))  # a later grid: same ladder
    assert model.blocks[0].attn.prior.max_freq == model.goat_max_freq
    for other in ('pope', 'lavo'):
        assert timm.create_model(f'vit_tiny_patch16_{other}_224', embed_dim=48, depth=1, num_heads=2,
                                 img_size=32, patch_size=8).goat_max_freq is None
    with pytest.raises(ValueError, match='grid_size must be positive'):
        vit_goat_max_freq((0, 0))


def test_goat_vit_prior_is_relative_by_default():
    """The ViTs' GOAT has no key-default MLP (``VIT_GOAT_DEFAULTS``), so every block's logits depend on patch
    coordinates only through their differences: shifting the whole grid changes nothing, the property that lets
    the model run on grids larger than its training grid without leaving the prior's training range."""
    from vision_priors.models.vision_transformer_priors import VIT_GOAT_DEFAULTS
    assert VIT_GOAT_DEFAULTS == dict(key_mlp_hidden=0)
    model = timm.create_model('vit_tiny_patch16_goat_224', embed_dim=48, depth=1, num_heads=2, img_size=32,
                              patch_size=8, class_token=False, global_pool='avg', num_classes=0).double()
    attn = model.blocks[0].attn
    assert attn.prior.key_mlp is None
    with torch.no_grad():
        attn.prior.alpha.normal_()
        attn.prior.beta.normal_()
    x = torch.randn(2, 16, 48, dtype=torch.float64)
    ys, xs = torch.meshgrid(torch.arange(4.), torch.arange(4.), indexing='ij')
    coords = torch.stack([xs.flatten(), ys.flatten()], -1).double()
    torch.testing.assert_close(attn(x, coords), attn(x, coords + torch.tensor([5., 3.], dtype=torch.float64)),
                               rtol=1e-12, atol=1e-12)
    # the paper's key-default MLP is one option away, and then absolute positions matter
    with_mlp = timm.create_model('vit_tiny_patch16_goat_224', embed_dim=48, depth=1, num_heads=2, img_size=32,
                                 patch_size=8, attn_kwargs=dict(key_mlp_hidden=8))
    assert with_mlp.blocks[0].attn.prior.key_mlp is not None


def test_goat_vit_frequency_ladder_tops_at_max_freq():
    """The 2D ViTs' GOAT ladder is w_r = max_freq * 100^(-r / R) per axis, in every block, with max_freq 0.4 on a
    4 x 4 training grid; the layer's own default stays the paper's ladder (w_0 = 1), and an explicit ``max_freq``
    overrides the ViTs' default."""
    model = timm.create_model('vit_tiny_patch16_goat_224', embed_dim=48, depth=2, num_heads=2, img_size=32,
                              patch_size=8, num_classes=0)
    assert model.goat_max_freq == 0.4
    R = model.blocks[0].attn.prior.num_modes
    expected = torch.tensor([0.4 * 100.0 ** (-r / R) for r in range(R)], dtype=torch.float64).expand(2, R)
    for block in model.blocks:
        torch.testing.assert_close(block.attn.prior.frequencies(torch.float64, torch.device('cpu')), expected,
                                   rtol=1e-15, atol=0)
    from vision_priors.layers import GoatAttention
    paper = GoatAttention(48, num_heads=2, num_spatial_dims=2).prior.frequencies(torch.float64, torch.device('cpu'))
    assert paper[0, 0].item() == 1.0
    learned = timm.create_model('vit_tiny_patch16_goat_224', embed_dim=48, depth=1, num_heads=2, img_size=32,
                                patch_size=8, attn_kwargs=dict(learn_freqs=True, max_freq=0.25))
    assert learned.goat_max_freq == 0.25
    torch.testing.assert_close(learned.blocks[0].attn.prior.log_freqs.exp().double(),
                               (expected * 0.25 / 0.4), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match='max_freq must be a finite number > 0'):
        GoatAttention(48, num_heads=2, num_spatial_dims=2, max_freq=0.0)
