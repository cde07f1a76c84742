"""PCN completion recipe on the shared layer: train, kill + resume (bit-exact), eval tables, compare, complete,
errors."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from run_helpers import assert_same_final_weights
from vision_priors.recipes import pcn as recipe
from vision_priors.recipes.data.pcn import write_pcd

SHARED_DEMO = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'pcn_demo'


@pytest.fixture(scope='module')
def builtin_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp('pcn_data')


def tiny(builtin_root: Path) -> list:
    return ['--builtin-root', str(builtin_root), '--builtin-models', '2', '1', '1', '--builtin-views', '2',
            '--num-partial', '64', '--num-complete', '256', '--model-overrides', json.dumps(TINY_MODEL),
            '--batch-size', '4', '--cpu', '--threads', '1', '--renders', '2']


TINY_MODEL = dict(embed_dim=32, num_heads=2, encoder_depth=1, decoder_depth=1, num_proxies=16, num_queries=8,
                  fold_step=4, knn_k=8, geo_k=4, global_dim=64, fold_hidden=32)  # 128 fine points


def test_train_kill_resume_equals_uninterrupted_and_eval(builtin_root, tmp_path):
    common = ['train', '--cross-attn', 'lavo', *tiny(builtin_root), '--updates', '6', '--checkpoint-every', '2']
    full, killed = tmp_path / 'full', tmp_path / 'killed'
    recipe.main([*common, '--out', str(full)])
    recipe.main([*common, '--out', str(killed), '--stop-after', '3'])
    recipe.main([*common, '--out', str(killed), '--resume'])
    assert_same_final_weights(full, killed)
    result = recipe.main(['eval', str(full), '--out', str(tmp_path / 'eval'), '--cpu', '--batch-size', '4',
                          '--renders', '1'])
    row = result['rows'][0]
    assert row['cross_attn'] == 'lavo' and set(row['overall']) == {'cd_l1', 'cd_l2', 'f_score'}
    assert len(row['by_category']) == 8 and all(v['n'] == 1 for v in row['by_category'].values())
    for metric in ('cd_l1', 'cd_l2', 'f_score'):  # overall = mean of the category means (PoinTr)
        expected = np.mean([v[metric] for v in row['by_category'].values()])
        assert row['overall'][metric] == pytest.approx(expected)
    assert 0 <= row['overall']['f_score'] <= 1 and row['overall']['cd_l1'] > 0
    assert Path(row['renders'][0]).stat().st_size > 5000
    saved = json.loads((tmp_path / 'eval' / 'results.json').read_text())
    assert saved['seeds'] == [0] and 'CD-L1' in saved['table_markdown']


def test_compare_both_cross_attentions_and_complete_real_scans(builtin_root, tmp_path):
    out = tmp_path / 'cmp'
    result = recipe.main(['compare', *tiny(builtin_root), '--updates', '2', '--seeds', '0', '1', '--eval-every', '2',
                          '--out', str(out)])
    assert set(result['summary']) == {'vanilla', 'lavo'}
    for cell in result['summary'].values():
        assert cell['seeds'] == [0, 1] and cell['overall']['cd_l1']['n'] == 2
    assert (out / 'pcn_cd_l1.png').exists() and (out / 'lavo' / 'seed1' / 'best' / 'model.safetensors').exists()
    floor = json.loads((out / 'results.json').read_text())['sampling_floor']
    assert floor['points_per_draw'] == [256, 256] and 0 < floor['overall']['cd_l1'] < 100
    assert 'Sampling floor (two disjoint draws of 256' in result['table_markdown']
    scans = sorted(SHARED_DEMO.glob('*.pcd'))[:1] + sorted(SHARED_DEMO.glob('*.ply'))[:1]
    if not scans:  # a user's clone has no ../shared: complete a scan the test writes
        scan = tmp_path / 'scan.pcd'
        write_pcd(scan, np.random.default_rng(0).normal(size=(300, 3)).astype(np.float32) * 0.2)
        scans = [scan]
    completions = recipe.main(['complete', str(out / 'lavo' / 'seed0'), *map(str, scans), '--out',
                               str(tmp_path / 'completions'), '--cpu'])
    assert len(completions) == len(scans)
    for item in completions:
        assert Path(item['completion']).exists() and Path(item['render']).stat().st_size > 5000


def test_recipe_errors(builtin_root, tmp_path):
    with pytest.raises(ValueError, match=r"--categories \['spaceship'\] are not built-in categories"):
        recipe.main(['train', *tiny(builtin_root), '--categories', 'spaceship', '--out', str(tmp_path / 'r')])
    with pytest.raises(ValueError, match='--model-overrides .* is not a JSON dict'):
        recipe.main(['train', *tiny(builtin_root), '--model-overrides', '[1]', '--out', str(tmp_path / 'r')])
    with pytest.raises(ValueError, match=r'--model-overrides \{"embed_dim": -3\} cannot build the pointr_cpu model '
                                         r'with --cross-attn lavo: embed_dim must be an integer >= 1'):
        recipe.main(['train', *tiny(builtin_root), '--model-overrides', '{"embed_dim": -3}',
                     '--out', str(tmp_path / 'r')])
    with pytest.raises(ValueError, match=r'--model-overrides \{"bogus": 1\} cannot build the pointr_cpu model with '
                                         r'--cross-attn vanilla: unknown override'):
        recipe.main(['compare', *tiny(builtin_root), '--cross-attns', 'vanilla', '--model-overrides', '{"bogus": 1}',
                     '--out', str(tmp_path / 'r')])
    with pytest.raises(ValueError, match='--cross-attns lists lavo more than once'):
        recipe.main(['compare', *tiny(builtin_root), '--cross-attns', 'lavo', 'lavo', '--out', str(tmp_path / 'r')])
    with pytest.raises(FileNotFoundError):
        recipe.main(['train', *tiny(builtin_root), '--data', str(tmp_path / 'nowhere'), '--out', str(tmp_path / 'r')])
    with pytest.raises(ValueError, match=r'training samples < --batch-size 1000'):  # the loader, before config.json
        recipe.main(['train', *tiny(builtin_root), '--batch-size', '1000', '--out', str(tmp_path / 'r')])
    assert not (tmp_path / 'r').exists()


def test_sampling_floor_hand_checked(tmp_path):
    """Two ground-truth points 0.005 apart: the two disjoint one-point draws are 0.005 apart both ways, so
    CD-L1 = 5, CD-L2 = 2 * 0.005^2 * 1000 = 0.05 and F-score@0.01 = 1; a category mean of the two items."""
    from test_data_pcn import make_pcn
    from vision_priors.recipes.data.pcn import PCNDataset
    pair = np.array([[0, 0, 0], [0.003, 0.004, 0]], np.float32)
    wide = np.array([[0, 0, 0], [0.02, 0, 0]], np.float32)  # 0.02 apart: CD-L1 20, F-score 0
    view = np.zeros((4, 3), np.float32)
    make_pcn(tmp_path, {('chair', '03001627'): {'a': (pair, [view])}, ('lamp', '03636649'): {'b': (wide, [view])}},
             split='test')
    floor = recipe.sampling_floor(PCNDataset(tmp_path, 'test', num_partial=4, num_complete=1))
    assert floor['points_per_draw'] == [1, 1]
    assert floor['by_category']['chair']['cd_l1'] == pytest.approx(5.0, rel=1e-5)
    assert floor['by_category']['chair']['cd_l2'] == pytest.approx(0.05, rel=1e-5)
    assert floor['by_category']['chair']['f_score'] == pytest.approx(1.0)
    assert floor['by_category']['lamp']['cd_l1'] == pytest.approx(20.0, rel=1e-5)
    assert floor['by_category']['lamp']['f_score'] == pytest.approx(0.0)
    assert floor['overall']['cd_l1'] == pytest.approx(12.5, rel=1e-5)


def test_changed_data_folder_refuses_eval_naming_it(builtin_root, tmp_path):
    """The built-in data folder, generated onto disk, is fingerprinted like --data: a file added to it afterwards
    refuses eval naming the folder and the file count, with nothing written; complete (the user's own scans) is
    not refused; the folder restored, eval runs."""
    run = tmp_path / 'run'
    recipe.main(['train', '--cross-attn', 'vanilla', *tiny(builtin_root), '--updates', '1', '--out', str(run)])
    root, stored = next(iter(json.loads((run / 'config.json').read_text())['data_fingerprint'].items()))
    assert Path(root).parent == builtin_root and stored['kind'] == 'folder'
    extra = Path(root) / 'test' / 'extra.txt'
    extra.write_text('not a point cloud')
    try:
        with pytest.raises(ValueError, match=re.escape(f'the data changed since run {run} was trained: {root}: files '
                                                       f'{stored["files"]} -> {stored["files"] + 1}')):
            recipe.main(['eval', str(run), '--out', str(tmp_path / 'eval'), '--cpu', '--renders', '0'])
        assert not (tmp_path / 'eval').exists()
        scan = tmp_path / 'scan.pcd'
        write_pcd(scan, np.random.default_rng(0).random((100, 3)).astype(np.float32))
        recipe.main(['complete', str(run), str(scan), '--out', str(tmp_path / 'done'), '--cpu'])
    finally:
        extra.unlink()
    recipe.main(['eval', str(run), '--out', str(tmp_path / 'eval'), '--cpu', '--renders', '0'])
    assert (tmp_path / 'eval' / 'results.json').exists()


def _copy_builtin(builtin_root: Path, tmp_path: Path) -> Path:
    """A copy of the tiny built-in dataset (written by the recipe into ``builtin_root``) to damage."""
    import shutil
    recipe.main(['train', '--cross-attn', 'vanilla', *tiny(builtin_root), '--updates', '1', '--out',
                 str(tmp_path / 'warm')])  # writes the built-in folder if no earlier test did
    source = next(builtin_root.glob('builtin-*'))
    return Path(shutil.copytree(source, tmp_path / 'data'))


def _set_point_nan(path: Path, index: int) -> None:
    """Overwrite point ``index``'s x of a binary float32 x y z PCD with NaN, keeping the file's size."""
    raw = bytearray(path.read_bytes())
    start = raw.index(b'DATA binary\n') + len(b'DATA binary\n') + 12 * index
    raw[start:start + 4] = np.array([np.nan], np.float32).tobytes()
    path.write_bytes(bytes(raw))


def _first_model(root: Path, split: str) -> tuple:
    entry = json.loads((root / 'PCN.json').read_text())[0]
    return entry['taxonomy_id'], entry[split][0]


@pytest.mark.parametrize('fault', ['nan_in_a_later_view', 'truncated_complete', 'nan_in_validation'])
def test_damaged_point_cloud_refuses_train_before_any_write(builtin_root, tmp_path, fault):
    """A damaged file anywhere a training item (or, with --eval-every, a validation item) can read is an error
    naming the file and the value before the run folder exists; not only when a batch first draws it."""
    data = _copy_builtin(builtin_root, tmp_path)
    split = 'val' if fault == 'nan_in_validation' else 'train'
    taxonomy, model = _first_model(data, split)
    if fault == 'truncated_complete':
        bad = data / split / 'complete' / taxonomy / f'{model}.pcd'
        bad.write_bytes(bad.read_bytes()[:-120])  # ten whole points short
        message = rf'{re.escape(str(bad))}: PCD data holds \d+ points but the header says POINTS \d+'
    else:
        bad = data / split / 'partial' / taxonomy / model / ('01.pcd' if split == 'train' else '00.pcd')
        _set_point_nan(bad, 3)
        message = rf'{re.escape(str(bad))}: point 3 is not finite: \[nan, '
    out = tmp_path / 'run'
    with pytest.raises(ValueError, match=message):
        recipe.main(['train', '--cross-attn', 'lavo', *tiny(builtin_root), '--data', str(data), '--updates', '1',
                     '--eval-every', '1', '--out', str(out)])
    assert not out.exists()


def test_damaged_test_file_refuses_eval_before_any_write(builtin_root, tmp_path, monkeypatch):
    """A same-size corruption of a test file (a folder above the content-hash limit is fingerprinted by its
    listing only, so the fingerprint cannot see it) is an error naming the file before eval writes anything."""
    from vision_priors.recipes import fingerprint
    monkeypatch.setattr(fingerprint, 'FOLDER_CONTENT_LIMIT', 0)
    data = _copy_builtin(builtin_root, tmp_path)
    run = tmp_path / 'run'
    recipe.main(['train', '--cross-attn', 'vanilla', *tiny(builtin_root), '--data', str(data), '--updates', '1',
                 '--out', str(run)])
    taxonomy, model = _first_model(data, 'test')
    bad = data / 'test' / 'complete' / f'{taxonomy}' / f'{model}.pcd'
    _set_point_nan(bad, 5)
    out = tmp_path / 'eval'
    with pytest.raises(ValueError, match=rf'{re.escape(str(bad))}: point 5 is not finite: \[nan, '):
        recipe.main(['eval', str(run), str(run), '--out', str(out), '--cpu', '--renders', '1'])
    assert not out.exists()


def test_check_files_reads_each_file_once_per_process(builtin_root, tmp_path):
    """Training items read every view, evaluation items view 0; a second check of unchanged files reads none,
    a rewritten file is read again."""
    from vision_priors.recipes.data.pcn import PCNDataset
    data = _copy_builtin(builtin_root, tmp_path)
    train, test = PCNDataset(data, 'train', augment=True), PCNDataset(data, 'test')
    assert len(train.item_files()) == len(train) * 3 and len(test.item_files()) == len(test) * 2  # 2 views
    assert train.check_files() == len(train) * 3 and train.check_files() == 0
    first = train.item_files()[0]
    first.write_bytes(first.read_bytes())  # same bytes, a new modification time
    assert train.check_files() <= 1 and test.check_files() == len(test) * 2
