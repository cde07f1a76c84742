"""Spatial VQA recipe (GOAT Tables 9-10 protocol): scenes, scan orders, readers, model invariances, CLI end to end."""
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from recipes import spatial_vqa as recipe
from recipes.engine import PerSampleSeeds
from vision_priors.layers import grid_coords
from vision_priors.models import SpatialVQATransformer, vqa_attention_mask, vqa_text_coords

SHARED_DATA = Path(__file__).resolve().parents[2] / 'shared' / 'data'
CIFAR_NPZ = SHARED_DATA / 'cifar10' / 'cifar10_test_10k_jpeg.npz'
TINY = ['--embed-dim', '32', '--depth', '1', '--num-heads', '2', '--patch-size', '16',
        '--synthetic-per-class', '6', '3',
        '--train-scenes', '32', '--test-scenes', '8', '--batch-size', '8', '--cpu', '--threads', '1']


def solid_pool(num_classes: int = 4, per_class: int = 2) -> recipe.ImagePool:
    """Images whose class is their colour: channel c = 40 * (class + 1), so a scene's pixels reveal its layout."""
    labels = np.repeat(np.arange(num_classes), per_class)
    images = np.zeros((len(labels), 32, 32, 3), dtype=np.uint8)
    images[...] = (40 * (labels + 1)).astype(np.uint8)[:, None, None, None]
    names = [f'c{k}' for k in range(num_classes)]
    return recipe.ImagePool(images, labels, names, np.arange(len(labels)), 'solid')


# ------------------------------------------------------------------------------------- scan orders

def test_scan_orders_are_distinct_permutations_and_default_split_is_disjoint():
    for grid in ((8, 8), (4, 4)):
        perms = {name: recipe.scan_order(name, grid) for name in recipe.ORDER_NAMES}
        for name, perm in perms.items():
            assert sorted(perm.tolist()) == list(range(grid[0] * grid[1])), name
        assert len({tuple(p.tolist()) for p in perms.values()}) == len(perms)  # all orders differ
    assert len(recipe.ORDER_NAMES) >= 8
    assert not set(recipe.DEFAULT_TRAIN_ORDERS) & set(recipe.DEFAULT_TEST_ORDERS)
    # the training orders keep every image in one span (TL, TR, BL, BR); row-major interleaves them
    quadrant_of = lambda idx: (idx // 8 >= 4) * 2 + (idx % 8 >= 4)  # noqa: E731
    for name in recipe.DEFAULT_TRAIN_ORDERS:
        spans = quadrant_of(recipe.scan_order(name, (8, 8))).reshape(4, 16)
        assert (spans == np.arange(4)[:, None]).all(), name
    assert quadrant_of(recipe.scan_order('row_major', (8, 8)))[:8].tolist() == [0] * 4 + [1] * 4
    hilbert = recipe.scan_order('hilbert', (8, 8))
    steps = np.abs(np.diff(hilbert // 8)) + np.abs(np.diff(hilbert % 8))
    assert (steps == 1).all()  # a Hilbert curve moves to a neighbouring patch at every step


def test_scene_coordinates_are_canonical_whatever_the_scan_order():
    pool = solid_pool(5, 3)
    vocab = recipe.Vocabulary(pool.class_names)
    a = recipe.SceneQuestions(pool, 6, seed=3, orders=['row_major'], patch_size=8, vocab=vocab, train=False)
    b = recipe.SceneQuestions(pool, 6, seed=3, orders=['hilbert'], patch_size=8, vocab=vocab, train=False)
    grid = grid_coords((8, 8))
    for i in range(6):
        x, y = a[i], b[i]
        assert not torch.equal(x['coords'], y['coords']) and not torch.equal(x['patches'], y['patches'])
        for item, name in ((x, 'row_major'), (y, 'hilbert')):
            perm = torch.from_numpy(recipe.scan_order(name, (8, 8)))
            torch.testing.assert_close(item['coords'], grid[perm], rtol=0, atol=0)
            # patch k of the sequence is the scene patch at its coordinate (x = column, y = row)
            scene = recipe.scene_patches(
                (a.render(a.layout(i)[1]).astype(np.float32) - a.mean) / a.std, 8)
            rowmajor = (item['coords'][:, 1] * 8 + item['coords'][:, 0]).long()
            torch.testing.assert_close(item['patches'], torch.from_numpy(scene)[rowmajor], rtol=0, atol=0)
        # same scene, same questions; sorting by coordinate gives identical tokens
        assert torch.equal(x['text'], y['text']) and torch.equal(x['answers'], y['answers'])
        key_x = (x['coords'][:, 1] * 8 + x['coords'][:, 0]).argsort()
        key_y = (y['coords'][:, 1] * 8 + y['coords'][:, 0]).argsort()
        assert torch.equal(x['patches'][key_x], y['patches'][key_y])
        assert torch.equal(x['coords'][key_x], y['coords'][key_y])


def test_held_out_orders_never_appear_in_training_batches():
    pool = solid_pool(6, 2)
    vocab = recipe.Vocabulary(pool.class_names)
    train = recipe.SceneQuestions(pool, 24, seed=0, orders=recipe.DEFAULT_TRAIN_ORDERS, patch_size=16, vocab=vocab,
                                  train=True)
    grid = grid_coords((4, 4))
    sequences = {name: grid[torch.from_numpy(recipe.scan_order(name, (4, 4)))] for name in recipe.ORDER_NAMES}
    wrapped = PerSampleSeeds(train, seed=1)
    loader = DataLoader(wrapped, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    used = []
    for epoch in range(3):
        wrapped.set_epoch(epoch)
        for batch in loader:
            for coords, order in zip(batch['coords'], batch['order']):
                # identify the order from the coordinates themselves, not from the label
                matches = [n for n, seq in sequences.items() if torch.equal(seq, coords)]
                assert matches == [recipe.ORDER_NAMES[int(order)]]
                used.append(matches[0])
    assert set(used) == set(recipe.DEFAULT_TRAIN_ORDERS)  # every training order is used ...
    assert not set(used) & set(recipe.DEFAULT_TEST_ORDERS)  # ... and no held-out one
    # per-sample seeding: the same (seed, epoch, index) gives the same episode
    wrapped.set_epoch(1)
    assert torch.equal(wrapped[5]['coords'], wrapped[5]['coords'])
    assert torch.equal(wrapped[5]['text'], wrapped[5]['text'])


# ---------------------------------------------------------------------------------------- questions

def test_answers_on_hand_built_scene():
    layout = ['cat', 'dog', 'ship', 'frog']  # TL, TR, BL, BR
    cases = [('what', ['bottom-left'], 'ship'), ('what', ['top-right'], 'dog'), ('where', ['frog'], 'bottom-right'),
             ('where', ['cat'], 'top-left'), ('left', ['cat', 'dog'], 'yes'), ('left', ['dog', 'cat'], 'no'),
             ('left', ['ship', 'dog'], 'yes'), ('left', ['frog', 'cat'], 'no'), ('above', ['cat', 'ship'], 'yes'),
             ('above', ['frog', 'dog'], 'no'), ('above', ['dog', 'ship'], 'yes')]
    for qtype, args, expected in cases:
        assert recipe.answer_question(qtype, args, layout) == expected, (qtype, args)
    with pytest.raises(ValueError, match='same column'):
        recipe.answer_question('left', ['cat', 'ship'], layout)
    with pytest.raises(ValueError, match='same row'):
        recipe.answer_question('above', ['cat', 'dog'], layout)


def test_dataset_answers_match_the_rendered_pixels():
    """Decode every question of real dataset items and answer it from the scene's pixels (colour = class)."""
    pool = solid_pool(6, 2)
    vocab = recipe.Vocabulary(pool.class_names)
    data = recipe.SceneQuestions(pool, 40, seed=5, orders=['spiral'], patch_size=8, vocab=vocab, train=False)
    answers_seen = {t: set() for t in recipe.QUESTION_TYPES}
    for i in range(len(data)):
        item = data[i]
        scene = data.render(data.layout(i)[1])
        quadrant_class = [f'c{scene[r, c, 0] // 40 - 1}' for r, c in ((0, 0), (0, 32), (32, 0), (32, 32))]
        assert len(set(quadrant_class)) == 4
        centre = {name: ((q % 2) * 32 + 16, (q // 2) * 32 + 16) for q, name in enumerate(quadrant_class)}
        for k, (tokens, answer) in enumerate(zip(item['text'].tolist(), item['answers'].tolist())):
            words = [vocab.tokens[t] for t in tokens]
            assert words[0] == recipe.QUESTION_TYPES[k]
            if words[0] == 'what':
                q = recipe.QUADRANTS.index(words[1])
                expected = quadrant_class[q]
            elif words[0] == 'where':
                expected = recipe.QUADRANTS[quadrant_class.index(words[1])]
            else:
                axis = 0 if words[0] == 'left' else 1
                a, b = centre[words[1]][axis], centre[words[2]][axis]
                assert a != b  # only pairs that differ along the asked axis
                expected = 'yes' if a < b else 'no'
            assert vocab.tokens[answer] == expected, (i, words)
            answers_seen[words[0]].add(expected)
    assert answers_seen['left'] == answers_seen['above'] == {'yes', 'no'}
    assert len(answers_seen['where']) == 4 and len(answers_seen['what']) > 4


# ------------------------------------------------------------------------------------------ readers

def _write_cifar_folder(folder: Path, per_batch: int = 3) -> np.ndarray:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    all_images = []
    for name in list(recipe.CIFAR_TRAIN_FILES) + [recipe.CIFAR_TEST_FILE]:
        images = rng.integers(0, 256, size=(per_batch, 32, 32, 3), dtype=np.uint8)
        all_images.append(images)
        data = images.transpose(0, 3, 1, 2).reshape(per_batch, 3072)  # channel-major, as CIFAR stores it
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        batch = {b'data': data, b'labels': labels, b'batch_label': name.encode()}
        with (folder / name).open('wb') as f:
            pickle.dump(batch, f)
    with (folder / recipe.CIFAR_META_FILE).open('wb') as f:
        pickle.dump({b'label_names': [n.encode() for n in ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog',
                                                            'frog', 'horse', 'ship', 'truck')]}, f)
    return np.concatenate(all_images)


def test_cifar_batch_reader(tmp_path):
    root = tmp_path / 'cifar'
    images = _write_cifar_folder(root / 'cifar-10-batches-py')
    train = recipe.read_cifar_batches(root, 'train')  # finds the nested cifar-10-batches-py folder
    test = recipe.read_cifar_batches(root / 'cifar-10-batches-py', 'test')
    assert train.images.shape == (15, 32, 32, 3) and test.images.shape == (3, 32, 32, 3)
    assert np.array_equal(train.images, images[:15]) and np.array_equal(test.images, images[15:])
    assert train.class_names[3] == 'cat' and train.labels.dtype == np.int64 and len(train.labels) == 15
    (root / 'cifar-10-batches-py' / 'data_batch_4').unlink()
    with pytest.raises(FileNotFoundError, match=r"cifar-10-batches-py has no file 'data_batch_4'"):
        recipe.read_cifar_batches(root, 'train')
    assert len(recipe.read_cifar_batches(root, 'test').labels) == 3  # the test split does not need it
    with (root / 'cifar-10-batches-py' / 'test_batch').open('wb') as f:
        pickle.dump({b'labels': [0]}, f)
    with pytest.raises(ValueError, match=r"test_batch is not a CIFAR-10 batch: expected b'data'"):
        recipe.read_cifar_batches(root, 'test')
    with pytest.raises(FileNotFoundError, match=r"empty has no file 'batches.meta'"):
        (tmp_path / 'empty').mkdir()
        recipe.read_cifar_batches(tmp_path / 'empty', 'test')


def test_npz_reader_and_disjoint_deterministic_split(tmp_path):
    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(5), 10)
    images = rng.integers(0, 256, size=(50, 32, 32, 3), dtype=np.uint8)
    path = tmp_path / 'subset.npz'
    np.savez(path, images=images, labels=labels, class_names=np.array([f'k{i}' for i in range(5)]))
    train, test = recipe.read_npz_pools(path, 0.2, seed=3)
    assert not set(train.indices) & set(test.indices)
    assert sorted(np.concatenate([train.indices, test.indices]).tolist()) == list(range(50))
    assert np.bincount(test.labels).tolist() == [2] * 5 and np.bincount(train.labels).tolist() == [8] * 5
    assert np.array_equal(test.images, images[test.indices]) and np.array_equal(train.labels, labels[train.indices])
    assert test.class_names == [f'k{i}' for i in range(5)]
    again, _ = recipe.read_npz_pools(path, 0.2, seed=3)
    other, _ = recipe.read_npz_pools(path, 0.2, seed=4)
    assert np.array_equal(again.indices, train.indices) and not np.array_equal(other.indices, train.indices)
    np.savez(tmp_path / 'bad.npz', images=images)
    with pytest.raises(ValueError, match=r"bad.npz has no 'labels' array"):
        recipe.read_npz_pools(tmp_path / 'bad.npz', 0.2, 0)
    with pytest.raises(FileNotFoundError, match=r'missing.npz does not exist'):
        recipe.read_npz_pools(tmp_path / 'missing.npz', 0.2, 0)


def test_builtin_pools_are_deterministic_disjoint_and_learnable_by_colour():
    train, test = recipe.synthetic_pools(4, 2, seed=7)
    again, _ = recipe.synthetic_pools(4, 2, seed=7)
    other, _ = recipe.synthetic_pools(4, 2, seed=8)
    assert np.array_equal(train.images, again.images) and not np.array_equal(train.images, other.images)
    assert train.images.shape == (40, 32, 32, 3) and test.images.shape == (20, 32, 32, 3)
    assert not any((test.images[i] == train.images).all(axis=(1, 2, 3)).any() for i in range(20))
    # nearest class-mean colour classifies the test pool: the classes can be told apart
    means = np.stack([train.images[train.labels == c].reshape(-1, 3).mean(0) for c in range(10)])
    pred = np.linalg.norm(test.images.reshape(20, -1, 3).mean(1)[:, None] - means[None], axis=-1).argmin(1)
    assert (pred == test.labels).mean() >= 0.9


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
    perms = torch.stack([torch.from_numpy(recipe.scan_order(o, (4, 4))) for o in orders])
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
    perm = torch.from_numpy(recipe.scan_order('hilbert', (4, 4)))
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
    with pytest.raises(ValueError, match='--threads must be >= 0'):
        recipe.main(['train', '--out', str(tmp_path / 'r'), *TINY, '--threads', '-1'])
    assert torch.get_num_threads() == threads
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
    with pytest.raises(ValueError, match='--prior-lr-scale must be > 0'):
        recipe.make_optimizer(rope, argparse.Namespace(**{**vars(args), 'prior_lr_scale': 0.0}))


def test_train_resume_eval_compare_end_to_end(tmp_path):
    common = ['train', '--method', 'goat', *TINY, '--updates', '6', '--checkpoint-every', '2', '--seed', '2']
    full, killed = tmp_path / 'full', tmp_path / 'killed'
    recipe.main([*common, '--out', str(full)])
    recipe.main([*common, '--out', str(killed), '--stop-after', '3'])
    assert json.loads((killed / 'latest.json').read_text())['step'] == 3
    with pytest.raises(FileExistsError, match='--resume'):
        recipe.main([*common, '--out', str(killed)])
    recipe.main([*common, '--out', str(killed), '--resume'])
    a = load_file(str(recipe.latest_checkpoint(full) / 'model.safetensors'))
    b = load_file(str(recipe.latest_checkpoint(killed) / 'model.safetensors'))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    config = json.loads((full / 'config.json').read_text())
    assert config['data']['train_orders'] == recipe.DEFAULT_TRAIN_ORDERS and config['model']['pos_method'] == 'goat'
    log = [json.loads(line) for line in (full / 'log.jsonl').read_text().splitlines()]
    assert log[0]['event'] == 'start' and any(r['event'] == 'train' for r in log)

    out = tmp_path / 'eval'
    threads = torch.get_num_threads()
    payload = recipe.main(['eval', str(full), '--out', str(out), '--batch-size', '4', '--cpu', '--threads', '1'])
    assert torch.get_num_threads() == threads  # --threads is scoped to the command
    row = json.loads((out / 'results.json').read_text())['rows'][0]
    for split in ('seen', 'unseen'):
        assert row[split]['n'] == 8 * 4 and 0 <= row[split]['acc'] <= 1 and row[split]['nll'] > 0
        assert set(row[split]['by_type']) == set(recipe.QUESTION_TYPES)
    assert set(row['seen']['by_order']) == set(recipe.DEFAULT_TRAIN_ORDERS)
    assert set(row['unseen']['by_order']) == set(recipe.DEFAULT_TEST_ORDERS)
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
def test_real_cifar_subset_pools_and_scenes():
    train, test = recipe.read_npz_pools(CIFAR_NPZ, 0.2, seed=0)
    assert len(train.labels) == 8000 and len(test.labels) == 2000
    assert not set(train.indices) & set(test.indices)
    assert np.bincount(test.labels).tolist() == [200] * 10
    assert 'cat' in train.class_names and train.images.dtype == np.uint8
    vocab = recipe.Vocabulary(train.class_names)
    data = recipe.SceneQuestions(test, 4, seed=1, orders=recipe.DEFAULT_TEST_ORDERS, patch_size=8, vocab=vocab,
                                 train=False)
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ('patches', 'coords', 'text')}
    assert batch['patches'].shape == (4, 64, 192) and abs(float(batch['patches'].mean())) < 1.0
    model = SpatialVQATransformer('pope', vocab_size=len(vocab), patch_dim=192, embed_dim=32, depth=1, num_heads=2)
    assert model(batch['patches'], batch['coords'], batch['text']).shape == (4, 4, len(vocab))


@pytest.mark.parametrize('init', ['zero', 'random', 'alibi'])
def test_goat_prior_init_flag_reaches_every_goat_layer(init):
    args = recipe.build_parser().parse_args(['train', '--method', 'goat', '--goat-prior-init', init] + TINY)
    model = recipe.build_model(recipe.model_config(args, 'goat', vocab_size=8))
    priors = [m for m in model.modules() if type(m).__name__ == 'GoatPrior']
    assert priors and all(p.prior_init == init for p in priors)
    # zero init: a flat (uniform) prior; random / alibi: logits that depend on the key's position
    with torch.no_grad():
        logits = priors[0].prior_logits(grid_coords((3, 3)))
    spread = (logits.amax(-1) - logits.amin(-1)).max().item()
    assert spread == pytest.approx(0.0, abs=1e-6) if init == 'zero' else spread > 1e-3
