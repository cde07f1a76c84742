"""vision_priors.recipes.data.image_folders: class-folder checks, StrictImages decoding, webdataset folder and split
checks.

Every fault-injection test writes the damaged folder or file into tmp_path and asserts the error type and
that the message names the folder or file (and what was expected).
"""
import io
import json
import re
import shutil
import tarfile
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
import pytest
from PIL import Image

from vision_priors.recipes.data.image_folders import (StrictImages, check_image_folder, check_wds_folder, data_kind,
                                                      wds_root, wds_shards)

SHARED_DATA = Path(__file__).resolve().parents[2] / 'shared' / 'data'
IMAGENET_SAMPLES = SHARED_DATA / 'imagenet_samples'


def named(path: Path, detail: str = '') -> str:
    """A pytest ``match`` pattern: the full path, then ``detail`` (a regex) somewhere after it."""
    return re.escape(str(path)) + ('.*' + detail if detail else '')


def _image(value: int, size=(12, 10), mode: str = 'RGB') -> Image.Image:
    channels = 3 if mode == 'RGB' else 1
    array = np.full((size[1], size[0], channels), value, np.uint8)
    return Image.fromarray(array[..., 0] if channels == 1 else array, mode)


def make_folder(root: Path, layout: Dict[str, Sequence[str]], split: str = 'train') -> Path:
    """``root/split/<class>/<file>`` for ``layout`` = {class: file names}; image k of a class has value 20 k."""
    for cls, names in layout.items():
        (root / split / cls).mkdir(parents=True, exist_ok=True)
        for k, name in enumerate(names):
            _image(20 * k).save(root / split / cls / name)
    return root


def test_data_kind():
    assert data_kind(None) == 'builtin' and data_kind('wds:/x') == 'wds' and data_kind('/data/imagenet') == 'folder'


# ---------------------------------------------------------------------------------- image folders

def test_strict_images_reads_classes_and_images_like_timm(tmp_path):
    root = make_folder(tmp_path, {'b_dog': ['0.png', '1.PNG'], 'a_cat': ['x.jpg'], 'c10': ['y.jpeg'],
                                  'c9': ['z.png']})
    _image(7, mode='L').save(root / 'train' / 'a_cat' / 'grey.png')
    (root / 'train' / 'a_cat' / 'notes.txt').write_text('not an image: ignored')
    data = StrictImages(root, 'train')
    assert data.class_to_idx == {'a_cat': 0, 'b_dog': 1, 'c9': 2, 'c10': 3}  # timm's natural sort
    assert len(data) == 6 and data.num_classes == 4
    items = [data[i] for i in range(len(data))]
    assert all(image.mode == 'RGB' and image.size == (12, 10) for image, _ in items)  # greyscale -> RGB
    assert sorted(label for _, label in items) == [0, 0, 1, 1, 2, 3]
    grey = [i for i in range(len(data)) if data.filename(i).endswith('grey.png')][0]
    assert data.filename(grey) == str(root / 'train' / 'a_cat' / 'grey.png')
    assert np.asarray(items[grey][0]).tolist()[0][0] == [7, 7, 7]
    sized = StrictImages(root, 'train', transform=lambda image: image.size)
    assert sized[0] == ((12, 10), 0)


def test_image_folder_checks(tmp_path):
    with pytest.raises(FileNotFoundError, match=named(tmp_path / 'train', r'does not exist \(expected ')):
        check_image_folder(tmp_path, 'train')
    (tmp_path / 'train').mkdir()
    with pytest.raises(ValueError, match=named(tmp_path / 'train', 'has no class subfolders')):
        StrictImages(tmp_path, 'train')
    make_folder(tmp_path, {'a': ['0.jpg']})
    (tmp_path / 'train' / 'b').mkdir()
    with pytest.raises(ValueError, match=named(tmp_path / 'train' / 'b', 'is empty: no image files')):
        StrictImages(tmp_path, 'train')
    # timm's reader ignores .bmp files, so a class folder of .bmp images counts as empty
    _image(1).save(tmp_path / 'train' / 'b' / '0.bmp')
    with pytest.raises(ValueError, match=named(tmp_path / 'train' / 'b', r'is empty: no image files \(.jpeg, .jpg')):
        check_image_folder(tmp_path, 'train')
    _image(1).save(tmp_path / 'train' / 'b' / '0.JPG')  # any case
    assert check_image_folder(tmp_path, 'train') == tmp_path / 'train'


def test_images_outside_the_class_folders_are_an_error(tmp_path):
    root = make_folder(tmp_path / 'stray', {'a': ['0.jpg'], 'b': ['0.jpg']})
    _image(3).save(root / 'train' / 'loose.jpg')  # timm would label it as a class named ''
    with pytest.raises(ValueError, match=named(root / 'train', r"images in folders \[''\] that are not its class")):
        StrictImages(root, 'train')
    nested = make_folder(tmp_path / 'nested', {'a': ['0.jpg'], 'b': ['0.jpg']})
    (nested / 'train' / 'b' / 'sub').mkdir()
    _image(3).save(nested / 'train' / 'b' / 'sub' / '1.jpg')  # timm would label it 'sub'
    with pytest.raises(ValueError, match=named(nested / 'train', r"images in folders \['sub'\]")):
        StrictImages(nested, 'train')


@pytest.mark.parametrize('damage', [
    lambda raw: b'not a jpeg at all',
    lambda raw: b'',
    lambda raw: raw[:len(raw) // 3],                              # truncated JPEG: fails while decoding
    lambda raw: np.random.default_rng(0).bytes(len(raw)),
])
def test_undecodable_image_is_named_not_skipped(tmp_path, damage):
    root = tmp_path
    (root / 'train' / 'a').mkdir(parents=True)
    for k in range(3):
        noise = np.random.default_rng(k).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(noise).save(root / 'train' / 'a' / f'{k}.jpg', quality=90)
    bad = root / 'train' / 'a' / '1.jpg'
    bad.write_bytes(damage(bad.read_bytes()))
    data = StrictImages(root, 'train')
    assert data[0][0].size == (64, 64) and data[2][0].size == (64, 64)
    with pytest.raises(ValueError, match=named(bad, 'not a decodable image file')):
        data[1]  # timm's ImageDataset would log a warning and return image 2 instead


@pytest.mark.skipif(not IMAGENET_SAMPLES.is_dir(), reason=f'{IMAGENET_SAMPLES} not present (../shared/data is absent)')
def test_real_imagenet_samples_decode(tmp_path):
    """Real JPEGs (upper-case .JPEG, one greyscale) in a two-class folder built in tmp_path."""
    picks = {'n03908714': 'n03908714_pencil_sharpener.JPEG', 'n01440764': 'n01440764_tench.JPEG'}
    for wnid, name in picks.items():
        (tmp_path / 'val' / wnid).mkdir(parents=True)
        shutil.copy(IMAGENET_SAMPLES / name, tmp_path / 'val' / wnid / name)
    data = StrictImages(tmp_path, 'val')
    assert data.class_to_idx == {'n01440764': 0, 'n03908714': 1}
    modes = {Image.open(IMAGENET_SAMPLES / picks[w]).mode: data[i] for i, w in enumerate(sorted(picks))}
    assert set(modes) == {'RGB', 'L'}
    assert all(image.mode == 'RGB' and min(image.size) > 50 for image, _ in modes.values())


# ------------------------------------------------------------------------------------- webdataset

def write_shard(path: Path, count: int) -> None:
    with tarfile.open(path, 'w') as tar:
        for i in range(count):
            buf = io.BytesIO()
            _image(i).save(buf, format='JPEG')
            for ext, payload in (('jpg', buf.getvalue()), ('cls', str(i % 2).encode())):
                member = tarfile.TarInfo(f'{i:05d}.{ext}')
                member.size = len(payload)
                tar.addfile(member, io.BytesIO(payload))


@pytest.fixture
def wds(tmp_path) -> Path:
    """train: two shards, validation: one, listed in _info.json (timm's format)."""
    root = tmp_path / 'shards'
    root.mkdir()
    info = {'name': 'tiny', 'splits': {}}
    for split, shards in (('train', 2), ('validation', 1)):
        names = [f'{split}-{s:06d}.tar' for s in range(shards)]
        for name in names:
            write_shard(root / name, 3)
        info['splits'][split] = dict(name=split, num_samples=3 * shards, filenames=names, shard_lengths=[3] * shards)
    (root / '_info.json').write_text(json.dumps(info))
    return root


def test_wds_split_names_and_patterns_resolve_to_shards(wds):
    assert wds_shards(wds, 'train') == [wds / 'train-000000.tar', wds / 'train-000001.tar']
    assert wds_shards(wds, 'train-{000000..000001}.tar|6') == wds_shards(wds, 'train')
    assert wds_shards(wds, 'validation-000000.tar') == [wds / 'validation-000000.tar']
    assert wds_root(f'wds:{wds}', 'validation') == str(wds)
    assert check_wds_folder(wds, 'train') == wds


def test_wds_folder_errors(tmp_path, wds):
    missing = tmp_path / 'nowhere'
    with pytest.raises(FileNotFoundError, match=named(missing, r'does not exist \(expected a folder of .tar shards')):
        wds_root(f'wds:{missing}', 'train')
    empty = tmp_path / 'no_shards'
    empty.mkdir()
    (empty / 'train-000000.tgz').write_bytes(b'')
    with pytest.raises(ValueError, match=named(empty, r'holds no .tar shards \(expected e.g. .*train-000000.tar')):
        wds_root(f'wds:{empty}', 'train')
    with pytest.raises(ValueError, match=named(wds, r"has no split 'val': _info.json names splits "
                                                    r"\['train', 'validation'\]")):
        check_wds_folder(wds, 'val')
    with pytest.raises(FileNotFoundError, match=named(wds, r"split 'train-\{000000..000003\}.tar' names 2 shard\(s\) "
                                                           r'that do not exist, first .*train-000002.tar')):
        check_wds_folder(wds, 'train-{000000..000003}.tar')
    with pytest.raises(ValueError, match=r'sample count after "\|" must be an integer'):
        check_wds_folder(wds, 'train-000000.tar|many')
    with pytest.raises(ValueError, match=r'must look like wds:FOLDER'):
        wds_root(str(wds), 'train')
    (wds / 'train-000001.tar').unlink()
    with pytest.raises(FileNotFoundError, match=named(wds, r"split 'train' names 1 shard\(s\) that do not exist")):
        check_wds_folder(wds, 'train')


def test_wds_info_file_errors(wds):
    info = json.loads((wds / '_info.json').read_text())
    del info['splits']['train']['shard_lengths']
    (wds / '_info.json').write_text(json.dumps(info))
    with pytest.raises(ValueError, match=named(wds / '_info.json', r"split 'train' lacks \['shard_lengths'\]")):
        check_wds_folder(wds, 'train')
    (wds / '_info.json').write_text('{"splits": ')
    with pytest.raises(ValueError, match=named(wds / '_info.json', 'is not readable JSON')):
        check_wds_folder(wds, 'train')
    (wds / '_info.json').write_text('[1, 2]')
    with pytest.raises(ValueError, match=named(wds / '_info.json', 'holds a list, expected a JSON object')):
        check_wds_folder(wds, 'train')
    (wds / '_info.json').unlink()
    with pytest.raises(ValueError, match=named(wds, r"has no _info.json or info.json naming its splits, so split "
                                                    r"'train' cannot be found")):
        check_wds_folder(wds, 'train')
    assert len(wds_shards(wds, 'train-{000000..000001}.tar|6')) == 2  # a pattern needs no info file
