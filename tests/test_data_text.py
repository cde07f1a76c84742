"""Byte-level text data: corpora (files, folders, webdataset shards, built-in), the disjoint deterministic split,
windows, the passkey and indirect-indexing generators, and an error naming the file for every bad input."""
import io
import re
import tarfile

import numpy as np
import pytest
import torch

from vision_priors.recipes.data.text import (INDEX_LENGTH, INDEX_MAX_OFFSET, KEY_DIGITS, IndexSpec, IndexTask,
                                             PasskeyTask, TrainWindows, builtin_corpus, eval_windows, index_sample,
                                             passkey_sample, read_corpus, split_corpus)


def write_shard(path, members):
    with tarfile.open(path, 'w') as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_builtin_corpus_is_pydoc_prose_plus_optional_stdlib():
    docs = builtin_corpus()
    assert all(d.source.startswith('pydoc_data.topics:') for d in docs)
    assert 300_000 < sum(len(d.data) for d in docs) < 1_000_000
    more = builtin_corpus(with_stdlib=True, stdlib_limit_bytes=200_000)
    extra = more[len(docs):]
    assert extra and all(d.source.endswith('.py') for d in extra) and sum(len(d.data) for d in extra) <= 200_000


def test_files_folders_and_shards(tmp_path):
    (tmp_path / 'dir' / 'sub').mkdir(parents=True)
    (tmp_path / 'dir' / 'b.txt').write_bytes(b'second')
    (tmp_path / 'dir' / 'sub' / 'a.md').write_bytes(b'third')
    (tmp_path / 'dir' / '.hidden').write_bytes(b'\x00skipped')
    (tmp_path / 'one.txt').write_text('first')
    write_shard(tmp_path / 'dir' / 'shard-0.tar', {'k1.txt': b'fourth', 'k1.json': b'{}', 'k2.txt': b'fifth'})
    docs = read_corpus([str(tmp_path / 'one.txt'), str(tmp_path / 'dir')])
    assert [d.data for d in docs] == [b'first', b'second', b'fourth', b'fifth', b'third']
    assert docs[2].source.endswith('shard-0.tar:k1.txt')


def test_bad_text_errors_name_the_file(tmp_path):
    (tmp_path / 'empty.txt').write_bytes(b'')
    with pytest.raises(ValueError, match=r'empty\.txt is empty'):
        read_corpus([str(tmp_path / 'empty.txt')])
    (tmp_path / 'bin.txt').write_bytes(b'ab\x00cd')
    with pytest.raises(ValueError, match=r'bin\.txt is not text: NUL byte at offset 2'):
        read_corpus([str(tmp_path / 'bin.txt')])
    write_shard(tmp_path / 'good.tar', {'a.txt': b'x' * 5000})
    (tmp_path / 'cut.tar').write_bytes((tmp_path / 'good.tar').read_bytes()[:700])
    with pytest.raises(ValueError, match=r'cut\.tar is not a readable webdataset shard'):
        read_corpus([str(tmp_path / 'cut.tar')])
    write_shard(tmp_path / 'images.tar', {'a.jpg': b'\xff\xd8'})
    with pytest.raises(ValueError, match=r'images\.tar holds no \.txt members'):
        read_corpus([str(tmp_path / 'images.tar')])
    write_shard(tmp_path / 'emptymember.tar', {'a.txt': b''})
    with pytest.raises(ValueError, match=r'emptymember\.tar:a\.txt is empty'):
        read_corpus([str(tmp_path / 'emptymember.tar')])
    with pytest.raises(FileNotFoundError, match='nowhere does not exist'):
        read_corpus([str(tmp_path / 'nowhere')])
    (tmp_path / 'void').mkdir()
    with pytest.raises(ValueError, match='void holds no files'):
        read_corpus([str(tmp_path / 'void')])


def test_split_is_disjoint_deterministic_and_complete():
    docs = builtin_corpus()
    a, b = split_corpus(docs, 0.1, 4096, seed=0), split_corpus(docs, 0.1, 4096, seed=0)
    assert a.val_block_ids == b.val_block_ids and np.array_equal(a.train, b.train)
    assert split_corpus(docs, 0.1, 4096, seed=1).val_block_ids != a.val_block_ids
    stream = np.frombuffer(b''.join(d.data for d in docs), dtype=np.uint8)
    blocks = stream[:a.num_blocks * 4096].reshape(a.num_blocks, 4096)
    train_ids = [i for i in range(a.num_blocks) if i not in a.val_block_ids]
    assert len(a.val_block_ids) == round(0.1 * a.num_blocks) and not set(train_ids) & set(a.val_block_ids)
    assert np.array_equal(a.train[:len(train_ids) * 4096], blocks[train_ids].reshape(-1))  # exactly the other blocks
    assert len(a.train) + sum(map(len, a.val_blocks)) == len(stream)  # nothing lost, nothing shared
    with pytest.raises(ValueError, match='too few for a 10% validation split'):
        split_corpus(docs[:1], 0.1, 4096)


def test_windows():
    stream = np.arange(100, dtype=np.uint8)
    train = TrainWindows(stream, 10)
    assert len(train) == 8
    torch.manual_seed(0)
    w = train[3]
    assert w.shape == (11,) and 30 <= int(w[0]) < 40 and torch.equal(w, torch.arange(int(w[0]), int(w[0]) + 11))
    windows = eval_windows([stream[:50], stream[50:]], 9)
    assert windows.shape == (10, 10) and torch.equal(windows[5], torch.arange(50, 60))  # never across blocks
    with pytest.raises(ValueError, match='does not fit in a validation block of 50 bytes'):
        eval_windows([stream[:50]], 50)
    with pytest.raises(ValueError, match='too short for windows of 64 tokens'):
        TrainWindows(stream, 64)


def test_passkey_answer_recoverable_at_every_length_and_depth():
    for length in (81, 128, 517):
        for depth in (0.0, 0.37, 1.0):
            text, start = passkey_sample(length, depth, 4321)
            assert len(text) == length and text[start:] == b'04321' and len(text) - start == KEY_DIGITS
            key_at = text.index(b'The pass key is ') + len('The pass key is ')
            assert text[key_at:key_at + KEY_DIGITS] == b'04321'  # the needle holds the same digits
            filler = length - 81
            assert abs(text.index(b' The pass key is') - depth * filler) <= 0.5  # placed at the asked depth
    task = PasskeyTask(200, 4, seed=5, depths=[0.5])
    item = task[2]
    assert torch.equal(item['tokens'], task[2]['tokens'])  # a function of (seed, index)
    text = bytes(item['tokens'].tolist())
    digits = text[item['answer_start']:]
    assert text.count(digits) == 2 and digits.isdigit()
    with pytest.raises(ValueError, match='passkey length 80 is too short'):
        PasskeyTask(80, 1, 0)


def test_index_sample_target_is_letter_at_anchor_plus_offset():
    rng = np.random.default_rng(0)
    offsets = set()
    for _ in range(300):
        text, target, facts = index_sample(rng)
        assert len(text) == INDEX_LENGTH and target == INDEX_LENGTH - 1
        m = re.fullmatch(rb' *([a-zA-Z]{20,40})\|([a-zA-Z])([+-]\d\d)=([a-zA-Z])', text)
        letters, anchor, offset, answer = m.group(1), m.group(2), int(m.group(3)), m.group(4)
        # the facts returned are the prompt's: the offset written, the string's length, letters after the anchor
        assert facts == dict(offset=offset, letters=len(letters), anchor_back=len(letters) - 1 - letters.index(anchor))
        assert len(set(letters)) == len(letters) and 0 < abs(offset) <= INDEX_MAX_OFFSET
        assert letters[letters.index(anchor) + offset:][:1] == answer == text[target:target + 1]
        offsets.add(offset)
    assert min(offsets) == -INDEX_MAX_OFFSET and max(offsets) == INDEX_MAX_OFFSET
    assert torch.equal(IndexTask(3, 1)[2]['tokens'], IndexTask(3, 1)[2]['tokens'])


@pytest.mark.parametrize('layout', ['anchor-offset', 'offset-anchor'])
def test_index_spec_letters_offsets_and_layouts(layout):
    spec = IndexSpec(5, 7, 3, layout)
    assert spec.length == 7 + (7 if layout == 'anchor-offset' else 6)
    pattern = (rb' *([a-zA-Z]{5,7})\|([a-zA-Z])([+-]\d\d)=([a-zA-Z])' if layout == 'anchor-offset'
               else rb' *([a-zA-Z]{5,7})\|([+-]\d\d)([a-zA-Z])([a-zA-Z])')
    rng, counts, offsets = np.random.default_rng(1), set(), set()
    for _ in range(300):
        text, target, facts = index_sample(rng, spec)
        assert len(text) == spec.length and target == spec.length - 1
        m = re.fullmatch(pattern, text)
        letters, answer = m.group(1), m.group(4)
        anchor, offset = (m.group(2), int(m.group(3))) if layout == 'anchor-offset' else (m.group(3), int(m.group(2)))
        assert facts == dict(offset=offset, letters=len(letters), anchor_back=len(letters) - 1 - letters.index(anchor))
        assert len(set(letters)) == len(letters) and 0 < abs(offset) <= 3
        assert letters[letters.index(anchor) + offset:][:1] == answer == text[target:target + 1]
        counts.add(len(letters))
        offsets.add(offset)
    assert counts == {5, 6, 7} and offsets == {-3, -2, -1, 1, 2, 3}
    item = IndexTask(4, 2, spec)[3]
    assert item['tokens'].shape == (spec.length,) and item['answer_start'] == spec.length - 1
    text = bytes(item['tokens'].tolist())
    assert item['offset'] == int(text[-5:-2]) and 0 < abs(item['offset']) <= 3  # sign and digits, both layouts
    assert item['letters'] == len(text.split()[0].split(b'|')[0]) and 0 <= item['anchor_back'] < item['letters']
    # the default spec is the paper's task, byte for byte what the generator wrote before IndexSpec existed
    assert index_sample(np.random.default_rng(3)) == (b'   LwcJERzSxMPeldGrFTsYCmZbnNvuypaOVkQWU|Z+04=v', 46,
                                                      dict(offset=4, letters=37, anchor_back=14))


@pytest.mark.parametrize('kwargs, message', [
    (dict(min_letters=1), 'min_letters <= max_letters'), (dict(min_letters=30, max_letters=20), 'got 30..20'),
    (dict(max_letters=53), '<= 52 distinct'), (dict(max_offset=0), 'max_offset must be in 1..99'),
    (dict(max_offset=100), 'got 100'), (dict(layout='anchor-last'), 'layout must be one of')])
def test_index_spec_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        IndexSpec(**kwargs)
