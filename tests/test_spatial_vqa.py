"""Spatial VQA recipe (GOAT Tables 9-10 protocol): model invariances, optimiser groups, CLI end to end.

The data (pools, scenes, scan orders, questions) is tested in tests/test_data_image_pools.py and
tests/test_data_vqa_scenes.py.
"""
import json
from pathlib import Path

import pytest
import torch

from run_helpers import final_weights
from vision_priors.recipes import spatial_vqa as recipe
from vision_priors.recipes.data.image_pools import read_npz_pools
from vision_priors.recipes.data.vqa_scenes import (DEFAULT_TEST_ORDERS, DEFAULT_TRAIN_ORDERS, QUESTION_TYPES,
                                                   SceneQuestions, Vocabulary, scan_order)
from vision_priors.layers import grid_coords
from vision_priors.models import SpatialVQATransformer, vqa_attention_mask, vqa_text_coords

SHARED_DATA = Path(__file__).resolve().parents[2] / 'shared' / 'data'
CIFAR_NPZ = SHARED_DATA / 'cifar10' / 'cifar10_test_10k_jpeg.npz'
TINY = ['--embed-dim', '32', '--depth', '1', '--num-heads', '2', '--patch-size', '16',
        '--synthetic-per-class', '6', '3',
        '--train-scenes', '32', '--test-scenes', '8', '--batch-size', '8', '--cpu', '--threads', '1']


# ------------------------------------------------------------------------------------------- model

def _tokens(method: str, image_attention: str = 'prefix', seed: int = 0):
    torch.manual_seed(seed)
    goat_kwargs = dict(prior_init='random', init_seed=seed)
    model = SpatialVQATransformer(method, vocab_size=12, patch_dim=6, grid_size=(4, 4), embed_dim=48, depth=2,
                                  num_heads=2, image_attention=image_attention, goat_kwargs=goat_kwargs).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'phase_bias' in name:
                p.normal_(0, 2)  # a non-trivial PoPE phase bias
    g = torch.Generator().manual_seed(seed)
    content = torch.randn(2, 16, 6, generator=g, dtype=torch.float64)  # row-major patches
    coords = grid_coords((4, 4), dtype=torch.float64)
    text = torch.randint(0, 12, (2, 3, 3), generator=g)
    return model, content, coords, text


def _run(model, content, coords, text, orders):
    perms = torch.stack([torch.from_numpy(scan_order(o, (4, 4))) for o in orders])
    patches = torch.stack([content[b, perms[b]] for b in range(len(orders))])
    return model(patches, coords[perms], text)


@pytest.mark.parametrize('method', ['goat', 'pope', 'nope', 'rope'])
def test_scan_order_invariance_holds_for_canonical_coordinates_only(method):
    """Prefix mask + canonical coordinates: goat / pope outputs at the question tokens ignore the scan order.

    nope is invariant too (it sees an unordered set of patches: blind to position, see below); rope is
    not (its positions are sequence indices).
    """
    model, content, coords, text = _tokens(method)
    ref = _run(model, content, coords, text, ['quad_row', 'quad_col'])
    for orders in (['row_major', 'hilbert'], ['spiral', 'reverse'], ['quad_blocks_col', 'diagonal']):
        out = _run(model, content, coords, text, orders)
        if method == 'rope':
            assert (out - ref).abs().max() > 1e-4, orders
        else:
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    # moving the content without its coordinates (a different scene) changes the answer for the
    # position-aware methods, never for nope: its invariance is blindness, not geometry
    perm = torch.from_numpy(scan_order('hilbert', (4, 4)))
    base = grid_coords((4, 4), dtype=torch.float64)[None].expand(2, -1, -1)
    moved = model(content[:, perm], base, text)
    same = model(content, base, text)
    if method == 'nope':
        torch.testing.assert_close(moved, same, rtol=0, atol=1e-10)
    else:
        assert (moved - same).abs().max() > 1e-4


def test_causal_image_attention_breaks_the_invariance():
    model, content, coords, text = _tokens('goat', image_attention='causal')
    a = _run(model, content, coords, text, ['row_major', 'row_major'])
    b = _run(model, content, coords, text, ['hilbert', 'spiral'])
    assert (a - b).abs().max() > 1e-4


def test_mask_and_text_coordinates():
    mask = vqa_attention_mask(4, 2, 3)
    assert mask[:4, :4].all() and not mask[:4, 4:].any() and mask[4:, :4].all()
    assert mask[4:7, 4:7].tolist() == torch.ones(3, 3, dtype=torch.bool).tril().tolist()
    assert not mask[4:7, 7:].any() and not mask[7:, 4:7].any()  # questions never see each other
    assert vqa_attention_mask(4, 1, 2, 'causal')[:4, :4].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
    coords = vqa_text_coords(2, 3, (8, 8))
    assert coords.tolist() == [[8, 8], [9, 9], [10, 10]] * 2
    with pytest.raises(ValueError, match="image_attention must be one of"):
        vqa_attention_mask(4, 1, 2, 'full')


def test_model_errors():
    with pytest.raises(ValueError, match="pos_method must be one of .* got 'alibi'"):
        SpatialVQATransformer('alibi', vocab_size=5, patch_dim=4)
    model = SpatialVQATransformer('goat', vocab_size=5, patch_dim=4, grid_size=(2, 2), embed_dim=32, num_heads=2,
                                  depth=1)
    with pytest.raises(ValueError, match=r'patches have shape \(1, 3, 4\), expected \(B, 4, 4\)'):
        model(torch.zeros(1, 3, 4), torch.zeros(1, 3, 2), torch.zeros(1, 1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r'coords have shape \(2, 4, 2\), expected \(1, 4, 2\)'):
        model(torch.zeros(1, 4, 4), torch.zeros(2, 4, 2), torch.zeros(1, 1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r'text has shape \(1, 2\), expected \(1, Q, 3\)'):
        model(torch.zeros(1, 4, 4), torch.zeros(1, 4, 2), torch.zeros(1, 2, dtype=torch.long))


# ------------------------------------------------------------------------------------------ recipe

def test_recipe_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r'--data .*nowhere does not exist'):
        recipe.main(['train', '--data', str(tmp_path / 'nowhere'), '--out', str(tmp_path / 'r'), *TINY])
    (tmp_path / 'partial').mkdir()
    with pytest.raises(FileNotFoundError, match=r"partial has no file 'batches.meta'"):
        recipe.main(['train', '--data', str(tmp_path / 'partial'), '--out', str(tmp_path / 'r'), *TINY])
    with pytest.raises(ValueError, match=r"\['snake'\] are both training and held-out orders"):
        recipe.main(['train', '--train-orders', 'quad_row', 'snake', '--test-orders', 'snake', '--out',
                     str(tmp_path / 'r'), *TINY])
    with pytest.raises(ValueError, match='patch size 12 must divide'):
        recipe.main(['train', '--out', str(tmp_path / 'r'), *TINY, '--patch-size', '12'])
    with pytest.raises(FileNotFoundError, match='no config.json'):
        recipe.main(['eval', str(tmp_path), '--out', str(tmp_path / 'e'), '--cpu'])
    threads = torch.get_num_threads()
    with pytest.raises(FileNotFoundError, match=r'--data .*nowhere does not exist'):  # TINY sets --threads 1
        recipe.main(['train', '--data', str(tmp_path / 'nowhere'), '--out', str(tmp_path / 'r'), *TINY])
    assert torch.get_num_threads() == threads  # restored after the failed command
    assert not (tmp_path / 'r').exists()  # no error above wrote anything
    with pytest.raises(SystemExit):
        recipe.main(['train', '--method', 'alibi'])


def test_prior_lr_scale_puts_positional_parameters_in_a_scaled_group():
    import argparse
    from timm.scheduler import create_scheduler_v2
    args = argparse.Namespace(prior_lr_scale=10.0, opt='adamw', lr=1e-3, weight_decay=0.05)
    small = dict(vocab_size=8, patch_dim=12, grid_size=(2, 2), embed_dim=32, num_heads=2)
    goat = SpatialVQATransformer('goat', depth=2, **small)
    optimizer = recipe.make_optimizer(goat, args)
    prior = [g for g in optimizer.param_groups if 'lr_scale' in g]
    assert len(prior) == 1 and prior[0]['weight_decay'] == 0.0
    names = {id(p): n for n, p in goat.named_parameters()}
    assert {names[id(p)] for p in prior[0]['params']} == goat.no_weight_decay()
    assert any(n.endswith('prior.alpha') for n in goat.no_weight_decay())
    assert sum(len(g['params']) for g in optimizer.param_groups) == len(list(goat.parameters()))
    scheduler, _ = create_scheduler_v2(optimizer, sched='cosine', num_epochs=10, step_on_epochs=False,
                                       updates_per_epoch=1)
    scheduler.step_update(3)
    lrs = {('prior' if 'lr_scale' in g else 'other'): g['lr'] for g in optimizer.param_groups}
    assert lrs['prior'] == pytest.approx(10 * lrs['other'])
    rope = SpatialVQATransformer('rope', depth=1, **small)
    assert not any('lr_scale' in g for g in recipe.make_optimizer(rope, args).param_groups)  # nothing to scale
    with pytest.raises(SystemExit):  # checked at parse time
        recipe.main(['train', '--prior-lr-scale', '0'])


def test_train_resume_eval_compare_end_to_end(tmp_path):
    common = ['train', '--method', 'goat', *TINY, '--updates', '6', '--checkpoint-every', '2', '--seed', '2']
    full, killed = tmp_path / 'full', tmp_path / 'killed'
    recipe.main([*common, '--out', str(full)])
    recipe.main([*common, '--out', str(killed), '--stop-after', '3'])
    assert json.loads((killed / 'latest.json').read_text())['step'] == 3
    with pytest.raises(FileExistsError, match='--resume'):
        recipe.main([*common, '--out', str(killed)])
    recipe.main([*common, '--out', str(killed), '--resume'])
    a, b = final_weights(full), final_weights(killed)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    config = json.loads((full / 'config.json').read_text())
    assert config['data']['train_orders'] == DEFAULT_TRAIN_ORDERS and config['model']['pos_method'] == 'goat'
    log = [json.loads(line) for line in (full / 'log.jsonl').read_text().splitlines()]
    assert log[0]['event'] == 'start' and any(r['event'] == 'train' for r in log)

    out = tmp_path / 'eval'
    threads = torch.get_num_threads()
    payload = recipe.main(['eval', str(full), '--out', str(out), '--batch-size', '4', '--cpu', '--threads', '1'])
    assert torch.get_num_threads() == threads  # --threads is scoped to the command
    row = json.loads((out / 'results.json').read_text())['rows'][0]
    for split in ('seen', 'unseen'):
        assert row[split]['n'] == 8 * 4 and 0 <= row[split]['acc'] <= 1 and row[split]['nll'] > 0
        assert set(row[split]['by_type']) == set(QUESTION_TYPES)
    assert set(row['seen']['by_order']) == set(DEFAULT_TRAIN_ORDERS)
    assert set(row['unseen']['by_order']) == set(DEFAULT_TEST_ORDERS)
    # goat is exactly invariant: the paired seen / unseen evaluation gives the same numbers
    assert row['seen']['acc'] == row['unseen']['acc'] and abs(row['seen']['nll'] - row['unseen']['nll']) < 1e-5
    assert payload['summary']['goat']['seen']['acc']['n'] == 1

    cmp = tmp_path / 'compare'
    recipe.main(['compare', '--methods', 'nope', 'rope', '--seeds', '0', '1', *TINY, '--updates', '2',
                 '--out', str(cmp)])
    results = json.loads((cmp / 'results.json').read_text())
    assert set(results['summary']) == {'nope', 'rope'} and results['seeds'] == [0, 1]
    assert results['config']['methods'] == ['nope', 'rope'] and results['config']['train_scenes'] == 32
    assert all(results['summary'][m][s]['acc']['n'] == 2 for m in ('nope', 'rope') for s in ('seen', 'unseen'))
    assert '| nope |' in results['table_markdown'] and 'unseen acc %' in results['table_markdown']
    assert (cmp / 'spatial_vqa.png').stat().st_size > 5000


@pytest.mark.skipif(not CIFAR_NPZ.exists(), reason=f'{CIFAR_NPZ} not present (../shared/data is absent)')
def test_real_cifar_subset_scenes_feed_the_model():
    train, test = read_npz_pools(CIFAR_NPZ, 0.2, seed=0)  # the pools themselves: tests/test_data_image_pools.py
    vocab = Vocabulary(train.class_names)
    data = SceneQuestions(test, 4, seed=1, orders=DEFAULT_TEST_ORDERS, patch_size=8, vocab=vocab, train=False)
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ('patches', 'coords', 'text')}
    assert batch['patches'].shape == (4, 64, 192) and abs(float(batch['patches'].mean())) < 1.0
    model = SpatialVQATransformer('pope', vocab_size=len(vocab), patch_dim=192, embed_dim=32, depth=1, num_heads=2)
    assert model(batch['patches'], batch['coords'], batch['text']).shape == (4, 4, len(vocab))


@pytest.mark.parametrize('init', ['zero', 'random', 'alibi', 'offsets', None])
def test_goat_prior_init_flag_reaches_every_goat_layer(init):
    flag = ['--goat-prior-init', init] if init else []
    args = recipe.build_parser().parse_args(['train', '--method', 'goat', *flag] + TINY)
    config = recipe.model_config(args, 'goat', vocab_size=8)
    model = recipe.build_model(config)
    init = init or 'offsets'  # the single-stream model's default, stored resolved in the run's config
    assert config['goat_kwargs'] == {'prior_init': init}
    priors = [m for m in model.modules() if type(m).__name__ == 'GoatPrior']
    assert priors and all(p.prior_init == init for p in priors)
    # zero init: a flat (uniform) prior; random / alibi / offsets: logits that depend on the key's position
    with torch.no_grad():
        logits = priors[0].prior_logits(grid_coords((3, 3)))
    spread = (logits.amax(-1) - logits.amin(-1)).max().item()
    assert spread == pytest.approx(0.0, abs=1e-6) if init == 'zero' else spread > 1e-3
