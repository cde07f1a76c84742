"""Informer-style long-sequence forecasting (LAVO paper, Table 8): the decoder's cross-attention full or LAVO,
next to the Informer paper's figures and a linear baseline.

Commands (``vision-priors forecast COMMAND --help`` explains every option):

  train     train one model: ``--model informer_cpu|informer_mid|informer|informerstack`` with ``--cross-attn
            full|lavo`` and ``--attn prob|full``, or ``--model linear``; Informer's protocol (MSE loss, Adam,
            validation every epoch, early stopping with ``--patience 3`` and the best weights in ``RUN/best``, lr
            halved each epoch after the second); verified checkpoints after every epoch, exact ``--resume``.
  eval      test-split MSE / MAE (scaled values, as Informer's tables) of run folders (their ``best/``
            weights when present), table, JSON and a plot of predictions vs truth (target column).
  compare   train + eval full / LAVO cross-attention and the linear baseline over ``--pred-lens`` and
            ``--seeds``: mean +- std table beside the published Informer figures, JSON, plot. ``--seq-lens`` /
            ``--label-lens`` give each horizon its own lengths and ``--factors`` its own ProbSparse factor
            (paired with ``--pred-lens``).

Data (``--data``, ``vision_priors.recipes.data.ett``): a CSV with a ``date`` column, read, split and scaled as
Informer does (``ETTh*`` files 12 / 4 / 4 months, ``ETTm*`` x 4, others 70 / 10 / 20 %; standard scaling fitted
on the training rows; windows ``seq_len`` / ``label_len`` / ``pred_len``; time features ``timeenc=1``), or
nothing: a generated ETT-format CSV (20 months, hourly; written once to ``--builtin-root``).

Smoke run on the real ETTh1 (multivariate), the small ``informer_cpu`` (d_model 64), one epoch:

  vision-priors forecast compare --data ../shared/data/ett/ETTh1.csv --features M --pred-lens 24 48 168 \\
      --seeds 0 1 --epochs 1 --threads 1 --out outputs/forecast

The README's table: Informer's per-horizon lengths (``scripts/ETTh1.sh``) with the quarter-width ``informer_mid``,
one epoch (about an hour on two CPU cores):

  vision-priors forecast compare --data ../shared/data/ett/ETTh1.csv --features M --model informer_mid \\
      --pred-lens 24 48 168 --seq-lens 48 96 168 --label-lens 48 48 168 --seeds 0 1 --epochs 1 --threads 1

Informer's full size and protocol (d_model 512, ``mix=True``, 6 epochs, patience 3, the script's lengths and
factors), e.g. on a GPU:

  vision-priors forecast compare --data ETTh1.csv --model informer --pred-lens 24 48 168 336 720 \\
      --seq-lens 48 96 168 168 336 --label-lens 48 48 168 168 336 --factors 3 5 5 5 5 --seeds 0 1 2

``--model informerstack`` is Informer2020's encoder stack (3 / 2 / 1 blocks on the last L, L / 2, L / 4 steps).
"""
import argparse
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader
from timm.optim import create_optimizer_v2

from vision_priors.models.informer import (ATTENTIONS, CROSS_ATTENTIONS, FORECAST_MODELS, create_forecast_model,
                                           decoder_input, forecast_model_names)

from . import cli
from .data.ett import FEATURE_MODES, LAYOUTS, ForecastSeries, write_ett_csv
from .engine import close_distributed, cosine_schedule, count_updates, fit, make_accelerator, train_loader
from .logs import JsonlLogger
from .plotting import figure, save_figure
from .report import format_cell, group_rows, markdown_table, mean_std, write_results
from .runs import (DATA_FINGERPRINT, RunFolder, data_fingerprints, load_finished_run, run_settings, sweep_folders,
                   to_json, train_sweep)

BASELINE = 'linear'
METHODS = (*CROSS_ATTENTIONS, BASELINE)  # a compare's rows: Informer with each cross-attention, the baseline
METRICS = ('mse', 'mae')
# Informer2020's 1e-4; informer_mid (one CPU epoch): 1e-3, the best ETTh1 validation MSE of 1e-4 / 3e-4 / 1e-3 at
# horizon 24 (0.823 / 0.645 / 0.601 after one epoch); the linear baseline: DLinear's ETTh1 script
DEFAULT_LR = {'informer': 1e-4, 'informerstack': 1e-4, 'informer_mid': 1e-3, 'informer_cpu': 1e-4, BASELINE: 5e-3}
EVAL_ONLY_FLAGS = ('plot_windows',)
# named configs whose default 'mix' changed (Informer2020's mix=True): their runs stored without 'mix' were
# built with mix=False and are rebuilt so; new runs store it
LEGACY_UNMIXED = ('informer',)
# Informer paper (Zhou et al. 2021), Table 2, ETTh1 multivariate: horizon -> (MSE, MAE)
PUBLISHED = {('ETTh1', 'M'): {24: (0.577, 0.549), 48: (0.685, 0.625), 168: (0.931, 0.752), 336: (1.128, 0.873),
                              720: (1.215, 0.896)}}


# ------------------------------------------------------------------------------------- arguments

def epoch_cadence(text: str) -> Any:
    """``--eval-every`` / ``--checkpoint-every``: ``epoch`` (after every epoch, as Informer validates) or a number
    of updates."""
    return text if text == 'epoch' else cli.nonnegative_int(text)


def updates_between(cadence: Any, updates_per_epoch: int) -> int:
    """The number of updates an ``epoch_cadence`` value stands for."""
    return updates_per_epoch if cadence == 'epoch' else cadence


def add_data_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    g = p.add_argument_group('data')
    g.add_argument('--data', type=cli.location, default=None,
                   help='CSV with a date column; default: a generated ETT-format CSV')
    g.add_argument('--builtin-root', type=cli.location, default='outputs/forecast_data',
                   help='where the generated CSV is written once')
    g.add_argument('--builtin-seed', type=cli.nonnegative_int, default=0, help='generated CSV: seed')
    g.add_argument('--layout', choices=LAYOUTS, default='auto', help='split borders (auto: from the file name)')
    g.add_argument('--features', choices=FEATURE_MODES, default='M', help='M: all -> all, S: target -> target, '
                                                                           'MS: all -> target')
    g.add_argument('--target', default='OT', help='target column (S / MS; the plotted column)')
    g.add_argument('--freq', default=None, help="time-feature frequency (Informer letter h / t / d ..., or a pandas "
                                                "alias); default h (t for ETTm)")
    g.add_argument('--seq-len', type=cli.positive_int, default=96, help='encoder input length')
    g.add_argument('--label-len', type=cli.nonnegative_int, default=48, help='decoder start tokens')
    if sweep:
        g.add_argument('--pred-lens', type=cli.positive_int, nargs='+', default=[24, 48, 168], help='horizons')
        g.add_argument('--seq-lens', type=cli.positive_int, nargs='+', default=None,
                       help='encoder input length per horizon, paired with --pred-lens (default: --seq-len for all; '
                            "Informer's ETTh1 script: 48 96 168 for 24 48 168)")
        g.add_argument('--label-lens', type=cli.nonnegative_int, nargs='+', default=None,
                       help='decoder start tokens per horizon, paired with --pred-lens (default: --label-len for '
                            "all; Informer's ETTh1 script: 48 48 168)")
    else:
        g.add_argument('--pred-len', type=cli.positive_int, default=24, help='horizon')


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('model')
    g.add_argument('--model', default='informer_cpu', choices=forecast_model_names(),
                   help='registered configuration (in compare: the transformer; the baseline is linear)')
    g.add_argument('--attn', choices=ATTENTIONS, default='prob', help='self-attention: ProbSparse or full')
    g.add_argument('--model-overrides', default='{}',
                   help='JSON dict of constructor overrides, e.g. \'{"d_model": 32}\'')


def add_training_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    add_data_args(p, sweep)
    add_model_args(p)
    if sweep:
        p.add_argument('--factors', type=cli.positive_int, nargs='+', default=None,
                       help="ProbSparse factor c per horizon, paired with --pred-lens (default: the named config's; "
                            "Informer's ETTh1 script: 3 5 5 for 24 48 168)")
        p.add_argument('--baseline-lr', type=cli.positive_float, default=None,
                       help=f'learning rate of the linear baseline (default: {DEFAULT_LR[BASELINE]}, DLinear\'s; '
                            '--lr sets the transformer\'s only)')
    cli.add_optim_flags(p, lr=1e-4, epochs=6, warmup_frac=0.0, weight_decay=0.0)
    g = p.add_argument_group('Informer schedule')
    g.add_argument('--schedule', choices=('halve', 'cosine'), default='halve',
                   help="halve: Informer's lr * 0.5 ** max(0, epoch - 1); cosine: the shared cosine schedule")
    cli.add_device_flags(p, batch_size=32)
    cli.add_run_flags(p, out='outputs/forecast' + ('' if sweep else '/run'), sweep=sweep)
    # patience: 3 when validating, see validate; a checkpoint after each epoch: a stopped run loses one epoch at most
    p.set_defaults(opt='adam', lr=None, patience=None, eval_every='epoch', checkpoint_every='epoch')
    for action in p._actions:  # the shared flags, with this recipe's defaults explained
        if action.dest == 'lr':
            action.help = f'peak learning rate (default: per model, {DEFAULT_LR})'
        if action.dest == 'eval_every':
            action.type = epoch_cadence
            action.help = 'validate every N updates, or after every epoch (epoch); 0 = never'
        if action.dest == 'checkpoint_every':
            action.type = epoch_cadence
            action.help = ('checkpoint every N updates, or after every epoch (epoch: --resume loses one epoch at '
                           'most); 0 = only at the end')
        if action.dest == 'patience':
            action.help = ('stop after N validations without improvement; default 3 (Informer) when validating, '
                           'none with --eval-every 0')
    p.add_argument('--plot-windows', type=cli.nonnegative_int, default=3, help='test windows to plot')


def build_parser() -> argparse.ArgumentParser:
    parser, add_command = cli.command_parser('vision-priors forecast', __doc__)
    p = add_command('train', 'train one model')
    p.add_argument('--cross-attn', choices=CROSS_ATTENTIONS, default='lavo', help="the decoder's cross-attention")
    add_training_args(p, sweep=False)
    p = add_command('eval', 'evaluate run folders on the test split')
    p.add_argument('runs', nargs='+', help='run folders (their best/ weights when present) or checkpoint folders')
    p.add_argument('--out', default='outputs/forecast/eval', help='folder for results.json, the table and the plot')
    p.add_argument('--plot-windows', type=cli.nonnegative_int, default=3, help='test windows to plot')
    cli.add_device_flags(p, batch_size=32)
    p = add_command('compare', 'train + eval full / LAVO cross-attention and the linear baseline')
    p.add_argument('--cross-attns', nargs='+', choices=CROSS_ATTENTIONS, default=list(CROSS_ATTENTIONS))
    p.add_argument('--no-baseline', dest='baseline', action='store_false', help='leave out the linear baseline')
    add_training_args(p, sweep=True)
    return parser


def validate(args: argparse.Namespace) -> None:
    """Recipe-specific checks, before any folder is touched."""
    if hasattr(args, 'patience') and args.patience is None:  # Informer's patience 3, or none without validation
        args.patience = 3 if args.eval_every else 0
    if hasattr(args, 'model_overrides'):
        cli.model_overrides(args.model_overrides)
    if getattr(args, 'pred_lens', None):
        cli.check_unique('--pred-lens', args.pred_lens)
        for flag in ('seq_lens', 'label_lens', 'factors'):
            values = getattr(args, flag)
            if values is not None and len(values) != len(args.pred_lens):
                what = 'factor(s)' if flag == 'factors' else 'length(s)'
                raise ValueError(f'--{flag.replace("_", "-")} gives {len(values)} {what} for {len(args.pred_lens)} '
                                 f'--pred-lens {args.pred_lens}: give one per horizon, in the same order')
        if getattr(args, 'factors', None) is not None and 'factor' in cli.model_overrides(args.model_overrides):
            raise ValueError('--factors and a "factor" in --model-overrides both set the ProbSparse factor: give one')
    if hasattr(args, 'label_len'):
        for pred_len in getattr(args, 'pred_lens', None) or [getattr(args, 'pred_len', None)]:
            seq_len, label_len = horizon_lengths(args, pred_len)
            if label_len > seq_len:
                where = f' (horizon {pred_len})' if getattr(args, 'pred_lens', None) else ''
                raise ValueError(f'--label-len {label_len} exceeds --seq-len {seq_len}{where} (the start tokens are '
                                 f'the end of the encoder input)')
    if getattr(args, 'command', None) == 'compare' and args.model == BASELINE:
        transformers = ' / '.join(n for n in forecast_model_names() if n != BASELINE)
        raise ValueError(f'compare: --model names the transformer ({transformers}); the '
                         'linear baseline is added unless --no-baseline')
    if getattr(args, 'data', None) is not None and not Path(args.data).is_file():
        raise FileNotFoundError(f'--data {args.data}: no such CSV file')


# ------------------------------------------------------------------------------------------ data

def data_path(args: argparse.Namespace) -> Path:
    """``--data``, or the generated ETT-format CSV for ``--builtin-seed`` (written on first use)."""
    if args.data is not None:
        return Path(args.data)
    path = Path(args.builtin_root) / f'ETTh_generated_seed{args.builtin_seed}.csv'
    if not path.exists():
        write_ett_csv(path, seed=args.builtin_seed)
    return path


def paired_with_horizon(args: argparse.Namespace, flag: str, pred_len: int) -> Optional[int]:
    """The entry of the per-horizon list ``flag`` (``seq_lens`` / ``label_lens`` / ``factors``, compare) paired with
    horizon ``pred_len`` in ``--pred-lens``; None where the list is not given."""
    values = getattr(args, flag, None)
    return values[list(args.pred_lens).index(pred_len)] if values else None


def horizon_lengths(args: argparse.Namespace, pred_len: int) -> Tuple[int, int]:
    """``(seq_len, label_len)`` of horizon ``pred_len``: its ``--seq-lens`` / ``--label-lens`` entries, else
    ``--seq-len`` / ``--label-len``."""
    seq_len, label_len = (paired_with_horizon(args, flag + 's', pred_len) for flag in ('seq_len', 'label_len'))
    return (args.seq_len if seq_len is None else seq_len), (args.label_len if label_len is None else label_len)


def horizon_factor(args: argparse.Namespace, pred_len: int) -> Dict[str, int]:
    """``{'factor': c}`` of horizon ``pred_len`` from ``--factors``, else ``{}`` (the named config's factor, or the
    one in ``--model-overrides``)."""
    factor = paired_with_horizon(args, 'factors', pred_len)
    return {} if factor is None else dict(factor=factor)


def data_config(args: argparse.Namespace, pred_len: int) -> Dict[str, Any]:
    """Everything that fixes the data of a run (saved in config.json, reused by ``eval``)."""
    seq_len, label_len = horizon_lengths(args, pred_len)
    return dict(path=str(data_path(args)), seq_len=seq_len, label_len=label_len, pred_len=pred_len,
                features=args.features, target=args.target, layout=args.layout, freq=args.freq)


def load_series(cfg: Dict[str, Any]) -> ForecastSeries:
    return ForecastSeries(cfg['path'], cfg['seq_len'], cfg['label_len'], cfg['pred_len'], features=cfg['features'],
                          target=cfg['target'], layout=cfg['layout'], freq=cfg['freq'])


# ----------------------------------------------------------------------------------------- model

def model_config(args: argparse.Namespace, method: str, series: ForecastSeries) -> Dict[str, Any]:
    """Registered name and constructor arguments (data sizes from the series) of a method's model."""
    dims = dict(enc_in=series.channels, dec_in=series.channels, c_out=series.out_channels, seq_len=series.seq_len,
                label_len=series.label_len, pred_len=series.pred_len, mark_dim=series.mark_dim)
    if method == BASELINE:
        return dict(name=BASELINE, overrides=dims)
    # 'informer' runs store the decoder's head mixing resolved: runs stored without it were built with mix=False
    named_mix = dict(mix=bool(FORECAST_MODELS[args.model].get('mix', False))) if args.model in LEGACY_UNMIXED else {}
    return dict(name=args.model, overrides=dict(named_mix, **cli.model_overrides(args.model_overrides),
                                                **horizon_factor(args, series.pred_len), attn=args.attn,
                                                cross_attn=method, **dims))


def build_model(cfg: Dict[str, Any]) -> nn.Module:
    overrides = dict(cfg['overrides'])
    if cfg['name'] in LEGACY_UNMIXED and 'mix' not in overrides:
        overrides['mix'] = False  # a run stored before 'informer' took Informer2020's mix=True was trained without it
    return create_forecast_model(cfg['name'], **overrides)


# ------------------------------------------------------------------------------------------ step

def forecast(model: nn.Module, batch: Dict[str, torch.Tensor], label_len: int, pred_len: int) -> torch.Tensor:
    """One forward pass: encoder input + generative decoder input (start tokens, zero placeholders)."""
    return model(batch['x'], batch['x_mark'], decoder_input(batch['y'], label_len, pred_len), batch['y_mark'])


def horizon_truth(batch: Dict[str, torch.Tensor], pred_len: int, out_channels: int) -> torch.Tensor:
    """The horizon's values of the predicted channels (all, or the target = last channel for S / MS)."""
    return batch['y'][:, -pred_len:, -out_channels:]


class InformerHalving:
    """Informer2020's ``lradj='type1'`` in updates: ``lr * 0.5 ** max(0, epoch - 1)`` (epochs 0 and 1 at ``lr``,
    then halved each epoch), with the timm-scheduler interface :func:`fit` uses."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr: float, updates_per_epoch: int) -> None:
        self.optimizer, self.lr, self.updates_per_epoch = optimizer, lr, updates_per_epoch
        self.step_update(0)

    def lr_at(self, updates_done: int) -> float:
        return self.lr * 0.5 ** max(0, updates_done // self.updates_per_epoch - 1)

    def step_update(self, num_updates: int, metric: Any = None) -> None:
        for group in self.optimizer.param_groups:
            group['lr'] = self.lr_at(num_updates)

    def state_dict(self) -> Dict[str, Any]:
        return dict(lr=self.lr, updates_per_epoch=self.updates_per_epoch)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.lr, self.updates_per_epoch = float(state['lr']), int(state['updates_per_epoch'])


# ------------------------------------------------------------------------------------ evaluation

def forecast_metrics(pred: np.ndarray, true: np.ndarray) -> Dict[str, float]:
    """Informer's MSE and MAE: means over every window, step and channel (scaled values)."""
    if pred.shape != true.shape or pred.size == 0:
        raise ValueError(f'predictions {pred.shape} and truth {true.shape} must have one non-empty shape')
    error = pred.astype(np.float64) - true.astype(np.float64)
    return dict(mse=float(np.mean(error ** 2)), mae=float(np.mean(np.abs(error))))


@torch.no_grad()
def predict(model: nn.Module, loader: DataLoader, accelerator, series: ForecastSeries):
    """(predictions, truth), each (windows, pred_len, out_channels) float32, over all processes."""
    model.eval()
    preds, trues = [], []
    for batch in loader:
        with accelerator.autocast():
            out = forecast(model, batch, series.label_len, series.pred_len)
        out, truth = accelerator.gather_for_metrics((out.float(), horizon_truth(batch, series.pred_len,
                                                                                series.out_channels)))
        preds.append(out.cpu().numpy())
        trues.append(truth.cpu().numpy())
    if not preds:
        raise ValueError('the evaluation set is empty')
    return np.concatenate(preds), np.concatenate(trues)


def eval_loader(data, batch_size: int, accelerator, num_workers: int = 0) -> DataLoader:
    return accelerator.prepare(DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=num_workers))


def plot_examples(series: ForecastSeries, pred: np.ndarray, count: int) -> Dict[str, Any]:
    """The target column (original units) of ``count`` evenly spaced test windows: input, truth, prediction."""
    windows = series.split('test')
    chosen = np.unique(np.linspace(0, len(windows) - 1, count).astype(int)) if count else np.array([], int)
    target = series.channels - 1
    examples = []
    for index in chosen:
        item = windows[int(index)]
        examples.append(dict(
            window=int(index),
            history=series.inverse(item['x'][:, target, None].numpy(), [target])[:, 0].tolist(),
            truth=series.inverse(item['y'][-series.pred_len:, target, None].numpy(), [target])[:, 0].tolist(),
            prediction=series.inverse(pred[index, :, -1:], [target])[:, 0].tolist()))
    return dict(column=series.columns[target], windows=examples)


# ----------------------------------------------------------------------------------------- train

def method_name(args: argparse.Namespace) -> str:
    return BASELINE if args.model == BASELINE else args.cross_attn


def run_train(args: argparse.Namespace, method: str, pred_len: int, seed: int, out_dir: Path, resume: bool) -> Path:
    """Train ``method`` (a cross-attention, or the linear baseline) for horizon ``pred_len`` with ``seed``."""
    folder = RunFolder(out_dir, resume)
    accelerator = make_accelerator(seed, mixed_precision=args.amp, grad_accum=args.grad_accum, cpu=args.cpu)
    dcfg = data_config(args, pred_len)
    series = load_series(dcfg)
    mcfg = model_config(args, method, series)
    model = build_model(mcfg) if method == BASELINE else cli.build_or_explain(  # the baseline takes no overrides
        lambda: build_model(mcfg), '--model-overrides', args.model_overrides,
        f"the {mcfg['name']} model with --cross-attn {method} (seq_len {series.seq_len}, label_len "
        f"{series.label_len}, pred_len {series.pred_len}, {series.channels} channel(s))")
    # compare: --lr is the transformer's, --baseline-lr the baseline's; train: --lr is the one model's
    chosen = args.baseline_lr if method == BASELINE and hasattr(args, 'baseline_lr') else args.lr
    lr = chosen or DEFAULT_LR[mcfg['name']]
    settings = {k: v for k, v in run_settings(args).items()  # the run's own lr is config['lr']
                if k not in ('pred_len', 'pred_lens', 'seq_lens', 'label_lens', 'factors', 'baseline', 'baseline_lr')}
    settings.update(seq_len=dcfg['seq_len'], label_len=dcfg['label_len'])  # this run's lengths (per horizon)
    config = dict(method=method, seed=seed, lr=lr, model=mcfg, data=dcfg, columns=series.columns,
                  borders=series.borders, parameters=sum(p.numel() for p in model.parameters()), args=settings,
                  data_fingerprint=data_fingerprints([dcfg['path']]))  # the CSV read (generated one included)
    loader = train_loader(series.split('train'), args.batch_size, seed, args.num_workers)
    updates_per_epoch = max(1, len(loader) // args.grad_accum)
    total_updates = count_updates(args.updates, args.epochs, len(loader), args.grad_accum)
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=lr, weight_decay=args.weight_decay)
    scheduler = (InformerHalving(optimizer, lr, updates_per_epoch) if args.schedule == 'halve'
                 else cosine_schedule(optimizer, lr, total_updates, args.warmup_frac))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    eval_every = updates_between(args.eval_every, updates_per_epoch)
    checkpoint_every = updates_between(args.checkpoint_every, updates_per_epoch)
    evaluate = None
    if eval_every:
        val = eval_loader(series.split('val'), args.batch_size, accelerator, args.num_workers)

        def evaluate() -> Dict[str, float]:
            return forecast_metrics(*predict(model, val, accelerator, series))

    def step(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        out = forecast(model, batch, series.label_len, series.pred_len)
        return nn.functional.mse_loss(out.float(), horizon_truth(batch, series.pred_len, series.out_channels))

    # the first write: loader, optimizer, schedule and evaluation data are built (a bad input has failed)
    folder.commit(config, may_change=EVAL_ONLY_FLAGS, write=accelerator.is_main_process)
    logger = JsonlLogger(out_dir / 'log.jsonl', enabled=accelerator.is_main_process)
    logger.log(event='start', method=method, pred_len=pred_len, seed=seed, total_updates=total_updates,
               updates_per_epoch=updates_per_epoch, parameters=config['parameters'], device=str(accelerator.device))
    result = fit(accelerator, model, optimizer, scheduler, loader, None, total_updates, out_dir, step_fn=step,
                 clip_grad=args.clip_grad, checkpoint_every=checkpoint_every,
                 keep_checkpoints=args.keep_checkpoints, resume=resume,
                 stop_after=args.stop_after, logger=logger, log_every=args.log_every, eval_every=eval_every,
                 evaluate=evaluate, best_metric='mse' if evaluate else None, best_mode='min',
                 patience=args.patience if evaluate else 0)
    logger.log(event='end', **{k: str(v) for k, v in result.items()})
    return Path(result['checkpoint'])


# ------------------------------------------------------------------------------------------ eval

def weights_folder(run: Path) -> Path:
    """A run folder's ``best/`` weights when it has them (Informer tests the best-on-validation model)."""
    run = Path(run)
    return run / 'best' if (run / 'config.json').exists() and (run / 'best').is_dir() else run


def check_same_data(series: ForecastSeries, config: Dict[str, Any], run: str) -> None:
    """For a run stored before data fingerprints (no ``data_fingerprint`` in its config; newer runs have their CSV
    checked byte for byte by ``load_finished_run``): the CSV a run is evaluated on still has the columns and split
    borders it was trained with (an edited, truncated or extended file would silently move the test windows and
    the training-split scaling)."""
    stored = {k: config.get(k) for k in ('columns', 'borders')}
    found = to_json(dict(columns=series.columns, borders=series.borders))
    if found != stored:
        changed = '; '.join(f'{k}: {stored[k]} -> {found[k]}' for k in stored if stored[k] != found[k])
        raise ValueError(f'{series.path}: the data changed since run {run} was trained ({changed}); evaluate on the '
                         f'file it was trained on')


def run_eval(args: argparse.Namespace, runs: Sequence[str]) -> List[Dict[str, Any]]:
    """Test-split MSE / MAE of each run (rows), with the target column of a few test windows for the plot."""
    accelerator = make_accelerator(0, mixed_precision=args.amp, cpu=args.cpu)
    rows = []
    for run in runs:
        loaded = load_finished_run(weights_folder(Path(run)), 'forecast')
        config = loaded.config
        model = build_model(config['model'])
        model.load_state_dict(loaded.state_dict)
        series = load_series(config['data'])
        if DATA_FINGERPRINT not in config:  # an older run: its columns / borders are what can be checked
            check_same_data(series, config, run)
        model = accelerator.prepare(model)
        torch.manual_seed(config['seed'])  # ProbSparse samples keys at test time too
        pred, true = predict(model, eval_loader(series.split('test'), args.batch_size, accelerator,
                                                args.num_workers), accelerator, series)
        metrics = forecast_metrics(pred, true)
        row = dict(run=str(run), weights=str(loaded.checkpoint), method=config['method'], seed=config['seed'],
                   pred_len=config['data']['pred_len'], data=config['data']['path'],
                   features=config['data']['features'], parameters=config['parameters'], windows=len(pred), **metrics,
                   examples=plot_examples(series, pred, args.plot_windows))
        accelerator.print(f"{config['method']} pred_len={row['pred_len']} seed={config['seed']}: "
                          f"MSE {metrics['mse']:.4f} MAE {metrics['mae']:.4f} ({len(pred)} test windows)")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------- report

def aggregate(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """'pred_len' -> method -> {'mse', 'mae': mean/std over seeds, 'seeds', 'parameters'}."""
    table: Dict[str, Any] = {}
    for pred_len, horizon_rows in sorted(group_rows(rows, 'pred_len').items()):
        table[str(pred_len)] = {}
        for method, mine in group_rows(horizon_rows, 'method').items():
            table[str(pred_len)][method] = dict(seeds=[r['seed'] for r in mine], parameters=mine[0]['parameters'],
                                                **{k: mean_std(r[k] for r in mine) for k in METRICS})
    return table


def published_figures(rows: List[Dict[str, Any]]) -> Dict[int, Any]:
    """The Informer paper's figures for these rows' data set and feature mode, if it has them."""
    if not rows:
        return {}
    return PUBLISHED.get((Path(rows[0]['data']).stem, rows[0]['features']), {})


def format_table(table: Dict[str, Any], published: Dict[int, Any]) -> str:
    methods = list(dict.fromkeys(m for cells in table.values() for m in cells))
    header = ['horizon'] + [f'{m} {k.upper()}' for m in methods for k in METRICS]
    if published:
        header += ['Informer paper MSE', 'Informer paper MAE']
    lines = []
    for pred_len, cells in table.items():
        line = [pred_len] + [format_cell(cells[m][k], digits=3) if m in cells else ''
                             for m in methods for k in METRICS]
        if published:
            line += ([f'{v:.3f}' for v in published.get(int(pred_len), ('', ''))] if int(pred_len) in published
                     else ['', ''])
        lines.append(line)
    return markdown_table(header, lines)


def plot_predictions(rows: List[Dict[str, Any]], path: Path) -> Optional[Path]:
    """One row per horizon, one panel per test window: the input, the truth and each method's forecast
    (the first seed's), target column in original units."""
    horizons = sorted({r['pred_len'] for r in rows if r['examples']['windows']})
    if not horizons:
        return None
    count = max(len(r['examples']['windows']) for r in rows)
    fig, axes = figure(len(horizons), count, size=(4.2 * count, 2.8 * len(horizons)))
    for i, pred_len in enumerate(horizons):
        shown = {}
        for r in rows:
            if r['pred_len'] == pred_len and r['method'] not in shown:
                shown[r['method']] = r
        first = next(iter(shown.values()))
        for j, window in enumerate(first['examples']['windows']):
            ax = axes[i][j]
            history, truth = window['history'], window['truth']
            ax.plot(range(len(history)), history, color='0.5', lw=1, label='input')
            steps = range(len(history), len(history) + len(truth))
            ax.plot(steps, truth, color='k', lw=1.2, label='truth')
            for method, r in shown.items():
                ax.plot(steps, r['examples']['windows'][j]['prediction'], lw=1, label=f'{method} (seed {r["seed"]})')
            ax.set_title(f'horizon {pred_len}, test window {window["window"]}', fontsize=8)
            ax.set_ylabel(first['examples']['column'], fontsize=8)
            if i == 0 and j == 0:
                ax.legend(fontsize=6)
    return save_figure(fig, path)


def report(rows: List[Dict[str, Any]], args: argparse.Namespace, out_dir: Path) -> Dict[str, Any]:
    table = aggregate(rows)
    published = published_figures(rows)
    text = format_table(table, published)
    print(text)
    results = write_results(out_dir, rows=rows, summary=table, table_markdown=text, args=args,
                            published={str(k): v for k, v in published.items()})
    plot = plot_predictions(rows, out_dir / 'forecast_predictions.png')
    print(f'saved {results}' + (f' and {plot}' if plot else ''))
    return dict(rows=rows, summary=table, table_markdown=text)


# ------------------------------------------------------------------------------------------ main

def dispatch(args: argparse.Namespace) -> Any:
    out = Path(args.out)
    if args.command == 'train':
        ckpt = run_train(args, method_name(args), args.pred_len, args.seed, out, args.resume)
        print(f'checkpoint: {ckpt}')
        return dict(checkpoint=str(ckpt))
    if args.command == 'eval':
        return report(run_eval(args, args.runs), args, out)
    methods = list(args.cross_attns) + ([BASELINE] if args.baseline else [])
    runs = [(method, pred_len, seed, run_dir) for pred_len in args.pred_lens
            for method, seed, run_dir in sweep_folders(out / f'h{pred_len}', methods, args.seeds, args.resume,
                                                       flag='--cross-attns')]
    train_sweep(run_train, args, runs)
    return report(run_eval(args, [str(run_dir) for *_, run_dir in runs]), args, out)


def main(argv: Optional[List[str]] = None) -> Any:
    return cli.run_main(build_parser(), dispatch, argv, validate)


if __name__ == '__main__':
    main()
    close_distributed()
