"""Spatial VQA scenes: four distinct-class images on a 2x2 grid as scan-ordered patch tokens + questions.

Reads image pools (``vision_priors.recipes.data.image_pools``); makes ``SceneQuestions`` datasets: a 64x64 scene cut
into p x p patches, laid into the sequence in a *scan order* (``SCAN_ORDERS``) with each patch's
canonical (x, y) coordinate, plus one answer-only question of each type (what / where / left / above)
over a small ``Vocabulary``. ``build_sets`` makes the train / seen / unseen sets from a data config
(the dict ``vision_priors.recipes.spatial_vqa.data_config`` saves in a run's config.json). The protocol is described
in ``recipes/spatial_vqa.py``.
"""
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from vision_priors.layers import grid_coords

from .image_pools import CIFAR_MEAN, CIFAR_STD, IMAGE_SIZE, ImagePool, load_pools

__all__ = ['SCENE_SIZE', 'QUADRANTS', 'QUESTION_TYPES', 'QUESTION_LEN', 'FILLER', 'ANSWER_WORDS',
           'POSITION_BLIND_ACCURACY', 'SET_NAMES', 'SCAN_ORDERS', 'ORDER_NAMES', 'DEFAULT_TRAIN_ORDERS',
           'DEFAULT_TEST_ORDERS', 'scan_order', 'check_orders', 'Vocabulary', 'answer_question', 'sample_questions',
           'encode_question', 'check_patch_size', 'scene_patches', 'SceneQuestions', 'build_sets']

SCENE_SIZE = 2 * IMAGE_SIZE
QUADRANTS = ('top-left', 'top-right', 'bottom-left', 'bottom-right')  # quadrant q: row q // 2, column q % 2
QUESTION_TYPES = ('what', 'where', 'left', 'above')
QUESTION_LEN = 3
FILLER = '?'
ANSWER_WORDS = ('yes', 'no')
# accuracy reachable without knowing where anything is (knowing which four classes are present)
POSITION_BLIND_ACCURACY = {'what': 0.25, 'where': 0.25, 'left': 0.5, 'above': 0.5}
SET_NAMES = ('train', 'val', 'seen', 'unseen')  # what build_sets makes


# ------------------------------------------------------------------------------------- scan orders

def _quadrant_blocks(grid: np.ndarray) -> Tuple[np.ndarray, ...]:
    r, c = grid.shape[0] // 2, grid.shape[1] // 2
    return grid[:r, :c], grid[:r, c:], grid[r:, :c], grid[r:, c:]  # TL, TR, BL, BR


def _snake(grid: np.ndarray) -> np.ndarray:
    rows = [row if i % 2 == 0 else row[::-1] for i, row in enumerate(grid)]
    return np.concatenate(rows)


def _hilbert(grid: np.ndarray) -> np.ndarray:
    n = grid.shape[0]
    if grid.shape[0] != grid.shape[1] or n & (n - 1):
        raise ValueError(f'the hilbert order needs a square power-of-two patch grid, got {grid.shape}')
    out = []
    for d in range(n * n):  # index d along the curve -> (x, y), the classic iterative construction
        x = y = 0
        t, s = d, 1
        while s < n:
            rx = 1 & (t // 2)
            ry = 1 & (t ^ rx)
            if ry == 0:
                if rx == 1:
                    x, y = s - 1 - x, s - 1 - y
                x, y = y, x
            x, y = x + s * rx, y + s * ry
            t //= 4
            s *= 2
        out.append(grid[y, x])
    return np.array(out)


def _spiral(grid: np.ndarray) -> np.ndarray:
    out, g = [], grid
    while g.size:
        out.extend(g[0])
        g = np.rot90(g[1:])  # drop the row just read, turn so the next side becomes the top row
    return np.array(out)


def _diagonal(grid: np.ndarray) -> np.ndarray:
    rows, cols = grid.shape
    out = []
    for s in range(rows + cols - 1):
        cells = [grid[r, s - r] for r in range(rows) if 0 <= s - r < cols]
        out.extend(cells if s % 2 else cells[::-1])
    return np.array(out)


def _blocks(order: Tuple[int, ...], inner: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    def scan(grid: np.ndarray) -> np.ndarray:
        blocks = _quadrant_blocks(grid)
        return np.concatenate([inner(blocks[q]) for q in order])
    return scan


SCAN_ORDERS: Dict[str, Callable[[np.ndarray], np.ndarray]] = {
    'quad_row': _blocks((0, 1, 2, 3), lambda g: g.ravel()),
    'quad_col': _blocks((0, 1, 2, 3), lambda g: g.T.ravel()),
    'quad_snake': _blocks((0, 1, 2, 3), _snake),
    'quad_reverse': _blocks((0, 1, 2, 3), lambda g: g.ravel()[::-1]),
    'row_major': lambda g: g.ravel(),
    'column_major': lambda g: g.T.ravel(),
    'snake': _snake,
    'reverse': lambda g: g.ravel()[::-1],
    'quad_blocks_col': _blocks((0, 2, 1, 3), lambda g: g.ravel()),
    'hilbert': _hilbert,
    'spiral': _spiral,
    'diagonal': _diagonal,
}
ORDER_NAMES = list(SCAN_ORDERS)
DEFAULT_TRAIN_ORDERS = ['quad_row', 'quad_col', 'quad_snake', 'quad_reverse']
DEFAULT_TEST_ORDERS = ['row_major', 'column_major', 'snake', 'reverse', 'quad_blocks_col', 'hilbert', 'spiral',
                       'diagonal']


def scan_order(name: str, grid_size: Tuple[int, int]) -> np.ndarray:
    """Permutation of the row-major patch indices: sequence position k holds patch ``order[k]``."""
    if name not in SCAN_ORDERS:
        raise ValueError(f'unknown scan order {name!r}; available: {", ".join(ORDER_NAMES)}')
    rows, cols = grid_size
    if rows % 2 or cols % 2:
        raise ValueError(f'scan orders need an even patch grid (two images per side), got {rows}x{cols}')
    order = np.array(SCAN_ORDERS[name](np.arange(rows * cols).reshape(rows, cols)), dtype=np.int64)  # a fresh copy
    if not np.array_equal(np.sort(order), np.arange(rows * cols)):
        raise RuntimeError(f'scan order {name!r} is not a permutation of the {rows}x{cols} grid')
    return order


def check_orders(train_orders: Sequence[str], test_orders: Sequence[str], grid_size: Tuple[int, int]) -> None:
    """Both lists non-empty, known, valid on the grid and disjoint (held-out orders are never trained on)."""
    if not train_orders or not test_orders:
        raise ValueError('need at least one training and one held-out scan order')
    for name in list(train_orders) + list(test_orders):
        scan_order(name, grid_size)
    overlap = sorted(set(train_orders) & set(test_orders))
    if overlap:
        raise ValueError(f'scan orders {overlap} are both training and held-out orders; the lists must be disjoint')


# ---------------------------------------------------------------------------------------- questions

class Vocabulary:
    """Question and answer tokens: filler, question words, positions, yes / no and the class names."""

    def __init__(self, class_names: Sequence[str]) -> None:
        self.class_names = list(class_names)
        self.tokens = [FILLER, *QUESTION_TYPES, *QUADRANTS, *ANSWER_WORDS, *self.class_names]
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError(f'class names {self.class_names} collide with the question words {self.tokens[:11]}')
        self.index = {t: i for i, t in enumerate(self.tokens)}

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, words: Sequence[str]) -> List[int]:
        return [self.index[w] for w in words]


def answer_question(qtype: str, args: Sequence[str], quadrant_classes: Sequence[str]) -> str:
    """The answer word to a question about a scene whose quadrants TL, TR, BL, BR hold ``quadrant_classes``.

    Args:
        qtype: 'what' (args: a position), 'where' (a class), 'left' / 'above' (two classes a, b).
        args: Position / class names.
        quadrant_classes: Class name in each quadrant (all different).
    """
    where = {cls: q for q, cls in enumerate(quadrant_classes)}
    if qtype == 'what':
        return quadrant_classes[QUADRANTS.index(args[0])]
    if qtype == 'where':
        return QUADRANTS[where[args[0]]]
    a, b = where[args[0]], where[args[1]]
    if qtype == 'left':
        if a % 2 == b % 2:
            raise ValueError(f'left-of question about {args[0]} and {args[1]} in the same column')
        return 'yes' if a % 2 < b % 2 else 'no'
    if qtype == 'above':
        if a // 2 == b // 2:
            raise ValueError(f'above question about {args[0]} and {args[1]} in the same row')
        return 'yes' if a // 2 < b // 2 else 'no'
    raise ValueError(f'unknown question type {qtype!r}; expected one of {QUESTION_TYPES}')


def sample_questions(quadrant_classes: Sequence[str], rng: np.random.Generator) -> List[Tuple[str, List[str], str]]:
    """One question of each type, (type, args, answer), in ``QUESTION_TYPES`` order."""
    q = int(rng.integers(4))
    out = [('what', [QUADRANTS[q]]), ('where', [quadrant_classes[int(rng.integers(4))]])]
    for qtype, same in (('left', lambda a, b: a % 2 == b % 2), ('above', lambda a, b: a // 2 == b // 2)):
        a = int(rng.integers(4))
        others = [b for b in range(4) if not same(a, b)]
        b = others[int(rng.integers(len(others)))]
        out.append((qtype, [quadrant_classes[a], quadrant_classes[b]]))
    return [(t, args, answer_question(t, args, quadrant_classes)) for t, args in out]


def encode_question(vocab: Vocabulary, qtype: str, args: Sequence[str]) -> List[int]:
    words = [qtype, *args]
    return vocab.encode(words + [FILLER] * (QUESTION_LEN - len(words)))


# ------------------------------------------------------------------------------------------ scenes

def check_patch_size(patch_size: int) -> None:
    """p must divide the 32-pixel images (no patch straddles two images) and leave >= 2 patches per image side."""
    if patch_size < 1 or IMAGE_SIZE % patch_size or IMAGE_SIZE // patch_size < 2:
        raise ValueError(f'patch size {patch_size} must divide the {IMAGE_SIZE}-pixel images and leave at least '
                         f'two patches per image side: 1, 2, 4, 8 or 16')


def scene_patches(scene: np.ndarray, patch_size: int) -> np.ndarray:
    """(64, 64, 3) scene -> (rows * cols, p * p * 3) patches in row-major order."""
    h, w, c = scene.shape
    rows, cols = h // patch_size, w // patch_size
    blocks = scene.reshape(rows, patch_size, cols, patch_size, c).transpose(0, 2, 1, 3, 4)
    return blocks.reshape(rows * cols, patch_size * patch_size * c)


class SceneQuestions(Dataset):
    """Scenes of four distinct-class images on a 2x2 grid, as scan-ordered patch tokens + four questions.

    Item ``i``: ``patches`` (M, p*p*3) float32 in scan order, ``coords`` (M, 2) float32 canonical (x, y)
    patch coordinates in the same order, ``text`` (4, 3) int64 question tokens, ``answers`` (4,) int64,
    ``order`` (int64, index into ``ORDER_NAMES``), ``scene`` (int64, i).

    The layout (classes, images, quadrants) depends only on (seed, i). Training sets (``train=True``)
    draw the scan order, questions and image flips from numpy's global RNG, which ``PerSampleSeeds``
    seeds per (seed, epoch, index); evaluation sets fix them per (seed, i): scene i is shown in order
    ``orders[i % len(orders)]`` and its questions do not depend on the order list.

    Args:
        pool: Images to draw from.
        num_scenes: Length.
        seed: Scene seed.
        orders: Scan orders this set uses.
        patch_size: p; must divide 32.
        vocab: Question vocabulary.
        train: Random per-epoch episodes (and flips) instead of fixed ones.
        flip: Horizontally flip each image with probability 1/2 (training only).
    """

    def __init__(self, pool: ImagePool, num_scenes: int, seed: int, orders: Sequence[str], patch_size: int,
                 vocab: Vocabulary, train: bool, flip: bool = True) -> None:
        check_patch_size(patch_size)
        if num_scenes < 1:
            raise ValueError(f'need at least one scene, got {num_scenes}')
        self.by_class = [np.flatnonzero(pool.labels == c) for c in range(len(pool.class_names))]
        self.classes = np.array([c for c, members in enumerate(self.by_class) if len(members)])
        if len(self.classes) < 4:
            raise ValueError(f'{pool.source} has images of {len(self.classes)} classes; '
                             f'a scene needs 4 distinct classes')
        self.pool = pool
        self.num_scenes = num_scenes
        self.seed = seed
        self.orders = list(orders)
        self.patch_size = patch_size
        self.grid_size = (SCENE_SIZE // patch_size, SCENE_SIZE // patch_size)
        self.permutations = {name: scan_order(name, self.grid_size) for name in self.orders}
        self.coords = grid_coords(self.grid_size).numpy()  # (M, 2) canonical (x, y), row-major
        self.vocab = vocab
        self.train = train
        self.flip = flip and train
        self.mean = np.array(CIFAR_MEAN, dtype=np.float32) * 255
        self.std = np.array(CIFAR_STD, dtype=np.float32) * 255

    def __len__(self) -> int:
        return self.num_scenes

    def layout(self, index: int) -> Tuple[np.ndarray, np.ndarray]:
        """(class per quadrant (4,), pool image index per quadrant (4,)), fixed by (seed, index)."""
        rng = np.random.default_rng([self.seed, index])
        classes = rng.choice(self.classes, size=4, replace=False)
        images = np.array([self.by_class[c][int(rng.integers(len(self.by_class[c])))] for c in classes])
        return classes, images

    def render(self, image_indices: np.ndarray, flips: Sequence[bool] = (False,) * 4) -> np.ndarray:
        """(64, 64, 3) uint8 scene: image q in quadrant q (TL, TR, BL, BR)."""
        scene = np.empty((SCENE_SIZE, SCENE_SIZE, 3), dtype=np.uint8)
        for q, (idx, flip) in enumerate(zip(image_indices, flips)):
            img = self.pool.images[idx]
            r, c = (q // 2) * IMAGE_SIZE, (q % 2) * IMAGE_SIZE
            scene[r:r + IMAGE_SIZE, c:c + IMAGE_SIZE] = img[:, ::-1] if flip else img
        return scene

    def episode(self, index: int, classes: np.ndarray) -> Tuple[str, List[Tuple[str, List[str], str]], List[bool]]:
        """(scan order, questions, flips) of item ``index`` with quadrant ``classes`` (random per epoch in training)."""
        names = [self.pool.class_names[c] for c in classes]
        if self.train:
            rng = np.random.default_rng(int(np.random.randint(0, 2 ** 62)))
            order = self.orders[int(rng.integers(len(self.orders)))]
            flips = [bool(f) for f in rng.integers(0, 2, size=4)] if self.flip else [False] * 4
        else:
            rng = np.random.default_rng([self.seed, index, 1])
            order = self.orders[index % len(self.orders)]
            flips = [False] * 4
        return order, sample_questions(names, rng), flips

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        classes, images = self.layout(index)
        order, questions, flips = self.episode(index, classes)
        scene = (self.render(images, flips).astype(np.float32) - self.mean) / self.std
        perm = self.permutations[order]
        patches = scene_patches(scene, self.patch_size)[perm]
        text = [encode_question(self.vocab, t, args) for t, args, _ in questions]
        answers = [self.vocab.index[a] for _, _, a in questions]
        return {
            'patches': torch.from_numpy(np.ascontiguousarray(patches)),
            'coords': torch.from_numpy(np.ascontiguousarray(self.coords[perm])),
            'text': torch.tensor(text, dtype=torch.int64),
            'answers': torch.tensor(answers, dtype=torch.int64),
            'order': torch.tensor(ORDER_NAMES.index(order), dtype=torch.int64),
            'scene': torch.tensor(index, dtype=torch.int64),
        }


# ------------------------------------------------------------------------------------------ setup

def build_sets(cfg: Dict[str, Any], which: Sequence[str]) -> Tuple[Dict[str, SceneQuestions], Vocabulary]:
    """Datasets named in ``which`` ('train', 'val', 'seen', 'unseen') and the vocabulary, from a data config.

    ``cfg`` keys (``vision_priors.recipes.spatial_vqa.data_config`` writes them): data, data_seed, npz_test_fraction,
    synthetic_per_class, train_scenes, val_scenes (for 'val'), test_scenes, patch_size, train_orders,
    test_orders, flip. Training scenes come from the train pool; validation scenes (model selection during
    training) from the train pool too, in another layout stream and the training orders, with fixed
    episodes; seen / unseen test scenes share one layout stream and the test pool.
    """
    unknown = [name for name in which if name not in SET_NAMES]
    if unknown:
        raise ValueError(f'unknown scene sets {unknown}; build_sets makes {", ".join(SET_NAMES)}')
    check_patch_size(cfg['patch_size'])
    grid = (SCENE_SIZE // cfg['patch_size'],) * 2
    check_orders(cfg['train_orders'], cfg['test_orders'], grid)
    train_pool, test_pool = load_pools(cfg['data'], cfg['data_seed'], cfg['npz_test_fraction'],
                                       tuple(cfg['synthetic_per_class']))
    vocab = Vocabulary(train_pool.class_names)
    test_seed = cfg['data_seed'] + 1_000_003  # test scenes: another layout stream, another image pool
    val_seed = cfg['data_seed'] + 2_000_003   # validation scenes: another layout stream, the train pool
    sets: Dict[str, SceneQuestions] = {}
    if 'train' in which:
        sets['train'] = SceneQuestions(train_pool, cfg['train_scenes'], cfg['data_seed'], cfg['train_orders'],
                                       cfg['patch_size'], vocab, train=True, flip=cfg['flip'])
    if 'val' in which:
        sets['val'] = SceneQuestions(train_pool, cfg['val_scenes'], val_seed, cfg['train_orders'], cfg['patch_size'],
                                     vocab, train=False)
    for name, orders in (('seen', cfg['train_orders']), ('unseen', cfg['test_orders'])):
        if name in which:
            sets[name] = SceneQuestions(test_pool, cfg['test_scenes'], test_seed, orders, cfg['patch_size'],
                                        vocab, train=False)
    return sets, vocab
