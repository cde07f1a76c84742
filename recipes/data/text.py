"""Byte-level text for the language recipe: corpora, a disjoint split, windows, and two synthetic tasks.

Tokens are the bytes 0..255 of UTF-8 text (no tokenizer, nothing downloaded).

Corpus sources (``read_corpus``):
  * files and folders of text (folders are read recursively, sorted; hidden files skipped);
  * webdataset text shards: ``.tar`` files whose ``<key>.txt`` members are the documents;
  * nothing: the built-in corpus, the English prose of CPython's ``pydoc_data.topics`` (about 0.46 MB,
    ships with every CPython), optionally plus the standard library's own top-level ``.py`` sources.
An empty document, a binary file (NUL bytes) or a damaged shard is an error naming the file.

Split (``split_corpus``): the documents are concatenated and cut into blocks of ``block_bytes``; a seeded
permutation picks ``round(val_fraction * blocks)`` of them for validation. Disjoint by construction, the
same for the same inputs. Training windows are drawn inside the training stream with a per-sample random
shift; evaluation windows are non-overlapping and lie inside single validation blocks.

Synthetic tasks:
  * passkey (GOAT Fig. 3, after Mohtashami & Jaggi): filler sentences with `` The pass key is NNNNN. Remember
    it. `` at a relative depth, then `` What is the pass key? The pass key is NNNNN``; the model must produce
    the 5 key digits (81 fixed bytes, so any length >= 81 works).
  * indirect indexing (PoPE Sec. 4, App. B.1):
    ``<20-40 distinct letters of a-z, A-Z>|<anchor><sign><2 digits>=<target>``, the target being the letter at
    (anchor's position + offset), offset in -15..+15 (never 0, always inside).
    ``IndexSpec`` sets the letter counts, the largest offset and the layout: ``'anchor-offset'`` (the above) or
    ``'offset-anchor'`` (``<letters>|<sign><2 digits><anchor><target>``: the anchor is the byte the target is
    predicted from, as in an induction head's lookup).
"""
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ['Document', 'read_corpus', 'builtin_corpus', 'split_corpus', 'CorpusSplit', 'TrainWindows',
           'eval_windows', 'passkey_sample', 'PasskeyTask', 'IndexSpec', 'index_sample', 'IndexTask', 'KEY_DIGITS']

TEXT_SHARD_SUFFIX = '.txt'
KEY_DIGITS = 5
FILLER = b'The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. '
LETTERS = b'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'  # 40 distinct letters need both cases
INDEX_MIN_LETTERS, INDEX_MAX_LETTERS, INDEX_MAX_OFFSET = 20, 40, 15  # the paper's task
INDEX_LAYOUTS = ('anchor-offset', 'offset-anchor')


@dataclass(frozen=True)
class Document:
    """One text: its source (file, ``shard.tar:member`` or ``pydoc_data.topics:<topic>``) and its bytes."""
    source: str
    data: bytes


# ----------------------------------------------------------------------------------------- corpora

def check_document(source: str, data: bytes) -> Document:
    """Reject an empty or binary (NUL-containing) document, naming it."""
    if not data:
        raise ValueError(f'{source} is empty: no text to train on')
    nul = data.find(b'\x00')
    if nul >= 0:
        raise ValueError(f'{source} is not text: NUL byte at offset {nul} (binary file?)')
    return Document(source, data)


def read_shard(path: Path) -> List[Document]:
    """The ``.txt`` members of a webdataset shard, in archive order."""
    docs = []
    try:
        with tarfile.open(path, 'r') as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(TEXT_SHARD_SUFFIX):
                    docs.append(check_document(f'{path}:{member.name}', tar.extractfile(member).read()))
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ValueError(f'{path} is not a readable webdataset shard (truncated or damaged tar): {e}') from e
    if not docs:
        raise ValueError(f'{path} holds no {TEXT_SHARD_SUFFIX} members: not a text webdataset shard')
    return docs


def read_path(path: Path) -> List[Document]:
    if path.suffix == '.tar':
        return read_shard(path)
    return [check_document(str(path), path.read_bytes())]


def read_corpus(sources: Sequence[str]) -> List[Document]:
    """Documents of the given files, folders (recursive, sorted, hidden entries skipped) and ``.tar`` shards."""
    if not sources:
        raise ValueError('no text sources given')
    docs: List[Document] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.rglob('*') if p.is_file()
                           and not any(part.startswith('.') for part in p.relative_to(path).parts))
            if not files:
                raise ValueError(f'text folder {path} holds no files')
            for file in files:
                docs.extend(read_path(file))
        elif path.is_file():
            docs.extend(read_path(path))
        else:
            raise FileNotFoundError(f'text source {path} does not exist')
    return docs


def builtin_corpus(with_stdlib: bool = False, stdlib_limit_bytes: int = 4_000_000) -> List[Document]:
    """CPython's ``pydoc_data.topics`` prose (sorted by topic), optionally plus the stdlib's top-level ``.py``
    sources (sorted, up to ``stdlib_limit_bytes``)."""
    from pydoc_data.topics import topics

    docs = [check_document(f'pydoc_data.topics:{name}', topics[name].encode('utf-8')) for name in sorted(topics)]
    if with_stdlib:
        total = 0
        for path in sorted(Path(sysconfig.get_paths()['stdlib']).glob('*.py')):
            data = path.read_bytes()
            if not data or b'\x00' in data:
                continue  # e.g. an empty __init__-like file: the built-in corpus skips it rather than failing
            if total + len(data) > stdlib_limit_bytes:
                break
            docs.append(Document(str(path), data))
            total += len(data)
    return docs


# ------------------------------------------------------------------------------------------- split

@dataclass
class CorpusSplit:
    """Train / validation bytes: one training stream and the list of validation blocks."""
    train: np.ndarray  # uint8, the training blocks concatenated
    val_blocks: List[np.ndarray]
    val_block_ids: List[int]
    num_blocks: int


def split_corpus(docs: Sequence[Document], val_fraction: float = 0.1, block_bytes: int = 16384,
                 seed: int = 0) -> CorpusSplit:
    """Cut the concatenated documents into ``block_bytes`` blocks; a seeded choice of them is validation."""
    if not 0 < val_fraction < 1:
        raise ValueError(f'val_fraction must be in (0, 1), got {val_fraction}')
    if block_bytes < 2:
        raise ValueError(f'block_bytes must be >= 2, got {block_bytes}')
    stream = np.frombuffer(b''.join(d.data for d in docs), dtype=np.uint8)
    num_blocks = len(stream) // block_bytes
    num_val = round(val_fraction * num_blocks)
    if num_val < 1 or num_val >= num_blocks:
        raise ValueError(f'the corpus has {len(stream)} bytes = {num_blocks} blocks of {block_bytes}: too few for a '
                         f'{val_fraction:.0%} validation split with a block in each part; '
                         'add text or lower --block-bytes')
    order = np.random.default_rng(seed).permutation(num_blocks)
    val_ids = sorted(int(i) for i in order[:num_val])
    is_val = np.zeros(num_blocks, dtype=bool)
    is_val[val_ids] = True
    blocks = stream[:num_blocks * block_bytes].reshape(num_blocks, block_bytes)
    train = np.concatenate([blocks[~is_val].reshape(-1), stream[num_blocks * block_bytes:]])
    return CorpusSplit(train=train, val_blocks=[blocks[i] for i in val_ids], val_block_ids=val_ids,
                       num_blocks=num_blocks)


class TrainWindows(Dataset):
    """Windows of ``length + 1`` bytes from the training stream: item ``i`` starts at ``i * length`` plus a
    random shift in ``[0, length)`` (drawn from torch's RNG, so ``PerSampleSeeds`` makes it reproducible)."""

    def __init__(self, stream: np.ndarray, length: int) -> None:
        if length < 1:
            raise ValueError(f'window length must be >= 1, got {length}')
        self.count = (len(stream) - 1) // length - 1
        if self.count < 1:
            raise ValueError(f'the training text has {len(stream)} bytes: too short for windows of {length} tokens')
        self.stream = torch.from_numpy(stream.astype(np.int64))
        self.length = length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.length + int(torch.randint(0, self.length, ()))
        return self.stream[start:start + self.length + 1]


def eval_windows(blocks: Sequence[np.ndarray], length: int, max_windows: Optional[int] = None) -> torch.Tensor:
    """Non-overlapping windows of ``length + 1`` bytes inside single validation blocks, block order: (W, length + 1)."""
    windows = [torch.from_numpy(b[s:s + length + 1].astype(np.int64))
               for b in blocks for s in range(0, len(b) - length, length + 1)]
    if not windows:
        longest = max((len(b) for b in blocks), default=0)
        raise ValueError(f'evaluation length {length} does not fit in a validation block of {longest} bytes; '
                         f'raise --block-bytes to at least {length + 1}')
    return torch.stack(windows[:max_windows])


# ----------------------------------------------------------------------------------------- passkey

def passkey_sample(length: int, depth: float, key: int) -> Tuple[bytes, int]:
    """A ``length``-byte passkey prompt with its 5-digit ``key`` at relative ``depth`` of the filler.

    Returns (text, answer_start): the text ends with the key's digits, which start at ``answer_start``.
    """
    if not 0 <= depth <= 1:
        raise ValueError(f'depth must be in [0, 1], got {depth}')
    if not 0 <= key < 10 ** KEY_DIGITS:
        raise ValueError(f'key must have at most {KEY_DIGITS} digits, got {key}')
    digits = f'{key:0{KEY_DIGITS}d}'.encode()
    needle = b' The pass key is ' + digits + b'. Remember it. '
    tail = b' What is the pass key? The pass key is '
    filler_len = length - len(needle) - len(tail) - KEY_DIGITS
    if filler_len < 0:
        raise ValueError(f'passkey length {length} is too short: the fixed text alone takes '
                         f'{length - filler_len} bytes')
    filler = (FILLER * (filler_len // len(FILLER) + 1))[:filler_len]
    before = int(round(depth * filler_len))
    text = filler[:before] + needle + filler[before:] + tail + digits
    assert len(text) == length
    return text, length - KEY_DIGITS


class PasskeyTask(Dataset):
    """Passkey prompts of one ``length``: item ``i`` has a random depth and key from ``seed`` and ``i``.

    Items are dicts: ``tokens`` (length,), ``answer_start`` (position of the first key digit).
    """

    def __init__(self, length: int, size: int, seed: int, depths: Optional[Sequence[float]] = None) -> None:
        self.length, self.size, self.seed, self.depths = length, size, seed, depths
        passkey_sample(length, 0.5, 0)  # fails now for an impossible length

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng((self.seed, index))
        depth = float(rng.choice(self.depths)) if self.depths is not None else float(rng.uniform())
        text, start = passkey_sample(self.length, depth, int(rng.integers(0, 10 ** KEY_DIGITS)))
        return dict(tokens=torch.tensor(list(text), dtype=torch.long), answer_start=start)


# --------------------------------------------------------------------------------- indirect indexing

@dataclass(frozen=True)
class IndexSpec:
    """An indirect-indexing task: ``min_letters``-``max_letters`` distinct letters, offsets in
    -``max_offset``..+``max_offset`` (never 0, always inside the string), and the prompt ``layout``:
    ``'anchor-offset'`` ``<letters>|<anchor><sign><2 digits>=<target>`` (the default, the paper's task) or
    ``'offset-anchor'`` ``<letters>|<sign><2 digits><anchor><target>``."""
    min_letters: int = INDEX_MIN_LETTERS
    max_letters: int = INDEX_MAX_LETTERS
    max_offset: int = INDEX_MAX_OFFSET
    layout: str = 'anchor-offset'

    def __post_init__(self) -> None:
        if not 2 <= self.min_letters <= self.max_letters <= len(LETTERS):
            raise ValueError(f'indirect indexing needs 2 <= min_letters <= max_letters <= {len(LETTERS)} distinct '
                             f'letters, got {self.min_letters}..{self.max_letters}')
        if not 1 <= self.max_offset <= 99:
            raise ValueError(f'indirect-indexing offsets are written with two digits: max_offset must be in 1..99, '
                             f'got {self.max_offset}')
        if self.layout not in INDEX_LAYOUTS:
            raise ValueError(f'indirect-indexing layout must be one of {INDEX_LAYOUTS}, got {self.layout!r}')

    @property
    def length(self) -> int:
        """Bytes per prompt: the letters, '|', anchor, sign, two digits, '=' (anchor-offset only), target."""
        return self.max_letters + (7 if self.layout == 'anchor-offset' else 6)


INDEX_LENGTH = IndexSpec().length


def index_sample(rng: np.random.Generator, spec: IndexSpec = IndexSpec()) -> Tuple[bytes, int, Dict[str, int]]:
    """One indirect-indexing prompt, left-padded with spaces to ``spec.length`` bytes, ending with its target.

    Returns (text, target_position, facts); ``text[target_position]`` is the target letter and ``facts`` holds
    ``offset`` (the signed offset asked), ``letters`` (the string's length) and ``anchor_back`` (letters after the
    anchor in the string: 0 = the anchor is the last letter, nearest the query).
    """
    count = int(rng.integers(spec.min_letters, spec.max_letters + 1))
    letters = bytes(rng.permutation(list(LETTERS))[:count].tolist())
    anchor = int(rng.integers(0, count))
    offsets = [o for o in range(-spec.max_offset, spec.max_offset + 1) if o != 0 and 0 <= anchor + o < count]
    offset = int(rng.choice(offsets))
    anchor_byte, target_byte = letters[anchor:anchor + 1], letters[anchor + offset:anchor + offset + 1]
    code = (b'+' if offset > 0 else b'-') + f'{abs(offset):02d}'.encode()
    query = anchor_byte + code + b'=' if spec.layout == 'anchor-offset' else code + anchor_byte
    text = letters + b'|' + query + target_byte
    facts = dict(offset=offset, letters=count, anchor_back=count - 1 - anchor)
    return b' ' * (spec.length - len(text)) + text, spec.length - 1, facts


class IndexTask(Dataset):
    """Indirect-indexing prompts of ``spec``; item ``i`` is a function of (seed, i). Items: ``tokens``
    (spec.length,), ``answer_start`` (the target's position, the last one) and the facts of ``index_sample``
    (``offset``, ``letters``, ``anchor_back``)."""

    def __init__(self, size: int, seed: int, spec: IndexSpec = IndexSpec()) -> None:
        self.size, self.seed, self.spec = size, seed, spec

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        text, target, facts = index_sample(np.random.default_rng((self.seed, index)), self.spec)
        return dict(tokens=torch.tensor(list(text), dtype=torch.long), answer_start=target, **facts)
