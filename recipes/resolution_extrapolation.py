"""Resolution extrapolation (GOAT paper, Fig. 5): train at one resolution, evaluate at larger ones.

Commands (``python -m recipes.resolution_extrapolation COMMAND --help`` explains every option):

  train    train one registered model (ours or timm's) on the built-in scenes, an ImageNet-style
           folder (``train/``, ``val/`` with class subfolders) or webdataset shards; CPU, one GPU or
           many through ``accelerate launch``; checkpoints + ``--resume``.
  eval     evaluate checkpoints (or untrained model names) at a list of resolutions (square or
           HxW): table, JSON and a PNG plot of accuracy vs resolution.
  compare  train + eval a list of models over several seeds with one budget: mean +- spread
           table, JSON and plot. The README's main command runs this on the built-in scenes.
  analyze  for a trained GOAT model: plot the learned prior of chosen heads for a query patch
           (Fig. 1 style) and print per-layer spectral statistics (Table 6 style).

Evaluation at resolution r uses timm's eval transform for real images (resize to r / crop_pct,
centre crop r); the built-in scenes are rendered at r directly (the same scene, more patches).
timm's learned absolute embedding is resampled bicubically when the grid changes
(``dynamic_img_size=True``); GOAT / PoPE / RoPE models need no resampling.

Full ImageNet protocol (paper: ViT-S/16, 224 px, 150 epochs), e.g. on 8 GPUs:

  accelerate launch --num_processes 8 -m recipes.resolution_extrapolation compare \\
      --data /path/to/imagenet --models vit_small_patch16_224 vit_small_patch16_rope_224 \\
      vit_small_patch16_rope_mixed_224 vit_small_patch16_goat_224 vit_small_patch16_pope_224 \\
      --train-res 224 --eval-res 224 288 384 448 512 --epochs 150 --batch-size 128 --lr 1e-3 \\
      --weight-decay 0.05 --warmup-epochs 5 --mixup 0.8 --cutmix 1.0 --smoothing 0.1 \\
      --drop-path 0.1 --amp bf16 --seeds 0 --size-overrides none --out runs/imagenet
"""
import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import timm
from timm.data import Mixup, create_dataset, create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from safetensors.torch import load_file

import vision_priors  # noqa: F401  (registers our models)

from .builtin_scenes import TASKS, SpatialScenes
from .engine import JsonlLogger, close_distributed, PerSampleSeeds, evaluate_classifier, fit, latest_checkpoint, make_accelerator, write_json_atomic

DEFAULT_MODELS = [
    'vit_tiny_patch16_224',            # learned absolute embedding (timm), resampled bicubically
    'vit_small_patch16_rope_224',      # axial RoPE (timm Eva)
    'vit_small_patch16_rope_mixed_224',  # mixed (learned-frequency) RoPE (timm Eva)
    'vit_tiny_patch16_goat_224',
    'vit_tiny_patch16_pope_224',
    'vit_tiny_patch16_lavo_224',
]  # on the built-in scenes all get the same BUILTIN_OVERRIDES width / depth / patch
# the built-in experiment's small ViT: width 128 (2 heads of 64), depth 4, patch 4; LAVO models get a
# 3 x 3 local window (its default 7 x 7 would cover almost all of the 8 x 8 training grid)
BUILTIN_OVERRIDES = dict(embed_dim=64, depth=2, num_heads=2, patch_size=4)
BUILTIN_LAVO_OVERRIDES = dict(attn_kwargs=dict(window_2d=2))
IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp', '.webp', '.tif', '.tiff', '.ppm', '.pgm', '.gif')


# ----------------------------------------------------------------------------------------- data

def parse_resolution(value: str) -> Tuple[int, int]:
    """'384' -> (384, 384); '224x320' -> (224, 320) as (height, width)."""
    parts = value.lower().split('x')
    try:
        dims = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f'resolution {value!r} is not N or HxW with integers')
    if len(dims) not in (1, 2) or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f'resolution {value!r} is not N or HxW with positive integers')
    return dims[0], dims[-1]


def res_name(res: Tuple[int, int]) -> str:
    return str(res[0]) if res[0] == res[1] else f'{res[0]}x{res[1]}'


class StrictImages(Dataset):
    """timm ImageDataset wrapper that fails on an unreadable image, naming the file (timm would skip it)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.dataset._max_retries = 1

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        try:
            return self.dataset[index]
        except RuntimeError as e:
            name = self.dataset.reader.filename(index, absolute=True)
            raise ValueError(f'cannot read image {name}: not a decodable image file') from e


def check_image_folder(root: Path, split: str) -> Path:
    """``root/split`` must exist and every class subfolder must hold at least one image."""
    folder = root / split
    if not folder.is_dir():
        raise FileNotFoundError(f'data folder {folder} does not exist (expected {root}/{split}/<class>/<images>)')
    classes = sorted(p for p in folder.iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f'{folder} has no class subfolders (expected {folder}/<class>/<images>)')
    for cls in classes:
        if not any(p.suffix.lower() in IMAGE_SUFFIXES for p in cls.rglob('*') if p.is_file()):
            raise ValueError(f'class folder {cls} is empty: no image files ({", ".join(IMAGE_SUFFIXES)})')
    return folder


def data_kind(data: Optional[str]) -> str:
    if data is None:
        return 'builtin'
    if data.startswith('wds:'):
        return 'wds'
    return 'folder'


def builtin_dataset(split: str, args: argparse.Namespace, res: Tuple[int, int]) -> Dataset:
    num = args.train_samples if split == 'train' else args.val_samples
    return SpatialScenes(split=split, num_samples=num, resolution=res, seed=args.data_seed, transform=None,
                         task=args.task)


def image_transform(args: argparse.Namespace, model: nn.Module, res: Tuple[int, int], is_training: bool):
    """timm's train (random-resized crop, flip, optional auto-augment) or eval (resize + centre crop) transform."""
    mean, std = _mean_std(model)
    extra = dict(auto_augment=args.auto_augment) if is_training else dict(crop_pct=args.crop_pct)
    return create_transform(input_size=(3, *res), is_training=is_training, mean=mean, std=std,
                            interpolation='bicubic', **extra)


def wds_root(args: argparse.Namespace) -> str:
    root = args.data[len('wds:'):]
    if not Path(root).exists():
        raise FileNotFoundError(f'webdataset folder {root} does not exist')
    return root


def make_train_data(args: argparse.Namespace, model: nn.Module, seed: int) -> Tuple[Any, int, bool, Optional[int]]:
    """(loader or dataset, num_classes, is_map_style, epoch_length)."""
    kind = data_kind(args.data)
    res = args.train_res
    if kind == 'builtin':
        ds = builtin_dataset('train', args, res)
        return ds, ds.num_classes, True, None
    transform = image_transform(args, model, res, is_training=True)
    if kind == 'folder':
        root = Path(args.data)
        check_image_folder(root, 'train')
        ds = StrictImages(create_dataset('', root=str(root), split='train', is_training=True, transform=transform))
        return ds, len(ds.dataset.reader.class_to_idx), True, None
    ds = create_dataset('wds/', root=wds_root(args), split=args.train_split, is_training=True,
                        batch_size=args.batch_size, transform=transform, seed=seed)
    if args.num_classes is None:
        raise ValueError('webdataset training needs --num-classes')
    epoch_length = max(1, len(ds) // args.batch_size)
    return ds, args.num_classes, False, epoch_length


def make_eval_data(args: argparse.Namespace, model: nn.Module, res: Tuple[int, int]) -> Dataset:
    kind = data_kind(args.data)
    if kind == 'builtin':
        return builtin_dataset('val', args, res)
    transform = image_transform(args, model, res, is_training=False)
    if kind == 'folder':
        root = Path(args.data)
        check_image_folder(root, 'val')
        return StrictImages(create_dataset('', root=str(root), split='val', is_training=False, transform=transform))
    return create_dataset('wds/', root=wds_root(args), split=args.val_split, is_training=False,
                          batch_size=args.batch_size, transform=transform)


class Normalize(nn.Module):
    """Built-in scenes come in [0, 1]; normalise with the model's mean / std on device."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.register_buffer('mean', torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer('std', torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.device)) / self.std.to(x.device)


# ---------------------------------------------------------------------------------------- models

def model_kwargs(args: argparse.Namespace, num_classes: int, name: str) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = dict(num_classes=num_classes, img_size=args.train_res, dynamic_img_size=True,
                                  drop_path_rate=args.drop_path)
    overrides = args.size_overrides
    if overrides == 'auto':
        overrides = {}
        if data_kind(args.data) == 'builtin':
            overrides = dict(BUILTIN_OVERRIDES, **(BUILTIN_LAVO_OVERRIDES if '_lavo_' in name else {}))
    elif overrides == 'none':
        overrides = {}
    else:
        overrides = json.loads(overrides)
    kwargs.update(overrides)
    return kwargs


def build_model(name: str, kwargs: Dict[str, Any]) -> nn.Module:
    if name not in timm.list_models() and name not in timm.list_models(pretrained=True):
        raise ValueError(f'unknown model {name!r}: not registered with timm (did you import vision_priors?)')
    return timm.create_model(name, **kwargs)


def check_resolution(model: nn.Module, res: Tuple[int, int], name: str) -> None:
    patch = model.patch_embed.patch_size
    if res[0] % patch[0] or res[1] % patch[1]:
        raise ValueError(f'resolution {res_name(res)} is not divisible by the patch size '
                         f'{patch[0]}x{patch[1]} of {name}; choose multiples of {patch[0]}')


# ------------------------------------------------------------------------------------------ train

def run_train(args: argparse.Namespace, name: str, seed: int, out_dir: Path) -> Path:
    """Train ``name`` with ``seed`` into ``out_dir``; returns the final checkpoint folder."""
    if (out_dir / 'latest.json').exists() and not args.resume:
        raise FileExistsError(f'{out_dir} already holds a run (latest.json); pass --resume to continue it '
                              f'or choose another --out')
    accelerator = make_accelerator(seed, mixed_precision=args.amp, grad_accum=args.grad_accum, cpu=args.cpu)
    probe = build_model(name, model_kwargs(args, 10, name))
    check_resolution(probe, args.train_res, name)
    train_data, num_classes, map_style, epoch_length = make_train_data(args, probe, seed)
    kwargs = model_kwargs(args, num_classes, name)
    model = build_model(name, kwargs)
    config = dict(model=name, model_kwargs=kwargs, seed=seed, data=args.data, data_kind=data_kind(args.data),
                  args={k: (res_name(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
                        if k != 'func'})
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / 'config.json', config)

    if map_style:
        generator = torch.Generator().manual_seed(seed)
        train_data = PerSampleSeeds(train_data, seed)
        loader = DataLoader(train_data, batch_size=args.batch_size, shuffle=True, drop_last=True,
                            num_workers=args.workers, generator=generator)
        if len(loader) == 0:
            raise ValueError(f'{len(train_data)} training samples < batch size {args.batch_size}')
    else:
        loader = DataLoader(train_data, batch_size=args.batch_size, num_workers=args.workers, drop_last=True)
    steps_per_epoch = (epoch_length or len(loader)) // args.grad_accum
    total_updates = args.updates or max(1, args.epochs * steps_per_epoch)

    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay)
    scheduler, _ = create_scheduler_v2(
        optimizer, sched='cosine', num_epochs=max(1, math.ceil(total_updates / max(1, steps_per_epoch))),
        warmup_epochs=args.warmup_epochs, warmup_lr=args.lr * 0.01, min_lr=args.lr * 0.01,
        step_on_epochs=False, updates_per_epoch=max(1, steps_per_epoch))
    if map_style:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:  # webdataset: split per rank by timm's reader, never re-split by prepare
        model, optimizer = accelerator.prepare(model, optimizer)
    ema = ModelEmaV3(accelerator.unwrap_model(model), decay=args.ema_decay) if args.ema_decay else None

    mixup = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                      num_classes=num_classes)
        loss_fn: nn.Module = SoftTargetCrossEntropy()
    elif args.smoothing > 0:
        loss_fn = LabelSmoothingCrossEntropy(args.smoothing)
    else:
        loss_fn = nn.CrossEntropyLoss()
    normalize = Normalize(*_mean_std(accelerator.unwrap_model(model))) if data_kind(args.data) == 'builtin' else None

    def batch_transform(images: torch.Tensor, targets: torch.Tensor):
        if normalize is not None:
            images = normalize(images)
        if mixup is not None:
            images, targets = mixup(images, targets)
        return images, targets

    logger = JsonlLogger(out_dir / 'log.jsonl', enabled=accelerator.is_main_process)
    logger.log(event='start', model=name, seed=seed, total_updates=total_updates,
               processes=accelerator.num_processes, device=str(accelerator.device))
    result = fit(accelerator, model, optimizer, scheduler, loader, loss_fn, total_updates, out_dir,
                 batch_transform=batch_transform, ema=ema, clip_grad=args.clip_grad,
                 checkpoint_every=args.checkpoint_every, resume=args.resume, stop_after=args.stop_after,
                 logger=logger, epoch_length=epoch_length)
    logger.log(event='end', **{k: str(v) for k, v in result.items()})
    return Path(result['checkpoint'])


def _mean_std(model: nn.Module) -> Tuple[Sequence[float], Sequence[float]]:
    config = resolve_data_config(model=model)
    return config['mean'], config['std']


# ------------------------------------------------------------------------------------------- eval

def load_for_eval(source: str, args: argparse.Namespace) -> Tuple[str, nn.Module, Dict[str, Any]]:
    """A checkpoint folder / run folder (with config.json) or a model name -> (label, model, config)."""
    path = Path(source)
    if path.exists():
        run_dir = path if (path / 'config.json').exists() else path.parent
        if not (run_dir / 'config.json').exists():
            raise FileNotFoundError(f'{path}: no config.json in it or its parent (expected a run or checkpoint folder)')
        config = json.loads((run_dir / 'config.json').read_text())
        ckpt = latest_checkpoint(path) if (path / 'latest.json').exists() else path
        weights = ckpt / 'model.safetensors'
        if not weights.exists():
            raise FileNotFoundError(f'no weights at {weights}')
        model = build_model(config['model'], dict(config['model_kwargs'], img_size=tuple(config['model_kwargs']['img_size'])))
        model.load_state_dict(load_file(str(weights)))
        return config['model'], model, config
    if source in timm.list_models():
        kwargs = model_kwargs(
            args, args.num_classes or (len(TASKS[args.task]) if data_kind(args.data) == 'builtin' else 1000), source)
        return source, build_model(source, kwargs), dict(model=source, model_kwargs=kwargs)
    raise FileNotFoundError(f'{source!r} is neither a checkpoint / run folder nor a registered model name')


def run_eval(args: argparse.Namespace, sources: List[str]) -> List[Dict[str, Any]]:
    accelerator = make_accelerator(args.seed, mixed_precision=args.amp, cpu=args.cpu)
    rows = []
    for source in sources:
        label, model, config = load_for_eval(source, args)
        for res in args.eval_res:
            check_resolution(model, res, label)
        normalize = Normalize(*_mean_std(model)) if data_kind(args.data) == 'builtin' else None
        model = accelerator.prepare(model)
        for res in args.eval_res:
            dataset = make_eval_data(args, accelerator.unwrap_model(model), res)
            loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers)
            loader = accelerator.prepare(loader)
            if normalize is not None:
                loader = ((normalize(x.to(accelerator.device)), y) for x, y in loader)
            metrics = evaluate_classifier(model, loader, accelerator)
            rows.append(dict(source=source, model=label, seed=config.get('seed'), res=res_name(res), **metrics))
            accelerator.print(f'{label} seed={config.get("seed")} @ {res_name(res)}: top1 {metrics["top1"]:.2f}')
    return rows


def summarize(rows: List[Dict[str, Any]], resolutions: List[str]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """model -> res -> {mean, std, n} of top-1 over seeds."""
    table: Dict[str, Dict[str, Dict[str, float]]] = {}
    for model in dict.fromkeys(r['model'] for r in rows):
        table[model] = {}
        for res in resolutions:
            values = [r['top1'] for r in rows if r['model'] == model and r['res'] == res]
            if values:
                table[model][res] = dict(mean=statistics.fmean(values),
                                         std=statistics.stdev(values) if len(values) > 1 else 0.0, n=len(values))
    return table


def print_table(table: Dict[str, Dict[str, Dict[str, float]]], resolutions: List[str], train_res: str) -> str:
    lines = ['| model | ' + ' | '.join(f'{r}{" (train)" if r == train_res else ""}' for r in resolutions) + ' |',
             '|---|' + '---|' * len(resolutions)]
    for model, per_res in table.items():
        cells = []
        for res in resolutions:
            cell = per_res.get(res)
            cells.append('' if cell is None else f"{cell['mean']:.2f} ± {cell['std']:.2f}")
        lines.append(f'| {model} | ' + ' | '.join(cells) + ' |')
    text = '\n'.join(lines)
    print(text)
    return text


def plot_accuracy(table: Dict[str, Dict[str, Dict[str, float]]], resolutions: List[str], train_res: str,
                  path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    def pixels(res: str) -> float:
        h, w = parse_resolution(res)
        return math.sqrt(h * w)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for model, per_res in table.items():
        xs = [pixels(r) for r in resolutions if r in per_res]
        ys = [per_res[r]['mean'] for r in resolutions if r in per_res]
        es = [per_res[r]['std'] for r in resolutions if r in per_res]
        ax.errorbar(xs, ys, yerr=es, marker='o', capsize=3, label=model)
    ax.axvline(pixels(train_res), color='gray', linestyle='--', label=f'train res {train_res}')
    ax.set_xlabel('evaluation resolution (sqrt(H x W) pixels)')
    ax.set_ylabel('top-1 accuracy (%)')
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(rows: List[Dict[str, Any]], args: argparse.Namespace, out_dir: Path, title: str) -> Dict[str, Any]:
    resolutions = [res_name(r) for r in args.eval_res]
    table = summarize(rows, resolutions)
    text = print_table(table, resolutions, res_name(args.train_res))
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = dict(rows=rows, summary=table, table_markdown=text,
                   config={k: ([res_name(x) for x in v] if isinstance(v, list) and v and isinstance(v[0], tuple)
                               else res_name(v) if isinstance(v, tuple) else v)
                           for k, v in vars(args).items() if k != 'func'})
    write_json_atomic(out_dir / 'results.json', payload)
    plot_accuracy(table, resolutions, res_name(args.train_res), out_dir / 'accuracy_vs_resolution.png', title)
    print(f'saved {out_dir / "results.json"} and {out_dir / "accuracy_vs_resolution.png"}')
    return payload


# ----------------------------------------------------------------------------------------- analyze

def spectral_statistics(model: nn.Module) -> List[Dict[str, float]]:
    """Per layer: mean amplitude sqrt(sum alpha^2 + beta^2) per head, heads with amplitude > 1,
    heads whose antisymmetric (beta) energy dominates, median |beta| / |alpha| (GOAT Table 6)."""
    rows = []
    for index, block in enumerate(model.blocks):
        prior = getattr(block.attn, 'prior', None)
        if prior is None:
            raise ValueError(f'block {index} has no GOAT prior: analyze needs a GOAT model')
        alpha = prior.alpha.detach().flatten(1).double()
        beta = prior.beta.detach().flatten(1).double()
        amplitude = (alpha.square() + beta.square()).sum(1).sqrt()
        ratio = (beta.abs() / alpha.abs().clamp_min(1e-12)).flatten()
        rows.append(dict(layer=index, mean_amplitude=amplitude.mean().item(),
                         heads_amplitude_gt_1=int((amplitude > 1).sum()),
                         heads_antisymmetric_dominant=int((beta.square().sum(1) > alpha.square().sum(1)).sum()),
                         heads=alpha.shape[0], median_beta_over_alpha=ratio.median().item()))
    return rows


def run_analyze(args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    label, model, _ = load_for_eval(args.checkpoint, args)
    stats = spectral_statistics(model)
    print('| layer | mean amplitude | heads amp > 1 | antisymmetric-dominant heads | median abs(beta)/abs(alpha) |')
    print('|---|---|---|---|---|')
    for row in stats:
        print(f"| {row['layer']} | {row['mean_amplitude']:.3f} | {row['heads_amplitude_gt_1']}/{row['heads']} | "
              f"{row['heads_antisymmetric_dominant']}/{row['heads']} | {row['median_beta_over_alpha']:.2f} |")
    res = args.analyze_res or model.patch_embed.img_size
    grid = (res[0] // model.patch_embed.patch_size[0], res[1] // model.patch_embed.patch_size[1])
    query = args.query if args.query is not None else (grid[0] // 2, grid[1] // 2)
    if not (0 <= query[0] < grid[0] and 0 <= query[1] < grid[1]):
        raise ValueError(f'query patch {query} is outside the {grid[0]}x{grid[1]} grid')
    layers = args.layers or [0, len(model.blocks) - 1]
    heads = args.heads or list(range(model.blocks[0].attn.num_heads))
    fig, axes = plt.subplots(len(layers), len(heads), figsize=(2.6 * len(heads), 2.4 * len(layers)), squeeze=False)
    coords = vision_priors.layers.grid_coords(grid)
    prefix = model.num_prefix_tokens
    q_index = prefix + query[0] * grid[1] + query[1]
    for i, layer in enumerate(layers):
        prior = model.blocks[layer].attn.prior_logits(coords).detach()
        for j, head in enumerate(heads):
            row = prior[head, q_index, prefix:].softmax(-1).reshape(grid)
            ax = axes[i][j]
            ax.imshow(row.numpy(), cmap='viridis')
            ax.scatter([query[1]], [query[0]], marker='x', color='red')
            ax.set_title(f'layer {layer} head {head}', fontsize=8)
            ax.axis('off')
    fig.suptitle(f'{label}: prior attention of query patch (row {query[0]}, col {query[1]})', fontsize=9)
    fig.tight_layout()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / 'prior_heads.png', dpi=120)
    plt.close(fig)
    write_json_atomic(out / 'spectral_statistics.json', stats)
    print(f'saved {out / "prior_heads.png"} and {out / "spectral_statistics.json"}')


# --------------------------------------------------------------------------------------------- CLI

def add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('data')
    g.add_argument('--data', default=None,
                   help='ImageNet-style folder (train/, val/ with class subfolders) or wds:FOLDER for '
                        'webdataset shards (jpg/cls); default: the built-in spatial scenes')
    g.add_argument('--train-split', default='train', help='webdataset train split (name in _info.json or '
                   'a brace pattern like "train-{000000..000009}.tar|N")')
    g.add_argument('--val-split', default='validation', help='webdataset validation split')
    g.add_argument('--num-classes', type=int, default=None, help='classes (needed for webdataset)')
    g.add_argument('--train-samples', type=int, default=16000, help='built-in scenes: training samples')
    g.add_argument('--val-samples', type=int, default=480, help='built-in scenes: validation samples')
    g.add_argument('--data-seed', type=int, default=0, help='built-in scenes: generator seed')
    g.add_argument('--task', choices=sorted(TASKS), default='clock',
                   help="built-in scenes: 'clock' (clock direction of a red disc from a white one, learnable in "
                        "a few hundred CPU updates) or 'layouts' (twelve three-part configurations, needs far "
                        "longer training)")
    g.add_argument('--crop-pct', type=float, default=0.875, help='eval transform crop fraction (real images)')
    g.add_argument('--auto-augment', default=None, help='timm auto-augment policy, e.g. rand-m9-mstd0.5')
    g.add_argument('--workers', type=int, default=0, help='data loader workers')
    g = p.add_argument_group('model')
    g.add_argument('--train-res', type=parse_resolution, default=(32, 32), help='training resolution, N or HxW')
    g.add_argument('--size-overrides', default='auto',
                   help="JSON dict of model kwargs (e.g. '{\"depth\": 6}'), 'none', or 'auto' "
                        f"(= {json.dumps(BUILTIN_OVERRIDES)} on the built-in scenes, none otherwise)")
    g.add_argument('--drop-path', type=float, default=0.0, help='stochastic depth rate')
    g = p.add_argument_group('evaluation')
    g.add_argument('--eval-res', type=parse_resolution, nargs='+', default=[(32, 32), (48, 48), (64, 64)],
                   help='evaluation resolutions, N or HxW')
    g = p.add_argument_group('optimisation')
    g.add_argument('--epochs', type=int, default=1, help='training epochs (ignored when --updates is set)')
    g.add_argument('--updates', type=int, default=0, help='total optimizer updates (overrides --epochs)')
    g.add_argument('--batch-size', type=int, default=64, help='per-process batch size')
    g.add_argument('--grad-accum', type=int, default=1, help='gradient accumulation steps')
    g.add_argument('--opt', default='adamw', help='timm optimizer name')
    g.add_argument('--lr', type=float, default=2e-3)
    g.add_argument('--weight-decay', type=float, default=0.05)
    g.add_argument('--warmup-epochs', type=int, default=0)
    g.add_argument('--mixup', type=float, default=0.0, help='mixup alpha (0 = off)')
    g.add_argument('--cutmix', type=float, default=0.0, help='cutmix alpha (0 = off)')
    g.add_argument('--smoothing', type=float, default=0.0, help='label smoothing')
    g.add_argument('--clip-grad', type=float, default=None, help='gradient norm clip')
    g.add_argument('--ema-decay', type=float, default=0.0, help='model EMA decay (0 = off)')
    g.add_argument('--amp', choices=['no', 'fp16', 'bf16'], default='no', help='mixed precision')
    g.add_argument('--cpu', action='store_true', help='force CPU even when a GPU is present')
    g = p.add_argument_group('run')
    g.add_argument('--seed', type=int, default=0)
    g.add_argument('--out', default='outputs/resolution_extrapolation', help='output folder')
    g.add_argument('--checkpoint-every', type=int, default=0, help='checkpoint every N updates (and at the end)')
    g.add_argument('--resume', action='store_true', help='continue from OUT/latest.json')
    g.add_argument('--stop-after', type=int, default=None, help='stop after N updates (simulates a kill)')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='python -m recipes.resolution_extrapolation', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest='command', required=True)
    p = sub.add_parser('train', help='train one model', formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--model', default='vit_tiny_patch16_goat_224', help='any timm-registered model name')
    add_common(p)
    p = sub.add_parser('eval', help='evaluate checkpoints / models at several resolutions',
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('sources', nargs='+', help='run folders, checkpoint folders or model names')
    add_common(p)
    p = sub.add_parser('compare', help='train + eval several models over seeds',
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--models', nargs='+', default=DEFAULT_MODELS, help='timm-registered model names')
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    add_common(p)
    p = sub.add_parser('analyze', help='plot the learned GOAT prior, print spectral statistics',
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('checkpoint', help='run or checkpoint folder of a GOAT model')
    p.add_argument('--layers', type=int, nargs='*', default=None, help='layers to plot (default: first, last)')
    p.add_argument('--heads', type=int, nargs='*', default=None, help='heads to plot (default: all)')
    p.add_argument('--query', type=int, nargs=2, default=None, metavar=('ROW', 'COL'), help='query patch')
    p.add_argument('--analyze-res', type=parse_resolution, default=None, help='grid resolution for the plot')
    add_common(p)
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if args.command == 'train':
        ckpt = run_train(args, args.model, args.seed, out)
        print(f'checkpoint: {ckpt}')
    elif args.command == 'eval':
        rows = run_eval(args, args.sources)
        report(rows, args, out, 'evaluation')
    elif args.command == 'compare':
        sources = []
        for name in args.models:
            for seed in args.seeds:
                run_dir = out / name / f'seed{seed}'
                run_train(args, name, seed, run_dir)
                sources.append(str(run_dir))
        rows = run_eval(args, sources)
        report(rows, args, out, f'trained at {res_name(args.train_res)}, {len(args.seeds)} seed(s)')
    elif args.command == 'analyze':
        run_analyze(args)


if __name__ == '__main__':
    main()
    close_distributed()
