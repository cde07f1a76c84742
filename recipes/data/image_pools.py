"""Labelled 32x32 RGB image pools: CIFAR-10 python batches, an ``.npz`` split per class, or built-in images.

Reads a folder of CIFAR-10's python-version batches (``data_batch_1..5``, ``test_batch``,
``batches.meta``: pickled dicts, read directly, no download, no checksum), or an ``.npz`` with
``images`` (N, 32, 32, 3) uint8, integer ``labels`` (N,) and optional ``class_names`` (split per class,
deterministically, into disjoint train / test pools). Makes built-in procedural images in 10 classes
(a colour and a texture per class) when there is no file. Every reader checks what it reads and raises
an error naming the file and, where there is one, the offending value.
"""
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

__all__ = ['IMAGE_SIZE', 'CIFAR_MEAN', 'CIFAR_STD', 'CIFAR_TRAIN_FILES', 'CIFAR_TEST_FILE', 'CIFAR_META_FILE',
           'SYNTHETIC_CLASSES', 'ImagePool', 'check_labels', 'resolve_cifar_folder', 'read_cifar_batches',
           'split_indices_per_class', 'read_npz_pools', 'synthetic_images', 'synthetic_pools', 'load_pools',
           'CIFAR10_DOWNLOAD_ROOT', 'cifar10_pools', 'PoolImages']

IMAGE_SIZE = 32
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CIFAR_TRAIN_FILES = tuple(f'data_batch_{i}' for i in range(1, 6))
CIFAR_TEST_FILE = 'test_batch'
CIFAR_META_FILE = 'batches.meta'
_NPZ_LAYOUT = 'images (N, 32, 32, 3) uint8 and integer labels (N,), optional class_names (K,)'
SYNTHETIC_CLASSES = ('red-hstripes', 'green-vstripes', 'blue-checker', 'yellow-diag', 'magenta-dots',
                     'cyan-rings', 'orange-antidiag', 'purple-grid', 'white-noise', 'olive-plain')
# the only globals a CIFAR-10 batch pickle needs (numpy arrays; Python 3's protocol 2 encodes bytes with
# _codecs.encode); anything else is refused instead of being imported and called by the unpickler
_PICKLE_GLOBALS = frozenset({
    ('numpy', 'ndarray'), ('numpy', 'dtype'), ('_codecs', 'encode'),
    *((module, name) for module in ('numpy.core.multiarray', 'numpy._core.multiarray')
      for name in ('_reconstruct', 'scalar')),
    *((module, '_frombuffer') for module in ('numpy.core.numeric', 'numpy._core.numeric')),
})


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


# ------------------------------------------------------------------------------------- validation

def _first(values: np.ndarray, bad: np.ndarray) -> str:
    """'VALUE at index I' for the first True entry of ``bad``."""
    index = int(np.flatnonzero(bad)[0])
    return f'{values[index].item()!r} at index {index}'


def check_labels(labels: Any, source: Union[str, Path], num_images: int,
                 num_classes: Optional[int] = None) -> np.ndarray:
    """``labels`` as (N,) int64 class indices, or ValueError naming ``source`` and the first bad value.

    Labels must have an integer dtype: float labels are refused even when every value is a whole number
    (the message says so and how to convert them), so 0.7 is never silently truncated to 0 and NaN never
    becomes a huge integer. They must be non-negative and, given ``num_classes``, below it.
    """
    labels = np.asarray(labels)
    if labels.shape != (num_images,):
        raise ValueError(f'{source}: labels have shape {labels.shape} for {num_images} images; expected '
                         f'({num_images},), one label per image')
    if labels.dtype.kind not in 'iu':
        bad = np.ones(labels.shape, dtype=bool)
        if labels.dtype.kind == 'f':
            bad = ~np.isfinite(labels) | (labels != np.round(labels))
        detail = (f'; first non-integer label {_first(labels, bad)}' if bad.any() else
                  '; all values are whole numbers: store them as integers, e.g. labels.astype(np.int64)')
        raise ValueError(f'{source}: labels have dtype {labels.dtype}, expected integer class indices{detail}')
    if (labels < 0).any():
        raise ValueError(f'{source}: negative label {_first(labels, labels < 0)}; expected class indices >= 0')
    if num_classes is not None and (labels >= num_classes).any():
        raise ValueError(f'{source}: label {_first(labels, labels >= num_classes)} is outside 0..{num_classes - 1} '
                         f'({num_classes} class names)')
    return labels.astype(np.int64)


def _check_class_names(names: Any, source: Union[str, Path]) -> List[str]:
    """A non-empty 1-D sequence of distinct str / bytes names, as a list of str."""
    names = np.asarray(names)
    if names.ndim != 1 or not len(names) or names.dtype.kind not in 'US':
        raise ValueError(f'{source}: class names must be a non-empty 1-D array of strings, got shape '
                         f'{names.shape} dtype {names.dtype}')
    decoded = [n.decode() if isinstance(n, bytes) else n for n in names.tolist()]
    if len(set(decoded)) != len(decoded):
        raise ValueError(f'{source}: class names repeat: {decoded}')
    return decoded


# ------------------------------------------------------------------------------------------- CIFAR

class _BatchUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only (see ``_PICKLE_GLOBALS``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f'global {module}.{name} is not allowed in a CIFAR-10 batch')
        return super().find_class(module, name)


def _load_pickle(path: Path) -> Dict[bytes, Any]:
    """The dict pickled in ``path``; ValueError naming the file when it is damaged or not a dict."""
    try:
        with path.open('rb') as f:
            data = _BatchUnpickler(f, encoding='bytes').load()
    except Exception as e:  # damaged pickles raise many types: UnpicklingError, EOFError, ValueError, KeyError, ...
        raise ValueError(f'{path} is not a readable CIFAR-10 pickle ({type(e).__name__}: {e})') from e
    if not isinstance(data, dict):
        raise ValueError(f'{path} holds a {type(data).__name__}, expected a dict (a CIFAR-10 python batch)')
    return data


def resolve_cifar_folder(folder: Path) -> Path:
    """``folder`` or its ``cifar-10-batches-py`` subfolder, whichever holds ``batches.meta``."""
    nested = folder / 'cifar-10-batches-py'
    if not (folder / CIFAR_META_FILE).exists() and nested.is_dir():
        return nested
    return folder


def _read_cifar_batch(path: Path, num_classes: int) -> Tuple[np.ndarray, np.ndarray]:
    """(images (N, 32, 32, 3) uint8, labels (N,) int64) of one batch file, checked."""
    batch = _load_pickle(path)
    if b'data' not in batch or b'labels' not in batch:
        raise ValueError(f"{path} is not a CIFAR-10 batch: expected b'data' and b'labels', found {sorted(batch)}")
    data = np.asarray(batch[b'data'])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * IMAGE_SIZE * IMAGE_SIZE:
        raise ValueError(f"{path}: b'data' has shape {data.shape} dtype {data.dtype}, expected (N, 3072) uint8")
    if not len(data):
        raise ValueError(f'{path} holds no images (N = 0)')
    labels = check_labels(batch[b'labels'], path, len(data), num_classes)
    return data.reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE).transpose(0, 2, 3, 1), labels


def read_cifar_batches(folder: Path, split: str) -> ImagePool:
    """Read CIFAR-10's python-version batches from ``folder`` (no download, no checksum).

    Args:
        folder: Holds ``data_batch_1..5``, ``test_batch`` and ``batches.meta`` (pickled dicts with
            b'data' (N, 3072) uint8, channel-major, and b'labels'; meta with b'label_names'), or a
            ``cifar-10-batches-py`` subfolder that does.
        split: 'train' (the five data batches) or 'test' (``test_batch``).

    Raises:
        FileNotFoundError: naming the folder and the missing file.
        ValueError: naming the file: a damaged pickle, not a dict, no b'data' / b'labels', wrong shape or
            dtype, no images, labels that are not integers in 0..K-1 (K = number of label names).
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
    class_names = _check_class_names(meta[b'label_names'], folder / CIFAR_META_FILE)
    batches = [_read_cifar_batch(folder / name, len(class_names)) for name in names]
    labels = np.concatenate([b[1] for b in batches])
    return ImagePool(np.ascontiguousarray(np.concatenate([b[0] for b in batches])), labels, class_names,
                     np.arange(len(labels)), f'{folder}:{split}')


# --------------------------------------------------------------------------------------------- npz

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


def _unreadable_npz(path: Path, reason: str) -> ValueError:
    return ValueError(f'{path} is not a readable .npz archive ({reason}); expected {_NPZ_LAYOUT}')


def _read_npz(path: Path) -> Dict[str, np.ndarray]:
    """``images``, ``labels`` and (when present) ``class_names`` of an ``.npz``; errors name the file."""
    if not path.is_file():
        raise FileNotFoundError(f'npz file {path} does not exist (expected keys {_NPZ_LAYOUT})')
    with path.open('rb') as f:
        head = f.read(6)
    if not head:
        raise ValueError(f'npz file {path} is empty (0 bytes); expected an .npz archive with {_NPZ_LAYOUT}')
    if not head.startswith((b'PK\x03\x04', b'PK\x05\x06')):  # an .npz is a zip archive
        raise _unreadable_npz(path, 'an .npy array, not an archive' if head == b'\x93NUMPY' else 'no zip header')
    # numpy, zipfile and zlib raise many types on damaged archives: one message for all of them
    try:
        archive = np.load(path, allow_pickle=False)
    except Exception as e:
        raise _unreadable_npz(path, f'{type(e).__name__}: {e}') from e
    with archive:
        for key in ('images', 'labels'):
            if key not in archive.files:
                raise ValueError(f'{path} has no {key!r} array (found {archive.files}); expected {_NPZ_LAYOUT}')
        try:
            return {key: archive[key] for key in ('images', 'labels', 'class_names') if key in archive.files}
        except Exception as e:
            raise _unreadable_npz(path, f'{type(e).__name__}: {e}') from e


def read_npz_pools(path: Path, test_fraction: float, seed: int) -> Tuple[ImagePool, ImagePool]:
    """Read an ``.npz`` with ``images`` (N, 32, 32, 3) uint8 and ``labels`` and split it into disjoint pools.

    ``class_names`` is used when present (labels must then lie in 0..K-1). The split is per class and
    deterministic in ``seed`` (``split_indices_per_class``); this is how the 10,000-image CIFAR-10 subset is
    used.

    Raises:
        FileNotFoundError: no such file.
        ValueError: naming the file: empty or unreadable, a missing array, images of another shape or
            dtype, no images, labels not integer class indices (``check_labels``), a split pool that would
            be empty.
    """
    path = Path(path)
    data = _read_npz(path)
    images = data['images']
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(f'{path}: images have shape {images.shape} dtype {images.dtype}, expected (N, 32, 32, 3) '
                         f'uint8')
    if not len(images):
        raise ValueError(f'{path} holds no images (N = 0)')
    class_names = _check_class_names(data['class_names'], path) if 'class_names' in data else None
    labels = check_labels(data['labels'], path, len(images), None if class_names is None else len(class_names))
    if class_names is None:  # classes class0..classK-1; more classes than images means these are not class indices
        if labels.max() >= len(labels):
            raise ValueError(f'{path}: label {_first(labels, labels == labels.max())} implies more classes than '
                             f'the {len(labels)} images; expected class indices, or add a class_names array')
        class_names = [f'class{c}' for c in range(int(labels.max()) + 1)]
    train, test = split_indices_per_class(labels, test_fraction, seed)
    if not len(train) or not len(test):
        raise ValueError(f'{path}: a test fraction of {test_fraction} of {len(labels)} images leaves an empty '
                         f'{"train" if not len(train) else "test"} pool')
    return (ImagePool(images[train], labels[train], class_names, train, f'{path}:train'),
            ImagePool(images[test], labels[test], class_names, test, f'{path}:test'))


# --------------------------------------------------------------------------------------- built-in

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
               synthetic_per_class: Sequence[int]) -> Tuple[ImagePool, ImagePool]:
    """(train pool, test pool) for ``--data``: a CIFAR batch folder, an ``.npz`` or None (built-in)."""
    if data is None:
        return synthetic_pools(synthetic_per_class[0], synthetic_per_class[1], data_seed)
    path = Path(data)
    if path.suffix == '.npz':
        return read_npz_pools(path, npz_test_fraction, data_seed)
    expected = (f'a CIFAR-10 python-batch folder ({", ".join(CIFAR_TRAIN_FILES)}, {CIFAR_TEST_FILE}, '
                f'{CIFAR_META_FILE}) or an .npz file')
    if path.is_file():
        raise ValueError(f'--data {path} is a file but not an .npz: expected {expected}')
    if not path.is_dir():
        raise FileNotFoundError(f'--data {path} does not exist: expected {expected}')
    return read_cifar_batches(path, 'train'), read_cifar_batches(path, 'test')


# ----------------------------------------------------------------------------- CIFAR-10 for classification

CIFAR10_PREFIX = 'cifar10'
CIFAR10_DOWNLOAD_ROOT = Path.home() / '.cache' / 'vision_priors' / 'cifar10'


def cifar10_pools(spec: str, data_seed: int, npz_test_fraction: float = 0.2,
                  download_root: Optional[Path] = None) -> Tuple[ImagePool, ImagePool]:
    """(train, test) CIFAR-10 pools for ``--data cifar10`` (torchvision's downloader: the python batches, cached
    under ``download_root``) or ``--data cifar10:PATH`` (a folder of the python batches, read directly, or an
    ``.npz`` of ``images`` / ``labels`` split per class into disjoint pools by ``data_seed``; no network).

    Raises:
        ValueError: a spec that is not ``cifar10`` or ``cifar10:PATH``; everything the readers raise.
        RuntimeError: the download failed (offline), naming the URL's dataset and the offline alternatives.
    """
    if spec == CIFAR10_PREFIX:
        root = Path(download_root or CIFAR10_DOWNLOAD_ROOT)
        folder = root / 'cifar-10-batches-py'
        if not (folder / CIFAR_META_FILE).is_file():
            from torchvision.datasets import CIFAR10
            try:
                CIFAR10(str(root), train=True, download=True)
            except Exception as e:  # URLError, socket errors, checksum mismatch
                raise RuntimeError(
                    f'--data cifar10: downloading CIFAR-10 into {root} failed ({type(e).__name__}: {e}); offline, '
                    f'pass --data cifar10:FOLDER (the python batches) or --data cifar10:FILE.npz') from e
        return read_cifar_batches(folder, 'train'), read_cifar_batches(folder, 'test')
    if not spec.startswith(CIFAR10_PREFIX + ':') or len(spec) == len(CIFAR10_PREFIX) + 1:
        raise ValueError(f"--data {spec!r}: expected 'cifar10' (download) or 'cifar10:PATH' (a folder of the "
                         f'python batches or an .npz)')
    return load_pools(spec[len(CIFAR10_PREFIX) + 1:], data_seed, npz_test_fraction, (1, 1))


class PoolImages(Dataset):
    """A pool as a classification dataset: ``(transform(PIL RGB image), label)``."""

    def __init__(self, pool: ImagePool, transform: Optional[Callable] = None) -> None:
        self.pool, self.transform = pool, transform
        self.num_classes = len(pool.class_names)
        self.classes = list(pool.class_names)

    def __len__(self) -> int:
        return len(self.pool.labels)

    def __getitem__(self, index: int):
        image = Image.fromarray(self.pool.images[index], mode='RGB')
        return (self.transform(image) if self.transform is not None else image), int(self.pool.labels[index])

