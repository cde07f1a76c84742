"""The shared recipe layer: argument checks, run-folder guard, resume settings, verified checkpoints,
evaluation / best checkpoint / early stopping, sweeps. Each fault-injection test damages or misuses a
tiny run and asserts the error and that the run folder is byte-for-byte unchanged."""
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from vision_priors.recipes import spatial_vqa
from vision_priors.recipes import resolution_extrapolation
from vision_priors.recipes.checkpoints import CheckpointError, latest_checkpoint, verify_checkpoint
from vision_priors.recipes.cli import check_amp
from vision_priors.recipes.report import format_cell, group_rows, markdown_table, mean_std
from run_helpers import snapshot
from vision_priors.recipes.runs import config_differences

TINY = ['--embed-dim', '32', '--depth', '1', '--num-heads', '2', '--patch-size', '16',
        '--synthetic-per-class', '6', '3', '--train-scenes', '32', '--test-scenes', '8', '--batch-size', '8',
        '--cpu', '--threads', '1']


def train(out: Path, *extra: str, method: str = 'goat'):
    return spatial_vqa.main(['train', '--method', method, '--out', str(out), '--updates', '4',
                             '--checkpoint-every', '2', *TINY, *extra])


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory) -> Path:
    """A tiny run with checkpoints at updates 2 and 4 (both kept)."""
    out = tmp_path_factory.mktemp('run') / 'run'
    train(out)
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    import shutil
    copy = tmp_path / 'run'
    shutil.copytree(finished_run, copy)
    return copy


# ------------------------------------------------------------------------------- argument checks

@pytest.mark.parametrize('flag, value, message', [
    ('--batch-size', '0', 'must be an integer >= 1'),
    ('--lr', '-1', 'must be a number > 0'),
    ('--lr', 'nan', 'must be a number > 0'),
    ('--grad-accum', '0', 'must be an integer >= 1'),
    ('--updates', '-1', 'must be an integer >= 0'),
    ('--warmup-frac', '5', 'must be a number >= 0 and < 1'),
    ('--checkpoint-every', '-1', 'must be an integer >= 0'),
    ('--threads', '-1', 'must be an integer >= 0'),
    ('--num-workers', '-2', 'must be an integer >= 0'),
    ('--opt', 'no_such_optimizer', 'must be a timm optimizer'),
])
def test_bad_values_stop_at_parse_time_naming_the_flag(tmp_path, capsys, flag, value, message):
    out = tmp_path / 'run'
    with pytest.raises(SystemExit):
        train(out, flag, value)
    err = capsys.readouterr().err
    assert f'argument {flag}' in err and message in err and repr(value) in err
    assert not out.exists()


def test_bad_combinations_are_errors_before_anything_is_written(tmp_path):
    out = tmp_path / 'run'
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match='--amp fp16 needs a CUDA GPU'):
            train(out, '--amp', 'fp16')
    with pytest.raises(ValueError, match='--amp fp16 needs a CUDA GPU'):
        check_amp('fp16', cpu=True)
    with pytest.raises(ValueError, match='--patience needs --eval-every'):
        train(out, '--patience', '2')
    with pytest.raises(ValueError, match='--stop-after 9 is beyond --updates 4'):
        train(out, '--stop-after', '9')
    assert not out.exists()


@pytest.mark.parametrize('recipe', [spatial_vqa, resolution_extrapolation])
def test_a_shortened_flag_is_an_error_not_another_flag(tmp_path, capsys, recipe):
    out = tmp_path / 'run'
    with pytest.raises(SystemExit):  # argparse would otherwise read --warm as --warmup-frac
        recipe.main(['train', '--out', str(out), '--warm', '0.1'])
    assert 'unrecognized arguments: --warm' in capsys.readouterr().err
    assert not out.exists()


def test_resolution_recipe_shares_the_checks(tmp_path, capsys):
    out = tmp_path / 'run'
    with pytest.raises(SystemExit):
        resolution_extrapolation.main(['train', '--out', str(out), '--batch-size', '0'])
    assert "argument --batch-size: must be an integer >= 1, got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        resolution_extrapolation.main(['train', '--out', str(out), '--warmup-frac', '5'])
    assert not out.exists()


def test_out_that_is_a_file_is_refused_before_any_work(tmp_path):
    """``--out`` naming a file (or a folder under one) fails at validation naming the file, for a new run, a sweep and
    an evaluation (which would otherwise evaluate everything and then fail on the first write)."""
    file = tmp_path / 'notes.txt'
    file.write_text('not a folder')
    for out in (file, file / 'run'):
        with pytest.raises(NotADirectoryError, match=f'--out {re.escape(str(out))}: {re.escape(str(file))} is a file'):
            train(out)
    with pytest.raises(NotADirectoryError, match=re.escape(f'{file} is a file, not a folder')):
        spatial_vqa.main(['compare', '--methods', 'goat', '--out', str(file), '--updates', '1', *TINY])
    with pytest.raises(NotADirectoryError, match=re.escape(f'{file} is a file, not a folder')):
        spatial_vqa.main(['eval', str(tmp_path / 'any_run'), '--out', str(file), '--cpu'])
    assert file.read_text() == 'not a folder' and sorted(p.name for p in tmp_path.iterdir()) == ['notes.txt']


@pytest.mark.parametrize('extra, message', [
    (['--train-scenes', '4'], r'4 training samples < --batch-size 8'),
    (['--val-scenes', '1', '--eval-every', '2', '--batch-size', '8'], None),  # a valid setting: trains
])
def test_a_failure_while_building_the_run_writes_no_run_folder(tmp_path, extra, message):
    """The loader, optimizer, schedule and evaluation data are built before ``config.json`` is written: too few
    samples for a batch leave no folder behind (one that would refuse the corrected command as 'already holds a
    run'); an unknown ``--opt`` fails at parse time (test_bad_values_stop_at_parse_time_naming_the_flag)."""
    out = tmp_path / 'run'
    if message is None:
        train(out, *extra)
        assert (out / 'config.json').exists()
        return
    with pytest.raises(ValueError, match=message):
        train(out, *extra)
    assert not out.exists()
    train(out)  # the corrected command starts the run


# ---------------------------------------------------------------------------------- resume guard

def test_resume_with_other_settings_is_refused_and_changes_nothing(run_copy):
    before = snapshot(run_copy)
    with pytest.raises(ValueError, match=r"settings differ .*method: 'goat' -> 'pope'"):
        train(run_copy, '--resume', method='pope')
    with pytest.raises(ValueError, match=r'settings differ .*lr: 0\.001 -> 0\.5'):
        train(run_copy, '--resume', '--lr', '0.5')
    with pytest.raises(ValueError, match=r'settings differ .*embed_dim'):
        spatial_vqa.main(['train', '--method', 'goat', '--out', str(run_copy), '--updates', '4', '--resume',
                          *[t if t != '32' else '48' for t in TINY]])
    assert snapshot(run_copy) == before


def test_resume_may_change_the_whitelisted_flags(run_copy):
    before = snapshot(run_copy)
    train(run_copy, '--resume', '--num-workers', '0', '--log-every', '3', '--threads', '1')
    after = snapshot(run_copy)
    # a finished run: nothing to train, config and checkpoints untouched; the log records the resumed start
    assert after.pop('log.jsonl').startswith(before.pop('log.jsonl'))
    assert after == before


def test_resume_on_a_folder_without_a_run_is_an_error(tmp_path):
    missing = tmp_path / 'mistyped'
    with pytest.raises(FileNotFoundError, match=r'--resume: .*mistyped holds no run'):
        train(missing, '--resume')
    assert not missing.exists()


def test_new_run_into_a_run_folder_is_refused(run_copy):
    before = snapshot(run_copy)
    with pytest.raises(FileExistsError, match=r'already holds a run .* --resume'):
        train(run_copy)
    assert snapshot(run_copy) == before


# every command whose --out is not the one run it trains (evaluations, sweeps, completions, analyses); RUN is the run
# folder given as --out, also as the run to evaluate where the command takes one
RESULTS_INTO_A_RUN = [
    ('spatial_vqa', ['eval', 'RUN', '--cpu']),
    ('spatial_vqa', ['compare', '--methods', 'goat', '--updates', '1', *TINY]),
    ('forecast', ['eval', 'RUN', '--cpu']),
    ('forecast', ['compare', '--updates', '1', '--cpu']),
    ('pcn', ['eval', 'RUN', '--cpu']),
    ('pcn', ['compare', '--updates', '1', '--cpu']),
    ('pcn', ['complete', 'RUN', 'scan.pcd', '--cpu']),
    ('language', ['train', '--updates', '1', '--cpu']),
    ('language', ['ppl', 'RUN', '--cpu']),
    ('language', ['passkey', 'RUN', '--cpu']),
    ('language', ['index', '--updates', '1', '--cpu']),
    ('language', ['compare', '--updates', '1', '--cpu']),
    ('resolution_extrapolation', ['eval', 'RUN', '--cpu']),
    ('resolution_extrapolation', ['compare', '--updates', '1', '--cpu']),
    ('resolution_extrapolation', ['analyze', 'RUN']),
]


@pytest.mark.parametrize('recipe, argv', RESULTS_INTO_A_RUN, ids=[f'{r}-{a[0]}' for r, a in RESULTS_INTO_A_RUN])
def test_results_into_a_run_folder_are_refused_before_any_work(run_copy, recipe, argv):
    """An evaluation (or a sweep, a completion, an analysis) whose --out holds a training run would write its
    results.json, plots or runs into the run folder: refused at validation naming the folder, which stays
    byte-for-byte as it was, nothing written next to it."""
    import importlib
    main = importlib.import_module(f'vision_priors.recipes.{recipe}').main
    before, beside = snapshot(run_copy), sorted(run_copy.parent.iterdir())
    with pytest.raises(FileExistsError, match=f'{argv[0]}: --out {re.escape(str(run_copy))} holds a training run'):
        main([str(run_copy) if a == 'RUN' else a for a in argv] + ['--out', str(run_copy)])
    assert snapshot(run_copy) == before and sorted(run_copy.parent.iterdir()) == beside


ONE_RUN_TRAIN = [
    ('spatial_vqa', ['train', '--method', 'goat', '--updates', '1', *TINY]),
    ('forecast', ['train', '--updates', '1', '--cpu']),
]


@pytest.mark.parametrize('recipe, argv', RESULTS_INTO_A_RUN + ONE_RUN_TRAIN,
                         ids=[f'{r}-{a[0]}' for r, a in RESULTS_INTO_A_RUN + ONE_RUN_TRAIN])
def test_outputs_inside_a_run_folder_are_refused_before_any_work(run_copy, recipe, argv):
    """``--out RUN/sub`` (an evaluation in RUN/eval, a run nested in a run, a sweep under best/): a run folder is
    written only by its own training, so every command refuses it at validation, naming the enclosing run."""
    import importlib
    main = importlib.import_module(f'vision_priors.recipes.{recipe}').main
    before = snapshot(run_copy)
    inside = run_copy / 'best' / 'eval'
    with pytest.raises(FileExistsError, match=f'{argv[0]}: --out {re.escape(str(inside))} lies inside the training '
                                              f'run {re.escape(str(run_copy))}'):
        main([str(run_copy) if a == 'RUN' else a for a in argv] + ['--out', str(inside)])
    assert snapshot(run_copy) == before


def test_a_run_folder_with_only_its_latest_pointer_is_refused_as_eval_out(run_copy, tmp_path):
    """``latest.json`` alone marks a run too (``runs.holds_run``); a folder beside the run evaluates it."""
    (run_copy / 'config.json').rename(tmp_path / 'config.json')
    before = snapshot(run_copy)
    with pytest.raises(FileExistsError, match='holds a training run'):
        spatial_vqa.main(['eval', str(tmp_path / 'other'), '--out', str(run_copy), '--cpu'])
    assert snapshot(run_copy) == before
    (tmp_path / 'config.json').rename(run_copy / 'config.json')
    spatial_vqa.main(['eval', str(run_copy), '--out', str(tmp_path / 'eval'), '--cpu'])
    assert (tmp_path / 'eval' / 'results.json').exists() and snapshot(run_copy) == before | {
        'config.json': (run_copy / 'config.json').read_bytes()}


# ------------------------------------------------------------------------------ damaged checkpoints

@pytest.mark.parametrize('victim', ['model.safetensors', 'optimizer.bin', 'random_states_0.pkl', 'manifest.json'])
def test_damaged_checkpoint_file_is_named_and_the_older_one_offered(run_copy, victim):
    latest = latest_checkpoint(run_copy)
    path = latest / victim
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    before = snapshot(run_copy)
    with pytest.raises(CheckpointError) as info:
        train(run_copy, '--resume')
    message = str(info.value)
    assert str(latest) in message and 'checkpoint-00000002 is intact' in message
    assert snapshot(run_copy) == before
    with pytest.raises(CheckpointError, match=re.escape(str(latest))):
        spatial_vqa.main(['eval', str(run_copy), '--out', str(run_copy.parent / 'eval'), '--cpu'])
    assert not (run_copy.parent / 'eval').exists()


def test_following_the_hint_resumes_from_the_older_checkpoint(run_copy):
    latest = latest_checkpoint(run_copy)
    (latest / 'optimizer.bin').write_bytes(b'garbage')
    pointer = run_copy / 'latest.json'
    pointer.write_text(json.dumps({'checkpoint': 'checkpoint-00000002'}))
    train(run_copy, '--resume')
    verify_checkpoint(latest_checkpoint(run_copy))
    assert latest_checkpoint(run_copy).name == 'checkpoint-00000004'


def test_damaged_pointer_and_missing_rng_state_are_errors(run_copy):
    latest = latest_checkpoint(run_copy)
    pointer = run_copy / 'latest.json'
    original = pointer.read_text()
    pointer.write_text('{"checkpoint": ')
    before = snapshot(run_copy)
    with pytest.raises(CheckpointError, match=r'checkpoint pointer .*latest.json is damaged'):
        train(run_copy, '--resume')
    assert snapshot(run_copy) == before
    pointer.write_text(original)
    (latest / 'random_states_0.pkl').unlink()
    with pytest.raises(CheckpointError, match=r'random_states_0.pkl is missing'):
        train(run_copy, '--resume')


def test_rng_state_that_cannot_be_restored_is_an_error(run_copy, monkeypatch):
    """Even where the manifest is rewritten to match (a deliberate edit), unreadable RNG state fails loudly."""
    from vision_priors.recipes.checkpoints import write_manifest
    latest = latest_checkpoint(run_copy)
    (latest / 'random_states_0.pkl').write_bytes(b'\x80\x04not a pickle')
    write_manifest(latest)
    (run_copy / 'latest.json').write_text(json.dumps({'checkpoint': latest.name}))
    with pytest.raises(CheckpointError, match=r'RNG state .*random_states_0.pkl cannot be restored'):
        train(run_copy, '--resume', '--updates', '4')


@pytest.mark.parametrize('config', ['[]', '{}', '{"method": "goat", "seed": 0}'])
def test_run_config_that_is_not_a_run_config_is_named(run_copy, config):
    """Valid JSON of the wrong shape in config.json is a CheckpointError naming the file and what it lacks (was a
    KeyError / TypeError from the recipe for eval, and a --resume diff of every setting)."""
    (run_copy / 'config.json').write_text(config)
    before = snapshot(run_copy)
    message = re.escape(f'run config {run_copy / "config.json"} is damaged: it lacks')
    with pytest.raises(CheckpointError, match=message):
        train(run_copy, '--resume')
    with pytest.raises(CheckpointError, match=message):
        spatial_vqa.main(['eval', str(run_copy), '--out', str(run_copy.parent / 'eval'), '--cpu'])
    assert snapshot(run_copy) == before and not (run_copy.parent / 'eval').exists()


@pytest.mark.parametrize('entry', [5, {'size': 1}, {'bytes': 1, 'sha256': 'x'}])
def test_malformed_manifest_entry_is_named(run_copy, entry):
    """A manifest entry that is not {bytes, sha256} of a file inside the checkpoint is a CheckpointError naming the
    manifest and the entry (was a TypeError / KeyError), with the older checkpoint offered."""
    latest = latest_checkpoint(run_copy)
    name = '../config.json' if isinstance(entry, dict) and 'sha256' in entry else 'model.safetensors'
    (latest / 'manifest.json').write_text(json.dumps({'files': {name: entry}}))
    before = snapshot(run_copy)
    with pytest.raises(CheckpointError, match=re.escape(f'checkpoint manifest {latest / "manifest.json"} is damaged: '
                                                        f'entry {name!r}')) as info:
        spatial_vqa.main(['eval', str(run_copy), '--out', str(run_copy.parent / 'eval'), '--cpu'])
    assert 'checkpoint-00000002 is intact' in str(info.value)
    with pytest.raises(CheckpointError, match=re.escape(f'entry {name!r}')):
        train(run_copy, '--resume')
    assert snapshot(run_copy) == before


# ------------------------------------------------------------------- evaluation, best, early stop

def test_eval_every_evaluates_validation_scenes_and_keeps_the_best_weights(tmp_path):
    out = tmp_path / 'run'
    spatial_vqa.main(['train', '--method', 'nope', '--out', str(out), '--updates', '6', '--eval-every', '2',
                      '--patience', '3', *TINY])
    events = [json.loads(line) for line in (out / 'log.jsonl').read_text().splitlines()]
    evals = [e for e in events if e['event'] == 'eval']
    assert evals and all('acc' in e and 'nll' in e for e in evals)
    best = json.loads((out / 'best' / 'metrics.json').read_text())
    assert best['nll'] == min(e['nll'] for e in evals)
    verify_checkpoint(out / 'best')
    rows = spatial_vqa.main(['eval', str(out / 'best'), '--out', str(tmp_path / 'eval'), '--cpu'])['rows']
    assert rows[0]['method'] == 'nope'


def test_training_loss_is_read_back_only_at_the_log_interval(tmp_path):
    out = tmp_path / 'run'
    train(out, '--log-every', '2')
    losses = [json.loads(line) for line in (out / 'log.jsonl').read_text().splitlines()]
    assert [e['update'] for e in losses if e['event'] == 'train'] == [2, 4]
    assert [e['micro_batches'] for e in losses if e['event'] == 'train'] == [2, 2]


def test_the_first_loss_logged_after_a_resume_says_it_averages_fewer_updates(tmp_path):
    out = tmp_path / 'run'
    train(out, '--log-every', '2', '--stop-after', '3')
    train(out, '--log-every', '2', '--resume')
    logged = [e for e in map(json.loads, (out / 'log.jsonl').read_text().splitlines()) if e['event'] == 'train']
    assert [(e['update'], e['micro_batches']) for e in logged] == [(2, 2), (4, 1)]


# ----------------------------------------------------------------------------------------- sweeps

def test_compare_rejects_duplicates_and_taken_folders_up_front(tmp_path):
    out = tmp_path / 'cmp'
    with pytest.raises(ValueError, match='--methods lists goat more than once'):
        spatial_vqa.main(['compare', '--methods', 'goat', 'nope', 'goat', '--out', str(out), '--updates', '1', *TINY])
    with pytest.raises(ValueError, match='--seeds lists 1 more than once'):
        spatial_vqa.main(['compare', '--methods', 'goat', '--seeds', '1', '1', '--out', str(out), '--updates', '1',
                          *TINY])
    assert not out.exists()
    train(out / 'nope' / 'seed0')
    before = snapshot(out)
    with pytest.raises(FileExistsError, match=r'1 run folder\(s\) already hold a run'):
        spatial_vqa.main(['compare', '--methods', 'goat', 'nope', '--out', str(out), '--updates', '4', *TINY])
    assert snapshot(out) == before


# ------------------------------------------------------------------------------ data fingerprints

def test_data_fingerprint_of_a_file_a_folder_and_a_missing_path(tmp_path, monkeypatch):
    """A file: size + SHA-256 of its bytes; a folder: file count, total size and a hash of the (relative path,
    size) listing, plus its contents' hash up to FOLDER_CONTENT_LIMIT bytes; a missing path is a FileNotFoundError
    naming it."""
    import hashlib
    from vision_priors.recipes import fingerprint
    from vision_priors.recipes.fingerprint import check_data_unchanged, data_fingerprint, data_fingerprints
    file = tmp_path / 'a.csv'
    file.write_bytes(b'x,y\n1,2\n')
    assert data_fingerprint(file) == dict(kind='file', bytes=8, sha256=hashlib.sha256(b'x,y\n1,2\n').hexdigest())
    folder = tmp_path / 'data'
    (folder / 'sub').mkdir(parents=True)
    (folder / 'sub' / 'b.bin').write_bytes(b'1234')
    (folder / 'c.txt').write_bytes(b'hello')
    first = data_fingerprint(folder)
    assert first['kind'] == 'folder' and first['files'] == 2 and first['bytes'] == 9
    expected = ''.join(f'{name}\t{len(data)}\t{hashlib.sha256(data).hexdigest()}\n'
                       for name, data in (('c.txt', b'hello'), ('sub/b.bin', b'1234')))
    assert first['contents_sha256'] == hashlib.sha256(expected.encode()).hexdigest()
    (folder / 'c.txt').write_bytes(b'HELLO')  # same size, other contents: the listing is unchanged, the contents not
    changed = data_fingerprint(folder)
    assert changed['sha256'] == first['sha256'] and changed['contents_sha256'] != first['contents_sha256']
    with pytest.raises(ValueError, match=re.escape(f'{folder}: contents_sha256 {first["contents_sha256"][:16]}')):
        check_data_unchanged(dict(data_fingerprint={str(folder): first}), 'RUN')
    # a fingerprint stored before folder contents were hashed is compared on its listing only
    check_data_unchanged(dict(data_fingerprint={str(folder): {k: v for k, v in first.items()
                                                             if k != 'contents_sha256'}}), 'RUN')
    monkeypatch.setattr(fingerprint, 'FOLDER_CONTENT_LIMIT', 8)  # a folder above the limit: its listing only
    assert 'contents_sha256' not in data_fingerprint(folder)
    monkeypatch.undo()
    (folder / 'c.txt').write_bytes(b'hello')
    assert data_fingerprint(folder) == first
    (folder / 'c.txt').write_bytes(b'hello!')
    assert data_fingerprint(folder)['sha256'] != first['sha256'] and data_fingerprint(folder)['bytes'] == 10
    (folder / 'c.txt').write_bytes(b'hello')
    (folder / 'sub' / 'b.bin').rename(folder / 'b.bin')  # same files and sizes, another layout
    assert data_fingerprint(folder)['sha256'] != first['sha256']
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / 'nowhere'))):
        data_fingerprint(tmp_path / 'nowhere')
    assert data_fingerprints([None]) == {} and list(data_fingerprints([file, folder])) == [str(file), str(folder)]


def test_fingerprint_without_hidden_entries(tmp_path):
    """skip_hidden (the text loader's view of a folder): hidden files and everything under a hidden folder are left
    out and the fingerprint says so; a hidden file added later changes nothing, a visible edit still refuses, and
    check_data_unchanged re-fingerprints in the mode the stored fingerprint records."""
    from vision_priors.recipes.fingerprint import HIDDEN_SKIPPED, check_data_unchanged, data_fingerprint
    folder = tmp_path / 'texts'
    (folder / 'docs').mkdir(parents=True)
    (folder / 'docs' / 'a.txt').write_text('alpha')
    (folder / '.git').mkdir()
    (folder / '.git' / 'HEAD').write_text('ref')
    (folder / '.notes').write_text('hidden')
    stored = data_fingerprint(folder, skip_hidden=True)
    assert stored['hidden'] == HIDDEN_SKIPPED and stored['files'] == 1 and stored['bytes'] == 5
    assert data_fingerprint(folder)['files'] == 3 and 'hidden' not in data_fingerprint(folder)
    config = dict(data_fingerprint={str(folder): stored})
    (folder / '.DS_Store').write_bytes(b'\0' * 64)
    (folder / 'docs' / '.swp').write_text('editor')
    check_data_unchanged(config, 'RUN')
    assert data_fingerprint(folder, skip_hidden=True) == stored
    (folder / 'docs' / 'a.txt').write_text('ALPHA')
    with pytest.raises(ValueError, match=re.escape(f'{folder}: contents_sha256 ')):
        check_data_unchanged(config, 'RUN')
    (folder / 'docs' / 'b.txt').write_text('beta')
    with pytest.raises(ValueError, match=re.escape(f'{folder}: files 1 -> 2, bytes 5 -> 9')):
        check_data_unchanged(config, 'RUN')


def test_check_data_unchanged_names_the_file_and_what_changed(tmp_path):
    from vision_priors.recipes.fingerprint import check_data_unchanged, data_fingerprints
    a, b = tmp_path / 'a.txt', tmp_path / 'b.txt'
    a.write_text('abc')
    b.write_text('def')
    config = dict(data_fingerprint=data_fingerprints([a, b]))
    check_data_unchanged(config, 'RUN')
    a.write_text('abcd')
    with pytest.raises(ValueError, match=re.escape(f'the data changed since run RUN was trained: {a}: bytes 3 -> 4, '
                                                   f'sha256 ')) as info:
        check_data_unchanged(config, 'RUN')
    assert str(b) not in str(info.value)
    check_data_unchanged(config, 'RUN', reads=[b])  # the command reads only b (e.g. eval --data b)
    check_data_unchanged(config, 'RUN', reads=())  # or none of the run's data
    with pytest.raises(ValueError, match=re.escape(str(a))):
        check_data_unchanged(config, 'RUN', reads=[tmp_path / '.' / 'a.txt'])  # the same file, spelt otherwise
    b.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f'{b}: the data of run RUN no longer exist')):
        check_data_unchanged(config, 'RUN', reads=[b])
    check_data_unchanged({}, 'RUN')  # a run stored before fingerprints: nothing to check
    with pytest.raises(ValueError, match=r'config\.json is damaged: data_fingerprint must map'):
        check_data_unchanged(dict(data_fingerprint=[1]), tmp_path)


def test_resume_of_a_run_stored_before_fingerprints_is_not_refused(tmp_path):
    """An older run (no data_fingerprint in config.json) resumes as before; a new config must store one."""
    from vision_priors.recipes.runs import RunFolder
    run = tmp_path / 'run'
    config = dict(model='m', seed=0, data='d', args={})
    RunFolder(run, False).commit(dict(config, data_fingerprint={}))
    (run / 'config.json').write_text(json.dumps(config))
    RunFolder(run, True).commit(dict(config, data_fingerprint={'d': dict(kind='file', bytes=1, sha256='x')}))
    with pytest.raises(KeyError, match="lacks 'data_fingerprint'"):
        RunFolder(tmp_path / 'other', False).commit(config)
    assert not (tmp_path / 'other').exists()


@pytest.fixture
def npz_run(tmp_path):
    """A spatial VQA run on an .npz the test made, stopped after 2 of 4 updates; (run, npz, original bytes)."""
    import numpy as np
    npz = tmp_path / 'pool.npz'
    rng = np.random.default_rng(0)
    np.savez(npz, images=rng.integers(0, 256, (60, 32, 32, 3), dtype=np.uint8), labels=np.arange(60) % 10)
    run = tmp_path / 'run'
    train(run, '--data', str(npz), '--stop-after', '2')
    return run, npz, npz.read_bytes()


def test_changed_npz_refuses_resume_and_eval_naming_the_file(npz_run, tmp_path):
    """The run's .npz rewritten (other pixels, same shape) after training: --resume and eval are errors naming the
    file and what changed, with the run folder byte-for-byte unchanged and no evaluation written; eval --data on
    another source is not refused; the original bytes back, the run resumes and evaluates."""
    import numpy as np
    run, npz, original = npz_run
    config = json.loads((run / 'config.json').read_text())
    assert list(config['data_fingerprint']) == [str(npz)] and config['data_fingerprint'][str(npz)]['kind'] == 'file'
    images = np.load(npz)['images']
    np.savez(npz, images=255 - images, labels=np.arange(60) % 10)
    assert npz.stat().st_size == len(original)  # same size: only the hash tells
    before = snapshot(run)
    with pytest.raises(ValueError, match=re.escape(f'--resume: the data changed since the run in {run} was trained '
                                                   f'({npz}: sha256 ')):
        train(run, '--data', str(npz), '--resume')
    assert snapshot(run) == before
    evaluation = tmp_path / 'eval'
    with pytest.raises(ValueError, match=re.escape(f'the data changed since run {run} was trained: {npz}: sha256 ')):
        spatial_vqa.main(['eval', str(run), '--out', str(evaluation), '--cpu'])
    with pytest.raises(ValueError, match=re.escape(str(npz))):  # --data naming the same file is checked too
        spatial_vqa.main(['eval', str(run), '--data', str(npz), '--out', str(evaluation), '--cpu'])
    assert snapshot(run) == before and not evaluation.exists()
    other = tmp_path / 'other.npz'  # an explicit other source: the user's choice, not the run's data
    np.savez(other, images=images, labels=np.arange(60) % 10)
    rows = spatial_vqa.main(['eval', str(run), '--data', str(other), '--out', str(tmp_path / 'other_eval'),
                             '--cpu'])['rows']
    assert rows[0]['seen']['n'] > 0
    npz.write_bytes(original)
    train(run, '--data', str(npz), '--resume')
    assert latest_checkpoint(run).name == 'checkpoint-00000004'
    spatial_vqa.main(['eval', str(run), '--out', str(evaluation), '--cpu'])
    assert (evaluation / 'results.json').exists()


def test_run_without_fingerprints_still_evaluates(npz_run, tmp_path):
    """A config without data_fingerprint (a run stored before them) loads and evaluates as before."""
    from run_helpers import drop_data_fingerprint
    run, npz, _ = npz_run
    drop_data_fingerprint(run)
    rows = spatial_vqa.main(['eval', str(run), '--out', str(tmp_path / 'eval'), '--cpu'])['rows']
    assert rows[0]['seen']['n'] > 0
    train(run, '--data', str(npz), '--resume')  # and resumes
    assert latest_checkpoint(run).name == 'checkpoint-00000004'


# ---------------------------------------------------------------------------------------- helpers

def test_config_differences_and_report_helpers():
    stored = {'lr': 1e-3, 'model': {'depth': 2, 'dims': [1, 2]}, 'stop_after': 3}
    assert config_differences(stored, {'lr': 1e-3, 'model': {'depth': 2, 'dims': (1, 2)}, 'stop_after': 9}) == []
    assert config_differences(stored, {'lr': 1e-3, 'model': {'depth': 3, 'dims': [1, 2]}}) == ['model.depth']
    assert config_differences(stored, {'lr': 1e-3, 'model': {'depth': 2}}, may_change=['dims']) == []
    cell = mean_std([1.0, 3.0])
    assert cell == {'mean': 2.0, 'std': pytest.approx(2 ** 0.5), 'n': 2}
    assert format_cell(cell) == '2.00 ± 1.41' and format_cell(mean_std([5])) == '5.00'
    assert markdown_table(['a', 'b'], [[1, 2]]) == '| a | b |\n|---|---|\n| 1 | 2 |'
    with pytest.raises(ValueError):
        mean_std([])
    rows = [dict(m='b', s=0), dict(m='a', s=0), dict(m='b', s=1), dict(m='a', s=1), dict(m='c', s=0)]
    groups = group_rows(rows, 'm')
    assert list(groups) == ['b', 'a', 'c']  # first-seen order: the order the recipes print their table rows
    assert groups['b'] == [rows[0], rows[2]] and groups['a'] == [rows[1], rows[3]] and groups['c'] == [rows[4]]
    assert group_rows([], 'm') == {}
    with pytest.raises(KeyError):
        group_rows([dict(s=0)], 'm')


def _tiny_classifier_fit():
    """A prepared accelerator, linear classifier, SGD optimizer and loader of 8 batches: the engine tests' run."""
    from torch.utils.data import TensorDataset
    from vision_priors.recipes.engine import make_accelerator, train_loader

    accelerator = make_accelerator(0, cpu=True)
    model = torch.nn.Linear(3, 2)
    data = TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return (accelerator, *accelerator.prepare(model, optimizer, train_loader(data, 8, seed=0)))


def test_fit_keeps_the_best_weights_and_stops_after_patience_evaluations(tmp_path):
    """A scripted validation metric: best at the 2nd evaluation, then two worse ones -> stop (patience 2)."""
    from vision_priors.recipes.engine import cosine_schedule, fit
    from vision_priors.recipes.checkpoints import load_weights

    scripted = iter([0.9, 0.4, 0.6, 0.5, 0.1, 0.1])
    snapshots = {}
    accelerator, model, optimizer, loader = _tiny_classifier_fit()

    def evaluate():
        snapshots[len(snapshots) + 1] = {k: v.clone() for k, v in model.state_dict().items()}
        return {'loss': next(scripted)}

    result = fit(accelerator, model, optimizer, cosine_schedule(optimizer, 0.1, 40, 0.0), loader,
                 torch.nn.functional.cross_entropy, 40, tmp_path, eval_every=3, evaluate=evaluate,
                 best_metric='loss', best_mode='min', patience=2)
    assert result['stopped_early'] and result['updates'] == 12
    assert result['best_update'] == 6 and result['best_value'] == 0.4
    best = load_weights(tmp_path / 'best')
    assert all(torch.equal(best[k], snapshots[2][k]) for k in best)
    assert json.loads((tmp_path / 'best' / 'metrics.json').read_text()) == {'update': 6, 'loss': 0.4}
    with pytest.raises(ValueError, match=r'early stopping \(patience\) needs best_metric'):
        fit(accelerator, model, optimizer, None, loader, torch.nn.functional.cross_entropy, 1, tmp_path / 'x',
            evaluate=evaluate, patience=1)


def test_resuming_an_early_stopped_run_reports_how_it_ended(tmp_path):
    """--resume on a run that patience already stopped trains nothing and reports what the run ended with: stopped
    early, its last training loss and best update (not a NaN loss and 'not stopped'), with no second early_stop
    event in the log."""
    from vision_priors.recipes.engine import cosine_schedule, fit
    from vision_priors.recipes.logs import JsonlLogger

    def run(resume):
        scripted = iter([0.9, 0.4, 0.6, 0.5, 0.1])
        accelerator, model, optimizer, loader = _tiny_classifier_fit()
        return fit(accelerator, model, optimizer, cosine_schedule(optimizer, 0.1, 40, 0.0), loader,
                   torch.nn.functional.cross_entropy, 40, tmp_path, eval_every=3, log_every=5,
                   evaluate=lambda: {'loss': next(scripted)}, best_metric='loss', best_mode='min', patience=2,
                   resume=resume, logger=JsonlLogger(tmp_path / 'log.jsonl'))

    first = run(resume=False)
    assert first['stopped_early'] and first['updates'] == 12 and math.isfinite(first['last_loss'])
    again = run(resume=True)
    assert again == first
    events = [json.loads(line)['event'] for line in (tmp_path / 'log.jsonl').read_text().splitlines()]
    assert events.count('early_stop') == 1 and events.count('eval') == 4


@pytest.mark.parametrize('bad', [float('nan'), float('inf')])
def test_fit_stops_a_diverged_run_before_saving_or_evaluating_it(tmp_path, bad):
    """A non-finite training loss (here from update 3 on) stops the run with an error naming the update and the last
    good checkpoint, at the next checkpoint / evaluation even between log intervals: nothing diverged is saved,
    evaluated or kept as the best."""
    from vision_priors.recipes.engine import fit

    accelerator, model, optimizer, loader = _tiny_classifier_fit()
    calls, evaluated = [0], []

    def step_fn(model, batch):
        calls[0] += 1
        loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
        return loss * bad if calls[0] >= 3 else loss

    def evaluate():
        evaluated.append(calls[0])
        return {'loss': 1.0}

    message = re.escape(f' at update 4 (mean of the last 4 micro-batches): the run diverged and was stopped; the last '
                        f'checkpoint, {tmp_path / "checkpoint-00000002"}, is from before')
    with pytest.raises(FloatingPointError, match='training loss is (nan|inf)' + message):  # inf weights -> nan
        fit(accelerator, model, optimizer, None, loader, None, 40, tmp_path, step_fn=step_fn, checkpoint_every=2,
            log_every=100, eval_every=2, evaluate=evaluate, best_metric='loss')
    assert evaluated == [2] and latest_checkpoint(tmp_path).name == 'checkpoint-00000002'
    assert sorted(p.name for p in tmp_path.glob('checkpoint-*')) == ['checkpoint-00000002']
    assert json.loads((tmp_path / 'best' / 'metrics.json').read_text())['update'] == 2


def test_sweep_jobs_train_the_same_runs_in_worker_processes(tmp_path, monkeypatch):
    """``--jobs 2`` trains a sweep's runs in two spawned processes; every run ends with the weights it gets
    when the sweep trains one run at a time."""
    from run_helpers import assert_same_final_weights
    flags = ['compare', '--models', 'vit_tiny_patch16_224', 'vit_tiny_patch16_goat_224', '--seeds', '3',
             '--updates', '3', '--batch-size', '8', '--train-samples', '32', '--val-samples', '8',
             '--size-overrides', json.dumps(dict(embed_dim=32, depth=1, num_heads=1, patch_size=16)),
             '--train-res', '32', '--eval-res', '32', '--cpu', '--threads', '1']
    resolution_extrapolation.main([*flags, '--jobs', '1', '--out', str(tmp_path / 'one')])
    resolution_extrapolation.main([*flags, '--jobs', '2', '--out', str(tmp_path / 'two')])
    for name in ('vit_tiny_patch16_224', 'vit_tiny_patch16_goat_224'):
        assert_same_final_weights(tmp_path / 'one' / name / 'seed3', tmp_path / 'two' / name / 'seed3')
    # --jobs describes the command, not a run: resuming with another value is allowed
    stored = json.loads((tmp_path / 'two' / 'vit_tiny_patch16_224' / 'seed3' / 'config.json').read_text())
    assert 'jobs' not in json.dumps(stored)


def test_sweep_jobs_count():
    from vision_priors.recipes.runs import sweep_jobs
    assert sweep_jobs(1, 6) == 1 and sweep_jobs(4, 3) == 3 and sweep_jobs(2, 6) == 2
    assert 1 <= sweep_jobs(0, 6) <= 6


def test_per_sample_seeds_seed_the_cpu_generator_and_restore_every_rng():
    """An item is what the dataset gives under torch.manual_seed(sample seed) (the CPU generator is what
    loading draws from), and the caller's torch / numpy / python RNG streams are left where they were."""
    import random

    import numpy as np
    from torch.utils.data import Dataset

    from vision_priors.recipes.engine import PerSampleSeeds

    class Draws(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.rand(3), float(np.random.rand()), random.random()

    wrapped = PerSampleSeeds(Draws(), seed=5)
    wrapped.set_epoch(2)
    torch.manual_seed(123)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    item = wrapped[3]
    assert torch.equal(torch.get_rng_state(), before[0]) and (np.random.get_state()[1] == before[1]).all()
    assert random.getstate() == before[2]
    sample_seed = (5 * 1_000_003 + 2 * 9_176_467 + 3) % (2 ** 63)
    torch.manual_seed(sample_seed)
    random.seed(sample_seed)
    np.random.seed(sample_seed % (2 ** 32))
    expected = Draws()[3]
    assert torch.equal(item[0], expected[0]) and item[1:] == expected[1:]


def test_train_loader_reads_random_free_datasets_directly_with_the_same_batches():
    """Pre-rendered scenes draw no random numbers, so the training loader reads them without per-sample seeding
    (a third of a small model's step); the batches, and the RNG streams the model sees, are the same as with it."""
    from torch.utils.data import DataLoader

    from vision_priors.recipes.data.builtin_scenes import RenderedScenes, SpatialScenes
    from vision_priors.recipes.engine import PerSampleSeeds, train_loader

    scenes = RenderedScenes(SpatialScenes('train', num_samples=24, resolution=16, seed=1, task='clock'))
    loader = train_loader(scenes, 8, seed=3)
    assert loader.dataset is scenes
    seeded = DataLoader(PerSampleSeeds(scenes, 3), batch_size=8, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    for (x, y), (x_ref, y_ref) in zip(loader, seeded, strict=True):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    assert torch.equal(torch.get_rng_state(), state)
    assert isinstance(train_loader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), 4, 0).dataset, PerSampleSeeds)
    import numpy as np

    from vision_priors.recipes.data.ett import ForecastWindows
    windows = ForecastWindows(np.arange(40, dtype=np.float32).reshape(20, 2), np.zeros((20, 4), np.float32), 6, 3, 2)
    assert train_loader(windows, 4, 0).dataset is windows


def test_sweep_worker_failure_is_raised_after_the_other_runs_finish(tmp_path, capsys):
    import argparse

    from run_helpers import train_or_fail
    from vision_priors.recipes.runs import train_sweep
    args = argparse.Namespace(jobs=2, threads=1, resume=False)
    runs = [('broken', 0, tmp_path / 'broken'), ('fine', 1, tmp_path / 'fine'), ('fine', 2, tmp_path / 'fine2')]
    with pytest.raises(ValueError, match='run broken seed 0 failed on purpose'):
        train_sweep(train_or_fail, args, runs)
    assert (tmp_path / 'fine' / 'trained.txt').read_text() == 'fine 1 resume=False'
    assert (tmp_path / 'fine2' / 'trained.txt').exists() and not (tmp_path / 'broken').exists()
    out = capsys.readouterr().out
    assert 'FAILED: ' + str(tmp_path / 'broken') + ': ValueError' in out and 'trained: ' + str(tmp_path / 'fine') in out


def _process_ended(pid: int) -> bool:
    """Linux: the process is gone, or a zombie nobody has reaped yet (it no longer runs)."""
    try:
        stat = Path(f'/proc/{pid}/stat').read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(')', 1)[1].split()[0] in ('Z', 'X')


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads process states from /proc')
@pytest.mark.parametrize('stop', ['SIGTERM', 'SIGKILL'])
def test_stopping_a_sweep_stops_its_workers(tmp_path, stop):
    """A sweep stopped from outside (``kill`` of its process, or SIGKILL) takes its spawned workers with it: before
    stop 52 they went on training (and checkpointing) runs that nobody was watching."""
    import signal
    import subprocess
    import time
    tests = Path(__file__).resolve().parent
    script = (f"import argparse, sys; sys.path.insert(0, {str(tests)!r})\n"
              "from run_helpers import train_until_stopped\n"
              "from vision_priors.recipes.runs import train_sweep\n"
              "if __name__ == '__main__':\n"
              f"    train_sweep(train_until_stopped, argparse.Namespace(jobs=2, threads=1, resume=False),\n"
              f"                [('a', 0, {str(tmp_path / 'a')!r}), ('b', 1, {str(tmp_path / 'b')!r})])\n")
    (tmp_path / 'sweep.py').write_text(script)
    sweep = subprocess.Popen([sys.executable, str(tmp_path / 'sweep.py')], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    pid_files = [tmp_path / 'a' / 'pid.txt', tmp_path / 'b' / 'pid.txt']
    try:
        deadline = time.monotonic() + 120
        while not all(f.exists() for f in pid_files):
            assert sweep.poll() is None, sweep.stdout.read()
            assert time.monotonic() < deadline, 'the workers never started'
            time.sleep(0.2)
        workers = [int(f.read_text()) for f in pid_files]
        assert sweep.pid not in workers and not any(_process_ended(pid) for pid in workers)
        sweep.send_signal(getattr(signal, stop))
        sweep.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not all(_process_ended(pid) for pid in workers):
            assert time.monotonic() < deadline, f'workers {workers} still running after the sweep ended'
            time.sleep(0.2)
        assert 'has ended; stopping' in sweep.stdout.read()
    finally:
        if sweep.poll() is None:
            sweep.kill()
        for f in pid_files:
            if f.exists() and not _process_ended(int(f.read_text())):
                os.kill(int(f.read_text()), signal.SIGKILL)


def test_resumed_sweep_checks_every_run_before_any_trains(tmp_path, capsys):
    """With --resume a sweep takes every run that holds one through its settings check first: one changed
    setting stops the whole sweep, and no run (resumed or new) has trained or written anything."""
    import argparse

    from run_helpers import train_with_settings
    from vision_priors.recipes.runs import train_sweep
    runs = [('a', 0, tmp_path / 'a'), ('b', 1, tmp_path / 'b')]
    train_sweep(train_with_settings, argparse.Namespace(jobs=1, resume=False, setting=1), runs)
    config_b = tmp_path / 'b' / 'config.json'
    config_b.write_text(config_b.read_text().replace('"setting": 1', '"setting": 2'))  # b was trained otherwise
    before = snapshot(tmp_path)
    for jobs in (1, 2):
        with pytest.raises(ValueError, match=r'settings differ .*setting: 2 -> 1'):
            train_sweep(train_with_settings, argparse.Namespace(jobs=jobs, threads=1, resume=True, setting=1),
                        [*runs, ('c', 2, tmp_path / 'c')])
        assert snapshot(tmp_path) == before  # 'a' (listed first) did not train again, 'c' never started
    assert 'FAILED: ' + str(tmp_path / 'b') + ': ValueError' in capsys.readouterr().out
    # the stored settings given back: every run resumes (and the new one starts)
    train_sweep(train_with_settings, argparse.Namespace(jobs=1, resume=True, setting=1), [runs[0]])
    assert (tmp_path / 'a' / 'trained.txt').read_text() == '2'


def test_a_train_function_that_never_commits_cannot_pass_the_resume_check(tmp_path):
    import argparse

    from run_helpers import train_or_fail
    from vision_priors.recipes.runs import check_resumed_runs
    (tmp_path / 'a').mkdir()
    (tmp_path / 'a' / 'config.json').write_text('{}')
    with pytest.raises(RuntimeError, match='without reaching RunFolder.commit'):
        check_resumed_runs(train_or_fail, argparse.Namespace(), [('a', 0, tmp_path / 'a')])


@pytest.mark.parametrize('text, expected', [
    ('cifar10', 'cifar10'),
    ('cifar10:../data/c.npz', 'cifar10:{parent}/data/c.npz'),
    ('wds:shards', 'wds:{cwd}/shards'),
    ('folder/../x.csv', '{cwd}/x.csv'),
    ('/abs/x.csv', '/abs/x.csv'),
])
def test_data_flags_are_stored_as_absolute_paths(tmp_path, monkeypatch, text, expected):
    from vision_priors.recipes.cli import data_source
    monkeypatch.chdir(tmp_path)
    parse = data_source(keywords=('cifar10',), schemes=('wds', 'cifar10'))
    assert parse(text) == expected.format(cwd=tmp_path, parent=tmp_path.parent)


def test_resume_accepts_the_same_data_under_another_spelling(tmp_path, monkeypatch):
    """A relative --data and the absolute path of the same file are one setting; another file is not."""
    import shutil

    from vision_priors.recipes import forecast
    from vision_priors.recipes.data.ett import write_ett_csv
    csv = write_ett_csv(tmp_path / 'data' / 'tiny.csv', rows=300, seed=2)
    shutil.copy(csv, tmp_path / 'data' / 'other.csv')
    (tmp_path / 'work').mkdir()
    monkeypatch.chdir(tmp_path / 'work')
    flags = ['train', '--seq-len', '16', '--label-len', '8', '--pred-len', '4', '--updates', '2',
             '--model-overrides', json.dumps(dict(d_model=8, n_heads=2, d_ff=8, lavo_slots=4)), '--batch-size', '16',
             '--cpu', '--threads', '1', '--plot-windows', '1', '--out', str(tmp_path / 'run')]
    forecast.main([*flags, '--data', '../data/tiny.csv'])
    config = json.loads((tmp_path / 'run' / 'config.json').read_text())
    assert config['args']['data'] == str(csv)
    before = snapshot(tmp_path / 'run')
    forecast.main([*flags, '--data', str(csv), '--resume'])  # finished: nothing to train, nothing refused
    with pytest.raises(ValueError, match=r'settings differ .*data.*tiny\.csv.* -> .*other\.csv'):
        forecast.main([*flags, '--data', '../data/other.csv', '--resume'])
    after = snapshot(tmp_path / 'run')
    assert after.pop('log.jsonl').startswith(before.pop('log.jsonl')) and after == before
