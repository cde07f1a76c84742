"""Data fingerprints: what a run's data files were when it trained, so that a changed file cannot go unnoticed.

A run's ``config.json`` stores the paths of its data; a file edited, truncated or replaced at that path would let
``--resume`` continue, and ``eval`` report metrics, on other data without a word. Every recipe's ``run_train``
therefore stores :func:`data_fingerprints` of the files and folders it reads under :data:`DATA_FINGERPRINT`
(``{path: fingerprint}``; built-in data generated onto disk included, data generated in memory not):

- ``--resume``: :meth:`runs.RunFolder.commit` compares them with the stored ones and refuses a change, naming
  the path and what changed (:func:`fingerprint_changes`);
- ``eval`` (and every command that reads a trained run's data): :func:`runs.load_finished_run` calls
  :func:`check_data_unchanged`, which refuses a run whose data are not what they were.

A file's fingerprint hashes its bytes (streamed). A folder's hashes its listing (relative path and size of every
file below it) and, when its files total at most :data:`FOLDER_CONTENT_LIMIT` bytes, their contents too (so a
same-size edit inside a built-in PCN folder or a CIFAR batch folder is caught); larger folders (ImageNet-style
trees) are fingerprinted by their listing only. A recipe whose loader skips hidden files (the language recipe's
text folders) fingerprints without them (``skip_hidden``), so a stray ``.DS_Store`` does not refuse a resume.
Runs stored before fingerprints existed hold no :data:`DATA_FINGERPRINT` and load as before; a stored fingerprint
is compared on the keys it holds (one stored before folder contents were hashed is compared on its listing).
"""
import hashlib
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Union

PathLike = Union[str, 'os.PathLike[str]']
DATA_FINGERPRINT = 'data_fingerprint'  # the config key: {data path: data_fingerprint(path)}
_CHUNK = 1 << 20
FOLDER_CONTENT_LIMIT = 256 << 20  # folders up to this many bytes also get their files' contents hashed
_ORDER = ('kind', 'files', 'bytes', 'sha256', 'contents_sha256')  # how a change is reported
HIDDEN_SKIPPED = 'skipped'  # a folder fingerprint's 'hidden' value: hidden entries left out


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open('rb') as f:
        for chunk in iter(lambda: f.read(_CHUNK), b''):
            digest.update(chunk)
    return digest.hexdigest()


def _folder_listing(root: Path, skip_hidden: bool = False) -> List[tuple]:
    """(relative posix path, size) of every file below ``root``, sorted; symbolic links followed, each folder once;
    ``skip_hidden``: without files and folders whose name starts with a dot (and everything below such a folder)."""
    listing, seen = [], set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        stat = os.stat(folder)
        if (stat.st_dev, stat.st_ino) in seen:  # a link back up the tree
            dirs[:] = []
            continue
        seen.add((stat.st_dev, stat.st_ino))
        if skip_hidden:
            dirs[:] = [name for name in dirs if not name.startswith('.')]
            files = [name for name in files if not name.startswith('.')]
        for name in files:
            path = Path(folder) / name
            try:
                size = path.stat().st_size
            except OSError:  # a dangling link: its own entry
                size = path.lstat().st_size
            listing.append((path.relative_to(root).as_posix(), size))
    return sorted(listing)


def data_fingerprint(path: PathLike, skip_hidden: bool = False) -> Dict[str, Any]:
    """What ``path`` holds now.

    A file: ``{'kind': 'file', 'bytes': size, 'sha256': hash of the bytes}``. A folder: ``{'kind': 'folder',
    'files': count, 'bytes': total size, 'sha256': hash of the sorted (relative path, size) listing}``, plus
    ``'contents_sha256'`` (a hash of every file's path, size and SHA-256) when the total is at most
    :data:`FOLDER_CONTENT_LIMIT` bytes. ``skip_hidden`` (for a loader that skips them, e.g. the text folders of
    ``recipes.data.text``): a folder's hidden files and folders (name starting with a dot) are left out, and the
    fingerprint records ``'hidden': 'skipped'`` so that later checks leave them out too.

    Raises:
        FileNotFoundError: ``path`` does not exist (naming it).
    """
    path = Path(path)
    if path.is_dir():
        listing = _folder_listing(path, skip_hidden)
        digest = hashlib.sha256(''.join(f'{name}\t{size}\n' for name, size in listing).encode('utf-8'))
        total = sum(size for _, size in listing)
        found = dict(kind='folder', files=len(listing), bytes=total, sha256=digest.hexdigest())
        if skip_hidden:
            found['hidden'] = HIDDEN_SKIPPED
        if total <= FOLDER_CONTENT_LIMIT:
            contents = hashlib.sha256()
            for name, size in listing:
                contents.update(f'{name}\t{size}\t{_file_sha256(path / name)}\n'.encode('utf-8'))
            found['contents_sha256'] = contents.hexdigest()
        return found
    if path.is_file():
        return dict(kind='file', bytes=path.stat().st_size, sha256=_file_sha256(path))
    raise FileNotFoundError(f'data {path} does not exist (no file or folder to fingerprint)')


def data_fingerprints(paths: Iterable[Optional[PathLike]], skip_hidden: bool = False) -> Dict[str, Dict[str, Any]]:
    """``{str(path): data_fingerprint(path, skip_hidden)}`` of the data files / folders a run reads (``None`` entries
    skipped; empty when it reads none): the value of a config's :data:`DATA_FINGERPRINT`."""
    return {str(p): data_fingerprint(p, skip_hidden) for p in paths if p is not None}


def _show(key: str, value: Any) -> str:
    return f'{value[:16]}...' if key == 'sha256' and isinstance(value, str) else str(value)


def fingerprint_changes(stored: Dict[str, Any], found: Dict[str, Any]) -> List[str]:
    """One line per path whose fingerprint differs between two :data:`DATA_FINGERPRINT` mappings, naming the path
    and what changed (e.g. ``'a.csv: bytes 2500 -> 2100, sha256 3f2a... -> 91c0...'``). Only the keys a stored
    fingerprint holds are compared (an older one may record less, e.g. no folder contents)."""
    lines = []
    for path in list(dict.fromkeys([*stored, *found])):
        old, new = stored.get(path), found.get(path)
        if old == new or (old is not None and new is not None and all(new.get(k) == v for k, v in old.items())):
            continue
        if new is None:
            lines.append(f'{path}: read by the stored run, not now')
        elif old is None:
            lines.append(f'{path}: read now, not by the stored run')
        else:
            keys = [k for k in _ORDER if k in old] + sorted(set(old) - set(_ORDER))
            lines.append(f'{path}: ' + ', '.join(f'{k} {_show(k, old.get(k, "<absent>"))} -> '
                                                 f'{_show(k, new.get(k, "<absent>"))}'
                                                 for k in keys if old.get(k) != new.get(k)))
    return lines


def _same_path(a: str, b: str) -> bool:
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def check_stored_fingerprints(stored: Any, config_path: PathLike) -> None:
    """A config's :data:`DATA_FINGERPRINT` is a ``{path: fingerprint}`` mapping, else a ValueError naming the file."""
    if not isinstance(stored, dict) or not all(isinstance(v, dict) for v in stored.values()):
        raise ValueError(f'run config {config_path} is damaged: {DATA_FINGERPRINT} must map each data path to its '
                         f'fingerprint, found {stored!r}')


def check_data_unchanged(config: Dict[str, Any], run: PathLike, reads: Optional[Iterable[PathLike]] = None) -> None:
    """The data files a trained run stored fingerprints of are what they were when it trained.

    Args:
        config: The run's config (without :data:`DATA_FINGERPRINT`, e.g. an older run: nothing to check).
        run: The run folder, for messages.
        reads: The data paths the command will read (e.g. ``eval --data`` given another source: that one); only
            stored paths among them are checked. ``None``: the run's own data, all of them.

    Raises:
        ValueError: a file or folder changed (naming it and what changed: kind, files, bytes, sha256), or the
            stored fingerprints are not a ``{path: fingerprint}`` mapping.
        FileNotFoundError: a data path no longer exists (naming it).
    """
    stored = config.get(DATA_FINGERPRINT)
    if stored is None:
        return
    check_stored_fingerprints(stored, Path(run) / 'config.json')
    if reads is not None:
        reads = [str(p) for p in reads if p is not None]
        stored = {path: fp for path, fp in stored.items() if any(_same_path(path, r) for r in reads)}
    found: Dict[str, Any] = {}
    missing = []
    for path in stored:
        try:
            found[path] = data_fingerprint(path, skip_hidden=stored[path].get('hidden') == HIDDEN_SKIPPED)
        except FileNotFoundError:
            missing.append(path)
    if missing:
        raise FileNotFoundError(f'{", ".join(missing)}: the data of run {run} no longer exist(s); restore the data '
                                f'it was trained on')
    changes = fingerprint_changes(stored, found)
    if changes:
        raise ValueError(f'the data changed since run {run} was trained: {"; ".join(changes)}; restore the data it '
                         f'was trained on, or train a new run on these data')


__all__ = ['DATA_FINGERPRINT', 'FOLDER_CONTENT_LIMIT', 'HIDDEN_SKIPPED', 'check_data_unchanged',
           'check_stored_fingerprints', 'data_fingerprint', 'data_fingerprints', 'fingerprint_changes']
