"""vision_priors.recipes.data.vqa_scenes: scan orders, questions and answers, scene rendering and tokens, build_sets."""
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from vision_priors.recipes.data import vqa_scenes as vqa
from vision_priors.recipes.data.image_pools import ImagePool
from vision_priors.recipes.engine import PerSampleSeeds
from vision_priors.layers import grid_coords


def solid_pool(num_classes: int = 4, per_class: int = 2) -> ImagePool:
    """Images whose class is their colour: channel c = 40 * (class + 1), so a scene's pixels reveal its layout."""
    labels = np.repeat(np.arange(num_classes), per_class)
    images = np.zeros((len(labels), 32, 32, 3), dtype=np.uint8)
    images[...] = (40 * (labels + 1)).astype(np.uint8)[:, None, None, None]
    names = [f'c{k}' for k in range(num_classes)]
    return ImagePool(images, labels, names, np.arange(len(labels)), 'solid')


# ------------------------------------------------------------------------------------- scan orders

def test_scan_orders_are_distinct_permutations_and_default_split_is_disjoint():
    for grid in ((8, 8), (4, 4)):
        perms = {name: vqa.scan_order(name, grid) for name in vqa.ORDER_NAMES}
        for name, perm in perms.items():
            assert sorted(perm.tolist()) == list(range(grid[0] * grid[1])), name
        assert len({tuple(p.tolist()) for p in perms.values()}) == len(perms)  # all orders differ
    assert len(vqa.ORDER_NAMES) >= 8
    assert not set(vqa.DEFAULT_TRAIN_ORDERS) & set(vqa.DEFAULT_TEST_ORDERS)
    # the training orders keep every image in one span (TL, TR, BL, BR); row-major interleaves them
    quadrant_of = lambda idx: (idx // 8 >= 4) * 2 + (idx % 8 >= 4)  # noqa: E731
    for name in vqa.DEFAULT_TRAIN_ORDERS:
        spans = quadrant_of(vqa.scan_order(name, (8, 8))).reshape(4, 16)
        assert (spans == np.arange(4)[:, None]).all(), name
    assert quadrant_of(vqa.scan_order('row_major', (8, 8)))[:8].tolist() == [0] * 4 + [1] * 4
    hilbert = vqa.scan_order('hilbert', (8, 8))
    steps = np.abs(np.diff(hilbert // 8)) + np.abs(np.diff(hilbert % 8))
    assert (steps == 1).all()  # a Hilbert curve moves to a neighbouring patch at every step


def test_scene_coordinates_are_canonical_whatever_the_scan_order():
    pool = solid_pool(5, 3)
    vocab = vqa.Vocabulary(pool.class_names)
    a = vqa.SceneQuestions(pool, 6, seed=3, orders=['row_major'], patch_size=8, vocab=vocab, train=False)
    b = vqa.SceneQuestions(pool, 6, seed=3, orders=['hilbert'], patch_size=8, vocab=vocab, train=False)
    grid = grid_coords((8, 8))
    for i in range(6):
        x, y = a[i], b[i]
        assert not torch.equal(x['coords'], y['coords']) and not torch.equal(x['patches'], y['patches'])
        for item, name in ((x, 'row_major'), (y, 'hilbert')):
            perm = torch.from_numpy(vqa.scan_order(name, (8, 8)))
            torch.testing.assert_close(item['coords'], grid[perm], rtol=0, atol=0)
            # patch k of the sequence is the scene patch at its coordinate (x = column, y = row)
            scene = vqa.scene_patches(
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
    vocab = vqa.Vocabulary(pool.class_names)
    train = vqa.SceneQuestions(pool, 24, seed=0, orders=vqa.DEFAULT_TRAIN_ORDERS, patch_size=16, vocab=vocab,
                               train=True)
    grid = grid_coords((4, 4))
    sequences = {name: grid[torch.from_numpy(vqa.scan_order(name, (4, 4)))] for name in vqa.ORDER_NAMES}
    wrapped = PerSampleSeeds(train, seed=1)
    loader = DataLoader(wrapped, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    used = []
    for epoch in range(3):
        wrapped.set_epoch(epoch)
        for batch in loader:
            for coords, order in zip(batch['coords'], batch['order']):
                # identify the order from the coordinates themselves, not from the label
                matches = [n for n, seq in sequences.items() if torch.equal(seq, coords)]
                assert matches == [vqa.ORDER_NAMES[int(order)]]
                used.append(matches[0])
    assert set(used) == set(vqa.DEFAULT_TRAIN_ORDERS)  # every training order is used ...
    assert not set(used) & set(vqa.DEFAULT_TEST_ORDERS)  # ... and no held-out one
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
        assert vqa.answer_question(qtype, args, layout) == expected, (qtype, args)
    with pytest.raises(ValueError, match='same column'):
        vqa.answer_question('left', ['cat', 'ship'], layout)
    with pytest.raises(ValueError, match='same row'):
        vqa.answer_question('above', ['cat', 'dog'], layout)


def test_dataset_answers_match_the_rendered_pixels():
    """Decode every question of real dataset items and answer it from the scene's pixels (colour = class)."""
    pool = solid_pool(6, 2)
    vocab = vqa.Vocabulary(pool.class_names)
    data = vqa.SceneQuestions(pool, 40, seed=5, orders=['spiral'], patch_size=8, vocab=vocab, train=False)
    answers_seen = {t: set() for t in vqa.QUESTION_TYPES}
    for i in range(len(data)):
        item = data[i]
        scene = data.render(data.layout(i)[1])
        quadrant_class = [f'c{scene[r, c, 0] // 40 - 1}' for r, c in ((0, 0), (0, 32), (32, 0), (32, 32))]
        assert len(set(quadrant_class)) == 4
        centre = {name: ((q % 2) * 32 + 16, (q // 2) * 32 + 16) for q, name in enumerate(quadrant_class)}
        for k, (tokens, answer) in enumerate(zip(item['text'].tolist(), item['answers'].tolist())):
            words = [vocab.tokens[t] for t in tokens]
            assert words[0] == vqa.QUESTION_TYPES[k]
            if words[0] == 'what':
                q = vqa.QUADRANTS.index(words[1])
                expected = quadrant_class[q]
            elif words[0] == 'where':
                expected = vqa.QUADRANTS[quadrant_class.index(words[1])]
            else:
                axis = 0 if words[0] == 'left' else 1
                a, b = centre[words[1]][axis], centre[words[2]][axis]
                assert a != b  # only pairs that differ along the asked axis
                expected = 'yes' if a < b else 'no'
            assert vocab.tokens[answer] == expected, (i, words)
            answers_seen[words[0]].add(expected)
    assert answers_seen['left'] == answers_seen['above'] == {'yes', 'no'}
    assert len(answers_seen['where']) == 4 and len(answers_seen['what']) > 4


# ----------------------------------------------------------------------------------------- checks

def test_scene_checks():
    pool = solid_pool(5, 1)
    vocab = vqa.Vocabulary(pool.class_names)
    for p in (0, 3, 32):
        with pytest.raises(ValueError, match=f'patch size {p} must divide the 32-pixel images'):
            vqa.check_patch_size(p)
    with pytest.raises(ValueError, match='need at least one scene, got 0'):
        vqa.SceneQuestions(pool, 0, seed=0, orders=['snake'], patch_size=8, vocab=vocab, train=False)
    with pytest.raises(ValueError, match=r'solid has images of 3 classes; a scene needs 4 distinct classes'):
        vqa.SceneQuestions(solid_pool(3, 2), 4, seed=0, orders=['snake'], patch_size=8, vocab=vocab, train=False)
    with pytest.raises(ValueError, match=r"collide with the question words"):
        vqa.Vocabulary(['cat', 'yes'])
    with pytest.raises(ValueError, match=r"unknown scan order 'zigzag'"):
        vqa.scan_order('zigzag', (4, 4))
    with pytest.raises(ValueError, match=r'even patch grid .* got 3x4'):
        vqa.scan_order('snake', (3, 4))
    with pytest.raises(ValueError, match=r'hilbert order needs a square power-of-two patch grid'):
        vqa.scan_order('hilbert', (6, 6))
    with pytest.raises(ValueError, match=r"\['snake'\] are both training and held-out orders"):
        vqa.check_orders(['quad_row', 'snake'], ['snake'], (4, 4))
    with pytest.raises(ValueError, match='need at least one training and one held-out scan order'):
        vqa.check_orders([], ['snake'], (4, 4))


def test_build_sets_from_a_data_config():
    cfg = dict(data=None, data_seed=3, npz_test_fraction=0.2, synthetic_per_class=[3, 2], train_scenes=10,
               val_scenes=5, test_scenes=6, patch_size=16, train_orders=['quad_row', 'quad_col'],
               test_orders=['snake', 'hilbert'], flip=True)
    sets, vocab = vqa.build_sets(cfg, ['train', 'seen', 'unseen'])
    assert set(sets) == {'train', 'seen', 'unseen'} and len(sets['train']) == 10 and len(sets['unseen']) == 6
    assert sets['train'].train and sets['train'].flip and not sets['seen'].train
    assert sets['train'].pool.source == 'builtin:train' and sets['seen'].pool.source == 'builtin:test'
    assert vocab.class_names == sets['seen'].pool.class_names
    seen, unseen = sets['seen'][4], sets['unseen'][4]
    # the same test scene and questions in a seen and an unseen order (a paired comparison)
    assert torch.equal(seen['text'], unseen['text']) and torch.equal(seen['answers'], unseen['answers'])
    assert vqa.ORDER_NAMES[int(seen['order'])] == 'quad_row' and vqa.ORDER_NAMES[int(unseen['order'])] == 'snake'
    assert seen['patches'].shape == (16, 16 * 16 * 3)
    only, _ = vqa.build_sets(cfg, ['unseen'])
    assert set(only) == {'unseen'}
    with pytest.raises(ValueError, match='patch size 12 must divide'):
        vqa.build_sets({**cfg, 'patch_size': 12}, ['train'])
    val, _ = vqa.build_sets(cfg, ['val'])
    # validation: the train pool in another layout stream, the training orders, fixed episodes
    assert len(val['val']) == 5 and val['val'].pool.source == 'builtin:train' and not val['val'].train
    assert val['val'].orders == cfg['train_orders'] and val['val'].seed not in (sets['train'].seed, sets['seen'].seed)
    with pytest.raises(ValueError, match=r"unknown scene sets \['test'\]; build_sets makes train, val, seen, unseen"):
        vqa.build_sets(cfg, ['train', 'test'])
