"""Spatial VQA fusion variant (``--arch fusion``): scan-order invariance, independent questions, timm
conventions, errors, and the recipe end to end (train / kill / resume bit for bit / eval / compare of both
architectures). The blocks themselves are tested in tests/test_multimodal_blocks.py."""
import json
import math

import pytest
import torch

from run_helpers import final_weights
from vision_priors.layers import grid_coords
from vision_priors.models.multimodal import CONTENT_CROSS_ATTENTIONS, POSITIONAL_CROSS_ATTENTIONS
from vision_priors.models.spatial_vqa_fusion import FUSION_METHODS, IMAGE_POS, SpatialVQAFusion, coordinate_features
from vision_priors.recipes import spatial_vqa as recipe
from vision_priors.recipes.data.vqa_scenes import scan_order

TINY = ['--embed-dim', '32', '--depth', '1', '--num-heads', '2', '--patch-size', '16', '--goat-modes', '1',
        '--synthetic-per-class', '6', '3', '--train-scenes', '32', '--test-scenes', '8', '--batch-size', '8',
        '--cpu', '--threads', '1']


def _model(method: str, cross_attn: str, seed: int = 0, image_pos: str = 'none') -> SpatialVQAFusion:
    torch.manual_seed(seed)
    model = SpatialVQAFusion(method, vocab_size=12, patch_dim=6, grid_size=(4, 4), embed_dim=48, depth=2,
                             num_heads=2, cross_attn=cross_attn, goat_kwargs=dict(prior_init='random', init_seed=seed),
                             image_pos=image_pos)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'rel_bias' in name:
                p.normal_(0, 1)  # LAVO's relative position bias starts at zero (position-blind)
    return model.double().eval()


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    content = torch.randn(2, 16, 6, generator=g, dtype=torch.float64)  # row-major patches
    text = torch.randint(0, 12, (2, 3, 3), generator=g)
    return content, grid_coords((4, 4), dtype=torch.float64), text


@pytest.mark.parametrize('method', FUSION_METHODS)
def test_answers_ignore_the_scan_order_but_not_the_layout(method, one_thread):
    """Canonical coordinates (and, for LAVO, the grid order rebuilt from them; the sincos features and the rotary
    angles travel with their tokens; the positional cross-attention's image coordinates are the scan-ordered input
    coordinates): the same scene in any scan order gives the same answers; the same contents at other places (a
    different scene) do not."""
    content, coords, text = _data()
    configs = [(cross_attn, image_pos) for cross_attn in CONTENT_CROSS_ATTENTIONS for image_pos in IMAGE_POS]
    if method in POSITIONAL_CROSS_ATTENTIONS:
        configs.append((method, 'none'))  # the method's own positional cross-attention
    for cross_attn, image_pos in configs:
        model = _model(method, cross_attn, image_pos=image_pos)
        ref = model(content, coords, text)
        for orders in (['hilbert', 'spiral'], ['reverse', 'quad_col']):
            perms = torch.stack([torch.from_numpy(scan_order(o, (4, 4))) for o in orders])
            patches = torch.stack([content[b, perms[b]] for b in range(2)])
            torch.testing.assert_close(model(patches, coords[perms], text), ref, rtol=0, atol=1e-10)
        moved = content[:, torch.from_numpy(scan_order('hilbert', (4, 4)))]
        assert (model(moved, coords, text) - ref).abs().max() > 1e-6


@pytest.mark.parametrize('cross_attn', CONTENT_CROSS_ATTENTIONS + ('goat',))
def test_questions_are_independent_and_checkpointing_is_exact(cross_attn, one_thread):
    """Changing one question never changes another's answer; grad checkpointing gives the same values and
    gradients (timm's ``set_grad_checkpointing``)."""
    model = _model('goat', cross_attn)
    content, coords, text = _data(1)
    out = model(content, coords, text)
    other = text.clone()
    other[:, 1] = (other[:, 1] + 5) % 12
    changed = model(content, coords, other)
    torch.testing.assert_close(changed[:, [0, 2]], out[:, [0, 2]], rtol=0, atol=1e-12)
    assert (changed[:, 1] - out[:, 1]).abs().max() > 1e-6
    patches = content.clone().requires_grad_(True)
    grads = []
    for enable in (False, True):
        model.set_grad_checkpointing(enable)
        y = model(patches, coords, text)
        grads.append(torch.autograd.grad(y.square().sum(), [patches] + list(model.parameters()), allow_unused=True))
        torch.testing.assert_close(y, out, rtol=0, atol=0)
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_coordinate_features_match_the_formula():
    """Float64, odd coordinates: feature [a * dim / 2 + s * dim / 4 + k] = (sin, cos)[s](w_k coord_a)."""
    coords = torch.tensor([[0., 0.], [3., 1.], [-2.5, 7.25]], dtype=torch.float64)
    dim = 12
    feats = coordinate_features(coords, dim)
    for i in range(3):
        for a in range(2):
            for s, fn in enumerate((math.sin, math.cos)):
                for k in range(dim // 4):
                    w = 10000. ** (-4 * k / dim)
                    assert abs(feats[i, a * dim // 2 + s * dim // 4 + k].item() - fn(w * coords[i, a].item())) < 1e-12
    with pytest.raises(ValueError, match='divisible by 4'):
        coordinate_features(coords, 10)


def test_model_errors(one_thread):
    with pytest.raises(ValueError, match=r"pos_method must be one of \('goat', 'pope', 'lavo'\)"):
        SpatialVQAFusion('rope', vocab_size=12, patch_dim=6, grid_size=(4, 4))
    with pytest.raises(ValueError, match='cross_attn must be one of'):
        SpatialVQAFusion('goat', vocab_size=12, patch_dim=6, grid_size=(4, 4), cross_attn='linear')
    with pytest.raises(ValueError, match=r"cross_attn='pope' is positional and needs pos_method='pope'"):
        SpatialVQAFusion('goat', vocab_size=12, patch_dim=6, grid_size=(4, 4), cross_attn='pope')
    with pytest.raises(ValueError, match=r"cross_attn='goat' is positional and needs pos_method='goat'"):
        SpatialVQAFusion('lavo', vocab_size=12, patch_dim=6, grid_size=(4, 4), cross_attn='goat')
    with pytest.raises(ValueError, match='image_pos must be one of'):
        SpatialVQAFusion('goat', vocab_size=12, patch_dim=6, grid_size=(4, 4), image_pos='learned')
    content, coords, text = _data()
    model = _model('lavo', 'lavo')
    with pytest.raises(ValueError, match='coords must be a permutation of the 4x4 grid'):
        model(content, coords + 0.5, text)
    with pytest.raises(ValueError, match=r'patches have shape \(2, 15, 6\)'):
        model(content[:, :15], coords[:15], text)
    with pytest.raises(ValueError, match=r'text has shape \(2, 3, 2\)'):
        model(content, coords, text[..., :2])


def test_recipe_rejects_fusion_settings_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r'--arch fusion needs --method\(s\) in'):
        recipe.main(['train', '--arch', 'fusion', '--method', 'rope', '--out', str(tmp_path / 'r'), *TINY])
    with pytest.raises(ValueError, match='--image-attention must be prefix'):
        recipe.main(['compare', '--methods', 'goat', '--archs', 'fusion', '--image-attention', 'causal',
                     '--out', str(tmp_path / 'r'), *TINY])
    with pytest.raises(ValueError, match='--image-pos is an option of --arch fusion'):
        recipe.main(['train', '--image-pos', 'sincos', '--out', str(tmp_path / 'r'), *TINY])
    with pytest.raises(SystemExit):
        recipe.main(['train', '--arch', 'fusion', '--cross-attn', 'linear'])
    with pytest.raises(ValueError, match='--cross-attn goat is positional and needs --method goat'):
        recipe.main(['train', '--arch', 'fusion', '--method', 'pope', '--cross-attn', 'goat', '--out',
                     str(tmp_path / 'r'), *TINY])
    with pytest.raises(ValueError, match='--cross-attn pope is positional and needs --method pope'):
        recipe.main(['compare', '--methods', 'goat', '--archs', 'fusion', '--cross-attns', 'softmax', 'pope',
                     '--out', str(tmp_path / 'r'), *TINY])
    with pytest.raises(ValueError, match='--goat-prior-init offsets is a 2D start; --arch fusion'):
        recipe.main(['compare', '--methods', 'goat', '--archs', 'single', 'fusion', '--goat-prior-init', 'offsets',
                     '--out', str(tmp_path / 'r'), *TINY])
    assert not (tmp_path / 'r').exists()
    # without the flag each architecture gets its own start: offsets (single stream), zero (fusion)
    args = recipe.build_parser().parse_args(['compare', '--methods', 'goat', '--archs', 'single', 'fusion', *TINY])
    assert recipe.model_config(args, 'goat', 8)['goat_kwargs'] == {'prior_init': 'offsets'}
    assert recipe.model_config(args, 'goat-fusion-lavo', 8)['goat_kwargs'] == {'prior_init': 'zero'}


def test_architecture_defaults_are_resolved_per_run():
    """--goat-prior-init, --warmup-frac and --image-pos left at their defaults: offsets / 0.05 / none for the
    single-stream model; for fusion zero, a warm-up over half the updates, and rotary image positions with a
    content cross-attention (softmax, lavo), none with a positional one (goat, pope). Explicit flags win."""
    args = recipe.build_parser().parse_args(['compare', '--methods', 'goat', '--archs', 'single', 'fusion', *TINY])
    resolved = {name: recipe.run_args(args, name) for name in
                ('goat', 'goat-fusion-softmax', 'goat-fusion-lavo', 'goat-fusion-goat')}
    assert {n: (a.goat_prior_init, a.warmup_frac, a.image_pos) for n, a in resolved.items()} == {
        'goat': ('offsets', 0.05, 'none'), 'goat-fusion-softmax': ('zero', 0.5, 'rotary'),
        'goat-fusion-lavo': ('zero', 0.5, 'rotary'), 'goat-fusion-goat': ('zero', 0.5, 'none')}
    # the parsed flags themselves are left alone
    assert args.goat_prior_init is None and args.warmup_frac is None and args.image_pos is None
    assert recipe.model_config(args, 'goat-fusion-lavo', 8)['image_pos'] == 'rotary'
    # LAVO's cross-attention slots: the recipe's default reaches the model; a softmax run does not store them
    lavo_cfg = recipe.model_config(args, 'goat-fusion-lavo', 8)
    assert lavo_cfg['cross_slots'] == recipe.FUSION_CROSS_SLOTS == 8
    assert 'cross_slots' not in recipe.model_config(args, 'goat-fusion-softmax', 8)
    model = recipe.build_model(lavo_cfg)
    assert {blk.cross_attn.num_slots for blk in model.decoder_blocks} == {8}
    explicit = recipe.build_parser().parse_args(['compare', '--methods', 'goat', '--archs', 'fusion', '--image-pos',
                                                 'none', '--warmup-frac', '0.1', *TINY])
    assert (recipe.run_args(explicit, 'goat-fusion-lavo').warmup_frac,
            recipe.run_args(explicit, 'goat-fusion-lavo').image_pos) == (0.1, 'none')


def test_fusion_train_resume_eval_and_compare_both_architectures(tmp_path):
    common = ['train', '--arch', 'fusion', '--cross-attn', 'lavo', '--method', 'pope', '--image-pos', 'rotary', *TINY,
              '--updates', '4',
              '--checkpoint-every', '2', '--seed', '1']
    full, killed = tmp_path / 'full', tmp_path / 'killed'
    recipe.main([*common, '--out', str(full)])
    recipe.main([*common, '--out', str(killed), '--stop-after', '2'])
    recipe.main([*common, '--out', str(killed), '--resume'])
    a, b = final_weights(full), final_weights(killed)
    assert a.keys() == b.keys() and any(k.startswith('decoder_blocks.0.cross_attn.') for k in a)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    config = json.loads((full / 'config.json').read_text())
    assert config['method'] == 'pope-fusion-lavo'
    assert config['model']['arch'] == 'fusion' and config['model']['cross_attn'] == 'lavo'
    assert config['model']['image_pos'] == 'rotary'
    assert config['args']['warmup_frac'] == 0.5  # fusion's default warm-up, stored resolved
    # a run trained with another warm-up is a changed setting on --resume, refused before any work
    with pytest.raises(ValueError, match='warmup_frac'):
        recipe.main([*common, '--out', str(killed), '--resume', '--warmup-frac', '0.05'])

    recipe.main(['eval', str(full), '--out', str(tmp_path / 'eval'), '--cpu', '--threads', '1'])
    row = json.loads((tmp_path / 'eval' / 'results.json').read_text())['rows'][0]
    assert row['method'] == 'pope-fusion-lavo' and row['seen']['n'] == 8 * 4
    assert row['seen']['acc'] == row['unseen']['acc']  # the fusion model ignores the scan order (paired scenes)

    cmp = tmp_path / 'compare'
    recipe.main(['compare', '--methods', 'goat', '--archs', 'single', 'fusion', '--seeds', '0', *TINY,
                 '--updates', '1', '--out', str(cmp)])
    results = json.loads((cmp / 'results.json').read_text())
    assert list(results['summary']) == ['goat', 'goat-fusion-softmax', 'goat-fusion-lavo']
    assert results['config']['archs'] == ['single', 'fusion']
    assert '| goat-fusion-lavo |' in results['table_markdown']
    # the positional cross-attention: pairs with its own method only; label round trip
    assert recipe.fusion_cross_attns('pope', ['softmax', 'goat', 'pope']) == ['softmax', 'pope']
    assert recipe.parse_model_name(recipe.model_name('goat', 'fusion', 'goat')) == ('goat', 'fusion', 'goat')
    pos = tmp_path / 'compare_positional'
    recipe.main(['compare', '--methods', 'goat', 'pope', '--archs', 'fusion', '--cross-attns', 'goat', 'pope',
                 '--seeds', '0', *TINY, '--updates', '1', '--out', str(pos)])
    results = json.loads((pos / 'results.json').read_text())
    assert list(results['summary']) == ['goat-fusion-goat', 'pope-fusion-pope']
    assert '| pope-fusion-pope |' in results['table_markdown']


def test_goat_encoder_keeps_its_top_frequency_on_every_grid(one_thread):
    """The fusion model's GOAT image encoder keeps 0.4 rad per patch on any scene grid (the ViTs' grid-dependent
    default is for extrapolating to larger grids, which these scenes never do); an explicit ``max_freq`` wins, and
    the question decoder's 1D prior keeps the layer's own ladder."""
    for grid in ((4, 4), (8, 8), (2, 2)):
        model = SpatialVQAFusion('goat', vocab_size=12, patch_dim=6, grid_size=grid, embed_dim=32, depth=1,
                                 num_heads=2)
        assert all(block.attn.prior.max_freq == 0.4 for block in model.image_blocks)
    model = SpatialVQAFusion('goat', vocab_size=12, patch_dim=6, grid_size=(8, 8), embed_dim=32, depth=1,
                             num_heads=2, goat_kwargs=dict(max_freq=0.25))
    assert model.image_blocks[0].attn.prior.max_freq == 0.25
    default_1d = SpatialVQAFusion('goat', vocab_size=12, patch_dim=6, grid_size=(8, 8), embed_dim=32, depth=1,
                                  num_heads=2)
    decoder_priors = [m for m in default_1d.decoder_blocks.modules() if hasattr(m, 'max_freq')]
    assert decoder_priors and all(p.max_freq == 1.0 for p in decoder_priors)
