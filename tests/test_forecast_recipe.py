"""Forecast recipe on the shared layer: train, kill + resume (bit-exact), eval, compare, metrics, schedule, errors."""
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from run_helpers import assert_same_final_weights, drop_data_fingerprint, snapshot
from vision_priors.models import informer as informer_models
from vision_priors.recipes import forecast as recipe
from vision_priors.recipes.data.ett import write_ett_csv

TINY_MODEL = dict(d_model=8, n_heads=2, d_ff=8, lavo_slots=4)


@pytest.fixture(scope='module')
def tiny_csv(tmp_path_factory) -> Path:
    """300 hourly rows, custom layout: train [0, 210), val [194, 240), test [224, 300) for seq_len 16."""
    return write_ett_csv(tmp_path_factory.mktemp('forecast') / 'tiny.csv', rows=300, seed=2)


def tiny(csv: Path) -> list:
    return ['--data', str(csv), '--seq-len', '16', '--label-len', '8', '--model-overrides', json.dumps(TINY_MODEL),
            '--batch-size', '16', '--cpu', '--threads', '1', '--plot-windows', '2']


def test_train_kill_resume_equals_uninterrupted_and_eval(tiny_csv, tmp_path):
    common = ['train', '--cross-attn', 'lavo', *tiny(tiny_csv), '--pred-len', '4', '--updates', '6',
              '--checkpoint-every', '2', '--eval-every', '3']
    full, killed = tmp_path / 'full', tmp_path / 'killed'
    recipe.main([*common, '--out', str(full)])
    recipe.main([*common, '--out', str(killed), '--stop-after', '3'])
    recipe.main([*common, '--out', str(killed), '--resume'])
    assert_same_final_weights(full, killed)
    config = json.loads((full / 'config.json').read_text())
    assert config['borders'] == {'train': [0, 210], 'val': [194, 240], 'test': [224, 300]}
    assert config['lr'] == 1e-4 and config['method'] == 'lavo' and config['data']['pred_len'] == 4
    result = recipe.main(['eval', str(full), '--out', str(tmp_path / 'eval'), '--cpu', '--batch-size', '16',
                          '--plot-windows', '2'])
    row = result['rows'][0]
    assert row['weights'].endswith('best') and row['windows'] == 76 - 16 - 4 + 1
    assert row['mse'] > 0 and row['mae'] > 0 and row['method'] == 'lavo' and row['seed'] == 0
    window = row['examples']['windows'][1]
    assert row['examples']['column'] == 'OT' and window['window'] == 56
    raw_ot = pd.read_csv(tiny_csv)['OT'].to_numpy()  # the plot is in original units: the raw column
    np.testing.assert_allclose(window['truth'], raw_ot[224 + 56 + 16:224 + 56 + 20], rtol=1e-5)
    np.testing.assert_allclose(window['history'], raw_ot[224 + 56:224 + 56 + 16], rtol=1e-5)
    saved = json.loads((tmp_path / 'eval' / 'results.json').read_text())
    assert saved['seeds'] == [0] and 'lavo MSE' in saved['table_markdown']
    assert (tmp_path / 'eval' / 'forecast_predictions.png').stat().st_size > 5000


def test_informerstack_through_the_recipe(tiny_csv, tmp_path):
    """``informerstack`` (Informer2020's encoder stack, 3 / 2 / 1 blocks) trains at Informer's lr, resumes exactly,
    is rebuilt by ``eval``; a stack given as a list in --model-overrides is a setting --resume compares."""
    def train(out, *extra, stack=None):
        overrides = json.dumps(dict(TINY_MODEL, **({} if stack is None else dict(e_layers=stack))))
        return recipe.main(['train', '--model', 'informerstack', '--cross-attn', 'full', *tiny(tiny_csv),
                            '--model-overrides', overrides, '--pred-len', '4', '--updates', '4', '--checkpoint-every',
                            '2', '--eval-every', '2', '--out', str(out), *extra])

    full, killed = tmp_path / 'full', tmp_path / 'killed'
    train(full)
    train(killed, '--stop-after', '2')
    train(killed, '--resume')
    assert_same_final_weights(full, killed)
    config = json.loads((full / 'config.json').read_text())
    assert config['model']['name'] == 'informerstack' and config['lr'] == 1e-4
    model = recipe.build_model(config['model'])
    assert [len(e.layers) for e in model.encoder.encoders] == [3, 2, 1]
    result = recipe.main(['eval', str(full), '--out', str(tmp_path / 'eval'), '--cpu', '--batch-size', '16'])
    assert result['rows'][0]['mse'] > 0
    before = snapshot(full)
    with pytest.raises(ValueError, match='e_layers'):
        train(full, '--resume', stack=[2, 1])
    assert snapshot(full) == before
    train(tmp_path / 'two', stack=[2, 1])
    stored = json.loads((tmp_path / 'two' / 'config.json').read_text())['model']
    assert stored['overrides']['e_layers'] == [2, 1]
    assert [len(e.layers) for e in recipe.build_model(stored).encoder.encoders] == [2, 1]


def test_a_run_killed_mid_epoch_resumes_from_its_last_epoch(tiny_csv, tmp_path, monkeypatch):
    """The default checkpoint cadence is one epoch (Informer runs are epoch-based and long on a CPU): a run killed
    in its third epoch keeps the checkpoints of epochs 1-2, and --resume from there ends bit-exact with the
    uninterrupted run."""
    args = recipe.build_parser().parse_args(['train', *tiny(tiny_csv)])
    assert args.checkpoint_every == 'epoch' and args.eval_every == 'epoch'
    common = ['train', '--cross-attn', 'full', *tiny(tiny_csv), '--pred-len', '4', '--epochs', '3']
    full, killed = tmp_path / 'full', tmp_path / 'killed'
    recipe.main([*common, '--out', str(full)])
    per_epoch = json.loads((full / 'log.jsonl').read_text().splitlines()[0])['updates_per_epoch']
    assert per_epoch == 11  # 191 training windows, batches of 16, the last one dropped
    assert sorted(p.name for p in full.glob('checkpoint-*')) == [f'checkpoint-{22:08d}', f'checkpoint-{33:08d}']

    training_steps = []
    real_forecast = recipe.forecast

    def killed_in_epoch_three(model, *rest):
        if model.training:
            training_steps.append(1)
            if len(training_steps) == 2 * per_epoch + 5:
                raise KeyboardInterrupt('killed')
        return real_forecast(model, *rest)

    monkeypatch.setattr(recipe, 'forecast', killed_in_epoch_three)
    with pytest.raises(KeyboardInterrupt):
        recipe.main([*common, '--out', str(killed)])
    monkeypatch.setattr(recipe, 'forecast', real_forecast)
    assert json.loads((killed / 'latest.json').read_text())['step'] == 2 * per_epoch
    recipe.main([*common, '--out', str(killed), '--resume'])
    assert_same_final_weights(full, killed)
    assert recipe.build_parser().parse_args(['train', '--checkpoint-every', '0']).checkpoint_every == 0
    with pytest.raises(SystemExit):
        recipe.build_parser().parse_args(['train', '--checkpoint-every', 'weekly'])


def test_compare_full_lavo_linear_over_horizons_and_seeds(tiny_csv, tmp_path):
    out = tmp_path / 'cmp'
    result = recipe.main(['compare', *tiny(tiny_csv), '--pred-lens', '4', '8', '--seeds', '0', '1', '--updates', '2',
                          '--out', str(out)])
    assert set(result['summary']) == {'4', '8'}
    for cells in result['summary'].values():
        assert set(cells) == {'full', 'lavo', 'linear'}
        assert all(c['seeds'] == [0, 1] and c['mse']['n'] == 2 for c in cells.values())
    assert (out / 'h8' / 'linear' / 'seed1' / 'best' / 'model.safetensors').exists()
    linear = json.loads((out / 'h4' / 'linear' / 'seed0' / 'config.json').read_text())
    assert linear['lr'] == 5e-3 and linear['model']['name'] == 'linear'
    assert (out / 'forecast_predictions.png').stat().st_size > 5000
    assert 'linear MSE' in result['table_markdown'] and 'Informer paper' not in result['table_markdown']
    with pytest.raises(FileExistsError, match='already hold a run'):  # every folder checked before training
        recipe.main(['compare', *tiny(tiny_csv), '--pred-lens', '4', '--seeds', '0', '--out', str(out)])
    # --lr is the transformer's: the baseline keeps DLinear's 5e-3 unless --baseline-lr sets it
    for extra, baseline_lr in (([], 5e-3), (['--baseline-lr', '2e-3'], 2e-3)):
        lrs = tmp_path / f'lrs{len(extra)}'
        recipe.main(['compare', *tiny(tiny_csv), '--pred-lens', '4', '--seeds', '0', '--updates', '1',
                     '--cross-attns', 'full', '--lr', '3e-4', *extra, '--out', str(lrs)])
        stored = {m: json.loads((lrs / 'h4' / m / 'seed0' / 'config.json').read_text())['lr']
                  for m in ('full', 'linear')}
        assert stored == {'full': 3e-4, 'linear': baseline_lr}
    with pytest.raises(ValueError, match=r'linear.*\(lr: 0.005 -> 0.001\)'):  # a changed baseline lr: a changed run
        recipe.main(['compare', *tiny(tiny_csv), '--pred-lens', '4', '--seeds', '0', '--updates', '1',
                     '--cross-attns', 'full', '--lr', '3e-4', '--baseline-lr', '1e-3', '--out', str(tmp_path / 'lrs0'),
                     '--resume'])


def test_compare_per_horizon_lengths(tiny_csv, tmp_path):
    """--seq-lens / --label-lens pair with --pred-lens (Informer's ETTh1 script: 48/48 for 24, 96/48 for 48,
    168/168 for 168); each run's data, model and settings carry its own lengths."""
    out = tmp_path / 'cmp'
    result = recipe.main(['compare', *tiny(tiny_csv), '--pred-lens', '4', '8', '--seq-lens', '12', '16',
                          '--label-lens', '12', '6', '--seeds', '0', '--updates', '1', '--eval-every', '0', '--out',
                          str(out)])
    assert set(result['summary']) == {'4', '8'}
    for pred_len, seq_len, label_len in ((4, 12, 12), (8, 16, 6)):
        for method in ('full', 'lavo', 'linear'):
            config = json.loads((out / f'h{pred_len}' / method / 'seed0' / 'config.json').read_text())
            assert (config['data']['seq_len'], config['data']['label_len']) == (seq_len, label_len)
            assert config['model']['overrides']['seq_len'] == seq_len
            assert (config['args']['seq_len'], config['args']['label_len']) == (seq_len, label_len)
            assert 'seq_lens' not in config['args'] and 'label_lens' not in config['args']
    assert {r['windows'] for r in result['rows']
            if r['pred_len'] == 4} == {(60 + 12) - 12 - 4 + 1}  # test rows [228, 300)
    args = recipe.build_parser().parse_args(['compare', *tiny(tiny_csv), '--pred-lens', '4', '8', '--seq-lens', '12',
                                             '20'])
    recipe.validate(args)
    assert [recipe.horizon_lengths(args, p) for p in (4, 8)] == [(12, 8), (20, 8)]  # --label-len for both


def test_compare_per_horizon_factors(tiny_csv, tmp_path):
    """--factors pairs a ProbSparse factor with each --pred-lens entry (Informer's ETTh1 script: 3 for horizon 24,
    its default 5 for the others); each run's model is built with, and its config stores, its own factor."""
    out = tmp_path / 'cmp'
    recipe.main(['compare', *tiny(tiny_csv), '--pred-lens', '4', '8', '--factors', '3', '2', '--seeds', '0',
                 '--updates', '1', '--eval-every', '0', '--no-baseline', '--out', str(out)])
    for pred_len, factor in ((4, 3), (8, 2)):
        for method in ('full', 'lavo'):
            config = json.loads((out / f'h{pred_len}' / method / 'seed0' / 'config.json').read_text())
            assert config['model']['overrides']['factor'] == factor and 'factors' not in config['args']
            model = recipe.build_model(config['model'])
            factors = {m.factor for m in model.modules() if isinstance(m, informer_models.ProbAttention)}
            assert factors == {factor}  # every ProbSparse attention, encoder and decoder
    # without --factors the named config's factor stands and nothing is added to the overrides
    args = recipe.build_parser().parse_args(['compare', *tiny(tiny_csv), '--pred-lens', '4', '8'])
    recipe.validate(args)
    assert recipe.horizon_factor(args, 8) == {}
    with pytest.raises(ValueError, match=r'--factors gives 1 factor\(s\) for 2 --pred-lens \[4, 8\]'):
        recipe.main(['compare', *tiny(tiny_csv), '--pred-lens', '4', '8', '--factors', '3', '--out',
                     str(tmp_path / 'bad')])
    with pytest.raises(ValueError, match='--factors and a "factor" in --model-overrides'):
        recipe.main(['compare', '--data', str(tiny_csv), '--model-overrides', '{"factor": 3}', '--pred-lens', '4',
                     '--factors', '3', '--cpu', '--out', str(tmp_path / 'bad')])
    assert not (tmp_path / 'bad').exists()  # refused before any folder is written


def test_metrics_schedule_and_published_table():
    assert set(recipe.DEFAULT_LR) == set(recipe.forecast_model_names())  # every registered model has its lr
    metrics = recipe.forecast_metrics(np.array([[1., 2.], [3., 4.]]), np.array([[1., 0.], [0., 4.]]))
    assert metrics == {'mse': pytest.approx((0 + 4 + 9 + 0) / 4), 'mae': pytest.approx((0 + 2 + 3 + 0) / 4)}
    with pytest.raises(ValueError, match='one non-empty shape'):
        recipe.forecast_metrics(np.zeros((2, 3)), np.zeros((3, 2)))
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = recipe.InformerHalving(optimizer, 1e-4, updates_per_epoch=10)
    # Informer2020 type1: epochs 0 and 1 at lr, then lr / 2, lr / 4, ...
    assert [schedule.lr_at(u) for u in (0, 9, 10, 19, 20, 30, 45)] == [1e-4, 1e-4, 1e-4, 1e-4, 5e-5, 2.5e-5, 1.25e-5]
    schedule.step_update(31)
    assert optimizer.param_groups[0]['lr'] == 2.5e-5
    rows = [dict(pred_len=24, method='full', seed=s, parameters=1, mse=m, mae=m / 2, data='x/ETTh1.csv', features='M')
            for s, m in ((0, 0.5), (1, 0.7))]
    text = recipe.format_table(recipe.aggregate(rows), recipe.published_figures(rows))
    assert text.splitlines()[2] == '| 24 | 0.600 ± 0.141 | 0.300 ± 0.071 | 0.577 | 0.549 |'


def test_recipe_errors(tiny_csv, tmp_path):
    out = tmp_path / 'r'
    with pytest.raises(ValueError, match='--label-len 20 exceeds --seq-len 16'):
        recipe.main(['train', *tiny(tiny_csv), '--label-len', '20', '--out', str(out)])
    with pytest.raises(ValueError, match=r'--seq-lens gives 1 length\(s\) for 2 --pred-lens \[4, 8\]'):
        recipe.main(['compare', *tiny(tiny_csv), '--pred-lens', '4', '8', '--seq-lens', '16', '--out', str(out)])
    with pytest.raises(ValueError, match=r'--label-len 12 exceeds --seq-len 8 \(horizon 8\)'):
        recipe.main(['compare', *tiny(tiny_csv), '--pred-lens', '4', '8', '--seq-lens', '16', '8', '--label-lens',
                     '8', '12', '--out', str(out)])
    with pytest.raises(ValueError, match='--pred-lens lists 4 more than once'):
        recipe.main(['compare', *tiny(tiny_csv), '--pred-lens', '4', '4', '--out', str(out)])
    with pytest.raises(ValueError, match='--model-overrides .* is not a JSON dict'):
        recipe.main(['train', *tiny(tiny_csv), '--model-overrides', '[1]', '--out', str(out)])
    # overrides the constructor rejects: an error naming the flag (not torch's), before config.json
    with pytest.raises(ValueError, match=r'--model-overrides \{"d_model": -3\} cannot build the informer_cpu model '
                                         r'with --cross-attn lavo .*negative dimension'):
        recipe.main(['train', *tiny(tiny_csv), '--model-overrides', '{"d_model": -3}', '--out', str(out)])
    with pytest.raises(ValueError, match=r'--model-overrides \{"n_heads": 0\} cannot build .*modulo by zero'):
        recipe.main(['compare', *tiny(tiny_csv), '--pred-lens', '4', '--no-baseline', '--model-overrides',
                     '{"n_heads": 0}', '--out', str(out)])
    with pytest.raises(ValueError, match=r'--model-overrides \{"bogus": 1\} cannot build .*unknown argument'):
        recipe.main(['train', *tiny(tiny_csv), '--model-overrides', '{"bogus": 1}', '--out', str(out)])
    with pytest.raises(ValueError, match='compare: --model names the transformer'):
        recipe.main(['compare', *tiny(tiny_csv), '--model', 'linear', '--out', str(out)])
    with pytest.raises(FileNotFoundError, match='--data .*nowhere.csv: no such CSV file'):
        recipe.main(['train', *tiny(tiny_csv), '--data', str(tmp_path / 'nowhere.csv'), '--out', str(out)])
    with pytest.raises(SystemExit):
        recipe.main(['train', *tiny(tiny_csv), '--eval-every', 'weekly', '--out', str(out)])
    bad = tmp_path / 'bad.csv'
    frame = pd.read_csv(tiny_csv)
    frame.loc[40, 'HULL'] = np.nan
    frame.to_csv(bad, index=False)
    with pytest.raises(ValueError, match=r"bad.csv: row 40 \(line 42\), column 'HULL': empty / NaN cell"):
        recipe.main(['train', *tiny(tiny_csv), '--data', str(bad), '--out', str(out)])
    with pytest.raises(ValueError, match=r'too few rows: the val split'):
        recipe.main(['train', *tiny(tiny_csv), '--pred-len', '40', '--out', str(out)])
    with pytest.raises(ValueError,
                       match=r'training samples < --batch-size 5000'):  # the loader, built before config.json
        recipe.main(['train', *tiny(tiny_csv), '--batch-size', '5000', '--out', str(out)])
    assert not out.exists()  # nothing written by a rejected run


def test_keep_checkpoints_zero_keeps_every_epoch_for_eval(tiny_csv, tmp_path):
    """By default a run keeps its newest 2 checkpoints; --keep-checkpoints 0 keeps one per epoch, so an earlier
    epoch's weights can be tested after the run (here epoch 1 against the best); the flag may change on --resume."""
    common = ['train', *tiny(tiny_csv), '--pred-len', '4', '--epochs', '3']
    recipe.main([*common, '--out', str(tmp_path / 'default')])
    recipe.main([*common, '--out', str(tmp_path / 'all'), '--keep-checkpoints', '0'])
    per_epoch = (210 - 16 - 4 + 1) // 16
    kept = lambda run: sorted(p.name for p in (tmp_path / run).glob('checkpoint-*'))
    assert kept('default') == [f'checkpoint-{per_epoch * e:08d}' for e in (2, 3)]
    assert kept('all') == [f'checkpoint-{per_epoch * e:08d}' for e in (1, 2, 3)]
    recipe.main([*common, '--out', str(tmp_path / 'all'), '--keep-checkpoints', '1', '--resume'])  # accepted
    assert kept('all') == [f'checkpoint-{per_epoch * e:08d}' for e in (1, 2, 3)]  # nothing trained, nothing pruned
    result = recipe.main(['eval', str(tmp_path / 'all' / f'checkpoint-{per_epoch:08d}'), str(tmp_path / 'all'),
                          '--out', str(tmp_path / 'eval'), '--cpu', '--batch-size', '16', '--plot-windows', '2'])
    first, best = result['rows']
    assert first['weights'].endswith(f'checkpoint-{per_epoch:08d}') and best['weights'].endswith('best')
    assert first['mse'] != best['mse']


def test_patience_follows_validation(tiny_csv, tmp_path):
    """Informer's patience 3 is the default only when validating: --eval-every 0 alone trains without early
    stopping (it was rejected as '--patience needs --eval-every'); an explicit --patience still needs it."""
    args = recipe.build_parser().parse_args(['train', *tiny(tiny_csv), '--eval-every', '0'])
    recipe.validate(args)
    assert args.patience == 0
    args = recipe.build_parser().parse_args(['train', *tiny(tiny_csv)])
    recipe.validate(args)
    assert args.patience == 3 and args.eval_every == 'epoch'
    recipe.main(['train', *tiny(tiny_csv), '--eval-every', '0', '--updates', '2', '--out', str(tmp_path / 'r')])
    assert (tmp_path / 'r' / 'latest.json').exists()
    with pytest.raises(ValueError, match='--patience needs --eval-every'):
        recipe.main(['train', *tiny(tiny_csv), '--eval-every', '0', '--patience', '2', '--out', str(tmp_path / 's')])


def test_changed_csv_refuses_resume_and_eval_naming_the_file(tiny_csv, tmp_path):
    """The run's CSV fingerprint (size + SHA-256) is in its config: a truncated or edited file (even one keeping its
    size, columns and borders) refuses --resume and eval, naming the file and what changed, with the run folder
    byte-for-byte unchanged and nothing written; the original bytes back, the run resumes and evaluates."""
    csv = tmp_path / 'copy.csv'
    original = tiny_csv.read_bytes()
    csv.write_bytes(original)
    run, evaluation = tmp_path / 'run', tmp_path / 'eval'
    common = ['train', *tiny(csv), '--updates', '2', '--checkpoint-every', '1', '--eval-every', '0', '--out', str(run)]
    recipe.main([*common, '--stop-after', '1'])
    stored = json.loads((run / 'config.json').read_text())['data_fingerprint']
    assert stored == {str(csv): dict(kind='file', bytes=len(original), sha256=hashlib.sha256(original).hexdigest())}
    before = snapshot(run)
    lines = original.decode().splitlines(keepends=True)
    edits = {'truncated': ''.join(lines[:251]),  # 250 of the 300 rows
             'one digit': _edit_one_digit(original.decode())}
    for name, text in edits.items():
        csv.write_text(text)
        what = 'bytes ' if name == 'truncated' else 'sha256 '
        with pytest.raises(ValueError, match=re.escape(f'the data changed since the run in {run} was trained '
                                                       f'({csv}: ') + '.*' + what):
            recipe.main([*common, '--resume'])
        with pytest.raises(ValueError, match=re.escape(f'the data changed since run {run} was trained: {csv}: ')
                           + '.*' + what):
            recipe.main(['eval', str(run), '--out', str(evaluation), '--cpu', '--threads', '1'])
        assert snapshot(run) == before and not evaluation.exists()
    csv.write_bytes(original)
    recipe.main([*common, '--resume'])
    assert json.loads((run / 'latest.json').read_text())['step'] == 2
    recipe.main(['eval', str(run), '--out', str(evaluation), '--cpu', '--threads', '1'])
    assert (evaluation / 'results.json').exists()


def _edit_one_digit(text: str) -> str:
    """``text`` with the first digit of its second line changed (same size, columns and borders)."""
    first, second, rest = text.split('\n', 2)
    index = next(i for i, c in enumerate(second) if c.isdigit() and i > second.index(','))
    second = second[:index] + ('1' if second[index] != '1' else '2') + second[index + 1:]
    return '\n'.join([first, second, rest])


def test_run_stored_before_fingerprints_still_evaluates_with_the_column_check(tiny_csv, tmp_path):
    """A config without data_fingerprint (an older run) evaluates as before, and its stored columns / borders are
    still compared (``check_same_data``): a CSV that lost rows or renamed a column is an error naming the file."""
    csv = tmp_path / 'copy.csv'
    csv.write_text(tiny_csv.read_text())
    run = tmp_path / 'run'
    recipe.main(['train', *tiny(csv), '--updates', '1', '--eval-every', '0', '--out', str(run)])
    drop_data_fingerprint(run)
    recipe.main(['eval', str(run), '--out', str(tmp_path / 'ok'), '--cpu', '--threads', '1'])
    lines = csv.read_text().splitlines(keepends=True)
    csv.write_text(''.join(lines[:251]))  # 250 of the 300 rows
    with pytest.raises(ValueError, match=f"{csv}: the data changed since run {run} was trained .*borders"):
        recipe.main(['eval', str(run), '--out', str(tmp_path / 'eval'), '--cpu', '--threads', '1'])
    frame = pd.read_csv(tiny_csv).rename(columns={'HULL': 'HULL2'})
    frame.to_csv(csv, index=False)
    with pytest.raises(ValueError, match=r"the data changed since run .* \(columns: .*'HULL2'"):
        recipe.main(['eval', str(run), '--out', str(tmp_path / 'eval'), '--cpu', '--threads', '1'])
    assert not (tmp_path / 'eval').exists()


def test_informer_runs_store_the_decoder_head_mixing_and_older_runs_rebuild_without_it(tiny_csv):
    """'informer' is Informer2020's configuration, mix=True included; its runs store mix resolved. A run stored
    before that default (no 'mix' in its overrides) was trained with mix=False and is rebuilt so; an explicit
    --model-overrides mix wins; the other named configs store nothing new."""
    args = recipe.build_parser().parse_args(['train', *tiny(tiny_csv), '--model', 'informer'])
    series = recipe.load_series(recipe.data_config(args, 4))
    cfg = recipe.model_config(args, 'full', series)
    assert cfg['overrides']['mix'] is True
    assert recipe.build_model(cfg).decoder.layers[0].self_attention.mix
    legacy = dict(cfg, overrides={k: v for k, v in cfg['overrides'].items() if k != 'mix'})
    assert not recipe.build_model(legacy).decoder.layers[0].self_attention.mix
    args = recipe.build_parser().parse_args(['train', *tiny(tiny_csv), '--model', 'informer',
                                             '--model-overrides', '{"mix": false, "d_model": 8, "n_heads": 2}'])
    assert recipe.model_config(args, 'lavo', series)['overrides']['mix'] is False
    for name in ('informer_mid', 'informer_cpu'):
        args = recipe.build_parser().parse_args(['train', *tiny(tiny_csv), '--model', name])
        cfg = recipe.model_config(args, 'full', series)
        assert 'mix' not in cfg['overrides']
        assert recipe.build_model(cfg).decoder.layers[0].self_attention.mix is (name == 'informer_mid')
