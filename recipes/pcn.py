"""PCN point-cloud completion (LAVO paper, Table 7): a PoinTr-style model, vanilla or LAVO cross-attention.

Commands (``vision-priors pcn COMMAND --help`` explains every option):

  train     train one model (``--cross-attn vanilla|lavo``) on PCN-layout data; CPU, one GPU or many
            through ``accelerate launch``; verified checkpoints, exact ``--resume``, best-on-validation
            weights (``--eval-every``, validation CD-L1) in ``RUN/best``.
  eval      evaluate run folders on the test split: CD-L1, CD-L2 (x 1000) and F-score@0.01 per category,
            and the overall mean of the category means (PoinTr's protocol); table, JSON, renders.
  compare   train + eval both cross-attentions over seeds with one budget: mean +- std tables, JSON, a
            metric plot and renders of partial / predicted / ground-truth clouds for a few test shapes.
  complete  complete your own partial scans (``.pcd`` / ``.ply``) with a trained run and render them.

Data (``--data``): a folder in PCN's layout (``{train,val,test}/complete/<taxonomy>/<model>.pcd``,
``{split}/partial/<taxonomy>/<model>/NN.pcd``, ``PCN.json``; ``vision_priors.recipes.data.pcn``), or
nothing: the built-in procedural PCN-layout dataset (8 categories of primitive compositions, partial views
by visible-surface sampling from random viewpoints), written once to ``--builtin-root`` and reused.
Partial clouds are resampled to ``--num-partial`` points and complete ones to ``--num-complete`` (PCN:
2,048 and 16,384; the CPU defaults are smaller); training draws a view per item per epoch with random
mirroring and scaling.

Model (``vision_priors.models.point_completion``): farthest-point proxies with kNN-grouped features, a
transformer encoder, queries from a global feature (coarse centres), a decoder whose cross-attention to
the proxies is softmax (``vanilla``) or LAVO's (``LavoCrossAttention``), and a folding head. Loss: PoinTr's
CD-L1 of the coarse and of the fine cloud against the complete cloud. Metrics
(``vision_priors.metrics``): CD-L1 = (mean sqrt d1 + mean sqrt d2) / 2 x 1000, CD-L2 = (mean d1 + mean
d2) x 1000, F-score at 0.01 on unsquared nearest-neighbour distances, all through the package's Chamfer
op (torch path on CPU, Triton on GPU).

CPU run on the built-in data (the README's table; far from converged, see there):

  vision-priors pcn compare --seeds 0 1 --updates 600 --batch-size 8 --num-complete 1024 --eval-every 200 \
      --jobs 2 --out outputs/pcn

PCN scale (paper: 16,384 points, PoinTr backbone), e.g. on GPUs:

  accelerate launch --num_processes 8 -m vision_priors.recipes.pcn compare --data /path/to/PCN \\
      --model pointr_pcn --num-partial 2048 --num-complete 16384 --epochs 300 --batch-size 48 \\
      --lr 5e-4 --weight-decay 5e-4 --eval-every 2000 --seeds 0 --out runs/pcn
"""
import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader
from timm.optim import create_optimizer_v2

from vision_priors.metrics import completion_metrics
from vision_priors.models.point_completion import completion_loss, completion_model_names, create_completion_model

from . import cli, engine
from .checkpoints import write_json_atomic
from .data.pcn import BUILTIN_CATEGORIES, PCNDataset, read_point_cloud, write_builtin_pcn
from .engine import close_distributed, cosine_schedule, count_updates, fit, make_accelerator, train_loader
from .logs import JsonlLogger
from .plotting import figure, render_clouds, save_figure
from .report import format_cell, group_rows, markdown_table, mean_std, write_results
from .runs import RunFolder, data_fingerprints, load_finished_run, run_settings, sweep_folders, train_sweep

CROSS_ATTENTIONS = ('vanilla', 'lavo')
METRICS = ('cd_l1', 'cd_l2', 'f_score')  # CD x 1000 (lower is better), F-score@0.01 (higher is better)
EVAL_ONLY_FLAGS = ('renders',)


# ------------------------------------------------------------------------------------- arguments

def add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('data')
    g.add_argument('--data', type=cli.location, default=None,
                   help='PCN-layout folder; default: the built-in procedural dataset')
    g.add_argument('--categories', nargs='+', default=None, help='taxonomy names to use (default: all)')
    g.add_argument('--num-partial', type=cli.positive_int, default=512, help='points per partial cloud (PCN: 2048)')
    g.add_argument('--num-complete', type=cli.positive_int, default=2048, help='points per complete cloud (PCN: 16384)')
    g.add_argument('--builtin-root', type=cli.location, default='outputs/pcn_data',
                   help='where the built-in dataset is written once')
    g.add_argument('--builtin-models', type=cli.positive_int, nargs=3, default=(24, 4, 6),
                   metavar=('TRAIN', 'VAL', 'TEST'),
                   help='built-in data: models per category and split')
    g.add_argument('--builtin-views', type=cli.positive_int, default=8, help='built-in data: partial views per model')
    g.add_argument('--builtin-seed', type=cli.nonnegative_int, default=0, help='built-in data: generator seed')


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('model')
    g.add_argument('--model', default='pointr_cpu', choices=completion_model_names(), help='registered configuration')
    g.add_argument('--model-overrides', default='{}',
                   help='JSON dict of constructor overrides, e.g. \'{"num_proxies": 64}\'')


def add_training_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    add_data_args(p)
    add_model_args(p)
    cli.add_optim_flags(p, lr=1e-3, epochs=30, warmup_frac=0.02, weight_decay=5e-4, clip_grad=10.0)
    cli.add_device_flags(p, batch_size=16)
    cli.add_run_flags(p, out='outputs/pcn' + ('' if sweep else '/run'), sweep=sweep)
    p.add_argument('--renders', type=cli.nonnegative_int, default=4, help='test shapes to render per model')


def build_parser() -> argparse.ArgumentParser:
    parser, add_command = cli.command_parser('vision-priors pcn', __doc__)
    p = add_command('train', 'train one model')
    p.add_argument('--cross-attn', choices=CROSS_ATTENTIONS, default='lavo', help="the decoder's cross-attention")
    add_training_args(p, sweep=False)
    p = add_command('eval', 'evaluate run folders on the test split')
    p.add_argument('runs', nargs='+', help='run folders, their checkpoint folders or their best/ folders')
    p.add_argument('--out', default='outputs/pcn/eval', help='folder for results.json, the table and the renders')
    p.add_argument('--renders', type=cli.nonnegative_int, default=4, help='test shapes to render per run')
    cli.add_device_flags(p, batch_size=16)
    p = add_command('compare', 'train + eval both cross-attentions over seeds')
    p.add_argument('--cross-attns', nargs='+', choices=CROSS_ATTENTIONS, default=list(CROSS_ATTENTIONS))
    add_training_args(p, sweep=True)
    p = add_command('complete', 'complete your own partial scans with a trained run')
    p.add_argument('run', help='run folder, checkpoint folder or best/ folder')
    p.add_argument('inputs', nargs='+', help='.pcd / .ply partial scans')
    p.add_argument('--out', default='outputs/pcn/completions', help='folder for the completed .pcd files and renders')
    p.add_argument('--no-normalize', action='store_true',
                   help='feed the scan as it is (default: centre it and scale it into the training frame, then map '
                        'the completion back)')
    p.add_argument('--cpu', action='store_true', help='force the CPU even when a GPU is present')
    p.add_argument('--threads', type=cli.nonnegative_int, default=0, help="torch CPU threads (0 = torch's default)")
    return parser


def validate(args: argparse.Namespace) -> None:
    """Recipe-specific checks, before any folder is touched."""
    if hasattr(args, 'model_overrides'):
        cli.model_overrides(args.model_overrides)
    if getattr(args, 'categories', None):
        cli.check_unique('--categories', args.categories)
    if getattr(args, 'data', None) is None and getattr(args, 'categories', None):
        unknown = sorted(set(args.categories) - set(BUILTIN_CATEGORIES))
        if unknown:
            raise ValueError(f'--categories {unknown} are not built-in categories ({", ".join(BUILTIN_CATEGORIES)})')


# ------------------------------------------------------------------------------------------ data

def data_root(args: argparse.Namespace) -> Path:
    """``--data``, or the built-in dataset for these generator settings (written on first use)."""
    if args.data is not None:
        return Path(args.data)
    train, val, test = args.builtin_models
    root = Path(args.builtin_root) / (f'builtin-seed{args.builtin_seed}-models{train}-{val}-{test}-'
                                      f'views{args.builtin_views}-points{max(args.num_complete, 2048)}')
    if not (root / 'PCN.json').exists():
        write_builtin_pcn(root, models_per_split=(train, val, test), num_views=args.builtin_views,
                          num_complete=max(args.num_complete, 2048), seed=args.builtin_seed)
    return root


def data_config(args: argparse.Namespace) -> Dict[str, Any]:
    """Everything that fixes the data of a run (saved in config.json, reused by ``eval``)."""
    return dict(root=str(data_root(args)), categories=args.categories, num_partial=args.num_partial,
                num_complete=args.num_complete)


def dataset(cfg: Dict[str, Any], split: str, augment: bool = False) -> PCNDataset:
    return PCNDataset(cfg['root'], split, num_partial=cfg['num_partial'], num_complete=cfg['num_complete'],
                      augment=augment, categories=cfg['categories'])


# ----------------------------------------------------------------------------------------- model

def model_config(args: argparse.Namespace, cross_attn: str) -> Dict[str, Any]:
    return dict(name=args.model, overrides=dict(cli.model_overrides(args.model_overrides), cross_attn=cross_attn))


def build_model(cfg: Dict[str, Any]) -> nn.Module:
    return create_completion_model(cfg['name'], **cfg['overrides'])


# ------------------------------------------------------------------------------------------ step

def completion_step(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """PoinTr's loss: CD-L1 of the coarse and the fine cloud against the complete cloud."""
    coarse, fine = model(batch['partial'])
    return completion_loss(coarse.float(), fine.float(), batch['complete'].float())


# ------------------------------------------------------------------------------------ evaluation

@torch.no_grad()
def predict_metrics(model: nn.Module, loader: DataLoader, accelerator) -> Dict[str, np.ndarray]:
    """Per test item: CD-L1, CD-L2 (x 1000), F-score and its category (all processes)."""
    model.eval()
    out: Dict[str, List[np.ndarray]] = {k: [] for k in (*METRICS, 'category')}
    for batch in loader:
        with accelerator.autocast():
            _, fine = model(batch['partial'])
        metrics = completion_metrics(fine.float(), batch['complete'].float())
        values = accelerator.gather_for_metrics((*[metrics[k] for k in METRICS], batch['category']))
        for key, value in zip((*METRICS, 'category'), values):
            out[key].append(value.cpu().numpy())
    if not out['category']:
        raise ValueError('the evaluation set is empty')
    return {k: np.concatenate(v) for k, v in out.items()}


def summarize_metrics(pred: Dict[str, np.ndarray], categories: Sequence[str]) -> Dict[str, Any]:
    """Per category: mean of each metric; overall: the mean of the category means (PoinTr / PCN)."""
    by_category = {}
    for index, name in enumerate(categories):
        chosen = pred['category'] == index
        if chosen.any():
            by_category[name] = {k: float(pred[k][chosen].mean()) for k in METRICS}
            by_category[name]['n'] = int(chosen.sum())
    overall = {k: float(np.mean([c[k] for c in by_category.values()])) for k in METRICS}
    return dict(by_category=by_category, overall=overall)


@torch.no_grad()
def sampling_floor(data: PCNDataset) -> Dict[str, Any]:
    """The metrics of the ground truth against itself at the evaluated density: per item, two disjoint random
    draws of ``min(num_complete, N // 2)`` of its N stored complete points (seeded by the index), one scored as
    the prediction against the other; summarised like a run. A reference for the trained models' figures,
    which are bounded by how densely ``num_complete`` points sample the surface (not a strict bound)."""
    out: Dict[str, List[np.ndarray]] = {k: [] for k in (*METRICS, 'category')}
    draw_sizes = []
    for index, sample in enumerate(data.samples):
        points = read_point_cloud(sample.paths.complete)
        half = min(data.num_complete, len(points) // 2)
        draw_sizes.append(half)
        if half < 1:
            raise ValueError(f'{sample.paths.complete}: {len(points)} point(s), too few for two disjoint draws')
        order = np.random.default_rng(index).permutation(len(points))
        draw_a, draw_b = (torch.from_numpy(np.ascontiguousarray(points[o], dtype=np.float32))[None]
                          for o in (order[:half], order[half:2 * half]))
        metrics = completion_metrics(draw_a, draw_b)
        for key in METRICS:
            out[key].append(metrics[key].numpy())
        out['category'].append(np.array([data.sample_categories[index]]))
    summary = summarize_metrics({k: np.concatenate(v) for k, v in out.items()}, data.categories)
    return dict(summary, points_per_draw=[min(draw_sizes), max(draw_sizes)])


def eval_loader(data, args: argparse.Namespace, accelerator) -> DataLoader:
    return accelerator.prepare(DataLoader(data, batch_size=args.batch_size, shuffle=False,
                                          num_workers=getattr(args, 'num_workers', 0)))


@torch.no_grad()
def render_examples(model: nn.Module, data: PCNDataset, count: int, out_dir: Path, label: str, device) -> List[str]:
    """Renders of partial / predicted / ground truth for the first ``count`` test items of distinct categories."""
    model.eval()
    chosen, seen = [], set()
    for index, (taxonomy, model_id, _) in enumerate(data.samples):
        if taxonomy not in seen and len(chosen) < count:
            chosen.append(index)
            seen.add(taxonomy)
    paths = []
    for index in chosen:
        item = data[index]
        _, fine = model(item['partial'][None].to(device))
        name = data.categories[int(item['category'])]
        path = out_dir / f'{label}_{index:04d}_{name}.png'
        render_clouds(path, {'partial': item['partial'].numpy(), f'{label} completion': fine[0].float().cpu().numpy(),
                             'ground truth': item['complete'].numpy()}, title=f'{label}: {name} (test item {index})')
        paths.append(str(path))
    return paths


# ----------------------------------------------------------------------------------------- train

def run_train(args: argparse.Namespace, cross_attn: str, seed: int, out_dir: Path, resume: bool) -> Path:
    """Train the model with ``cross_attn`` and ``seed`` into ``out_dir``; returns the final checkpoint folder."""
    folder = RunFolder(out_dir, resume)
    accelerator = make_accelerator(seed, mixed_precision=args.amp, grad_accum=args.grad_accum, cpu=args.cpu)
    dcfg = data_config(args)
    train_set = dataset(dcfg, 'train', augment=True)
    show_progress = engine.PROGRESS and accelerator.is_main_process
    train_set.check_files(progress=show_progress)  # every file a training item can read, before the first write
    mcfg = model_config(args, cross_attn)
    model = cli.build_or_explain(lambda: build_model(mcfg), '--model-overrides', args.model_overrides,
                                 f"the {mcfg['name']} model with --cross-attn {cross_attn}")
    config = dict(cross_attn=cross_attn, seed=seed, model=mcfg, data=dcfg, categories=train_set.categories,
                  parameters=sum(p.numel() for p in model.parameters()), args=run_settings(args),
                  data_fingerprint=data_fingerprints([dcfg['root']]))  # the PCN folder (built-in one included)
    loader = train_loader(train_set, args.batch_size, seed, args.num_workers)
    total_updates = count_updates(args.updates, args.epochs, len(loader), args.grad_accum)
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = cosine_schedule(optimizer, args.lr, total_updates, args.warmup_frac)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    evaluate = None
    if args.eval_every:
        val_set = dataset(dcfg, 'val')
        val_set.check_files(progress=show_progress)
        val = eval_loader(val_set, args, accelerator)

        def evaluate() -> Dict[str, float]:
            return summarize_metrics(predict_metrics(model, val, accelerator), val_set.categories)['overall']

    # the first write: loader, optimizer, schedule and evaluation data are built (a bad input has failed)
    folder.commit(config, may_change=EVAL_ONLY_FLAGS, write=accelerator.is_main_process)
    logger = JsonlLogger(out_dir / 'log.jsonl', enabled=accelerator.is_main_process)
    logger.log(event='start', cross_attn=cross_attn, seed=seed, total_updates=total_updates,
               parameters=config['parameters'], processes=accelerator.num_processes, device=str(accelerator.device))
    result = fit(accelerator, model, optimizer, scheduler, loader, None, total_updates, out_dir,
                 step_fn=completion_step, clip_grad=args.clip_grad, checkpoint_every=args.checkpoint_every,
                 keep_checkpoints=args.keep_checkpoints,
                 resume=resume, stop_after=args.stop_after, logger=logger, log_every=args.log_every,
                 eval_every=args.eval_every, evaluate=evaluate, best_metric='cd_l1' if evaluate else None,
                 best_mode='min', patience=args.patience)
    logger.log(event='end', **{k: str(v) for k, v in result.items()})
    return Path(result['checkpoint'])


# ------------------------------------------------------------------------------------------ eval

def load_model(run: Path, reads: Optional[Sequence[str]] = None):
    """(config, model) of a trained run; ``reads``: the run's data paths the caller reads (``load_finished_run``:
    ``None`` all, checked unchanged; ``()`` none, e.g. ``complete`` on scans of its own)."""
    loaded = load_finished_run(Path(run), 'pcn', reads=reads)
    model = build_model(loaded.config['model'])
    model.load_state_dict(loaded.state_dict)
    return loaded.config, model


def run_eval(args: argparse.Namespace, runs: Sequence[str], out_dir: Path) -> List[Dict[str, Any]]:
    """Test-split metrics of each run (rows) and renders of a few test shapes (first run of each cross-attention)."""
    accelerator = make_accelerator(0, mixed_precision=args.amp, cpu=args.cpu)
    loaded = [load_model(Path(run)) for run in runs]
    test_sets = [dataset(config['data'], 'test') for config, _ in loaded]
    for test_set in test_sets:  # every run's test files, before the first render is written
        test_set.check_files(progress=engine.PROGRESS and accelerator.is_main_process)
    rows, rendered = [], set()
    for run, (config, model), test_set in zip(runs, loaded, test_sets):
        model = accelerator.prepare(model)
        summary = summarize_metrics(predict_metrics(model, eval_loader(test_set, args, accelerator), accelerator),
                                    test_set.categories)
        row = dict(run=str(run), cross_attn=config['cross_attn'], seed=config['seed'],
                   parameters=config['parameters'], data=config['data'], **summary)
        if args.renders and config['cross_attn'] not in rendered and accelerator.is_main_process:
            row['renders'] = render_examples(accelerator.unwrap_model(model), test_set, args.renders,
                                             out_dir / 'renders', config['cross_attn'], accelerator.device)
            rendered.add(config['cross_attn'])
        overall = summary['overall']
        accelerator.print(f"{config['cross_attn']} seed={config['seed']}: CD-L1 {overall['cd_l1']:.3f} "
                          f"CD-L2 {overall['cd_l2']:.3f} F-score {overall['f_score']:.3f}")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------- report

def aggregate(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """cross_attn -> {'overall': metric -> mean/std over seeds, 'by_category': category -> metric -> mean/std}."""
    table: Dict[str, Any] = {}
    for name, mine in group_rows(rows, 'cross_attn').items():
        categories = list(dict.fromkeys(c for r in mine for c in r['by_category']))
        table[name] = dict(
            parameters=mine[0]['parameters'], seeds=[r['seed'] for r in mine],
            overall={k: mean_std(r['overall'][k] for r in mine) for k in METRICS},
            by_category={c: {k: mean_std(r['by_category'][c][k] for r in mine if c in r['by_category'])
                             for k in METRICS} for c in categories})
    return table


def format_tables(table: Dict[str, Any]) -> str:
    """Overall table (CD-L1, CD-L2 x 1000, F-score) and one table per metric with a column per category."""
    lines = [markdown_table(['cross-attention', 'params', 'CD-L1 (x1000)', 'CD-L2 (x1000)', 'F-score@0.01'],
                            [[name, f"{t['parameters']:,}", format_cell(t['overall']['cd_l1'], digits=3),
                              format_cell(t['overall']['cd_l2'], digits=3),
                              format_cell(t['overall']['f_score'], digits=3)]
                             for name, t in table.items()])]
    categories = list(dict.fromkeys(c for t in table.values() for c in t['by_category']))
    for metric, label in (('cd_l1', 'CD-L1 (x1000)'), ('cd_l2', 'CD-L2 (x1000)'), ('f_score', 'F-score@0.01')):
        lines += ['', markdown_table([label] + categories + ['mean'],
                                     [[name] + [format_cell(t['by_category'][c][metric], digits=3)
                                                if c in t['by_category'] else '' for c in categories]
                                      + [format_cell(t['overall'][metric], digits=3)] for name, t in table.items()])]
    return '\n'.join(lines)


def plot_metrics(table: Dict[str, Any], path: Path, title: str) -> None:
    """CD-L1 per category, one bar per cross-attention (mean +- std over seeds)."""
    names = list(table)
    categories = list(dict.fromkeys(c for t in table.values() for c in t['by_category']))
    fig, axes = figure(size=(max(6.4, 0.9 * len(categories) + 2), 4.2))
    ax = axes[0][0]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        cells = [table[name]['by_category'].get(c, {}).get('cd_l1') for c in categories]
        ax.bar(np.arange(len(categories)) + (i - (len(names) - 1) / 2) * width,
               [c['mean'] if c else np.nan for c in cells], width, yerr=[c['std'] if c else 0 for c in cells],
               capsize=3, label=name)
    ax.set_xticks(np.arange(len(categories)), categories, rotation=30, ha='right')
    ax.set_ylabel('CD-L1 x 1000 (lower is better)')
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def report(rows: List[Dict[str, Any]], args: argparse.Namespace, out_dir: Path, title: str) -> Dict[str, Any]:
    table = aggregate(rows)
    text = format_tables(table)
    floor = None
    data_configs = {json.dumps(r['data'], sort_keys=True) for r in rows}
    if len(data_configs) == 1:  # the runs share their test data: the ground truth against itself there
        floor = sampling_floor(dataset(rows[0]['data'], 'test'))
        low, high = floor['points_per_draw']
        text += ('\n\nSampling floor (two disjoint draws of ' + (f'{low}' if low == high else f'{low}-{high}')
                 + ' ground-truth points per test shape, scored against each other): CD-L1 '
                 f"{floor['overall']['cd_l1']:.3f}, CD-L2 {floor['overall']['cd_l2']:.3f}, "
                 f"F-score {floor['overall']['f_score']:.3f}")
    print(text)
    results = write_results(out_dir, rows=rows, summary=table, sampling_floor=floor, table_markdown=text, args=args)
    plot_metrics(table, out_dir / 'pcn_cd_l1.png', title)
    print(f'saved {results}, {out_dir / "pcn_cd_l1.png"} and renders in {out_dir / "renders"}')
    return dict(rows=rows, summary=table, table_markdown=text)


# -------------------------------------------------------------------------------------- complete

@torch.no_grad()
def run_complete(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Complete each input scan: (optionally) centre and scale it into the training frame, resample it to the
    run's number of partial points, predict, map back, write ``<name>_completion.pcd`` and a render."""
    from .data.pcn import write_pcd

    config, model = load_model(Path(args.run), reads=())  # the inputs are the user's scans, not the run's data
    device = torch.device('cuda' if torch.cuda.is_available() and not args.cpu else 'cpu')
    model.to(device).eval()
    out_dir = Path(args.out)
    results = []
    for source in args.inputs:
        points = read_point_cloud(Path(source))
        centre, scale = np.zeros(3, np.float32), 1.0
        if not args.no_normalize:  # into the built-in / PCN frame: bounding box centred, longest side 1
            low, high = points.min(0), points.max(0)
            centre, scale = (low + high) / 2, float((high - low).max()) or 1.0
        partial = (points - centre) / scale
        count = config['data']['num_partial']
        rng = np.random.default_rng(0)
        chosen = rng.choice(len(partial), count, replace=len(partial) < count)
        _, fine = model(torch.from_numpy(partial[chosen].astype(np.float32))[None].to(device))
        completion = fine[0].float().cpu().numpy() * scale + centre
        name = Path(source).stem
        out_dir.mkdir(parents=True, exist_ok=True)
        write_pcd(out_dir / f'{name}_completion.pcd', completion)
        render = render_clouds(out_dir / f'{name}_completion.png', {'input scan': points, 'completion': completion},
                               title=f'{name}: {config["cross_attn"]} completion')
        results.append(dict(input=str(source), points=len(points), completion=str(out_dir / f'{name}_completion.pcd'),
                            render=str(render)))
        print(f'{source}: {len(points)} points -> {len(completion)} ({out_dir / f"{name}_completion.pcd"}, {render})')
    write_json_atomic(out_dir / 'completions.json', results)
    return results


# ------------------------------------------------------------------------------------------ main

def dispatch(args: argparse.Namespace) -> Any:
    out = Path(args.out)
    if args.command == 'train':
        ckpt = run_train(args, args.cross_attn, args.seed, out, args.resume)
        print(f'checkpoint: {ckpt}')
        return dict(checkpoint=str(ckpt))
    if args.command == 'eval':
        return report(run_eval(args, args.runs, out), args, out, 'evaluation')
    if args.command == 'complete':
        return run_complete(args)
    runs = sweep_folders(out, args.cross_attns, args.seeds, args.resume, flag='--cross-attns')
    train_sweep(run_train, args, runs)
    rows = run_eval(args, [str(run_dir) for _, _, run_dir in runs], out)
    return report(rows, args, out, f'PCN completion, {len(args.seeds)} seed(s): CD-L1 per category')


def main(argv: Optional[List[str]] = None) -> Any:
    return cli.run_main(build_parser(), dispatch, argv, validate)


if __name__ == '__main__':
    main()
    close_distributed()
