"""Images on disk for the resolution recipe: ImageNet-style class folders and webdataset shard folders.

Reads ``ROOT/SPLIT/<class>/<image>`` folders: timm's public image-folder reader (``create_reader``) lists
the files and class indices exactly as timm's ``ImageDataset`` would, and ``StrictImages`` decodes them
with PIL itself, so an undecodable file is an error naming it (timm's dataset would skip it with a
warning). Checks ``wds:FOLDER`` webdataset folders (``.tar`` shards, ``_info.json`` naming the splits)
before timm's ``wds/`` reader streams them, so a wrong folder or split fails before training starts.
``data_kind`` tells the three forms of ``--data`` apart (nothing = the built-in scenes).
"""
import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from PIL import Image
from torch.utils.data import Dataset
from timm.data.readers import create_reader, get_img_extensions
from webdataset.shardlists import expand_urls

__all__ = ['WDS_PREFIX', 'WDS_INFO_FILES', 'data_kind', 'check_image_folder', 'StrictImages', 'wds_shards',
           'check_wds_folder', 'wds_root']

WDS_PREFIX = 'wds:'
WDS_INFO_FILES = ('_info.json', 'info.json')  # where timm's wds reader looks for the split table, in order
_WDS_SPLIT_KEYS = ('name', 'num_samples', 'filenames', 'shard_lengths')  # what timm reads of a split
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


def data_kind(data: Optional[str]) -> str:
    """'builtin' (no ``--data``), 'wds' (``wds:FOLDER``), 'cifar10' (``cifar10`` or ``cifar10:PATH``, read by
    ``image_pools.cifar10_pools``) or 'folder' (an image-folder root)."""
    if data is None:
        return 'builtin'
    if data.startswith(WDS_PREFIX):
        return 'wds'
    if data == 'cifar10' or data.startswith('cifar10:'):
        return 'cifar10'
    return 'folder'


# ----------------------------------------------------------------------------------- image folders

def check_image_folder(root: Path, split: str) -> Path:
    """``root/split`` must exist and every class subfolder must hold at least one image; returns it.

    Images are the files timm's reader picks up (``timm.data.readers.get_img_extensions``, any case).
    """
    folder = Path(root) / split
    if not folder.is_dir():
        raise FileNotFoundError(f'data folder {folder} does not exist (expected {root}/{split}/<class>/<images>)')
    classes = sorted(p for p in folder.iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f'{folder} has no class subfolders (expected {folder}/<class>/<images>)')
    suffixes = get_img_extensions(as_set=True)
    for cls in classes:
        if not any(p.suffix.lower() in suffixes for p in cls.rglob('*') if p.is_file()):
            raise ValueError(f'class folder {cls} is empty: no image files ({", ".join(sorted(suffixes))})')
    return folder


class StrictImages(Dataset):
    """Items (``transform`` of the RGB PIL image, class index) of ``root/split/<class>/<image>``.

    timm's reader lists the images (sorted) and numbers the classes (natural sort of the folder names),
    as timm's ``ImageDataset`` does; decoding happens here and an undecodable file raises ValueError
    naming it instead of being skipped.

    Args:
        root: Dataset root holding ``split``.
        split: Split folder name ('train', 'val').
        transform: Callable applied to the PIL image (e.g. ``timm.data.create_transform``); None keeps it.

    Raises:
        FileNotFoundError / ValueError: from ``check_image_folder``; ValueError also when images sit outside
            the class folders (timm labels an image by the folder that holds it).
    """

    def __init__(self, root: Path, split: str, transform: Optional[Callable] = None) -> None:
        self.folder = check_image_folder(root, split)
        self.reader = create_reader('', root=str(self.folder))
        self.class_to_idx: Dict[str, int] = dict(self.reader.class_to_idx)
        self.transform = transform
        stray = sorted(set(self.class_to_idx) - {p.name for p in self.folder.iterdir() if p.is_dir()})
        if stray:
            raise ValueError(f'{self.folder}: images in folders {stray[:5]} that are not its class folders (an '
                             f'image is labelled by the folder holding it; expected {self.folder}/<class>/<image>)')

    @property
    def num_classes(self) -> int:
        return len(self.class_to_idx)

    def __len__(self) -> int:
        return len(self.reader)

    def filename(self, index: int) -> str:
        """Absolute path of item ``index``."""
        return self.reader.filename(index, absolute=True)

    def __getitem__(self, index: int) -> Tuple[Any, int]:
        source, target = self.reader[index]
        with source:
            try:
                image = Image.open(source).convert('RGB')  # convert decodes every pixel
            except _DECODE_ERRORS as e:
                raise ValueError(f'cannot read image {self.filename(index)}: not a decodable image file ({e})') from e
        return (image if self.transform is None else self.transform(image)), target


# ------------------------------------------------------------------------------------- webdataset

def _wds_info(root: Path) -> Tuple[Optional[Path], Dict[str, Any]]:
    """(info file, its dict) of a webdataset folder; (None, {}) without one."""
    for name in WDS_INFO_FILES:
        path = root / name
        if path.is_file():
            try:
                info = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f'{path} is not readable JSON ({e})') from e
            if not isinstance(info, dict):
                raise ValueError(f'{path} holds a {type(info).__name__}, expected a JSON object with "splits"')
            return path, info
    return None, {}


def wds_shards(root: Path, split: str) -> List[Path]:
    """Shard files of ``split`` in the webdataset folder ``root``, resolved as timm's ``wds/`` reader does.

    ``split`` is a split name listed under "splits" in ``_info.json`` (or ``info.json``), or a brace
    pattern of shard names relative to ``root``, optionally with a sample count: ``'train-{000000..000009}.tar|N'``
    (timm treats any split containing 'tar' or '..' as a pattern).
    """
    root = Path(root)
    if 'tar' in split or '..' in split:
        pattern, _, count = split.partition('|')
        if count and not count.strip().isdigit():
            raise ValueError(f'webdataset split {split!r}: the sample count after "|" must be an integer, '
                             f'got {count!r}')
        names = expand_urls(pattern)
    else:
        info_path, info = _wds_info(root)
        if info_path is None:
            raise ValueError(f'webdataset folder {root} has no {" or ".join(WDS_INFO_FILES)} naming its splits, so '
                             f'split {split!r} cannot be found: add one (timm reads "splits" -> {split!r} -> '
                             f'{", ".join(_WDS_SPLIT_KEYS)}) or pass a shard pattern such as '
                             f"'{split}-{{000000..000009}}.tar|N'")
        splits = info.get('splits')
        if not isinstance(splits, dict) or split not in splits:
            known = sorted(splits) if isinstance(splits, dict) else []
            raise ValueError(f'webdataset folder {root} has no split {split!r}: {info_path.name} names splits {known}')
        entry = splits[split]
        missing = [k for k in _WDS_SPLIT_KEYS if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise ValueError(f'{info_path}: split {split!r} lacks {missing} (timm reads {", ".join(_WDS_SPLIT_KEYS)})')
        names = list(entry['filenames'])
    if not names:
        raise ValueError(f'webdataset folder {root}: split {split!r} names no shard files')
    shards = [root / name for name in names]
    absent = [str(s) for s in shards if not s.is_file()]
    if absent:
        raise FileNotFoundError(f'webdataset folder {root}: split {split!r} names {len(absent)} shard(s) that do '
                                f'not exist, first {absent[0]}')
    return shards


def check_wds_folder(root: Union[str, Path], split: str) -> Path:
    """``root`` must be a folder holding ``.tar`` shards, and ``split`` must name existing ones (``wds_shards``)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f'webdataset folder {root} does not exist (expected a folder of .tar shards and '
                                f'an _info.json naming the splits)')
    if next(root.rglob('*.tar'), None) is None:
        raise ValueError(f'webdataset folder {root} holds no .tar shards (expected e.g. {root}/{split}-000000.tar '
                         f'and an _info.json naming the splits)')
    wds_shards(root, split)
    return root


def wds_root(data: str, split: str) -> str:
    """The folder of ``--data wds:FOLDER``, checked to hold the shards of ``split`` (``check_wds_folder``)."""
    if not data.startswith(WDS_PREFIX):
        raise ValueError(f'webdataset data must look like {WDS_PREFIX}FOLDER, got {data!r}')
    root = data[len(WDS_PREFIX):]
    check_wds_folder(root, split)
    return root
