"""vision_priors.recipes.data.image_pools: CIFAR-10 batch and .npz readers, their checks on damaged files, built-in
pools.

Every fault-injection test writes the damaged file into tmp_path and asserts the error type and that the
message names the file (and the offending value where there is one).
"""
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import pytest

from vision_priors.recipes.data.image_pools import (CIFAR_META_FILE, CIFAR_TEST_FILE, CIFAR_TRAIN_FILES,
                                                    SYNTHETIC_CLASSES, check_labels, load_pools, read_cifar_batches,
                                                    read_npz_pools, synthetic_pools)

SHARED_DATA = Path(__file__).resolve().parents[2] / 'shared' / 'data'
CIFAR_NPZ = SHARED_DATA / 'cifar10' / 'cifar10_test_10k_jpeg.npz'
CIFAR_NAMES = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')


def named(path: Path, detail: str = '') -> str:
    """A pytest ``match`` pattern: the file's full path, then ``detail`` (a regex) somewhere after it."""
    return re.escape(str(path)) + ('.*' + detail if detail else '')


# ------------------------------------------------------------------------------------------ CIFAR

def _batch(images: np.ndarray, labels: Any, name: str) -> Dict[bytes, Any]:
    data = images.transpose(0, 3, 1, 2).reshape(len(images), 3072)  # channel-major, as CIFAR stores it
    return {b'data': data, b'labels': labels, b'batch_label': name.encode()}


def _dump(path: Path, obj: Any, protocol: Optional[int] = None) -> None:
    with path.open('wb') as f:
        pickle.dump(obj, f, protocol=protocol)


def write_cifar_folder(folder: Path, per_batch: int = 3, protocol: Optional[int] = None) -> np.ndarray:
    """A CIFAR-10 python-batch folder with ``per_batch`` random images per batch; returns all images."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    all_images = []
    for name in list(CIFAR_TRAIN_FILES) + [CIFAR_TEST_FILE]:
        images = rng.integers(0, 256, size=(per_batch, 32, 32, 3), dtype=np.uint8)
        all_images.append(images)
        _dump(folder / name, _batch(images, [int(v) for v in rng.integers(0, 10, per_batch)], name), protocol)
    _dump(folder / CIFAR_META_FILE, {b'label_names': [n.encode() for n in CIFAR_NAMES]}, protocol)
    return np.concatenate(all_images)


@pytest.fixture
def cifar(tmp_path) -> Path:
    folder = tmp_path / 'cifar-10-batches-py'
    write_cifar_folder(folder)
    return folder


def test_cifar_batch_reader(tmp_path):
    root = tmp_path / 'cifar'
    images = write_cifar_folder(root / 'cifar-10-batches-py')
    train = read_cifar_batches(root, 'train')  # finds the nested cifar-10-batches-py folder
    test = read_cifar_batches(root / 'cifar-10-batches-py', 'test')
    assert train.images.shape == (15, 32, 32, 3) and test.images.shape == (3, 32, 32, 3)
    assert np.array_equal(train.images, images[:15]) and np.array_equal(test.images, images[15:])
    assert train.class_names[3] == 'cat' and train.labels.dtype == np.int64 and len(train.labels) == 15
    (root / 'cifar-10-batches-py' / 'data_batch_4').unlink()
    with pytest.raises(FileNotFoundError, match=r"cifar-10-batches-py has no file 'data_batch_4'"):
        read_cifar_batches(root, 'train')
    assert len(read_cifar_batches(root, 'test').labels) == 3  # the test split does not need it
    _dump(root / 'cifar-10-batches-py' / 'test_batch', {b'labels': [0]})
    with pytest.raises(ValueError, match=r"test_batch is not a CIFAR-10 batch: expected b'data'"):
        read_cifar_batches(root, 'test')
    with pytest.raises(FileNotFoundError, match=r"empty has no file 'batches.meta'"):
        (tmp_path / 'empty').mkdir()
        read_cifar_batches(tmp_path / 'empty', 'test')


@pytest.mark.parametrize('protocol', [2, 3, 4, 5])
def test_cifar_reader_accepts_every_pickle_protocol(tmp_path, protocol):
    images = write_cifar_folder(tmp_path / 'c', protocol=protocol)
    assert np.array_equal(read_cifar_batches(tmp_path / 'c', 'test').images, images[15:])


def test_cifar_reader_accepts_python2_era_numpy_module_names(cifar):
    """The official batches (pickled by Python 2) name numpy.core.multiarray, not numpy 2's numpy._core."""
    raw = pickle.dumps(_batch(np.full((2, 32, 32, 3), 7, np.uint8), [1, 2], 'test'), protocol=2)
    assert b'numpy._core.multiarray' in raw
    (cifar / CIFAR_TEST_FILE).write_bytes(raw.replace(b'numpy._core.multiarray', b'numpy.core.multiarray'))
    pool = read_cifar_batches(cifar, 'test')
    assert pool.labels.tolist() == [1, 2] and (pool.images == 7).all()


class _CallsPrint:
    def __reduce__(self):
        return print, ('unpickling called print',)


@pytest.mark.parametrize('damage, detail', [
    (lambda raw: raw[:len(raw) // 2], r'not a readable CIFAR-10 pickle'),                    # truncated
    (lambda raw: np.random.default_rng(0).bytes(4000), r'not a readable CIFAR-10 pickle'),   # random bytes
    (lambda raw: b'', r'not a readable CIFAR-10 pickle \(EOFError'),                        # zero bytes
    (lambda raw: pickle.dumps([1, 2, 3]), r'holds a list, expected a dict'),
    (lambda raw: pickle.dumps({b'data': _CallsPrint()}), r'global builtins.print is not allowed'),
])
def test_damaged_cifar_pickles_name_the_file(cifar, capsys, damage, detail):
    path = cifar / 'data_batch_3'
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=named(path, detail)):
        read_cifar_batches(cifar, 'train')
    assert 'unpickling called print' not in capsys.readouterr().out  # refused, never called


def _good_images(n: int = 3) -> np.ndarray:
    return np.zeros((n, 32, 32, 3), np.uint8)


@pytest.mark.parametrize('batch, detail', [
    ({b'data': np.zeros((3, 3071), np.uint8), b'labels': [0, 1, 2]},
     r"b'data' has shape \(3, 3071\) dtype uint8, expected \(N, 3072\) uint8"),
    ({b'data': np.zeros((3, 3072), np.float32), b'labels': [0, 1, 2]}, r'dtype float32, expected \(N, 3072\) uint8'),
    ({b'data': np.zeros(3072, np.uint8), b'labels': [0]}, r"b'data' has shape \(3072,\)"),
    ({b'data': np.zeros((0, 3072), np.uint8), b'labels': []}, r'holds no images \(N = 0\)'),
    (_batch(_good_images(), [0, 1], 'x'), r'labels have shape \(2,\) for 3 images'),
    (_batch(_good_images(), [0, 10, 2], 'x'), r'label 10 at index 1 is outside 0..9 \(10 class names\)'),
    (_batch(_good_images(), [0, 1, -3], 'x'), r'negative label -3 at index 2'),
    (_batch(_good_images(), [0.0, 1.5, 2.0], 'x'), r'dtype float64, expected integer .* label 1.5 at index 1'),
    (_batch(_good_images(), ['a', 'b', 'c'], 'x'), r"dtype <U1, expected integer .* label 'a' at index 0"),
])
def test_malformed_cifar_batches_name_the_file_and_value(cifar, batch, detail):
    path = cifar / CIFAR_TEST_FILE
    _dump(path, batch)
    with pytest.raises(ValueError, match=named(path, detail)):
        read_cifar_batches(cifar, 'test')


@pytest.mark.parametrize('meta, detail', [
    ([b'cat'], r'holds a list, expected a dict'),
    ({b'names': []}, r"has no b'label_names' entry"),
    ({b'label_names': []}, r'class names must be a non-empty 1-D array of strings'),
    ({b'label_names': [1, 2]}, r'class names must be .* dtype int64'),
    ({b'label_names': [b'cat', b'cat']}, r"class names repeat: \['cat', 'cat'\]"),
])
def test_malformed_cifar_meta_names_the_file(cifar, meta, detail):
    path = cifar / CIFAR_META_FILE
    _dump(path, meta)
    with pytest.raises(ValueError, match=named(path, detail)):
        read_cifar_batches(cifar, 'test')


def test_labels_of_a_later_batch_are_checked_against_the_meta_names(cifar):
    _dump(cifar / CIFAR_META_FILE, {b'label_names': [b'a', b'b']})
    with pytest.raises(ValueError, match=named(cifar / 'data_batch_1', r'is outside 0..1 \(2 class names\)')):
        read_cifar_batches(cifar, 'train')


# -------------------------------------------------------------------------------------------- npz

def test_npz_reader_and_disjoint_deterministic_split(tmp_path):
    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(5), 10)
    images = rng.integers(0, 256, size=(50, 32, 32, 3), dtype=np.uint8)
    path = tmp_path / 'subset.npz'
    np.savez(path, images=images, labels=labels, class_names=np.array([f'k{i}' for i in range(5)]))
    train, test = read_npz_pools(path, 0.2, seed=3)
    assert not set(train.indices) & set(test.indices)
    assert sorted(np.concatenate([train.indices, test.indices]).tolist()) == list(range(50))
    assert np.bincount(test.labels).tolist() == [2] * 5 and np.bincount(train.labels).tolist() == [8] * 5
    assert np.array_equal(test.images, images[test.indices]) and np.array_equal(train.labels, labels[train.indices])
    assert test.class_names == [f'k{i}' for i in range(5)]
    again, _ = read_npz_pools(path, 0.2, seed=3)
    other, _ = read_npz_pools(path, 0.2, seed=4)
    assert np.array_equal(again.indices, train.indices) and not np.array_equal(other.indices, train.indices)
    # compressed archives, uint8 labels and no class names: names class0..classK-1
    np.savez_compressed(tmp_path / 'plain.npz', images=images, labels=labels.astype(np.uint8))
    train, _ = read_npz_pools(tmp_path / 'plain.npz', 0.2, seed=3)
    assert train.class_names == [f'class{i}' for i in range(5)] and train.labels.dtype == np.int64


def _save(path: Path, **arrays: Any) -> Path:
    np.savez(path, **arrays)
    return path


def _labels(n: int = 10) -> np.ndarray:
    return np.arange(n) % 2


def test_missing_npz_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=named(tmp_path / 'missing.npz', 'does not exist')):
        read_npz_pools(tmp_path / 'missing.npz', 0.2, 0)


@pytest.mark.parametrize('content, detail', [
    (b'', r'is empty \(0 bytes\)'),
    (np.random.default_rng(0).bytes(3000), r'not a readable .npz archive \(no zip header\)'),
    (b'PK\x03\x04' + np.random.default_rng(1).bytes(3000), r'not a readable .npz archive \(BadZipFile'),
])
def test_empty_and_random_npz_files(tmp_path, content, detail):
    path = tmp_path / 'data.npz'
    path.write_bytes(content)
    with pytest.raises(ValueError, match=named(path, detail)):
        read_npz_pools(path, 0.2, 0)


def test_npy_array_named_npz(tmp_path):
    path = tmp_path / 'array.npz'
    with path.open('wb') as f:
        np.save(f, _good_images())
    with pytest.raises(ValueError, match=named(path, r'an \.npy array, not an archive')):
        read_npz_pools(path, 0.2, 0)


def test_truncated_npz(tmp_path):
    path = _save(tmp_path / 'cut.npz', images=_good_images(10), labels=_labels())
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ValueError, match=named(path, r'not a readable .npz archive')):
        read_npz_pools(path, 0.2, 0)


def test_npz_with_a_corrupted_member(tmp_path):
    """Bytes flipped inside the images array: the zip CRC check fails when the array is read."""
    path = _save(tmp_path / 'flipped.npz', images=np.full((10, 32, 32, 3), 9, np.uint8), labels=_labels())
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo('images.npy')
    middle = info.header_offset + 30 + len(info.filename) + info.compress_size // 2
    raw[middle:middle + 16] = bytes(16)
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=named(path, r'not a readable .npz archive \(BadZipFile: Bad CRC-32')):
        read_npz_pools(path, 0.2, 0)


def test_npz_with_pickled_object_arrays_is_refused(tmp_path):
    path = _save(tmp_path / 'objects.npz', images=_good_images(10), labels=np.array([0, 1] * 5, dtype=object))
    with pytest.raises(ValueError, match=named(path, r'not a readable .npz archive \(ValueError: Object arrays')):
        read_npz_pools(path, 0.2, 0)


@pytest.mark.parametrize('arrays, detail', [
    (dict(images=_good_images(10)), r"has no 'labels' array \(found \['images'\]\)"),
    (dict(labels=_labels()), r"has no 'images' array"),
    (dict(images=np.zeros((10, 32, 32, 3), np.float32), labels=_labels()),
     r'images have shape \(10, 32, 32, 3\) dtype float32, expected \(N, 32, 32, 3\) uint8'),
    (dict(images=np.zeros((10, 3, 32, 32), np.uint8), labels=_labels()), r'images have shape \(10, 3, 32, 32\)'),
    (dict(images=np.zeros((10, 32, 32), np.uint8), labels=_labels()), r'images have shape \(10, 32, 32\)'),
    (dict(images=_good_images(0), labels=_labels(0)), r'holds no images \(N = 0\)'),
    (dict(images=_good_images(10), labels=_labels(9)), r'labels have shape \(9,\) for 10 images'),
    (dict(images=_good_images(10), labels=_labels()[:, None]), r'labels have shape \(10, 1\) for 10 images'),
    (dict(images=_good_images(4), labels=np.array([0.0, 0.7, 1.7, 1.0])),
     r'labels have dtype float64, expected integer class indices; first non-integer label 0.7 at index 1'),
    (dict(images=_good_images(4), labels=np.array([0.0, 1.0, 1.0, 0.0])), r'all values are whole numbers'),
    (dict(images=_good_images(4), labels=np.array([0.0, 1.0, np.nan, 0.0])), r'first non-integer label nan at index 2'),
    (dict(images=_good_images(4), labels=np.array([True, False, True, False])), r'labels have dtype bool'),
    (dict(images=_good_images(4), labels=np.array([0, 1, -1, 0])), r'negative label -1 at index 2'),
    (dict(images=_good_images(4), labels=np.array([0, 1, 2, 0]), class_names=np.array(['a', 'b'])),
     r'label 2 at index 2 is outside 0..1 \(2 class names\)'),
    (dict(images=_good_images(4), labels=np.array([0, 1, 1000, 0])), r'label 1000 at index 2 implies more classes'),
    (dict(images=_good_images(4), labels=np.array([0, 1, 1, 0]), class_names=np.array([1, 2])),
     r'class names must be a non-empty 1-D array of strings'),
    (dict(images=_good_images(4), labels=np.array([0, 1, 1, 0]), class_names=np.array(['a', 'a'])),
     r'class names repeat'),
    (dict(images=_good_images(2), labels=np.array([0, 1])), r'leaves an empty test pool'),
])
def test_malformed_npz_arrays_name_the_file_and_value(tmp_path, arrays, detail):
    path = _save(tmp_path / 'bad.npz', **arrays)
    with pytest.raises(ValueError, match=named(path, detail)):
        read_npz_pools(path, 0.2, 0)


def test_check_labels_directly():
    assert check_labels([3, 0, 1], 'src', 3, 4).tolist() == [3, 0, 1]
    with pytest.raises(ValueError, match=r'^src: labels have dtype float32'):
        check_labels(np.array([1.25], np.float32), 'src', 1)
    with pytest.raises(ValueError, match=r'^src: label 4 at index 0 is outside 0..3'):
        check_labels(np.array([4], np.uint8), 'src', 1, 4)


# ------------------------------------------------------------------------------------- load_pools

def test_load_pools_dispatches_on_the_data_source(tmp_path, cifar):
    train, test = load_pools(None, 0, 0.2, (2, 1))
    assert len(train.labels) == 20 and len(test.labels) == 10 and train.source == 'builtin:train'
    train, test = load_pools(str(cifar.parent), 0, 0.2, (2, 1))
    assert len(train.labels) == 15 and len(test.labels) == 3
    path = _save(tmp_path / 'x.npz', images=_good_images(10), labels=_labels())
    assert [len(p.labels) for p in load_pools(str(path), 0, 0.2, (2, 1))] == [8, 2]
    with pytest.raises(FileNotFoundError, match=named(tmp_path / 'nowhere', 'does not exist: expected a CIFAR-10')):
        load_pools(str(tmp_path / 'nowhere'), 0, 0.2, (2, 1))
    (tmp_path / 'cifar-10-python.tar.gz').write_bytes(b'\x1f\x8b')
    with pytest.raises(ValueError, match=named(tmp_path / 'cifar-10-python.tar.gz', 'is a file but not an .npz')):
        load_pools(str(tmp_path / 'cifar-10-python.tar.gz'), 0, 0.2, (2, 1))


# --------------------------------------------------------------------------------------- built-in

def test_builtin_pools_are_deterministic_disjoint_and_learnable_by_colour():
    train, test = synthetic_pools(4, 2, seed=7)
    again, _ = synthetic_pools(4, 2, seed=7)
    other, _ = synthetic_pools(4, 2, seed=8)
    assert np.array_equal(train.images, again.images) and not np.array_equal(train.images, other.images)
    assert train.images.shape == (40, 32, 32, 3) and test.images.shape == (20, 32, 32, 3)
    assert not any((test.images[i] == train.images).all(axis=(1, 2, 3)).any() for i in range(20))
    # nearest class-mean colour classifies the test pool: the classes can be told apart
    means = np.stack([train.images[train.labels == c].reshape(-1, 3).mean(0) for c in range(10)])
    pred = np.linalg.norm(test.images.reshape(20, -1, 3).mean(1)[:, None] - means[None], axis=-1).argmin(1)
    assert (pred == test.labels).mean() >= 0.9
    assert train.class_names == list(SYNTHETIC_CLASSES)


# ------------------------------------------------------------------------------------------ real

@pytest.mark.skipif(not CIFAR_NPZ.exists(), reason=f'{CIFAR_NPZ} not present (../shared/data is absent)')
def test_real_cifar_subset_npz():
    train, test = read_npz_pools(CIFAR_NPZ, 0.2, seed=0)
    assert len(train.labels) == 8000 and len(test.labels) == 2000
    assert not set(train.indices) & set(test.indices)
    assert np.bincount(test.labels).tolist() == [200] * 10
    assert 'cat' in train.class_names and train.images.dtype == np.uint8
