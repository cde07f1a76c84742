"""CIFAR scan-order spatial VQA (GOAT paper, Sec. 6, Tables 9-10): canonical 2D coordinates vs sequence positions.

Commands (``python -m recipes.spatial_vqa COMMAND --help`` explains every option):

  train    train one positional method (nope, rope, goat, pope) on scenes in the training scan orders;
           CPU, one GPU or many through ``accelerate launch``; atomic checkpoints + ``--resume``.
  eval     evaluate run folders on test scenes in seen and unseen scan orders: answer NLL and exact
           answer accuracy per question type and per scan order; table, JSON and PNG plot.
  compare  train + eval several methods over seeds with one budget: mean +- spread tables, JSON (with
           the config and seeds) and a PNG plot.

The paper gives only "four CIFAR-10 images on a canonical 2x2 grid; test scan orders unseen during
training; 50k / 10k train / test scenes; answer-only spatial questions; image tokens use 2D
coordinates, text uses 1D positions". Everything else below is this recipe's own protocol.

Scenes. Four 32x32 images of four *distinct* classes on a 2x2 grid (a 64x64 scene): quadrants
top-left, top-right, bottom-left, bottom-right. Distinct classes make every question unambiguous (each
named class occurs exactly once). Training scenes draw their images from the train pool, test scenes
from a disjoint test pool, so no test image is ever seen in training. A scene's layout (classes,
images, quadrants) is fixed by (data seed, scene index); training scenes get a new scan order,
question arguments and horizontal flips of the four images every epoch (``PerSampleSeeds``: a
function of (seed, epoch, index), so a resumed run sees the same batches).

Tokens. The scene is cut into p x p patches (``--patch-size``, default 8: an 8x8 grid of 64 patches, 16
per image; p must divide 32 so no patch straddles two images). Each patch token carries its canonical
(x, y) patch coordinate on the whole scene (x = column, y = row), whatever the scan order. The *scan
order* is the order in which patches are laid into the token sequence. Orders (``SCAN_ORDERS``):

  quad_row, quad_col, quad_snake, quad_reverse   image blocks in reading order TL, TR, BL, BR; inside
      each block row-major / column-major / boustrophedon / reversed row-major   -> default TRAIN orders
  row_major, column_major, snake, reverse        over the whole scene (the images interleave)
  quad_blocks_col                                 blocks TL, BL, TR, BR, row-major inside
  hilbert, spiral, diagonal                       Hilbert curve, clockwise spiral from the outside,
                                                  JPEG-style zig-zag over anti-diagonals
                                                  -> these eight are the default held-out TEST orders

Why this split: every training order puts image q in the same sequence span, so a model with sequence
positions (rope) *can* locate the images in the seen orders (its best case); the held-out orders lay
the same patches out differently (interleaved rows or columns, another block order, curves). Seen and
unseen sets are disjoint (checked). ``--train-orders`` / ``--test-orders`` choose others.

Questions (one of each type per scene, answer = one token; question tokens ``'?'``-padded to T = 3):

  what  <position> ?     -> a class              (chance 10 %; 25 % knowing only which classes are present)
  where <class> ?        -> a position           (chance 25 %)
  left  <class a> <class b> -> yes / no: is a left of b? asked only for a pair in different columns
  above <class a> <class b> -> yes / no: is a above b? asked only for a pair in different rows (50 %)

Each question is its own segment after the image tokens (1D positions restart at 0; it attends to all
image tokens and causally to its own tokens), so the four answers are independent predictions sharing
one pass over the image (``vision_priors.models.spatial_vqa``). Loss: mean cross-entropy of the four
answer tokens over the whole vocabulary. Metrics on the answer only: answer NLL (nats) and exact answer
accuracy (argmax = answer).

Evaluation. Every test scene is evaluated twice with the same questions: once in a seen (training)
order and once in an unseen order (scene i gets order i mod K of each list), so seen / unseen is a
paired comparison; per-order numbers are over the scenes assigned to that order.

Models. One transformer, one budget (width, depth, heads, MLP, optimiser, updates); only the positional
method changes (``--method``): nope, rope (1D over the sequence index, timm's rotary helpers), goat
(2D axis-wise prior on canonical coordinates, text at (c + t, c + t)), pope (2D phases likewise).
Image tokens attend bidirectionally among themselves (``--image-attention prefix``, default), so goat,
pope and nope are exactly invariant to the scan order (tested); ``causal`` is available.
``--prior-lr-scale`` (default 1) multiplies the learning rate of the positional-prior parameters (GOAT
alpha, beta, key default; PoPE delta; rope / nope have none): GOAT's prior starts at zero (uniform) and
its O(1) coefficients move by at most about lr per Adam step, which makes short runs slow to leave the
position-blind plateau.

Data (``--data``): a folder with CIFAR-10's python batches (``data_batch_1..5``, ``test_batch``,
``batches.meta``; read directly, no download, no checksum; train pool = the five data batches, test
pool = ``test_batch``), an ``.npz`` with ``images`` (N, 32, 32, 3) uint8 and ``labels`` (split per class,
deterministically by ``--data-seed``, into disjoint train / test pools, ``--npz-test-fraction``), or
nothing: built-in procedural 32x32 images in 10 classes (a colour and a texture per class, random
brightness, texture phase and noise), deterministic per ``--data-seed``, so the recipe runs anywhere.
Pixels are normalised with CIFAR-10's channel mean / std for every source.

Small CPU run on the built-in images (about 3 minutes per method on one busy core):

  python -m recipes.spatial_vqa compare --train-scenes 20000 --test-scenes 1000 --updates 900 \
      --batch-size 32 --patch-size 16 --embed-dim 128 --depth 2 --num-heads 4 --lr 2e-3 --threads 1 --cpu

Paper-scale protocol on real CIFAR-10 (e.g. on a GPU):

  python -m recipes.spatial_vqa compare --data /path/to/cifar-10-batches-py --train-scenes 50000 \\
      --test-scenes 10000 --epochs 30 --batch-size 128 --seeds 0 1 2 --out runs/spatial_vqa
"""
import argparse
import json
import math
import pickle
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from safetensors.torch import load_file

from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2

from vision_priors.layers import grid_coords
from vision_priors.layers.goat import PRIOR_INITS
from vision_priors.models.spatial_vqa import IMAGE_ATTENTION, POS_METHODS, SpatialVQATransformer, count_parameters

from .engine import JsonlLogger, close_distributed, PerSampleSeeds, fit, latest_checkpoint, make_accelerator, write_json_atomic

IMAGE_SIZE = 32
SCENE_SIZE = 2 * IMAGE_SIZE
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CIFAR_TRAIN_FILES = tuple(f'data_batch_{i}' for i in range(1, 6))
CIFAR_TEST_FILE = 'test_batch'
CIFAR_META_FILE = 'batches.meta'

QUADRANTS = ('top-left', 'top-right', 'bottom-left', 'bottom-right')  # quadrant q: row q // 2, column q % 2
QUESTION_TYPES = ('what', 'where', 'left', 'above')
QUESTION_LEN = 3
FILLER = '?'
ANSWER_WORDS = ('yes', 'no')
# accuracy reachable without knowing where anything is (knowing which four classes are present)
POSITION_BLIND_ACCURACY = {'what': 0.25, 'where': 0.25, 'left': 0.5, 'above': 0.5}
SYNTHETIC_CLASSES = ('red-hstripes', 'green-vstripes', 'blue-checker', 'yellow-diag', 'magenta-dots',
                     'cyan-rings', 'orange-antidiag', 'purple-grid', 'white-noise', 'olive-plain')


# ------------------------------------------------------------------------------------ image pools

@dataclass
class ImagePool:
    """Images one split draws its scenes from.

    Attributes:
        images: (N, 32, 32, 3) uint8 RGB.
        labels: (N,) int64 class indices into ``class_names``.
        class_names: Name of every class.
        indices: (N,) positions of the images in their source file (for checking splits).
        source: Where they came from (for messages and the config).
    """
    images: np.ndarray
    labels: np.ndarray
    class_names: List[str]
    indices: np.ndarray
    source: str


def _load_pickle(path: Path) -> Dict[bytes, Any]:
    with path.open('rb') as f:
        return pickle.load(f, encoding='bytes')


def resolve_cifar_folder(folder: Path) -> Path:
    """``folder`` or its ``cifar-10-batches-py`` subfolder, whichever holds ``batches.meta``."""
    nested = folder / 'cifar-10-batches-py'
    if not (folder / CIFAR_META_FILE).exists() and nested.is_dir():
        return nested
    return folder


def read_cifar_batches(folder: Path, split: str) -> ImagePool:
    """Read CIFAR-10's python-version batches from ``folder`` (no download, no checksum).

    Args:
        folder: Holds ``data_batch_1..5``, ``test_batch`` and ``batches.meta`` (pickled dicts with
            b'data' (N, 3072) uint8, channel-major, and b'labels'; meta with b'label_names').
        split: 'train' (the five data batches) or 'test' (``test_batch``).

    Raises:
        FileNotFoundError: naming the folder and the missing file.
        ValueError: a batch without b'data' / b'labels' or with the wrong shape.
    """
    folder = resolve_cifar_folder(Path(folder))
    if split not in ('train', 'test'):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    names = CIFAR_TRAIN_FILES if split == 'train' else (CIFAR_TEST_FILE,)
    for name in (CIFAR_META_FILE,) + names:
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f'CIFAR-10 folder {folder} has no file {name!r}: expected the python-version batches '
                f'{", ".join(CIFAR_TRAIN_FILES)}, {CIFAR_TEST_FILE} and {CIFAR_META_FILE}')
    meta = _load_pickle(folder / CIFAR_META_FILE)
    if b'label_names' not in meta:
        raise ValueError(f"{folder / CIFAR_META_FILE} has no b'label_names' entry")
    class_names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta[b'label_names']]
    images, labels = [], []
    for name in names:
        batch = _load_pickle(folder / name)
        if b'data' not in batch or b'labels' not in batch:
            raise ValueError(f"{folder / name} is not a CIFAR-10 batch: expected b'data' and b'labels', "
                             f'found {sorted(batch)}')
        data = np.asarray(batch[b'data'])
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * IMAGE_SIZE * IMAGE_SIZE:
            raise ValueError(f"{folder / name}: b'data' has shape {data.shape} dtype {data.dtype}, "
                             f'expected (N, 3072) uint8')
        images.append(data.reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE).transpose(0, 2, 3, 1))
        labels.append(np.asarray(batch[b'labels'], dtype=np.int64))
    images_np, labels_np = np.concatenate(images), np.concatenate(labels)
    if len(images_np) != len(labels_np) or labels_np.min() < 0 or labels_np.max() >= len(class_names):
        raise ValueError(f'{folder}: {len(labels_np)} labels for {len(images_np)} images, or labels outside '
                         f'0..{len(class_names) - 1}')
    return ImagePool(np.ascontiguousarray(images_np), labels_np, class_names, np.arange(len(labels_np)),
                     f'{folder}:{split}')


def split_indices_per_class(labels: np.ndarray, test_fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Deterministic per-class split into disjoint (train, test) index arrays (sorted)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f'test fraction must lie in (0, 1), got {test_fraction}')
    rng = np.random.default_rng(seed)
    train, test = [], []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        members = members[rng.permutation(len(members))]
        num_test = int(round(test_fraction * len(members)))
        test.append(members[:num_test])
        train.append(members[num_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def read_npz_pools(path: Path, test_fraction: float, seed: int) -> Tuple[ImagePool, ImagePool]:
    """Read an ``.npz`` with ``images`` (N, 32, 32, 3) uint8 and ``labels`` and split it into disjoint pools.

    ``class_names`` is used when present. The split is per class and deterministic in ``seed``
    (``split_indices_per_class``); this is how the 10,000-image CIFAR-10 subset is used.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f'npz file {path} does not exist (expected keys images (N, 32, 32, 3) uint8, labels)')
    with np.load(path, allow_pickle=False) as data:
        for key in ('images', 'labels'):
            if key not in data.files:
                raise ValueError(f'{path} has no {key!r} array (found {data.files}); expected images '
                                 f'(N, 32, 32, 3) uint8 and labels (N,)')
        images = data['images']
        labels = data['labels'].astype(np.int64)
        names = [str(n) for n in data['class_names']] if 'class_names' in data.files else None
    if images.dtype != np.uint8 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3) or len(images) != len(labels):
        raise ValueError(f'{path}: images {images.shape} {images.dtype} with {len(labels)} labels; expected '
                         f'(N, 32, 32, 3) uint8 and N labels')
    num_classes = int(labels.max()) + 1
    class_names = names if names is not None else [f'class{c}' for c in range(num_classes)]
    if labels.min() < 0 or num_classes > len(class_names):
        raise ValueError(f'{path}: labels outside 0..{len(class_names) - 1}')
    train, test = split_indices_per_class(labels, test_fraction, seed)
    return (ImagePool(images[train], labels[train], class_names, train, f'{path}:train'),
            ImagePool(images[test], labels[test], class_names, test, f'{path}:test'))


def _texture(cls: int, xx: np.ndarray, yy: np.ndarray, phase: np.ndarray, freq: np.ndarray,
             rng: np.random.Generator) -> np.ndarray:
    """Class texture in [-1, 1] for k images: xx, yy (32, 32) pixel grids, phase / freq (k, 1, 1)."""
    if cls == 0:
        return np.sin(freq * yy + phase)                                   # horizontal stripes
    if cls == 1:
        return np.sin(freq * xx + phase)                                   # vertical stripes
    if cls == 2:
        return np.sign(np.sin(0.5 * freq * xx + phase) * np.sin(0.5 * freq * yy + phase))  # checkerboard
    if cls == 3:
        return np.sin(0.7 * freq * (xx + yy) + phase)                      # diagonal stripes
    if cls == 4:
        return np.sin(freq * xx + phase) * np.sin(freq * yy + phase)       # dots
    if cls == 5:
        return np.sin(freq * np.hypot(xx - 15.5, yy - 15.5) + phase)       # rings
    if cls == 6:
        return np.sin(0.7 * freq * (xx - yy) + phase)                      # anti-diagonal stripes
    if cls == 7:
        return np.maximum(np.sin(freq * xx + phase), np.sin(freq * yy + phase))  # grid
    if cls == 8:
        return rng.uniform(-1, 1, size=(len(phase), IMAGE_SIZE, IMAGE_SIZE))     # noise
    return np.zeros((len(phase), IMAGE_SIZE, IMAGE_SIZE))                  # plain


def synthetic_images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Procedural 32x32 RGB images, one per label in 0..9: a class colour and a class texture.

    Brightness, texture phase / frequency and pixel noise are random, so every image differs; the
    class shows in every 8x8 patch (colour and texture cover the whole image).
    """
    palette = np.array([[220, 40, 40], [40, 190, 60], [50, 80, 230], [230, 210, 40], [210, 50, 200],
                        [40, 210, 220], [245, 140, 30], [130, 60, 190], [235, 235, 235], [120, 130, 40]],
                       dtype=np.float32)
    n = len(labels)
    yy, xx = np.meshgrid(np.arange(IMAGE_SIZE, dtype=np.float32), np.arange(IMAGE_SIZE, dtype=np.float32),
                         indexing='ij')
    phase = rng.uniform(0, 2 * np.pi, size=(n, 1, 1)).astype(np.float32)
    freq = rng.uniform(0.7, 0.9, size=(n, 1, 1)).astype(np.float32)
    brightness = rng.uniform(0.75, 1.15, size=(n, 1, 1, 1)).astype(np.float32)
    images = np.empty((n, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for cls in range(len(SYNTHETIC_CLASSES)):
        chosen = np.flatnonzero(labels == cls)
        if not len(chosen):
            continue
        texture = _texture(cls, xx, yy, phase[chosen], freq[chosen], rng)
        colour = palette[cls] * brightness[chosen]
        noise = rng.normal(0, 12, size=(len(chosen), IMAGE_SIZE, IMAGE_SIZE, 3))
        images[chosen] = np.clip(colour * (0.75 + 0.25 * texture[..., None]) + noise, 0, 255).astype(np.uint8)
    return images


def synthetic_pools(per_class_train: int, per_class_test: int, seed: int) -> Tuple[ImagePool, ImagePool]:
    """Built-in fallback: disjoint procedural train / test pools (different random streams of one seed)."""
    pools = []
    for split, per_class, stream in (('train', per_class_train, 0), ('test', per_class_test, 1)):
        rng = np.random.default_rng([seed, stream])
        labels = np.repeat(np.arange(len(SYNTHETIC_CLASSES)), per_class)
        pools.append(ImagePool(synthetic_images(labels, rng), labels, list(SYNTHETIC_CLASSES),
                               np.arange(len(labels)), f'builtin:{split}'))
    return pools[0], pools[1]


def load_pools(data: Optional[str], data_seed: int, npz_test_fraction: float,
               synthetic_per_class: Tuple[int, int]) -> Tuple[ImagePool, ImagePool]:
    """(train pool, test pool) for ``--data``: a CIFAR batch folder, an ``.npz`` or None (built-in)."""
    if data is None:
        return synthetic_pools(synthetic_per_class[0], synthetic_per_class[1], data_seed)
    path = Path(data)
    if path.suffix == '.npz':
        return read_npz_pools(path, npz_test_fraction, data_seed)
    if not path.is_dir():
        raise FileNotFoundError(f'--data {path} does not exist: expected a CIFAR-10 python-batch folder '
                                f'({", ".join(CIFAR_TRAIN_FILES)}, {CIFAR_TEST_FILE}, {CIFAR_META_FILE}) '
                                f'or an .npz file')
    return read_cifar_batches(path, 'train'), read_cifar_batches(path, 'test')


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

def data_config(args: argparse.Namespace) -> Dict[str, Any]:
    """Everything that fixes the data of a run (saved in config.json, reused by ``eval``)."""
    return dict(data=args.data, data_seed=args.data_seed, npz_test_fraction=args.npz_test_fraction,
                synthetic_per_class=list(args.synthetic_per_class), train_scenes=args.train_scenes,
                test_scenes=args.test_scenes, patch_size=args.patch_size, train_orders=list(args.train_orders),
                test_orders=list(args.test_orders), flip=not args.no_flip)


def build_sets(cfg: Dict[str, Any], which: Sequence[str]) -> Tuple[Dict[str, SceneQuestions], Vocabulary]:
    """Datasets named in ``which`` ('train', 'seen', 'unseen') and the vocabulary, from a data config."""
    check_patch_size(cfg['patch_size'])
    grid = (SCENE_SIZE // cfg['patch_size'],) * 2
    check_orders(cfg['train_orders'], cfg['test_orders'], grid)
    train_pool, test_pool = load_pools(cfg['data'], cfg['data_seed'], cfg['npz_test_fraction'],
                                       tuple(cfg['synthetic_per_class']))
    vocab = Vocabulary(train_pool.class_names)
    test_seed = cfg['data_seed'] + 1_000_003  # test scenes: another layout stream, another image pool
    sets: Dict[str, SceneQuestions] = {}
    if 'train' in which:
        sets['train'] = SceneQuestions(train_pool, cfg['train_scenes'], cfg['data_seed'], cfg['train_orders'],
                                       cfg['patch_size'], vocab, train=True, flip=cfg['flip'])
    for name, orders in (('seen', cfg['train_orders']), ('unseen', cfg['test_orders'])):
        if name in which:
            sets[name] = SceneQuestions(test_pool, cfg['test_scenes'], test_seed, orders, cfg['patch_size'],
                                        vocab, train=False)
    return sets, vocab


def model_config(args: argparse.Namespace, method: str, vocab_size: int) -> Dict[str, Any]:
    grid = SCENE_SIZE // args.patch_size
    return dict(pos_method=method, vocab_size=vocab_size, patch_dim=3 * args.patch_size ** 2,
                grid_size=[grid, grid], question_len=QUESTION_LEN, embed_dim=args.embed_dim, depth=args.depth,
                num_heads=args.num_heads, mlp_ratio=args.mlp_ratio, image_attention=args.image_attention,
                goat_modes=args.goat_modes, drop_path_rate=args.drop_path,
                goat_kwargs=dict(prior_init=args.goat_prior_init))


def build_model(cfg: Dict[str, Any]) -> SpatialVQATransformer:
    kwargs = dict(cfg)
    kwargs['grid_size'] = tuple(kwargs['grid_size'])
    return SpatialVQATransformer(kwargs.pop('pos_method'), **kwargs)


def make_optimizer(model: SpatialVQATransformer, args: argparse.Namespace) -> torch.optim.Optimizer:
    """timm optimizer; with ``--prior-lr-scale`` != 1 the positional-prior parameters form their own group.

    That group (GOAT alpha, beta, key-default MLP and biases; PoPE delta: ``model.no_weight_decay()``)
    has no weight decay and ``lr_scale`` = the scale, which timm's schedulers apply at every step. rope
    and nope have no such parameters, so the option changes nothing for them.
    """
    if args.prior_lr_scale <= 0:
        raise ValueError(f'--prior-lr-scale must be > 0, got {args.prior_lr_scale}')
    if args.prior_lr_scale == 1.0:
        return create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay)
    positional = model.no_weight_decay()
    groups: Dict[str, List[nn.Parameter]] = {'decay': [], 'no_decay': [], 'prior': []}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        key = 'prior' if name in positional else ('no_decay' if param.ndim <= 1 else 'decay')
        groups[key].append(param)
    param_groups = [dict(params=groups['decay'], weight_decay=args.weight_decay),
                    dict(params=groups['no_decay'], weight_decay=0.0)]
    if groups['prior']:
        param_groups.append(dict(params=groups['prior'], weight_decay=0.0, lr_scale=args.prior_lr_scale))
    return create_optimizer_v2(param_groups, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay)


def answer_loss(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens (the only supervised tokens)."""
    logits = model(batch['patches'], batch['coords'], batch['text'])
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch['answers'].flatten())


# ------------------------------------------------------------------------------------------ train

def run_train(args: argparse.Namespace, method: str, seed: int, out_dir: Path) -> Path:
    """Train ``method`` with ``seed`` into ``out_dir``; returns the final checkpoint folder."""
    if (out_dir / 'latest.json').exists() and not args.resume:
        raise FileExistsError(f'{out_dir} already holds a run (latest.json); pass --resume to continue it '
                              f'or choose another --out')
    accelerator = make_accelerator(seed, mixed_precision=args.amp, grad_accum=args.grad_accum, cpu=args.cpu)
    dcfg = data_config(args)
    sets, vocab = build_sets(dcfg, ['train'])
    mcfg = model_config(args, method, len(vocab))
    model = build_model(mcfg)
    config = dict(method=method, seed=seed, model=mcfg, data=dcfg, vocab=vocab.tokens,
                  parameters=count_parameters(model),
                  args={k: v for k, v in vars(args).items() if k != 'func'})
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / 'config.json', config)

    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(PerSampleSeeds(sets['train'], seed), batch_size=args.batch_size, shuffle=True,
                        drop_last=True, num_workers=args.workers, generator=generator)
    if len(loader) == 0:
        raise ValueError(f'{len(sets["train"])} training scenes < batch size {args.batch_size}')
    steps_per_epoch = len(loader) // args.grad_accum
    total_updates = args.updates or max(1, args.epochs * steps_per_epoch)
    warmup = int(round(args.warmup_frac * total_updates))

    optimizer = make_optimizer(model, args)
    # one scheduler "epoch" = one update: warm-up and cosine in updates, whatever the epoch length
    scheduler, _ = create_scheduler_v2(
        optimizer, sched='cosine', num_epochs=total_updates, warmup_epochs=warmup, warmup_lr=args.lr * 0.01,
        min_lr=args.lr * 0.01, step_on_epochs=False, updates_per_epoch=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    logger = JsonlLogger(out_dir / 'log.jsonl', enabled=accelerator.is_main_process)
    logger.log(event='start', method=method, seed=seed, total_updates=total_updates, parameters=config['parameters'],
               processes=accelerator.num_processes, device=str(accelerator.device))
    result = fit(accelerator, model, optimizer, scheduler, loader, None, total_updates, out_dir,
                 step_fn=answer_loss, clip_grad=args.clip_grad, checkpoint_every=args.checkpoint_every,
                 resume=args.resume, stop_after=args.stop_after, logger=logger, log_every=args.log_every)
    logger.log(event='end', **{k: str(v) for k, v in result.items()})
    return Path(result['checkpoint'])


# ------------------------------------------------------------------------------------------- eval

@torch.no_grad()
def predict(model: nn.Module, loader: DataLoader, accelerator) -> Dict[str, np.ndarray]:
    """Per question: answer NLL and correctness, with the scan order of its scene (all processes)."""
    model.eval()
    nll, correct, orders = [], [], []
    for batch in loader:
        with accelerator.autocast():
            logits = model(batch['patches'], batch['coords'], batch['text'])
        logits, answers, order = accelerator.gather_for_metrics((logits.float(), batch['answers'], batch['order']))
        logp = logits.log_softmax(-1)
        nll.append((-logp.gather(-1, answers[..., None])[..., 0]).cpu().numpy())
        correct.append((logits.argmax(-1) == answers).cpu().numpy())
        orders.append(order.cpu().numpy())
    if not nll:
        raise ValueError('the evaluation set is empty')
    return dict(nll=np.concatenate(nll), correct=np.concatenate(correct), order=np.concatenate(orders))


def summarize_predictions(pred: Dict[str, np.ndarray]) -> Dict[str, Any]:
    """NLL / accuracy overall, per question type and per scan order."""
    def cell(nll: np.ndarray, correct: np.ndarray) -> Dict[str, float]:
        return dict(nll=float(nll.mean()), acc=float(correct.mean()), n=int(nll.size))
    out = cell(pred['nll'], pred['correct'])
    out['by_type'] = {t: cell(pred['nll'][:, k], pred['correct'][:, k]) for k, t in enumerate(QUESTION_TYPES)}
    out['by_order'] = {}
    for oid in np.unique(pred['order']):
        chosen = pred['order'] == oid
        out['by_order'][ORDER_NAMES[int(oid)]] = cell(pred['nll'][chosen], pred['correct'][chosen])
    return out


def load_run(run: Path) -> Tuple[Dict[str, Any], SpatialVQATransformer]:
    """(config, model with the weights of the run's latest checkpoint or of a checkpoint folder)."""
    run = Path(run)
    run_dir = run if (run / 'config.json').exists() else run.parent
    if not (run_dir / 'config.json').exists():
        raise FileNotFoundError(f'{run}: no config.json in it or its parent (expected a spatial_vqa run folder)')
    config = json.loads((run_dir / 'config.json').read_text())
    ckpt = latest_checkpoint(run) if (run / 'latest.json').exists() else run
    weights = None if ckpt is None else ckpt / 'model.safetensors'
    if weights is None or not weights.exists():
        raise FileNotFoundError(f'{run}: no trained weights ({weights}); train it first')
    model = build_model(config['model'])
    model.load_state_dict(load_file(str(weights)))
    return config, model


def run_eval(args: argparse.Namespace, runs: Sequence[str]) -> List[Dict[str, Any]]:
    accelerator = make_accelerator(args.seed, mixed_precision=args.amp, cpu=args.cpu)
    rows = []
    for run in runs:
        config, model = load_run(Path(run))
        dcfg = dict(config['data'])
        for key in ('data', 'test_scenes'):
            if getattr(args, key, None) is not None:
                dcfg[key] = getattr(args, key)
        sets, _ = build_sets(dcfg, ['seen', 'unseen'])
        model = accelerator.prepare(model)
        row = dict(run=str(run), method=config['method'], seed=config['seed'], parameters=config['parameters'])
        for split in ('seen', 'unseen'):
            loader = accelerator.prepare(DataLoader(sets[split], batch_size=args.batch_size, shuffle=False,
                                                    num_workers=args.workers))
            row[split] = summarize_predictions(predict(model, loader, accelerator))
        accelerator.print(f"{config['method']} seed={config['seed']}: seen acc {100 * row['seen']['acc']:.2f} "
                          f"nll {row['seen']['nll']:.3f} | unseen acc {100 * row['unseen']['acc']:.2f} "
                          f"nll {row['unseen']['nll']:.3f}")
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------- reporting

def _mean_std(values: List[float]) -> Dict[str, float]:
    return dict(mean=statistics.fmean(values), std=statistics.stdev(values) if len(values) > 1 else 0.0,
                n=len(values))


def aggregate(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """method -> split -> {nll, acc, by_type, by_order}: mean / std over seeds of every number."""
    table: Dict[str, Any] = {}
    for method in dict.fromkeys(r['method'] for r in rows):
        mine = [r for r in rows if r['method'] == method]
        table[method] = {'parameters': mine[0]['parameters'], 'seeds': [r['seed'] for r in mine]}
        for split in ('seen', 'unseen'):
            entry: Dict[str, Any] = {m: _mean_std([r[split][m] for r in mine]) for m in ('nll', 'acc')}
            for group in ('by_type', 'by_order'):
                keys = list(dict.fromkeys(k for r in mine for k in r[split][group]))
                entry[group] = {k: {m: _mean_std([r[split][group][k][m] for r in mine if k in r[split][group]])
                                    for m in ('nll', 'acc')} for k in keys}
            table[method][split] = entry
    return table


def _fmt(cell: Dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    text = f"{cell['mean'] * scale:.{digits}f}"
    return text + (f" ± {cell['std'] * scale:.{digits}f}" if cell['n'] > 1 else '')


def format_tables(table: Dict[str, Any]) -> str:
    """Markdown: method x {seen, unseen} x {NLL, accuracy}; accuracy per question type; per scan order."""
    lines = ['| method | params | seen NLL | seen acc % | unseen NLL | unseen acc % |', '|---|---|---|---|---|---|']
    for method, t in table.items():
        lines.append(f"| {method} | {t['parameters']:,} | {_fmt(t['seen']['nll'], digits=3)} | "
                     f"{_fmt(t['seen']['acc'], 100)} | {_fmt(t['unseen']['nll'], digits=3)} | "
                     f"{_fmt(t['unseen']['acc'], 100)} |")
    lines += ['', '| method | ' + ' | '.join(f'{q} seen | {q} unseen' for q in QUESTION_TYPES) + ' |',
              '|---|' + '---|---|' * len(QUESTION_TYPES)]
    for method, t in table.items():
        cells = [f"{_fmt(t[s]['by_type'][q]['acc'], 100, 1)}" for q in QUESTION_TYPES for s in ('seen', 'unseen')]
        lines.append(f'| {method} acc % | ' + ' | '.join(cells) + ' |')
    for method, t in table.items():
        cells = [f"{_fmt(t[s]['by_type'][q]['nll'], digits=3)}" for q in QUESTION_TYPES for s in ('seen', 'unseen')]
        lines.append(f'| {method} NLL | ' + ' | '.join(cells) + ' |')
    lines.append('| position-blind | ' + ' | '.join(f'{100 * POSITION_BLIND_ACCURACY[q]:.0f}'
                                                 for q in QUESTION_TYPES for _ in range(2)) + ' |')
    orders = list(dict.fromkeys(o for t in table.values() for s in ('seen', 'unseen') for o in t[s]['by_order']))
    seen_orders = set(o for t in table.values() for o in t['seen']['by_order'])
    lines += ['', '| method | ' + ' | '.join(f"{o}{' (seen)' if o in seen_orders else ''}" for o in orders) + ' |',
              '|---|' + '---|' * len(orders)]
    for method, t in table.items():
        cells = []
        for o in orders:
            split = 'seen' if o in t['seen']['by_order'] else 'unseen'
            cell = t[split]['by_order'].get(o)
            cells.append('' if cell is None else _fmt(cell['acc'], 100, 1))
        lines.append(f'| {method} acc % | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def plot_results(table: Dict[str, Any], path: Path, title: str) -> None:
    """Three panels: accuracy seen / unseen per method; unseen accuracy per question type; per scan order."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    methods = list(table)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw=dict(width_ratios=[1, 1.4, 2.2]))
    width = 0.8 / max(1, len(methods))
    ax = axes[0]
    for i, split in enumerate(('seen', 'unseen')):
        means = [100 * table[m][split]['acc']['mean'] for m in methods]
        stds = [100 * table[m][split]['acc']['std'] for m in methods]
        ax.bar(np.arange(len(methods)) + (i - 0.5) * 0.4, means, 0.4, yerr=stds, capsize=3,
               label=f'{split} scan orders', hatch='' if split == 'seen' else '//')
    blind = 100 * statistics.fmean(POSITION_BLIND_ACCURACY.values())
    ax.axhline(blind, color='gray', linestyle='--', label='position-blind')
    ax.set_xticks(np.arange(len(methods)), methods)
    ax.set_ylabel('exact answer accuracy (%)')
    ax.set_title('all questions')
    ax.legend(fontsize=7)
    ax = axes[1]
    for i, m in enumerate(methods):
        means = [100 * table[m]['unseen']['by_type'][q]['acc']['mean'] for q in QUESTION_TYPES]
        ax.bar(np.arange(len(QUESTION_TYPES)) + (i - (len(methods) - 1) / 2) * width, means, width, label=m)
    ax.scatter(np.arange(len(QUESTION_TYPES)), [100 * POSITION_BLIND_ACCURACY[q] for q in QUESTION_TYPES],
               marker='_', s=400, color='gray', label='position-blind', zorder=3)
    ax.set_xticks(np.arange(len(QUESTION_TYPES)), QUESTION_TYPES)
    ax.set_title('unseen scan orders, per question type')
    ax.legend(fontsize=7)
    ax = axes[2]
    orders = list(dict.fromkeys(o for m in methods for s in ('seen', 'unseen') for o in table[m][s]['by_order']))
    for m in methods:
        ys = []
        for o in orders:
            split = 'seen' if o in table[m]['seen']['by_order'] else 'unseen'
            cell = table[m][split]['by_order'].get(o)
            ys.append(math.nan if cell is None else 100 * cell['acc']['mean'])
        ax.plot(np.arange(len(orders)), ys, marker='o', label=m)
    num_seen = len(table[methods[0]]['seen']['by_order'])
    ax.axvspan(-0.5, num_seen - 0.5, color='gray', alpha=0.12, label='seen in training')
    ax.set_xticks(np.arange(len(orders)), orders, rotation=45, ha='right', fontsize=7)
    ax.set_title('per scan order')
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(rows: List[Dict[str, Any]], args: argparse.Namespace, out_dir: Path, title: str) -> Dict[str, Any]:
    table = aggregate(rows)
    text = format_tables(table)
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != 'func'}
    payload = dict(rows=rows, summary=table, table_markdown=text, config=config,
                   seeds=sorted(set(r['seed'] for r in rows)))
    write_json_atomic(out_dir / 'results.json', payload)
    plot_results(table, out_dir / 'spatial_vqa.png', title)
    print(f'saved {out_dir / "results.json"} and {out_dir / "spatial_vqa.png"}')
    return payload


# --------------------------------------------------------------------------------------------- CLI

def add_data_args(p: argparse.ArgumentParser, for_eval: bool = False) -> None:
    g = p.add_argument_group('data')
    if for_eval:
        g.add_argument('--data', default=None, help="override the run's data source (CIFAR folder or .npz)")
        g.add_argument('--test-scenes', type=int, default=None, help="override the run's number of test scenes")
        return
    g.add_argument('--data', default=None,
                   help='CIFAR-10 python-batch folder (data_batch_1..5, test_batch, batches.meta), an .npz with '
                        'images (N, 32, 32, 3) uint8 + labels (split into disjoint pools), or nothing for the '
                        'built-in procedural images')
    g.add_argument('--train-scenes', type=int, default=50000, help='training scenes')
    g.add_argument('--test-scenes', type=int, default=10000,
                   help='test scenes (each evaluated in one seen and one unseen scan order)')
    g.add_argument('--data-seed', type=int, default=0, help='scene layouts, npz split and built-in images')
    g.add_argument('--npz-test-fraction', type=float, default=0.2, help='share of each class in the npz test pool')
    g.add_argument('--synthetic-per-class', type=int, nargs=2, default=(500, 100), metavar=('TRAIN', 'TEST'),
                   help='built-in images per class in the train / test pools')
    g.add_argument('--patch-size', type=int, default=8, help='patch side p (divides 32): (64 / p)^2 image tokens')
    g.add_argument('--train-orders', nargs='+', default=DEFAULT_TRAIN_ORDERS, choices=ORDER_NAMES,
                   help='scan orders used in training (and for the "seen" evaluation)')
    g.add_argument('--test-orders', nargs='+', default=DEFAULT_TEST_ORDERS, choices=ORDER_NAMES,
                   help='held-out scan orders (the "unseen" evaluation); disjoint from --train-orders')
    g.add_argument('--no-flip', action='store_true', help='no random horizontal flips of the images in training')


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('model (the same for every method)')
    g.add_argument('--embed-dim', type=int, default=128)
    g.add_argument('--depth', type=int, default=4)
    g.add_argument('--num-heads', type=int, default=4)
    g.add_argument('--mlp-ratio', type=float, default=4.0)
    g.add_argument('--goat-modes', type=int, default=2, help='GOAT Fourier modes R per axis (d_p = 4R + 2)')
    g.add_argument('--goat-prior-init', choices=PRIOR_INITS, default='zero',
                   help='GOAT prior initialisation (paper Table 5): zero (uniform), random (seeded), alibi '
                        '(recency-like decay with distance)')
    g.add_argument('--image-attention', choices=IMAGE_ATTENTION, default='prefix',
                   help='prefix: image tokens attend bidirectionally (scan-order invariance for goat / pope / '
                        'nope); causal: causal in scan order')
    g.add_argument('--drop-path', type=float, default=0.0, help='stochastic depth rate')


def add_run_args(p: argparse.ArgumentParser, train: bool = True) -> None:
    g = p.add_argument_group('optimisation' if train else 'run')
    if train:
        g.add_argument('--epochs', type=int, default=10,
                       help='epochs over the training scenes (ignored with --updates)')
        g.add_argument('--updates', type=int, default=0, help='total optimizer updates (overrides --epochs)')
        g.add_argument('--grad-accum', type=int, default=1, help='gradient accumulation steps')
        g.add_argument('--opt', default='adamw', help='timm optimizer name')
        g.add_argument('--lr', type=float, default=1e-3)
        g.add_argument('--prior-lr-scale', type=float, default=1.0,
                       help='learning-rate multiplier of the positional-prior parameters (GOAT alpha / beta / key '
                            'default, PoPE delta); no effect on rope / nope')
        g.add_argument('--weight-decay', type=float, default=0.05)
        g.add_argument('--warmup-frac', type=float, default=0.05, help='linear warm-up, share of the updates')
        g.add_argument('--clip-grad', type=float, default=1.0, help='gradient norm clip (0 = off)')
        g.add_argument('--checkpoint-every', type=int, default=0, help='checkpoint every N updates (and at the end)')
        g.add_argument('--resume', action='store_true', help='continue from OUT/latest.json')
        g.add_argument('--stop-after', type=int, default=None, help='stop after N updates (simulates a kill)')
        g.add_argument('--log-every', type=int, default=10, help='log the training loss every N updates')
    g.add_argument('--batch-size', type=int, default=64, help='per-process batch size')
    g.add_argument('--workers', type=int, default=0, help='data loader workers')
    g.add_argument('--amp', choices=['no', 'fp16', 'bf16'], default='no', help='mixed precision')
    g.add_argument('--cpu', action='store_true', help='force CPU even when a GPU is present')
    g.add_argument('--threads', type=int, default=0,
                   help="torch CPU threads (0 = torch's default); 1 is much faster on a machine whose cores are busy")
    g.add_argument('--seed', type=int, default=0, help='training seed (model init, data order)')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='python -m recipes.spatial_vqa', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest='command', required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser('train', help='train one positional method', formatter_class=fmt)
    p.add_argument('--method', choices=POS_METHODS, default='goat', help='how position enters attention')
    p.add_argument('--out', default='outputs/spatial_vqa/run', help='run folder')
    add_data_args(p)
    add_model_args(p)
    add_run_args(p)
    p = sub.add_parser('eval', help='evaluate run folders on seen and unseen scan orders', formatter_class=fmt)
    p.add_argument('runs', nargs='+', help='run folders (or checkpoint folders) written by train / compare')
    p.add_argument('--out', default='outputs/spatial_vqa/eval', help='folder for results.json and the plot')
    add_data_args(p, for_eval=True)
    add_run_args(p, train=False)
    p = sub.add_parser('compare', help='train + eval several methods over seeds', formatter_class=fmt)
    p.add_argument('--methods', nargs='+', choices=POS_METHODS, default=list(POS_METHODS))
    p.add_argument('--seeds', type=int, nargs='+', default=[0])
    p.add_argument('--out', default='outputs/spatial_vqa', help='one run folder per method / seed, plus results')
    add_data_args(p)
    add_model_args(p)
    add_run_args(p)
    return parser


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.threads < 0:
        raise ValueError(f'--threads must be >= 0, got {args.threads}')
    previous_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return run_command(args)
    finally:
        torch.set_num_threads(previous_threads)  # main() may be called in-process (tests, notebooks)


def run_command(args: argparse.Namespace) -> Dict[str, Any]:
    """Run the parsed ``train`` / ``eval`` / ``compare`` command; returns its result (checkpoint or report)."""
    out = Path(args.out)
    if args.command == 'train':
        ckpt = run_train(args, args.method, args.seed, out)
        print(f'checkpoint: {ckpt}')
        return dict(checkpoint=str(ckpt))
    if args.command == 'eval':
        return report(run_eval(args, args.runs), args, out, 'evaluation')
    runs = []
    for method in args.methods:
        for seed in args.seeds:
            run_dir = out / method / f'seed{seed}'
            run_train(args, method, seed, run_dir)
            runs.append(str(run_dir))
    eval_args = argparse.Namespace(**{**vars(args), 'data': None, 'test_scenes': None})
    rows = run_eval(eval_args, runs)
    return report(rows, args, out, f'spatial VQA, {len(args.seeds)} seed(s), train orders '
                                   f'{", ".join(args.train_orders)}')


if __name__ == '__main__':
    main()
    close_distributed()
