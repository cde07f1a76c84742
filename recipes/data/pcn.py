"""PCN point-cloud completion data: PCD / PLY readers, the PCN folder layout and a built-in generator.

The PCN layout (as PoinTr / GRNet ship it, ``data/PCN``)::

    ROOT/PCN.json                                       category file (see below)
    ROOT/{train,val,test}/complete/<taxonomy_id>/<model_id>.pcd       16384 points
    ROOT/{train,val,test}/partial/<taxonomy_id>/<model_id>/NN.pcd     one file per view: 00..07
                                                                       (PCN's test split: 00 only)

``PCN.json`` is a list of ``{"taxonomy_id": "02691156", "taxonomy_name": "airplane", "train": [model
ids], "val": [...], "test": [...]}``, one entry per category; the entry order is the category index order.

- ``read_pcd`` / ``write_pcd``: PCD files through pypcd4 (ASCII, binary, binary_compressed), ``read_point_cloud``
  also reads ``.ply`` (trimesh). Every error names the file; NaN / inf points, empty clouds, missing
  x / y / z fields and non-float x / y / z are errors. pypcd4 quirks handled here (pypcd4 1.5.1): its ASCII
  reader splits on single spaces only (``np.loadtxt(delimiter=' ')``: trailing spaces, tabs or double spaces
  fail), it reads at most 10 header lines (one extra header line makes it miss ``DATA`` and decode the file as
  binary_compressed), it accepts only ``VERSION 0.7`` and requires ``COUNT``, and it silently returns fewer
  points than ``POINTS`` for a truncated file. ``read_pcd`` parses the header itself, drops ``VERSION``,
  fills ``COUNT`` / ``WIDTH`` / ``HEIGHT`` / ``POINTS`` defaults, normalises ASCII whitespace, then lets
  pypcd4 decode the data and checks the point count.
- ``PCNDataset``: items ``{'partial', 'complete', 'category', 'index'}`` of one split; training items
  (``augment=True``) draw a random view, random resampling, a PoinTr random mirror (x and / or z) and a
  random scale from numpy's global RNG (seeded per (seed, epoch, index) by ``engine.PerSampleSeeds``);
  evaluation items use view 0 and a resampling seeded by the index alone. ``check_files`` reads every file the
  items can read (about 2,900 files a second on one core for the built-in clouds), so a damaged file is
  reported before training rather than when a batch first draws it.
- ``write_builtin_pcn``: a small procedural stand-in for PCN (the 8 PCN categories built from trimesh
  primitives, ShapeNet scale: bounding-box diagonal 1; complete clouds sampled on the outer surface, partial
  views by z-buffer visibility from random cameras) in the same layout and with PCN's taxonomy ids, so the
  recipe runs without downloading ShapeNet. Deterministic per seed; a folder already holding the same
  built-in dataset is reused (``builtin_pcn.json`` marker). The default (16 / 4 / 4 models per category,
  8 views) takes about 10 s on one CPU core and 66 MB.

    python -m vision_priors.recipes.data.pcn ROOT [--seed 0] [--preview preview.png]
"""
import argparse
import hashlib
import io
import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ['BUILTIN_CATEGORIES', 'TAXONOMY_IDS', 'CATEGORY_FILE', 'BUILTIN_MARKER', 'SPLITS', 'PCD_ENCODINGS',
           'read_pcd', 'write_pcd', 'read_ply', 'read_point_cloud', 'check_points', 'resample_points',
           'random_mirror_scale', 'load_category_file', 'PCNPaths', 'PCNSample', 'PCNDataset',
           'make_shape', 'sample_model', 'model_rng', 'model_id', 'write_builtin_pcn', 'main']

PathLike = Union[str, os.PathLike]

# The PCN categories in PCN.json's order (sorted by ShapeNet synset id), so that the built-in data numbers
# its categories exactly as the real PCN.json does.
BUILTIN_CATEGORIES: Tuple[str, ...] = ('airplane', 'cabinet', 'car', 'chair', 'lamp', 'sofa', 'table', 'watercraft')
TAXONOMY_IDS: Dict[str, str] = {
    'airplane': '02691156', 'cabinet': '02933112', 'car': '02958343', 'chair': '03001627',
    'lamp': '03636649', 'sofa': '04256520', 'table': '04379243', 'watercraft': '04530566',
}
CATEGORY_FILE = 'PCN.json'
BUILTIN_MARKER = 'builtin_pcn.json'   # written next to PCN.json by write_builtin_pcn (its parameters)
SPLITS = ('train', 'val', 'test')
PCD_ENCODINGS = ('ascii', 'binary', 'binary_compressed')
_CATEGORY_KEYS = ('taxonomy_id', 'taxonomy_name')
_VIEW_FILE = re.compile(r'^(\d+)\.pcd$')


# ------------------------------------------------------------------------------------------- PCD / PLY

_PCD_KEYS = ('VERSION', 'FIELDS', 'SIZE', 'TYPE', 'COUNT', 'WIDTH', 'HEIGHT', 'VIEWPOINT', 'POINTS', 'DATA')
_MAX_HEADER_LINES = 64


def _first_bad_row(points: np.ndarray) -> Optional[int]:
    bad = np.flatnonzero(~np.isfinite(points).all(axis=1))
    return int(bad[0]) if len(bad) else None


def check_points(points: Any, source: Union[str, PathLike], *, allow_empty: bool = False) -> np.ndarray:
    """``points`` as a C-contiguous (N, 3) float32 array; ValueError / TypeError naming ``source`` otherwise.

    Rejects non-float dtypes, a shape other than (N, 3), NaN / inf (names the first bad point index, also
    after the cast to float32, so float64 values beyond float32's range are caught) and, unless
    ``allow_empty``, an empty cloud.
    """
    array = np.asarray(points)
    if array.dtype.kind != 'f':
        raise TypeError(f'{source}: points must be float (float32 / float64), got dtype {array.dtype}')
    if array.ndim != 2 or array.shape[1] != 3:
        raise ValueError(f'{source}: points must have shape (N, 3), got {tuple(array.shape)}')
    if len(array) == 0 and not allow_empty:
        raise ValueError(f'{source}: empty point cloud (0 points)')
    with np.errstate(over='ignore'):   # float64 beyond float32's range becomes inf, reported below
        array = np.ascontiguousarray(array, dtype=np.float32)
    bad = _first_bad_row(array)
    if bad is not None:
        raise ValueError(f'{source}: point {bad} is not finite: [{", ".join(f"{v:.7g}" for v in array[bad])}]')
    return array


def _parse_pcd_header(raw: bytes, path: Path) -> Tuple[Dict[str, List[str]], int]:
    """(header values by upper-case key, offset of the data) of a PCD file's bytes."""
    header: Dict[str, List[str]] = {}
    pos = 0
    for _ in range(_MAX_HEADER_LINES):
        end = raw.find(b'\n', pos)
        if end < 0:
            break
        line_bytes, pos = raw[pos:end], end + 1
        try:
            line = line_bytes.decode('ascii').strip()
        except UnicodeDecodeError:
            raise ValueError(f'{path}: not a PCD file (binary bytes in the header before its DATA line)') from None
        if not line or line.startswith('#'):
            continue
        tokens = line.split()
        key = tokens[0].upper()
        if key not in _PCD_KEYS:
            if not header:
                raise ValueError(f'{path}: not a PCD file (first header line is {line[:60]!r})')
            continue  # an unknown header line: ignored (pypcd4 would stop reading the header at 10 lines)
        header[key] = tokens[1:]
        if key == 'DATA':
            return header, pos
    raise ValueError(f'{path}: not a PCD file (no DATA line in its first {_MAX_HEADER_LINES} lines)')


def _header_int(header: Dict[str, List[str]], key: str, path: Path) -> Optional[int]:
    if key not in header:
        return None
    values = header[key]
    try:
        value = int(values[0])
    except (IndexError, ValueError):
        raise ValueError(f'{path}: PCD header {key} must be an integer, got {" ".join(values)!r}') from None
    if value < 0:
        raise ValueError(f'{path}: PCD header {key} must be >= 0, got {value}')
    return value


def _normalised_pcd_header(header: Dict[str, List[str]], path: Path) -> Tuple[str, str, int]:
    """(header text pypcd4 reads, lower-case encoding, number of points) after checking the header."""
    for key in ('FIELDS', 'SIZE', 'TYPE', 'DATA'):
        if not header.get(key):
            raise ValueError(f'{path}: PCD header has no {key} line')
    fields = header['FIELDS']
    count = header.get('COUNT') or ['1'] * len(fields)  # COUNT is optional in old PCD files
    for key, values in (('SIZE', header['SIZE']), ('TYPE', header['TYPE']), ('COUNT', count)):
        if len(values) != len(fields):
            raise ValueError(f'{path}: PCD header {key} has {len(values)} values for {len(fields)} FIELDS '
                             f'({" ".join(fields)})')
    missing = [axis for axis in 'xyz' if axis not in fields]
    if missing:
        raise ValueError(f'{path}: PCD file has no {"/".join(missing)} field (FIELDS {" ".join(fields)})')
    for axis in 'xyz':
        i = fields.index(axis)
        kind, size, n = header['TYPE'][i].upper(), header['SIZE'][i], count[i]
        if kind != 'F' or size not in ('4', '8') or n != '1':
            raise ValueError(f'{path}: wrong dtype for field {axis}: TYPE {kind} SIZE {size} COUNT {n} '
                             '(x / y / z must be TYPE F SIZE 4 or 8, COUNT 1)')
    encoding = header['DATA'][0].lower()
    if encoding not in PCD_ENCODINGS:
        raise ValueError(f'{path}: unsupported PCD encoding DATA {header["DATA"][0]!r} '
                         f'(readable: {", ".join(PCD_ENCODINGS)})')
    width, height, points = (_header_int(header, key, path) for key in ('WIDTH', 'HEIGHT', 'POINTS'))
    height = 1 if height is None else height
    if points is None:
        if width is None:
            raise ValueError(f'{path}: PCD header has neither POINTS nor WIDTH')
        points = width * height
    if width is None:
        width, height = points, 1
    lines = [f'FIELDS {" ".join(fields)}', f'SIZE {" ".join(header["SIZE"])}',
             f'TYPE {" ".join(t.upper() for t in header["TYPE"])}', f'COUNT {" ".join(count)}',
             f'WIDTH {width}', f'HEIGHT {height}', f'POINTS {points}', f'DATA {encoding}']   # VIEWPOINT: unused
    return '\n'.join(lines) + '\n', encoding, points


def _normalised_ascii(payload: bytes) -> bytes:
    """ASCII PCD rows with single spaces (pypcd4's loadtxt splits on ' ' only), no blank lines."""
    rows = (b' '.join(line.split()) for line in payload.splitlines())
    return b'\n'.join(row for row in rows if row) + b'\n'


def read_pcd(path: PathLike, *, allow_empty: bool = False) -> np.ndarray:
    """The x y z columns of a PCD file as a (N, 3) float32 array (pypcd4 decodes the data).

    Reads ASCII, binary and binary_compressed PCD files with float32 or float64 x / y / z (other fields are
    ignored). Raises FileNotFoundError / ValueError naming ``path`` for a missing file, a malformed header,
    missing x / y / z fields, non-float x / y / z, an unsupported encoding, data pypcd4 cannot decode, a
    point count that differs from the header's POINTS, NaN / inf points (first bad index) and, unless
    ``allow_empty``, an empty cloud.
    """
    from pypcd4 import PointCloud

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f'point cloud file {path} does not exist')
    raw = path.read_bytes()
    header, offset = _parse_pcd_header(raw, path)
    header_text, encoding, num_points = _normalised_pcd_header(header, path)
    payload = raw[offset:]
    if encoding == 'ascii':
        payload = _normalised_ascii(payload)
    try:
        cloud = PointCloud.from_fileobj(io.BytesIO(header_text.encode('ascii') + payload))
        got = len(cloud.pc_data) if cloud.pc_data.ndim else 1
        points = cloud.numpy(('x', 'y', 'z'))
    except Exception as error:  # pypcd4 / numpy / lzf raise ValueError, KeyError, TypeError, struct.error...
        raise ValueError(f'{path}: cannot decode {encoding} PCD data with pypcd4: '
                         f'{type(error).__name__}: {error}') from error
    if got != num_points:
        raise ValueError(f'{path}: PCD data holds {got} points but the header says POINTS {num_points} '
                         '(truncated or damaged file)')
    return check_points(points.reshape(-1, 3), path, allow_empty=allow_empty)


def write_pcd(path: PathLike, points: np.ndarray, binary: bool = True, *, compressed: bool = False) -> None:
    """Write (N, 3) points as a float32 x y z PCD file with pypcd4.

    ``binary=False`` writes ASCII (pypcd4 formats with ``%.10f``: exact to 1e-10 absolute, not bit for bit
    for tiny values); ``compressed=True`` asks for binary_compressed, which pypcd4 silently downgrades to
    plain binary when LZF cannot shrink the data (typical for float coordinates; the header says which).
    Points must be finite floats and non-empty (errors name ``path``).
    """
    from pypcd4 import Encoding, PointCloud

    path = Path(path)
    if compressed and not binary:
        raise ValueError(f'{path}: compressed=True needs binary=True (binary_compressed)')
    array = check_points(points, path)
    encoding = Encoding.BINARY_COMPRESSED if compressed else Encoding.BINARY if binary else Encoding.ASCII
    PointCloud.from_xyz_points(array).save(path, encoding=encoding)


def read_ply(path: PathLike, *, allow_empty: bool = False) -> np.ndarray:
    """Vertices of a PLY file (ASCII or binary, any extra properties) as (N, 3) float32, via trimesh."""
    from trimesh.exchange.ply import load_ply

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f'point cloud file {path} does not exist')
    try:
        with open(path, 'rb') as f:
            loaded = load_ply(f)
    except Exception as error:  # trimesh raises ValueError, KeyError ('z'), IndexError...
        raise ValueError(f'{path}: cannot read PLY file with trimesh: {type(error).__name__}: {error}') from error
    vertices = loaded.get('vertices')
    if vertices is None:
        raise ValueError(f'{path}: PLY file has no vertices (no "element vertex" with x / y / z)')
    return check_points(np.asarray(vertices).reshape(-1, 3), path, allow_empty=allow_empty)


def read_point_cloud(path: PathLike, *, allow_empty: bool = False) -> np.ndarray:
    """(N, 3) float32 points of a ``.pcd`` (:func:`read_pcd`) or ``.ply`` (:func:`read_ply`) file."""
    suffix = Path(path).suffix.lower()
    if suffix == '.pcd':
        return read_pcd(path, allow_empty=allow_empty)
    if suffix == '.ply':
        return read_ply(path, allow_empty=allow_empty)
    raise ValueError(f'{path}: unsupported point cloud file type {suffix!r} (expected .pcd or .ply)')


# ------------------------------------------------------------------------------------------- sampling

def resample_points(points: np.ndarray, num: int, rng: Optional[np.random.Generator] = None,
                    source: Union[str, PathLike] = 'point cloud') -> np.ndarray:
    """``num`` points of ``points``: a random subset (no replacement) when there are more, all of them in a
    random order plus random repeats when there are fewer (GRNet's ``UpSamplePoints``; PoinTr's
    ``RandomSamplePoints`` pads with zeros instead). ``rng``: a numpy Generator, or None for numpy's global
    RNG. An empty cloud is a ValueError naming ``source``."""
    count = len(points)
    if count == 0:
        raise ValueError(f'{source}: empty point cloud, cannot resample to {num} points')
    if rng is None:
        order = np.random.permutation(count)
        extra = np.random.randint(0, count, size=max(num - count, 0))
    else:
        order = rng.permutation(count)
        extra = rng.integers(0, count, size=max(num - count, 0))
    index = order[:num] if count >= num else np.concatenate([order, extra])
    return points[index]


def random_mirror_scale(scale_range: Tuple[float, float] = (0.8, 1.2)) -> np.ndarray:
    """A 3x3 matrix from numpy's global RNG: PoinTr's ``RandomMirrorPoints`` (one uniform draw u: u <= 0.25
    mirrors x and z, u <= 0.5 x, u <= 0.75 z, else nothing; y is up and never mirrored) times an isotropic
    scale drawn uniformly from ``scale_range``. Points transform as ``points @ matrix.T``."""
    u = np.random.uniform(0.0, 1.0)
    scale = np.random.uniform(*scale_range)
    mirror_x, mirror_z = u <= 0.5, u <= 0.25 or 0.5 < u <= 0.75
    return np.diag([-scale if mirror_x else scale, scale, -scale if mirror_z else scale])


# ------------------------------------------------------------------------------------------- PCN layout

def load_category_file(path: PathLike, split: Optional[str] = None) -> List[Dict[str, Any]]:
    """The entries of a PCN category file, checked: a JSON list of objects with string ``taxonomy_id`` /
    ``taxonomy_name``, unique ids and, for ``split`` (all three when None), a list of string model ids."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f'category file {path} does not exist (expected ROOT/{CATEGORY_FILE})')
    try:
        entries = json.loads(path.read_text(encoding='utf-8'))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f'{path}: not valid JSON: {error}') from error
    if not isinstance(entries, list) or not entries:
        raise ValueError(f'{path}: expected a non-empty JSON list of categories, got {type(entries).__name__}')
    splits = SPLITS if split is None else (split,)
    seen = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f'{path}: entry {i} is a {type(entry).__name__}, expected an object')
        for key in _CATEGORY_KEYS + tuple(splits):
            if key not in entry:
                raise ValueError(f'{path}: entry {i} has no {key!r} key (keys: {", ".join(map(str, entry))})')
        for key in _CATEGORY_KEYS:
            if not isinstance(entry[key], str) or not entry[key]:
                raise ValueError(f'{path}: entry {i} {key} must be a non-empty string, got {entry[key]!r}')
        for key in splits:
            ids = entry[key]
            if not isinstance(ids, list) or not all(isinstance(m, str) and m for m in ids):
                raise ValueError(f'{path}: entry {i} ({entry["taxonomy_name"]}) {key!r} must be a list of '
                                 f'model id strings')
        if entry['taxonomy_id'] in seen:
            raise ValueError(f'{path}: taxonomy_id {entry["taxonomy_id"]!r} appears twice')
        seen.add(entry['taxonomy_id'])
    return entries


class PCNPaths(NamedTuple):
    complete: Path
    partials: Tuple[Path, ...]   # the views, in numeric order (00, 01, ...)


class PCNSample(NamedTuple):
    taxonomy_id: str
    model_id: str
    paths: PCNPaths


# files PCNDataset.check_files has read without error in this process: (resolved path, size, mtime_ns)
_CHECKED_FILES: Set[Tuple[str, int, int]] = set()


def _view_files(folder: Path) -> Tuple[Path, ...]:
    views = []
    for entry in os.scandir(folder):
        match = _VIEW_FILE.match(entry.name)
        if match:
            views.append((int(match.group(1)), Path(entry.path)))
    return tuple(path for _, path in sorted(views))


class PCNDataset(Dataset):
    """One split of a PCN folder: items ``{'partial': (num_partial, 3) float32, 'complete': (num_complete, 3)
    float32, 'category': int64, 'index': int64}`` tensors (default collation stacks them).

    ``augment=True`` (training): a random view, random resampling, :func:`random_mirror_scale` applied to
    both clouds alike, all drawn from numpy's global RNG (wrap in ``engine.PerSampleSeeds`` for per
    (seed, epoch, index) randomness). ``augment=False``: view 0 and a resampling seeded by the index alone
    (``np.random.default_rng(index)``), so evaluation items never depend on, nor touch, the global RNG.
    Clouds are used as stored (PCN's are already normalised). ``categories``: taxonomy names or ids to keep
    (PCN.json order is kept); the ``category`` index counts in ``self.categories``.

    Construction checks the layout (root, split folders, PCN.json, every listed model's complete file and
    partial folder with at least one ``NN.pcd`` view) and names what is missing. :meth:`check_files` reads
    every file the items can read and checks its contents (the recipe calls it before a run folder is written);
    ``__getitem__`` checks what it reads too (errors name the file). ``self.samples``: (taxonomy_id, model_id, paths)
    per item (``paths.complete``, ``paths.partials``); ``self.sample_categories``: their category indices;
    ``self.taxonomy_ids``: aligned with ``self.categories``.
    """

    def __init__(self, root: PathLike, split: str, *, num_partial: int = 2048, num_complete: int = 16384,
                 augment: bool = False, categories: Optional[Sequence[str]] = None,
                 scale_range: Tuple[float, float] = (0.8, 1.2)) -> None:
        self.root = Path(root)
        if split not in SPLITS:
            raise ValueError(f'unknown PCN split {split!r} (expected one of {", ".join(SPLITS)})')
        if num_partial < 1 or num_complete < 1:
            raise ValueError(f'num_partial and num_complete must be >= 1, got {num_partial}, {num_complete}')
        if not self.root.is_dir():
            raise FileNotFoundError(f'PCN root {self.root} does not exist (expected {CATEGORY_FILE} and '
                                    f'{"/".join(SPLITS)} folders in it)')
        self.split, self.augment = split, augment
        self.num_partial, self.num_complete = num_partial, num_complete
        self.scale_range = (float(scale_range[0]), float(scale_range[1]))
        category_file = self.root / CATEGORY_FILE
        entries = load_category_file(category_file, split)
        if categories is not None:
            wanted = list(categories)
            known = {e['taxonomy_name'] for e in entries} | {e['taxonomy_id'] for e in entries}
            unknown = [c for c in wanted if c not in known]
            if unknown:
                raise ValueError(f'{category_file}: no categor{"y" if len(unknown) == 1 else "ies"} '
                                 f'{", ".join(unknown)} (available: '
                                 f'{", ".join(e["taxonomy_name"] for e in entries)})')
            entries = [e for e in entries if e['taxonomy_name'] in wanted or e['taxonomy_id'] in wanted]
        self.categories: List[str] = [e['taxonomy_name'] for e in entries]
        self.taxonomy_ids: List[str] = [e['taxonomy_id'] for e in entries]
        folder = self.root / split
        for sub in (folder, folder / 'complete', folder / 'partial'):
            if not sub.is_dir():
                raise FileNotFoundError(f'PCN folder {sub} does not exist (expected {folder}/complete and '
                                        f'{folder}/partial)')
        self.samples: List[PCNSample] = []
        self.sample_categories: List[int] = []
        for category, entry in enumerate(entries):
            taxonomy = entry['taxonomy_id']
            for model in entry[split]:
                complete = folder / 'complete' / taxonomy / f'{model}.pcd'
                if not complete.is_file():
                    raise FileNotFoundError(f'{category_file} lists {split} model {taxonomy}/{model} but its '
                                            f'complete cloud {complete} does not exist')
                views_folder = folder / 'partial' / taxonomy / model
                if not views_folder.is_dir():
                    raise FileNotFoundError(f'{category_file} lists {split} model {taxonomy}/{model} but its '
                                            f'partial folder {views_folder} does not exist')
                views = _view_files(views_folder)
                if not views:
                    raise FileNotFoundError(f'partial folder {views_folder} has no views (expected '
                                            f'{views_folder}/00.pcd, 01.pcd, ...)')
                self.samples.append(PCNSample(taxonomy, model, PCNPaths(complete, views)))
                self.sample_categories.append(category)
        if not self.samples:
            raise ValueError(f'{category_file} lists no {split} models'
                             + (f' for categories {", ".join(self.categories)}' if categories is not None else ''))

    def __len__(self) -> int:
        return len(self.samples)

    def item_files(self) -> List[Path]:
        """Every file the items read: each complete cloud and, for training items (``augment=True``: a random
        view), every partial view, for evaluation items view 0 only."""
        files: List[Path] = []
        for sample in self.samples:
            files.append(sample.paths.complete)
            files.extend(sample.paths.partials if self.augment else sample.paths.partials[:1])
        return files

    def check_files(self, progress: bool = False) -> int:
        """Read every file of :meth:`item_files` with :func:`read_point_cloud`, which raises naming the file and
        the first bad value (truncated or undecodable data, NaN / inf points, empty clouds, non-float x / y / z).

        Files already read without error by this process, unchanged since (same size and modification time),
        are not read again, so a sweep over one dataset reads it once. Returns the number of files read.
        """
        from tqdm.auto import tqdm

        files = self.item_files()
        read = 0
        for path in tqdm(files, desc=f'checking {self.split} files', unit='file', disable=not progress,
                         mininterval=1.0):
            stat = path.stat()
            key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
            if key in _CHECKED_FILES:
                continue
            read_point_cloud(path)
            _CHECKED_FILES.add(key)
            read += 1
        return read

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        index = int(index)
        sample = self.samples[index]
        partials = sample.paths.partials
        if self.augment:
            view = partials[np.random.randint(len(partials))]
            rng = None   # numpy's global RNG
        else:
            view = partials[0]
            rng = np.random.default_rng(index)
        partial = resample_points(read_point_cloud(view), self.num_partial, rng, view)
        complete = resample_points(read_point_cloud(sample.paths.complete), self.num_complete, rng,
                                   sample.paths.complete)
        if self.augment:
            matrix = random_mirror_scale(self.scale_range).astype(np.float32)
            partial, complete = partial @ matrix.T, complete @ matrix.T
        return {'partial': torch.from_numpy(np.ascontiguousarray(partial, dtype=np.float32)),
                'complete': torch.from_numpy(np.ascontiguousarray(complete, dtype=np.float32)),
                'category': torch.tensor(self.sample_categories[index], dtype=torch.int64),
                'index': torch.tensor(index, dtype=torch.int64)}


# ------------------------------------------------------------------------------------------- built-in shapes
# Shapes are y-up like ShapeNet / PCN (cars, boats along x, airplane fuselages along z, sofas wide along z),
# built from convex trimesh primitives and normalised like ShapeNet v1: bounding box centred, diagonal 1.

_SECTIONS = 20           # cylinder / cone facets
_CAPSULE_COUNT = (12, 8)
_AXES = {'x': (0.0, math.pi / 2, 0.0), 'y': (-math.pi / 2, 0.0, 0.0), 'z': (0.0, 0.0, 0.0)}


def _pose(center=(0.0, 0.0, 0.0), axis: str = 'z', scale=(1.0, 1.0, 1.0), rotate=(0.0, 0.0, 0.0)) -> np.ndarray:
    """translate(center) @ rotate(x, y, z angles) @ (primitive z axis -> ``axis``) @ scale."""
    from trimesh.transformations import euler_matrix

    matrix = np.diag([*scale, 1.0])
    matrix = euler_matrix(*_AXES[axis], axes='sxyz') @ matrix
    matrix = euler_matrix(*rotate, axes='sxyz') @ matrix
    matrix[:3, 3] += np.asarray(center, dtype=float)
    return matrix


def _box(extents, center=(0, 0, 0), rotate=(0, 0, 0)):
    import trimesh
    return trimesh.creation.box(extents=extents, transform=_pose(center, 'z', rotate=rotate))


def _cylinder(radius, height, center=(0, 0, 0), axis='y', rotate=(0, 0, 0)):
    import trimesh
    return trimesh.creation.cylinder(radius=radius, height=height, sections=_SECTIONS,
                                     transform=_pose(center, axis, rotate=rotate))


def _cone(radius, height, base=(0, 0, 0), axis='y', scale=(1, 1, 1)):
    """A cone standing on its base centre ``base``, apex ``height`` away along +``axis``."""
    import trimesh
    return trimesh.creation.cone(radius=radius, height=height, sections=_SECTIONS,
                                 transform=_pose(base, axis, scale=scale))


def _capsule(radius, length, center=(0, 0, 0), axis='x', scale=(1, 1, 1)):
    """A capsule of total length ``length`` along ``axis`` (``scale`` squashes it, in primitive axes)."""
    import trimesh
    mesh = trimesh.creation.capsule(height=max(length - 2 * radius, 1e-3), radius=radius, count=_CAPSULE_COUNT)
    return mesh.apply_transform(_pose(center, axis, scale=scale))


def _sphere(radius, center=(0, 0, 0), scale=(1, 1, 1)):
    import trimesh
    mesh = trimesh.creation.icosphere(subdivisions=2, radius=radius)
    return mesh.apply_transform(_pose(center, 'z', scale=scale))


def _legs(half_x, half_z, top, thickness, round_legs):
    """Four legs from y=0 to y=top at (+-half_x, +-half_z)."""
    legs = []
    for sx in (-1, 1):
        for sz in (-1, 1):
            center = (sx * half_x, top / 2, sz * half_z)
            if round_legs:
                legs.append(_cylinder(thickness / 2, top, center))
            else:
                legs.append(_box((thickness, top, thickness), center))
    return legs


def _chair(rng):
    width, depth, seat_h = rng.uniform(0.42, 0.6), rng.uniform(0.4, 0.56), rng.uniform(0.38, 0.5)
    thick, leg = rng.uniform(0.035, 0.08), rng.uniform(0.025, 0.06)
    inset = rng.uniform(0.0, 0.04)
    parts = [_box((depth, thick, width), (0, seat_h - thick / 2, 0))]
    parts += _legs(depth / 2 - inset - leg / 2, width / 2 - inset - leg / 2, seat_h - thick + 0.01, leg,
                   rng.random() < 0.4)
    back_h, back_t, tilt = rng.uniform(0.3, 0.6), rng.uniform(0.025, 0.06), rng.uniform(0.0, 0.25)
    back_w = width * rng.uniform(0.8, 1.0)
    # the back leans backwards (-x) about its bottom edge
    cx = -depth / 2 + back_t / 2 - math.sin(tilt) * back_h / 2
    cy = seat_h - 0.01 + math.cos(tilt) * back_h / 2
    parts.append(_box((back_t, back_h, back_w), (cx, cy, 0), rotate=(0, 0, tilt)))
    if rng.random() < 0.35:   # arm rests on two posts
        arm_h, arm_w = rng.uniform(0.15, 0.25), rng.uniform(0.03, 0.06)
        for sz in (-1, 1):
            z = sz * (width / 2 - arm_w / 2)
            parts.append(_box((depth * 0.9, arm_w, arm_w), (0, seat_h + arm_h, z)))
            parts.append(_box((arm_w, arm_h, arm_w), (depth * 0.35, seat_h + arm_h / 2, z)))
    return parts


def _table(rng):
    height, thick = rng.uniform(0.6, 0.8), rng.uniform(0.03, 0.07)
    if rng.random() < 0.3:    # round top on a pedestal
        radius = rng.uniform(0.35, 0.6)
        parts = [_cylinder(radius, thick, (0, height - thick / 2, 0)),
                 _cylinder(rng.uniform(0.03, 0.07), height - thick + 0.01, (0, (height - thick + 0.01) / 2, 0))]
        foot = rng.uniform(0.4, 0.7) * radius
        parts.append(_cylinder(foot, 0.03, (0, 0.015, 0)))
        return parts
    length, depth, leg = rng.uniform(0.9, 1.6), rng.uniform(0.5, 0.9), rng.uniform(0.04, 0.08)
    inset = rng.uniform(0.0, 0.08)
    parts = [_box((length, thick, depth), (0, height - thick / 2, 0))]
    parts += _legs(length / 2 - inset - leg / 2, depth / 2 - inset - leg / 2, height - thick + 0.01, leg,
                   rng.random() < 0.4)
    if rng.random() < 0.3:    # lower shelf
        shelf_y = rng.uniform(0.1, 0.25)
        parts.append(_box((length - 2 * inset, 0.02, depth - 2 * inset), (0, shelf_y, 0)))
    return parts


def _lamp(rng):
    base_r, base_h = rng.uniform(0.1, 0.18), rng.uniform(0.02, 0.05)
    pole_r, pole_h = rng.uniform(0.01, 0.025), rng.uniform(0.45, 0.9)
    parts = [_cylinder(base_r, base_h, (0, base_h / 2, 0)) if rng.random() < 0.7
             else _box((2 * base_r, base_h, 2 * base_r), (0, base_h / 2, 0)),
             _cylinder(pole_r, pole_h, (0, pole_h / 2, 0))]
    top = np.array([0.0, pole_h, 0.0])
    if rng.random() < 0.4:    # an arm bent sideways from the pole top
        angle, arm_len = rng.uniform(0.5, 1.2), rng.uniform(0.15, 0.3)
        direction = np.array([math.sin(angle), math.cos(angle), 0.0])
        parts.append(_cylinder(pole_r, arm_len, top + direction * arm_len / 2, rotate=(0, 0, -angle)))
        top = top + direction * arm_len
    shade_r, shade_h = rng.uniform(0.1, 0.25), rng.uniform(0.12, 0.3)
    parts.append(_cone(shade_r, shade_h, top - [0, 0.6 * shade_h, 0]))
    if rng.random() < 0.5:    # bulb under the shade
        parts.append(_sphere(min(shade_r, shade_h) * 0.35, top - [0, 0.6 * shade_h, 0]))
    return parts


def _airplane(rng):
    length, radius = rng.uniform(0.9, 1.2), rng.uniform(0.045, 0.085)
    parts = [_capsule(radius, length, axis='z')]   # fuselage along z, nose at -z
    span, chord, thick = length * rng.uniform(0.8, 1.2), rng.uniform(0.12, 0.22), 0.02
    sweep, wing_y = rng.uniform(0.0, 0.6), rng.uniform(-0.6, 0.3) * radius
    wing_z = rng.uniform(-0.15, 0.05) * length
    for sx in (-1, 1):
        half = span / 2
        center = (sx * half / 2, wing_y, wing_z + math.tan(sweep) * half / 2)   # tips swept back to +z
        parts.append(_box((half / math.cos(sweep), thick, chord), center, rotate=(0, -sx * sweep, 0)))
    tail_c, tail_h = rng.uniform(0.08, 0.14), rng.uniform(0.1, 0.2)
    tail_z = length / 2 - tail_c / 2 - radius * 0.5
    parts.append(_box((thick, tail_h, tail_c), (0, radius * 0.5 + tail_h / 2, tail_z)))
    stab = span * rng.uniform(0.25, 0.4)
    parts.append(_box((stab, thick, tail_c * 0.8), (0, radius * 0.3, tail_z)))
    if rng.random() < 0.6:    # engines under the wings
        for sx in (-1, 1):
            for k in range(1 if rng.random() < 0.6 else 2):
                x = sx * span / 2 * (0.3 + 0.35 * k)
                z = wing_z + math.tan(sweep) * abs(x) - chord * 0.3
                parts.append(_cylinder(radius * 0.45, chord * 1.3, (x, wing_y - radius * 0.55, z), axis='z'))
    return parts


def _car(rng):
    length, width, body_h = rng.uniform(0.9, 1.2), rng.uniform(0.38, 0.5), rng.uniform(0.14, 0.24)
    wheel_r, wheel_w = rng.uniform(0.07, 0.11), rng.uniform(0.05, 0.08)
    clearance = wheel_r * rng.uniform(0.5, 0.9)
    parts = [_box((length, body_h, width), (0, clearance + body_h / 2, 0))]
    cabin_l, cabin_h = length * rng.uniform(0.4, 0.6), rng.uniform(0.1, 0.2)
    cabin_x = rng.uniform(-0.15, 0.05) * length
    parts.append(_box((cabin_l, cabin_h, width * rng.uniform(0.8, 0.95)),
                      (cabin_x, clearance + body_h + cabin_h / 2 - 0.005, 0)))
    axle = length * rng.uniform(0.3, 0.38)
    for sx in (-1, 1):
        for sz in (-1, 1):
            parts.append(_cylinder(wheel_r, wheel_w, (sx * axle, wheel_r, sz * (width / 2 - wheel_w / 3)), axis='z'))
    return parts


def _sofa(rng):
    width, depth, seat_h = rng.uniform(1.2, 2.0), rng.uniform(0.6, 0.9), rng.uniform(0.3, 0.45)
    leg_h = rng.uniform(0.0, 0.08)
    base_bottom = leg_h if leg_h > 0.02 else 0.0
    parts = [_box((depth, seat_h - base_bottom, width), (0, (seat_h + base_bottom) / 2, 0))]
    back_h, back_t = rng.uniform(0.3, 0.5), rng.uniform(0.12, 0.25)
    parts.append(_box((back_t, seat_h + back_h - base_bottom, width),
                      (-depth / 2 + back_t / 2, (seat_h + back_h + base_bottom) / 2, 0)))
    if rng.random() < 0.85:   # arms
        arm_w, arm_h = rng.uniform(0.1, 0.2), rng.uniform(0.12, 0.3)
        for sz in (-1, 1):
            parts.append(_box((depth, seat_h + arm_h - base_bottom, arm_w),
                              (0, (seat_h + arm_h + base_bottom) / 2, sz * (width / 2 - arm_w / 2))))
    if rng.random() < 0.5:    # seat cushions
        n = int(rng.integers(2, 4))
        inner = width - 0.4
        for k in range(n):
            z = -inner / 2 + (k + 0.5) * inner / n
            parts.append(_box((depth - back_t, 0.06, inner / n - 0.02), (back_t / 2, seat_h + 0.025, z)))
    if base_bottom:
        parts += _legs(depth / 2 - 0.05, width / 2 - 0.05, base_bottom + 0.01, 0.04, rng.random() < 0.5)
    return parts


def _cabinet(rng):
    width, height, depth = rng.uniform(0.4, 1.0), rng.uniform(0.5, 1.4), rng.uniform(0.3, 0.6)
    leg_h = rng.uniform(0.04, 0.12) if rng.random() < 0.4 else 0.0
    parts = [_box((depth, height, width), (0, leg_h + height / 2, 0))]
    front = depth / 2
    if rng.random() < 0.5:    # doors, side by side
        n = 1 if width < 0.6 else 2
        for k in range(n):
            z = -width / 2 + (k + 0.5) * width / n
            parts.append(_box((0.02, height - 0.04, width / n - 0.02), (front + 0.005, leg_h + height / 2, z)))
            hz = z + (width / n / 2 - 0.05) * (1 if k == 0 else -1)   # next to the middle / one side
            parts.append(_cylinder(0.012, 0.12, (front + 0.025, leg_h + height * 0.55, hz), axis='y'))
    else:                     # drawers, stacked
        n = int(rng.integers(2, 6))
        for k in range(n):
            y = leg_h + (k + 0.5) * height / n
            parts.append(_box((0.02, height / n - 0.02, width - 0.04), (front + 0.005, y, 0)))
            parts.append(_box((0.03, 0.02, min(0.2, width * 0.4)), (front + 0.025, y, 0)))
    if rng.random() < 0.3:    # overhanging top
        parts.append(_box((depth + 0.04, 0.03, width + 0.04), (0.01, leg_h + height + 0.012, 0)))
    if leg_h:
        parts += _legs(depth / 2 - 0.04, width / 2 - 0.04, leg_h + 0.01, 0.04, rng.random() < 0.5)
    return parts


def _watercraft(rng):
    length, beam, depth = rng.uniform(1.0, 1.4), rng.uniform(0.22, 0.4), rng.uniform(0.1, 0.2)
    # hull: a capsule along x squashed to an elliptic section (beam along z, depth along y)
    parts = [_capsule(beam / 2, length, axis='x', scale=(1.0, 2 * depth / beam, 1.0))]
    deck_y = depth * 0.55
    parts.append(_box((length * 0.75, 0.03, beam * 0.75), (0, deck_y, 0)))
    if rng.random() < 0.5:    # sailing boat: mast and sail
        mast_h = rng.uniform(0.5, 0.9)
        mast_x = rng.uniform(-0.05, 0.15) * length
        parts.append(_cylinder(0.012, mast_h, (mast_x, deck_y + mast_h / 2, 0)))
        sail_l = rng.uniform(0.25, 0.4) * length
        parts.append(_box((sail_l, mast_h * 0.75, 0.01), (mast_x - sail_l / 2, deck_y + mast_h * 0.5, 0)))
    else:                     # motor boat / ship: one or two cabin blocks
        cabin_l, cabin_h = rng.uniform(0.2, 0.4) * length, rng.uniform(0.08, 0.18)
        cabin_x = rng.uniform(-0.25, 0.05) * length
        parts.append(_box((cabin_l, cabin_h, beam * 0.6), (cabin_x, deck_y + cabin_h / 2, 0)))
        if rng.random() < 0.5:
            parts.append(_box((cabin_l * 0.5, cabin_h * 0.7, beam * 0.45),
                              (cabin_x - cabin_l * 0.1, deck_y + cabin_h * 1.35, 0)))
    return parts


_BUILDERS = {'airplane': _airplane, 'cabinet': _cabinet, 'car': _car, 'chair': _chair, 'lamp': _lamp,
             'sofa': _sofa, 'table': _table, 'watercraft': _watercraft}


def make_shape(category: str, rng: np.random.Generator) -> list:
    """The convex trimesh parts of one random ``category`` shape, normalised together (bounding box
    centred on the origin, diagonal 1, so every point lies in [-0.5, 0.5]^3), y up."""
    if category not in _BUILDERS:
        raise ValueError(f'unknown built-in PCN category {category!r} (available: {", ".join(BUILTIN_CATEGORIES)})')
    parts = _BUILDERS[category](rng)
    vertices = np.concatenate([p.vertices for p in parts])
    low, high = vertices.min(axis=0), vertices.max(axis=0)
    scale = 1.0 / float(np.linalg.norm(high - low))
    normalise = np.diag([scale, scale, scale, 1.0])
    normalise[:3, 3] = -(low + high) / 2 * scale
    return [p.apply_transform(normalise) for p in parts]


def _face_planes(mesh) -> np.ndarray:
    """(K, 4) unique outward planes (n, d) of a convex mesh: inside means n . p + d < 0 for all of them."""
    normals = mesh.face_normals
    offsets = -np.einsum('ij,ij->i', normals, mesh.triangles[:, 0])
    planes = np.round(np.column_stack([normals, offsets]), 9)
    return np.unique(planes, axis=0)


def _outer_mask(points: np.ndarray, owner: np.ndarray, parts: list, planes: List[np.ndarray],
                margin: float) -> np.ndarray:
    """Points (sampled on part ``owner``) not strictly inside any other (convex) part."""
    keep = np.ones(len(points), dtype=bool)
    for j, part in enumerate(parts):
        low, high = part.bounds
        near = np.flatnonzero(keep & (owner != j) & np.all((points > low) & (points < high), axis=1))
        if len(near) == 0:
            continue
        inside = np.all(points[near] @ planes[j][:, :3].T + planes[j][:, 3] < -margin, axis=1)
        keep[near[inside]] = False
    return keep


def _surface_points(parts: list, count: int, rng: np.random.Generator,
                    margin: float = 1e-4) -> Tuple[np.ndarray, np.ndarray, float]:
    """(points, outward normals, area): ``count`` points uniform on the outer surface of the union of
    ``parts`` (samples inside another part are dropped) and that outer surface's estimated area."""
    import trimesh

    mesh = trimesh.util.concatenate(parts)
    owner_of_face = np.repeat(np.arange(len(parts)), [len(p.faces) for p in parts])
    planes = [_face_planes(p) for p in parts]
    kept_points, kept_faces = [], []
    total = drawn = 0
    while total < count:
        batch = max(int((count - total) * 1.4), 1024)
        points, faces = trimesh.sample.sample_surface(mesh, batch, seed=rng)
        keep = _outer_mask(points, owner_of_face[faces], parts, planes, margin)
        kept_points.append(points[keep])
        kept_faces.append(faces[keep])
        total, drawn = total + int(keep.sum()), drawn + batch
    points, faces = np.concatenate(kept_points)[:count], np.concatenate(kept_faces)[:count]
    return points, mesh.face_normals[faces], float(mesh.area) * total / drawn


def _visible(points: np.ndarray, normals: np.ndarray, candidates: np.ndarray, direction: np.ndarray,
             pixel: float, distance: float = 2.0, min_cos: float = 0.15) -> np.ndarray:
    """Mask of the ``candidates`` (indices into ``points``) that a pinhole camera at ``direction *
    distance``, looking at the origin, sees.

    Back-facing points and grazing ones (cosine to the view ray < ``min_cos``) are dropped; the front-facing
    points fill a z-buffer of ``pixel`` (world size at the origin's depth) with each point splatting its
    depth over 3x3 pixels; a candidate is visible when it lies no deeper than that buffer plus a tolerance
    that grows with its own surface's tilt (the depth its surface gains across the splat).
    """
    forward = -direction
    up = np.array([0.0, 1.0, 0.0]) if abs(direction[1]) < 0.9 else np.array([1.0, 0.0, 0.0])
    right = np.cross(forward, up)
    right /= np.linalg.norm(right)
    up = np.cross(right, forward)
    rel = points - direction * distance
    depth = rel @ forward
    cosine = -np.einsum('ij,ij->i', normals, rel) / np.linalg.norm(rel, axis=1)
    front = cosine >= min_cos
    half = 0.8
    resolution = int(math.ceil(2 * half / pixel))
    u = np.clip(((rel @ right) / depth * distance + half) / pixel, 0, resolution - 1).astype(np.int64)
    v = np.clip(((rel @ up) / depth * distance + half) / pixel, 0, resolution - 1).astype(np.int64)
    index = v * resolution + u
    zbuffer = np.full(resolution * resolution, np.inf)
    np.minimum.at(zbuffer, index[front], depth[front])
    image = np.pad(zbuffer.reshape(resolution, resolution), 1, constant_values=np.inf)
    splat = np.full((resolution, resolution), np.inf)
    for dv in range(3):
        for du in range(3):
            np.minimum(splat, image[dv:dv + resolution, du:du + resolution], out=splat)
    splat = splat.reshape(-1)
    c = np.clip(cosine[candidates], min_cos, 1.0)
    footprint = pixel * depth[candidates] / distance     # world size of a pixel at the point's depth
    tolerance = footprint * (0.5 + 2.0 * np.sqrt(1.0 - c * c) / c)
    return front[candidates] & (depth[candidates] <= splat[index[candidates]] + tolerance)


def sample_model(parts: list, rng: np.random.Generator, *, num_complete: int = 16384, num_views: int = 8,
                 partial_pool: int = 4096, return_directions: bool = False):
    """(complete cloud, partial views) of a shape's parts, all float32.

    The complete cloud is ``num_complete`` points uniform on the outer surface; each view keeps the points
    of a separate ``partial_pool``-point outer-surface sample that a camera at a random direction (uniform
    on the sphere, distance 2 from the centre) sees (:func:`_visible`, all points as occluders), so a view is
    a subset of the surface with its far side missing (mostly 25-50% of the pool).
    ``return_directions=True`` also returns the (num_views, 3) unit camera directions (camera at 2x that).
    """
    points, normals, area = _surface_points(parts, num_complete + partial_pool, rng)
    pixel = 1.5 * math.sqrt(area / len(points))
    candidates = np.arange(num_complete, len(points))
    points32 = points.astype(np.float32)
    views, directions = [], []
    for _ in range(num_views):
        direction = rng.normal(size=3)
        direction /= np.linalg.norm(direction)
        mask = _visible(points, normals, candidates, direction, pixel)
        views.append(points32[candidates[mask]])
        directions.append(direction)
    if return_directions:
        return points32[:num_complete], views, np.stack(directions)
    return points32[:num_complete], views


def model_rng(seed: int, category: str, split: str, index: int) -> np.random.Generator:
    """The generator of one built-in model: independent of the other categories, splits and counts."""
    return np.random.default_rng([int(seed), int(TAXONOMY_IDS[category]), SPLITS.index(split), int(index)])


def model_id(seed: int, category: str, split: str, index: int) -> str:
    """A ShapeNet-like 32-hex model id for one built-in model."""
    return hashlib.md5(f'builtin-pcn:{seed}:{category}:{split}:{index}'.encode()).hexdigest()


def _write_builtin(folder: Path, params: Dict[str, Any]) -> None:
    """The files of a built-in dataset (see :func:`write_builtin_pcn`) under ``folder``."""
    seed, num_views, num_complete = params['seed'], params['num_views'], params['num_complete']
    entries = []
    for category in params['categories']:
        taxonomy = TAXONOMY_IDS[category]
        entry: Dict[str, Any] = {'taxonomy_id': taxonomy, 'taxonomy_name': category}
        for split, count in zip(SPLITS, params['models_per_split']):
            entry[split] = []
            (folder / split / 'complete' / taxonomy).mkdir(parents=True, exist_ok=True)
            for index in range(count):
                rng = model_rng(seed, category, split, index)
                complete, views = sample_model(make_shape(category, rng), rng, num_complete=num_complete,
                                               num_views=num_views, partial_pool=params['partial_pool'])
                model = model_id(seed, category, split, index)
                write_pcd(folder / split / 'complete' / taxonomy / f'{model}.pcd', complete)
                view_folder = folder / split / 'partial' / taxonomy / model
                view_folder.mkdir(parents=True)
                for v, view in enumerate(views):
                    write_pcd(view_folder / f'{v:02d}.pcd', view)
                entry[split].append(model)
        entries.append(entry)
    for split in SPLITS:
        (folder / split / 'partial').mkdir(parents=True, exist_ok=True)
    (folder / CATEGORY_FILE).write_text(json.dumps(entries, indent=4) + '\n')
    (folder / BUILTIN_MARKER).write_text(json.dumps(params, indent=2) + '\n')


def _marker_matches(root: Path, params: Dict[str, Any]) -> bool:
    try:
        return json.loads((root / BUILTIN_MARKER).read_text()) == params
    except (OSError, ValueError):
        return False


def write_builtin_pcn(root: PathLike, *, models_per_split: Sequence[int] = (16, 4, 4), num_views: int = 8,
                      num_complete: int = 16384, seed: int = 0,
                      categories: Sequence[str] = BUILTIN_CATEGORIES, partial_pool: int = 4096) -> Path:
    """Write a procedural PCN stand-in at ``root`` in PCN's layout (binary PCD files, ``PCN.json``); returns root.

    ``models_per_split``: models per category in (train, val, test); every split gets ``num_views`` views
    per model. The bytes depend only on the arguments (per-model generators from (seed, category, split,
    index)). The files are written to a temporary sibling folder and moved into place, with a
    ``builtin_pcn.json`` marker holding the arguments: when ``root`` already holds a built-in dataset with
    the same arguments, it is returned as is; any other non-empty ``root`` is a FileExistsError.
    """
    root = Path(root)
    counts = tuple(int(n) for n in models_per_split)
    if len(counts) != len(SPLITS) or min(counts) < 0:
        raise ValueError(f'models_per_split must be 3 counts >= 0 for {SPLITS}, got {tuple(models_per_split)}')
    if num_views < 1 or num_complete < 1 or partial_pool < 1:
        raise ValueError(f'num_views, num_complete and partial_pool must be >= 1, got {num_views}, '
                         f'{num_complete}, {partial_pool}')
    categories = tuple(categories)
    unknown = [c for c in categories if c not in _BUILDERS]
    if unknown or not categories or len(set(categories)) != len(categories):
        raise ValueError(f'categories must be distinct built-in categories ({", ".join(BUILTIN_CATEGORIES)}), '
                         f'got {", ".join(categories) or "none"}')
    params = {'generator': 1, 'models_per_split': list(counts), 'num_views': num_views,
              'num_complete': num_complete, 'seed': int(seed), 'categories': list(categories),
              'partial_pool': partial_pool}
    if root.exists():
        if _marker_matches(root, params):
            return root
        if not root.is_dir() or any(root.iterdir()):
            raise FileExistsError(f'{root} exists and is not a built-in PCN dataset made with these arguments '
                                  f'({params}); remove it or choose another folder')
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f'.{root.name}.tmp-{os.getpid()}'
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_builtin(tmp, params)
        if root.exists():
            root.rmdir()   # empty, checked above
        os.replace(tmp, root)
    except OSError:
        # another process (e.g. a second rank) may have moved the same dataset into place first
        shutil.rmtree(tmp, ignore_errors=True)
        if _marker_matches(root, params):
            return root
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


# ------------------------------------------------------------------------------------------- command line

def _preview(root: Path, out: Path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    entries = load_category_file(root / CATEGORY_FILE)
    entries = [e for e in entries if e['train']]
    fig = plt.figure(figsize=(3 * len(entries), 6))
    for i, entry in enumerate(entries):
        model = entry['train'][0]
        complete = read_pcd(root / 'train' / 'complete' / entry['taxonomy_id'] / f'{model}.pcd')
        partial = read_pcd(root / 'train' / 'partial' / entry['taxonomy_id'] / model / '00.pcd')
        for row, (points, title) in enumerate(((complete, 'complete'), (partial, 'view 00'))):
            ax = fig.add_subplot(2, len(entries), row * len(entries) + i + 1, projection='3d')
            ax.scatter(points[:, 0], points[:, 2], points[:, 1], s=0.3)   # y up on the plot's vertical axis
            ax.set_xlim(-0.5, 0.5), ax.set_ylim(-0.5, 0.5), ax.set_zlim(-0.5, 0.5)
            ax.set_title(f'{entry["taxonomy_name"]} {title} ({len(points)})', fontsize=8)
            ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description='Write the built-in PCN stand-in dataset.')
    parser.add_argument('root', type=Path)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--models-per-split', type=int, nargs=3, default=(16, 4, 4), metavar=('TRAIN', 'VAL', 'TEST'))
    parser.add_argument('--num-views', type=int, default=8)
    parser.add_argument('--num-complete', type=int, default=16384)
    parser.add_argument('--preview', type=Path, help='also save a PNG of one complete cloud and view per category')
    args = parser.parse_args(argv)
    start = time.perf_counter()
    root = write_builtin_pcn(args.root, models_per_split=args.models_per_split, num_views=args.num_views,
                             num_complete=args.num_complete, seed=args.seed)
    print(f'{root}: {len(BUILTIN_CATEGORIES)} categories x {args.models_per_split} models, {args.num_views} views, '
          f'{time.perf_counter() - start:.1f} s')
    if args.preview:
        _preview(root, args.preview)
        print(f'preview: {args.preview}')


if __name__ == '__main__':
    main()
