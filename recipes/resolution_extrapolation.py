"""Resolution extrapolation (GOAT paper, Fig. 5): train at one resolution, evaluate at larger ones.

Commands (``python -m vision_priors.recipes.resolution_extrapolation COMMAND --help`` explains every option):

  train    train one registered model (ours or timm's) on the built-in scenes, an ImageNet-style
           folder (``train/``, ``val/`` with class subfolders) or webdataset shards; CPU, one GPU or
           many through ``accelerate launch``; checkpoints + ``--resume``.
  eval     evaluate checkpoints (or untrained model names) at a list of resolutions (square or
           HxW): table, JSON and a PNG plot of accuracy vs resolution.
  compare  train + eval a list of models over several seeds with one budget: mean +- spread
           table, JSON and plot. The README's main command runs this on the built-in scenes.
  analyze  for a trained GOAT model: plot the learned prior of chosen heads for a query patch
           (Fig. 1 style) and print per-layer spectral statistics (Table 6 style).

Shared flags (``recipes/cli.py``): ``--out``, ``--seed`` / ``--seeds``, ``--resume`` (refuses changed
settings), ``--stop-after``, ``--checkpoint-every``, ``--eval-every`` (top-1 at the training resolution on
the validation data; the best weights go to ``RUN/best``), ``--patience``, ``--amp``, ``--cpu``,
``--threads``, ``--num-workers`` and the optimisation flags (cosine schedule in updates, ``--warmup-frac``).

Evaluation at resolution r uses timm's eval transform for real images (resize to r / crop_pct,
centre crop r); the built-in scenes are rendered at r directly (the same scene, more patches). Training
scenes are magnified by a random 1-2x (``--scene-zoom``, the built-in scenes' random-resized crop); real
images get timm's random-resized crops.
timm's learned absolute embedding is resampled bicubically when the grid changes
(``dynamic_img_size=True``); GOAT / PoPE / RoPE models need no resampling. ``--positions`` (eval and compare)
evaluates every model twice by default: with its native positions (patch units, so offsets beyond the training
grid are extrapolated; the absolute table resampled) and with its positions interpolated onto the training grid
(``vision_priors.models.interpolate_positions``: GOAT / PoPE coordinates and LAVO's 2D window rescaled through
``ref_feat_shape``, timm's RoPE through its own). The table, ``results.json`` and the plot show both.
``--rescale-coords R`` (default 2 on the built-in scenes, off for real images) trains GOAT / PoPE / RoPE with their
patch coordinates scaled by a log-uniform factor in [1/R, R] per forward pass (DINOv3's RoPE augmentation).

Full ImageNet protocol (paper: ViT-S/16, 224 px, 150 epochs), e.g. on 8 GPUs:

  accelerate launch --num_processes 8 -m vision_priors.recipes.resolution_extrapolation compare \\
      --data /path/to/imagenet --models vit_small_patch16_224 vit_small_patch16_rope_224 \\
      vit_small_patch16_rope_mixed_224 vit_small_patch16_goat_224 vit_small_patch16_pope_224 \\
      --train-res 224 --eval-res 224 288 384 448 512 --epochs 150 --batch-size 128 --lr 1e-3 \\
      --weight-decay 0.05 --warmup-frac 0.033 --mixup 0.8 --cutmix 1.0 --smoothing 0.1 \\
      --drop-path 0.1 --amp bf16 --seeds 0 --size-overrides none --out runs/imagenet
"""
import argparse
import functools
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import timm
from timm.data import Mixup, create_dataset, create_transform, resolve_data_config
from timm.layers import build_sincos2d_pos_embed
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import named_apply
from timm.models.vision_transformer import init_weights_vit_jax
from timm.optim import create_optimizer_v2
from timm.utils import ModelEmaV3

import vision_priors  # noqa: F401  (registers our models)
from vision_priors.models import interpolate_positions, rescale_coords_kwargs
from vision_priors.optim import VISION_PRIOR_LR_SCALE, prior_param_groups

from . import cli
from .checkpoints import write_json_atomic
from .data.builtin_scenes import TASKS, RenderedScenes, SpatialScenes, check_zoom_range
from .data import image_pools
from .data.image_folders import WDS_PREFIX, StrictImages, data_kind, wds_root
from .data.image_pools import PoolImages, cifar10_pools
from .engine import (close_distributed, cosine_schedule, count_updates, evaluate_classifier, fit, make_accelerator,
                     train_loader)
from .logs import JsonlLogger
from .plotting import figure, save_figure
from .report import format_cell, group_rows, markdown_table, mean_std, write_results
from .runs import RunFolder, data_fingerprints, load_finished_run, run_settings, sweep_folders, train_sweep

DEFAULT_MODELS = [
    'vit_tiny_patch16_224',            # learned absolute embedding (timm), resampled bicubically
    'vit_small_patch16_rope_224',      # axial RoPE (timm Eva)
    'vit_small_patch16_rope_mixed_224',  # mixed (learned-frequency) RoPE (timm Eva)
    'vit_tiny_patch16_goat_224',
    'vit_tiny_patch16_pope_224',
    'vit_tiny_patch16_lavo_224',
]  # on the built-in scenes all get the same BUILTIN_OVERRIDES width / depth / patch / pooling
# The built-in experiment's small ViT: width 64 (2 heads of 32), depth 2, patch 8 (a 4 x 4 grid at 32 px,
# 8 x 8 at 64 px), global average pooling of the patch tokens (no class token) for every method; LAVO keeps
# its own 7 x 7 local window. Why these (the README's ablation): with a class token the learned absolute
# embedding never left chance (the token must learn to read positions that start at std 0.02); patch 4 tokens
# cost 4x more per update, and 250 such updates left every method near its take-off point (seed spread up to
# +-28 points), where 1,000 updates of patch-8 tokens take the same time. Layer scale starts at 1 in every
# model: timm's RoPE ViTs (Eva) come with init_values=1e-5, made for 12-block ViT-S runs of 300 epochs, which
# at depth 2 and 1,000 updates left their blocks near-silent and the model position-blind on 2 of 3 seeds
# (17 / 35 % -> 89 / 100 % with 1.0); the other models have no layer scale by default, and 1.0 is that
# function at the start. (timm drops None-valued kwargs, so "no layer scale" cannot be asked of Eva.)
BUILTIN_OVERRIDES = dict(embed_dim=64, depth=2, num_heads=2, patch_size=8, global_pool='avg', class_token=False,
                         init_values=1.0)
# Every built-in training scene is magnified by a factor drawn log-uniformly from 1-2x, capped so both discs stay
# whole in view (--scene-zoom): the scenes' version of the random-resized crops that the GOAT paper's ImageNet
# models train with. It stretches the training distances between the discs from 1.1-2.2 to 1.2-3.3 patches (the
# 4 x 4 grid's reach); at 2x the evaluation's reach 2.3-4.4, beyond any training distance for 60 % of the scenes.
# Over seeds 0-5 it brought every method's spread at 1x / 1.5x to <= 5.1 points (from up to 15.9) and at 2x to
# 1.6-8.5 (from 8.8-17.5) (README, "Scene zoom"); (1, 3) was no better than (1, 2).
BUILTIN_SCENE_ZOOM = (1.0, 2.0)
# Every training forward pass of a model with coordinate positions (GOAT, PoPE, timm's RoPE) scales the patch
# coordinates by a factor drawn log-uniformly from [1/R, R] (--rescale-coords; DINOv3's RoPE augmentation, timm's
# function): the positions' version of the zoom. On the built-in scenes R = 2 (README, "Coordinate rescale"); real
# images: off (1).
BUILTIN_RESCALE_COORDS = 2.0
EVAL_ONLY_FLAGS = ('eval_res', 'positions')  # a resumed run may change them
# How a model measures patch positions on a grid it did not train on (--positions): 'native' = its own way (patch
# units for GOAT / PoPE / RoPE / LAVO, so offsets beyond the training grid are extrapolated; a learned absolute
# table is resampled), 'interpolated' = every grid rescaled onto the training grid
# (vision_priors.models.interpolate_positions; LAVO: its 2D window and relative bias table rescaled).
POSITION_MODES = ('native', 'interpolated')
POSITION_TITLES = {'native': 'native positions (patch units: offsets beyond the training grid extrapolated; '
                             'absolute tables resampled)',
                   'interpolated': 'positions interpolated onto the training grid (ref_feat_shape)'}
WEIGHT_INITS = ('jax', 'timm')
# A run's config records its GOAT ViT's top frequency (``goat_max_freq``), which follows the training grid; runs
# stored before that record (stop 44) had 0.4 rad per patch on every grid, and are rebuilt so.
LEGACY_GOAT_MAX_FREQ = 0.4


# ------------------------------------------------------------------------------------- arguments

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


def res_name(res: Sequence[int]) -> str:
    return str(res[0]) if res[0] == res[1] else f'{res[0]}x{res[1]}'


def add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('data')
    g.add_argument('--data', type=cli.data_source(keywords=('cifar10',), schemes=('wds', 'cifar10')), default=None,
                   help='ImageNet-style folder (train/, val/ with class subfolders), wds:FOLDER for webdataset '
                        'shards (jpg/cls), cifar10 (torchvision download) or cifar10:PATH (a folder of the '
                        'python batches, or an .npz of images / labels split per class by --data-seed); '
                        'default: the built-in spatial scenes')
    g.add_argument('--train-split', default='train', help='webdataset train split (name in _info.json or '
                   'a brace pattern like "train-{000000..000009}.tar|N")')
    g.add_argument('--val-split', default='validation', help='webdataset validation split')
    g.add_argument('--num-classes', type=cli.positive_int, default=None, help='classes (needed for webdataset)')
    g.add_argument('--train-samples', type=cli.positive_int, default=16000, help='built-in scenes: training samples')
    g.add_argument('--val-samples', type=cli.positive_int, default=480, help='built-in scenes: validation samples')
    g.add_argument('--data-seed', type=cli.nonnegative_int, default=0,
                   help='built-in scenes: generator seed; cifar10:FILE.npz: the per-class train / test split')
    g.add_argument('--task', choices=sorted(TASKS), default='clock',
                   help="built-in scenes: 'clock' (clock direction of a red disc from a white one, learnable in "
                        "a few hundred CPU updates) or 'layouts' (twelve three-part configurations, needs far "
                        "longer training)")
    g.add_argument('--crop-pct', type=cli.positive_float, default=0.875,
                   help='eval transform crop fraction (real images)')
    g.add_argument('--auto-augment', default=None, help='timm auto-augment policy, e.g. rand-m9-mstd0.5')


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('model')
    g.add_argument('--train-res', type=parse_resolution, default=(32, 32), help='training resolution, N or HxW')
    g.add_argument('--size-overrides', default='auto',
                   help="JSON dict of model kwargs (e.g. '{\"depth\": 6}'), 'none', or 'auto' "
                        f"(= {json.dumps(BUILTIN_OVERRIDES)} on the built-in scenes, none otherwise)")
    g.add_argument('--drop-path', type=cli.probability, default=0.0, help='stochastic depth rate')
    g.add_argument('--abs-pos-init', choices=('sincos', 'timm'), default='sincos',
                   help="start of a learned absolute position embedding (timm's ViTs): 'sincos' = the 2D sin-cos "
                        "table of the training grid (MAE-style, still learned), 'timm' = timm's normal(0.02)")
    g.add_argument('--eval-res', type=parse_resolution, nargs='+', default=[(32, 32), (48, 48), (64, 64)],
                   help='evaluation resolutions, N or HxW')
    g.add_argument('--positions', nargs='+', choices=POSITION_MODES, default=list(POSITION_MODES),
                   help="how positions are measured at the evaluation resolutions: 'native' (patch units, "
                        "extrapolated past the training grid) and / or 'interpolated' (rescaled onto the training "
                        "grid: LAVO's window and bias table rescaled)")


def add_init_args(p: argparse.ArgumentParser) -> None:
    p.add_argument('--weight-init', choices=WEIGHT_INITS, default='jax',
                   help="start of every model's weights: 'jax' = timm's JAX-style init for every model alike "
                        "(Xavier-uniform Linear layers, LeCun-normal patch embedding, zero head; the README's "
                        "ablation), 'timm' = each model's own timm start (trunc-normal 0.02 Linear layers; "
                        "Eva's RoPE models also rescale their output projections by depth)")


def add_training_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    add_data_args(p)
    add_model_args(p)
    add_init_args(p)
    cli.add_optim_flags(p, lr=2e-3, epochs=5, warmup_frac=0.1)
    cli.add_prior_lr_flag(p, default=VISION_PRIOR_LR_SCALE)
    g = p.add_argument_group('regularisation')
    g.add_argument('--scene-zoom', type=cli.positive_float, nargs=2, default=None, metavar=('LOW', 'HIGH'),
                   help="built-in scenes: magnify each training scene's parts by a factor drawn log-uniformly from "
                        "[LOW, HIGH], capped so every part stays whole in view (the scenes' random-resized crop; "
                        f"labels unchanged); 1 1 = off; default {' '.join(map(str, BUILTIN_SCENE_ZOOM))} on the "
                        "built-in scenes (README, 'Scene zoom'), off for real images (they get timm's crops)")
    g.add_argument('--rescale-coords', type=cli.positive_float, default=None, metavar='R',
                   help="training-only: scale the patch coordinates of every forward pass by a factor drawn "
                        "log-uniformly from [1/R, R] (DINOv3's RoPE augmentation; timm's rope_rescale_coords for "
                        "its RoPE ViTs, rescale_coords for GOAT / PoPE; R >= 1, 1 = off); models without coordinate "
                        f"positions (absolute table, LAVO) train without it. Default {BUILTIN_RESCALE_COORDS:g} on "
                        "the built-in scenes (README, 'Coordinate rescale'), off for real images")
    g.add_argument('--mixup', type=cli.nonnegative_float, default=0.0, help='mixup alpha (0 = off)')
    g.add_argument('--cutmix', type=cli.nonnegative_float, default=0.0, help='cutmix alpha (0 = off)')
    g.add_argument('--smoothing', type=cli.unit_fraction, default=0.0, help='label smoothing')
    g.add_argument('--ema-decay', type=cli.unit_fraction, default=0.0,
                   help='model EMA decay (0 = off); the averaged weights are evaluated, kept as best and reported')
    g.add_argument('--ema-warmup', action='store_true',
                   help="ramp the EMA decay up as timm's --model-ema-warmup does: min(decay, 1 - (1 + step) ** -2/3)")
    cli.add_device_flags(p, batch_size=64)
    cli.add_run_flags(p, out='outputs/resolution_extrapolation', sweep=sweep,
                      default_seeds=(0, 1, 2) if sweep else (0,),
                      default_jobs=0)  # the main job: one run per CPU core at a time when there is no GPU


def build_parser() -> argparse.ArgumentParser:
    parser, add_command = cli.command_parser('vision-priors resolution', __doc__)
    p = add_command('train', 'train one model')
    p.add_argument('--model', default='vit_tiny_patch16_goat_224', help='any timm-registered model name')
    add_training_args(p, sweep=False)
    p = add_command('eval', 'evaluate checkpoints / models at several resolutions')
    p.add_argument('sources', nargs='+', help='run folders, checkpoint folders (incl. RUN/best) or model names')
    p.add_argument('--out', default='outputs/resolution_extrapolation/eval', help='folder for the table, JSON and plot')
    add_data_args(p)
    add_model_args(p)
    cli.add_device_flags(p, batch_size=64)
    p = add_command('compare', 'train + eval several models over seeds')
    p.add_argument('--models', nargs='+', default=DEFAULT_MODELS, help='timm-registered model names')
    add_training_args(p, sweep=True)
    p = add_command('analyze', 'plot the learned GOAT prior, print spectral statistics')
    p.add_argument('checkpoint', help='run or checkpoint folder of a GOAT model')
    p.add_argument('--out', default='outputs/resolution_extrapolation/analysis', help='folder for the plot and JSON')
    p.add_argument('--layers', type=cli.nonnegative_int, nargs='*', default=None,
                   help='layers to plot (default: first, last)')
    p.add_argument('--heads', type=cli.nonnegative_int, nargs='*', default=None, help='heads to plot (default: all)')
    p.add_argument('--query', type=cli.nonnegative_int, nargs=2, default=None, metavar=('ROW', 'COL'),
                   help='query patch')
    p.add_argument('--analyze-res', type=parse_resolution, default=None, help='grid resolution for the plot')
    return parser


def validate(args: argparse.Namespace) -> None:
    """Recipe-specific checks, before any folder is touched."""
    if hasattr(args, 'size_overrides'):
        size_overrides(args.size_overrides, None, 'x')
    names = [args.model] if args.command == 'train' else args.models if args.command == 'compare' else []
    for name in names:
        check_model_name(name)
    if hasattr(args, 'rescale_coords'):  # resolved here, so a run's config.json stores the factor it trained with
        args.rescale_coords = rescale_coords(args)
    if getattr(args, 'ema_warmup', False) and not args.ema_decay:
        raise ValueError('--ema-warmup ramps the model EMA up: it needs --ema-decay > 0')
    if hasattr(args, 'scene_zoom'):  # resolved here, so a run's config.json stores the range it trained with
        args.scene_zoom = scene_zoom(args)
        if args.scene_zoom != (1.0, 1.0) and data_kind(args.data) != 'builtin':
            raise ValueError('--scene-zoom magnifies the built-in scenes: real images get random-resized crops '
                             '(timm transform) instead')
    if args.command in ('train', 'compare') and data_kind(args.data) == 'wds' and args.num_classes is None:
        raise ValueError('--data wds:... needs --num-classes (webdataset shards carry no class list)')


# ------------------------------------------------------------------------------------------ data

def data_paths(data: Optional[str]) -> List[str]:
    """The folder or file ``--data`` reads (fingerprinted in a run's config, checked again by ``eval``): the image
    folder, the webdataset folder, the CIFAR-10 folder or ``.npz`` (``cifar10``: the downloaded batches); none for
    the built-in scenes (rendered in memory)."""
    kind = data_kind(data)
    if kind == 'builtin':
        return []
    if kind == 'wds':
        return [data[len(WDS_PREFIX):]]
    if kind == 'cifar10':
        prefix = image_pools.CIFAR10_PREFIX + ':'
        return ([data[len(prefix):]] if data.startswith(prefix)
                else [str(Path(image_pools.CIFAR10_DOWNLOAD_ROOT) / 'cifar-10-batches-py')])
    return [data]


def scene_zoom(args: argparse.Namespace) -> Tuple[float, float]:
    """``--scene-zoom`` checked, or its default: ``BUILTIN_SCENE_ZOOM`` on the built-in scenes, off for real images."""
    if args.scene_zoom is None:
        return BUILTIN_SCENE_ZOOM if data_kind(args.data) == 'builtin' else (1.0, 1.0)
    return check_zoom_range(args.scene_zoom)


def rescale_coords(args: argparse.Namespace) -> float:
    """``--rescale-coords`` checked (>= 1), or its default: ``BUILTIN_RESCALE_COORDS`` on the built-in scenes, 1 (off)
    for real images."""
    if args.rescale_coords is None:
        return BUILTIN_RESCALE_COORDS if data_kind(args.data) == 'builtin' else 1.0
    if args.rescale_coords < 1:
        raise ValueError(f'--rescale-coords is a factor >= 1 (scales drawn from [1/R, R]; 1 = off), '
                         f'got {args.rescale_coords:g}')
    return float(args.rescale_coords)


def builtin_dataset(split: str, args: argparse.Namespace, res: Tuple[int, int]) -> Dataset:
    if split == 'train':
        return rendered_scenes(split, args.train_samples, tuple(res), args.data_seed, args.task, scene_zoom(args))
    return rendered_scenes(split, args.val_samples, tuple(res), args.data_seed, args.task)


@functools.lru_cache(maxsize=2)
def cifar_pools(spec: str, data_seed: int):
    """(train, test) CIFAR-10 pools of ``--data cifar10[:PATH]``, read (or downloaded) once per process."""
    return cifar10_pools(spec, data_seed)


@functools.lru_cache(maxsize=8)
def rendered_scenes(split: str, num: int, res: Tuple[int, int], seed: int, task: str,
                    zoom: Tuple[float, float] = (1.0, 1.0)) -> RenderedScenes:
    """The built-in scenes rendered once per process: every run of a compare reads the same stream."""
    return RenderedScenes(SpatialScenes(split=split, num_samples=num, resolution=res, seed=seed, transform=None,
                                        task=task, zoom=zoom))


def image_transform(args: argparse.Namespace, model: nn.Module, res: Tuple[int, int], is_training: bool):
    """timm's train (random-resized crop, flip, optional auto-augment) or eval (resize + centre crop) transform.

    CIFAR-10 (32 px objects that fill the frame): crops keep at least half the image (scale 0.5-1) and the
    evaluation resizes the whole image to the resolution (crop_pct 1), so 48 / 64 px show the same image at
    1.5x / 2x."""
    mean, std = mean_std_of(model)
    cifar = data_kind(args.data) == 'cifar10'
    if is_training:
        extra: Dict[str, Any] = dict(auto_augment=args.auto_augment, **(dict(scale=(0.5, 1.0)) if cifar else {}))
    else:
        extra = dict(crop_pct=1.0 if cifar else args.crop_pct)
    return create_transform(input_size=(3, *res), is_training=is_training, mean=mean, std=std,
                            interpolation='bicubic', **extra)


def make_train_data(args: argparse.Namespace, model: nn.Module, seed: int) -> Tuple[Any, int, bool, Optional[int]]:
    """(dataset, num_classes, is_map_style, epoch_length)."""
    kind = data_kind(args.data)
    if kind == 'builtin':
        ds = builtin_dataset('train', args, args.train_res)
        return ds, ds.num_classes, True, None
    transform = image_transform(args, model, args.train_res, is_training=True)
    if kind == 'cifar10':
        ds = PoolImages(cifar_pools(args.data, args.data_seed)[0], transform)
        return ds, ds.num_classes, True, None
    if kind == 'folder':
        ds = StrictImages(Path(args.data), 'train', transform)
        return ds, ds.num_classes, True, None
    ds = create_dataset('wds/', root=wds_root(args.data, args.train_split), split=args.train_split, is_training=True,
                        batch_size=args.batch_size, transform=transform, seed=seed)
    return ds, args.num_classes, False, max(1, len(ds) // args.batch_size)


def make_eval_data(args: argparse.Namespace, model: nn.Module, res: Tuple[int, int]) -> Dataset:
    kind = data_kind(args.data)
    if kind == 'builtin':
        return builtin_dataset('val', args, res)
    transform = image_transform(args, model, res, is_training=False)
    if kind == 'cifar10':
        return PoolImages(cifar_pools(args.data, args.data_seed)[1], transform)
    if kind == 'folder':
        return StrictImages(Path(args.data), 'val', transform)
    return create_dataset('wds/', root=wds_root(args.data, args.val_split), split=args.val_split, is_training=False,
                          batch_size=args.batch_size, transform=transform)


class Normalize(nn.Module):
    """Built-in scenes come in [0, 1]; normalise with the model's mean / std on device."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.register_buffer('mean', torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer('std', torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.device)) / self.std.to(x.device)


def mean_std_of(model: nn.Module) -> Tuple[Sequence[float], Sequence[float]]:
    config = resolve_data_config(model=model)
    return config['mean'], config['std']


def eval_batches(args: argparse.Namespace, model: nn.Module, res: Tuple[int, int], accelerator):
    """Prepared (images, targets) batches of the validation data at ``res`` (built-in scenes normalised)."""
    loader = accelerator.prepare(DataLoader(make_eval_data(args, model, res), batch_size=args.batch_size,
                                            shuffle=False, num_workers=args.num_workers))
    if data_kind(args.data) != 'builtin':
        return loader
    normalize = Normalize(*mean_std_of(model))
    return ((normalize(x.to(accelerator.device)), y) for x, y in loader)


# ----------------------------------------------------------------------------------------- model

def size_overrides(text: str, data: Optional[str], name: str) -> Dict[str, Any]:
    """``--size-overrides``: 'auto' (the built-in small ViT on the built-in scenes), 'none' or a JSON dict."""
    if text == 'auto':
        if data_kind(data) != 'builtin':
            return {}
        return dict(BUILTIN_OVERRIDES)
    if text == 'none':
        return {}
    return cli.model_overrides(text, '--size-overrides')


def model_kwargs(args: argparse.Namespace, num_classes: int, name: str) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = dict(num_classes=num_classes, img_size=args.train_res, dynamic_img_size=True,
                                  drop_path_rate=args.drop_path)
    kwargs.update(size_overrides(args.size_overrides, args.data, name))
    return kwargs


def init_abs_pos_embed(model: nn.Module, mode: str) -> bool:
    """``--abs-pos-init sincos``: start a learned absolute embedding (timm ViT ``pos_embed``) from the 2D sin-cos
    table of its patch grid (temperature 10,000, as MAE); it stays a learned parameter. Returns whether it applied.

    With timm's normal(0.02) start the patch positions are nearly invisible next to the patch content, and on
    the built-in scenes the model stayed at chance (README ablation)."""
    pos_embed = getattr(model, 'pos_embed', None)
    if mode == 'timm' or not isinstance(pos_embed, nn.Parameter):
        return False
    rows, cols = model.patch_embed.grid_size
    table = build_sincos2d_pos_embed([rows, cols], pos_embed.shape[-1], device=pos_embed.device, dtype=pos_embed.dtype)
    with torch.no_grad():
        pos_embed[0, pos_embed.shape[1] - rows * cols:].copy_(table)
    return True


def init_weights(model: nn.Module, mode: str) -> None:
    """``--weight-init``: 'timm' keeps the start the model's constructor gave it; 'jax' re-initialises every
    submodule with timm's ``init_weights_vit_jax`` (Xavier-uniform Linear, LeCun-normal Conv2d, zero head;
    modules with their own ``init_weights`` / ``reset_parameters``, e.g. the GOAT prior, PoPE's phases, layer
    scale and norms, re-apply their own start), for timm's ``VisionTransformer``, its ``Eva`` RoPE models and
    ours alike.

    Why: timm's trunc-normal 0.02 is a start made for width 384-768. At the built-in experiment's width 64 the
    attention logits start about 20x smaller than at fan-in scale; the JAX start raised five of the six methods
    at every resolution and left GOAT within its spread (README, "Start scale")."""
    if mode not in WEIGHT_INITS:
        raise ValueError(f'--weight-init must be one of {WEIGHT_INITS}, got {mode!r}')
    if mode == 'jax':
        named_apply(functools.partial(init_weights_vit_jax, head_bias=0.0), model)


def check_model_name(name: str) -> None:
    if name not in timm.list_models() and name not in timm.list_models(pretrained=True):
        raise ValueError(f'unknown model {name!r}: not registered with timm (did you import vision_priors?)')


def build_model(name: str, kwargs: Dict[str, Any]) -> nn.Module:
    check_model_name(name)
    return timm.create_model(name, **kwargs)


def build_from_flags(args: argparse.Namespace, name: str, kwargs: Dict[str, Any]) -> nn.Module:
    """``name`` built with ``kwargs`` from the command's flags (:func:`model_kwargs`): a constructor that rejects
    them is a ValueError naming ``--size-overrides`` (``cli.build_or_explain``), not a bare error from timm."""
    check_model_name(name)
    return cli.build_or_explain(lambda: build_model(name, kwargs), '--size-overrides', args.size_overrides,
                                f'the {name} model (with --train-res {res_name(args.train_res)}, --drop-path '
                                f'{args.drop_path:g})')


def check_resolution(model: nn.Module, res: Tuple[int, int], name: str) -> None:
    patch = model.patch_embed.patch_size
    if res[0] % patch[0] or res[1] % patch[1]:
        raise ValueError(f'resolution {res_name(res)} is not divisible by the patch size '
                         f'{patch[0]}x{patch[1]} of {name}; choose multiples of {patch[0]}')


# ------------------------------------------------------------------------------------------ step

def make_loss_and_transform(args: argparse.Namespace, num_classes: int, model: nn.Module):
    """(loss_fn, batch_transform): timm Mixup / CutMix with soft targets, label smoothing or plain CE;
    the built-in scenes are normalised on device."""
    mixup = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                      num_classes=num_classes)
        loss_fn: nn.Module = SoftTargetCrossEntropy()
    elif args.smoothing > 0:
        loss_fn = LabelSmoothingCrossEntropy(args.smoothing)
    else:
        loss_fn = nn.CrossEntropyLoss()
    normalize = Normalize(*mean_std_of(model)) if data_kind(args.data) == 'builtin' else None

    def batch_transform(images: torch.Tensor, targets: torch.Tensor):
        if normalize is not None:
            images = normalize(images)
        if mixup is not None:
            images, targets = mixup(images, targets)
        return images, targets

    return loss_fn, batch_transform


# ----------------------------------------------------------------------------------------- train

def run_train(args: argparse.Namespace, name: str, seed: int, out_dir: Path, resume: bool) -> Path:
    """Train ``name`` with ``seed`` into ``out_dir``; returns the final checkpoint folder."""
    folder = RunFolder(out_dir, resume)
    accelerator = make_accelerator(seed, mixed_precision=args.amp, grad_accum=args.grad_accum, cpu=args.cpu)
    probe = build_from_flags(args, name, model_kwargs(args, 10, name))
    check_resolution(probe, args.train_res, name)
    train_data, num_classes, map_style, epoch_length = make_train_data(args, probe, seed)
    kwargs = dict(model_kwargs(args, num_classes, name), **rescale_coords_kwargs(probe, args.rescale_coords))
    model = build_from_flags(args, name, kwargs)
    init_weights(model, args.weight_init)
    init_abs_pos_embed(model, args.abs_pos_init)
    config = dict(model=name, model_kwargs=kwargs, seed=seed, data=args.data, data_kind=data_kind(args.data),
                  args=run_settings(args), data_fingerprint=data_fingerprints(data_paths(args.data)),
                  goat_max_freq=getattr(model, 'goat_max_freq', None))
    if map_style:
        loader = train_loader(train_data, args.batch_size, seed, args.num_workers)
    else:  # webdataset: split per rank by timm's reader, never re-split by prepare
        loader = DataLoader(train_data, batch_size=args.batch_size, num_workers=args.num_workers, drop_last=True)
    total_updates = count_updates(args.updates, args.epochs, epoch_length or len(loader), args.grad_accum)
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                                    param_group_fn=functools.partial(prior_param_groups, weight_decay=args.weight_decay,
                                                                     lr_scale=args.prior_lr_scale))
    scheduler = cosine_schedule(optimizer, args.lr, total_updates, args.warmup_frac)
    if map_style:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    ema = (ModelEmaV3(accelerator.unwrap_model(model), decay=args.ema_decay, use_warmup=args.ema_warmup)
           if args.ema_decay else None)
    loss_fn, batch_transform = make_loss_and_transform(args, num_classes, accelerator.unwrap_model(model))
    evaluate = None
    if args.eval_every:
        def evaluate() -> Dict[str, float]:  # the EMA's averaged weights when there is one: they are the result
            evaluated = model if ema is None else ema.module
            batches = eval_batches(args, accelerator.unwrap_model(evaluated), args.train_res, accelerator)
            return evaluate_classifier(evaluated, batches, accelerator)

    # the first write: loader, optimizer, schedule and evaluation data are built (a bad input has failed)
    folder.commit(config, may_change=EVAL_ONLY_FLAGS, write=accelerator.is_main_process)
    logger = JsonlLogger(out_dir / 'log.jsonl', enabled=accelerator.is_main_process)
    logger.log(event='start', model=name, seed=seed, total_updates=total_updates,
               processes=accelerator.num_processes, device=str(accelerator.device))
    result = fit(accelerator, model, optimizer, scheduler, loader, loss_fn, total_updates, out_dir,
                 batch_transform=batch_transform, ema=ema, clip_grad=args.clip_grad,
                 checkpoint_every=args.checkpoint_every,
                 keep_checkpoints=args.keep_checkpoints, resume=resume, stop_after=args.stop_after,
                 log_every=args.log_every, logger=logger, epoch_length=epoch_length, eval_every=args.eval_every,
                 evaluate=evaluate, best_metric='top1' if evaluate else None, best_mode='max', patience=args.patience)
    logger.log(event='end', **{k: str(v) for k, v in result.items()})
    return Path(result['checkpoint'])


# ------------------------------------------------------------------------------------------ eval

def load_for_eval(source: str, args: argparse.Namespace,
                  reads: Sequence[str] = ()) -> Tuple[str, nn.Module, Dict[str, Any]]:
    """A run folder, checkpoint folder or ``best`` folder, or a model name -> (label, model, config).

    ``reads``: the data paths the command reads (``data_paths(--data)`` of ``eval``, which evaluates on its own
    ``--data``): a run's stored fingerprint of one of them must match (``load_finished_run``); others are not read."""
    if Path(source).exists():
        run = load_finished_run(Path(source), 'resolution_extrapolation', reads=reads)
        kwargs = dict(run.config['model_kwargs'], img_size=tuple(run.config['model_kwargs']['img_size']))
        model = build_model(run.config['model'], kwargs)
        trained_max_freq = run.config.get('goat_max_freq', LEGACY_GOAT_MAX_FREQ)
        if getattr(model, 'goat_max_freq', None) not in (None, trained_max_freq):  # the run's ladder, not today's
            attn_kwargs = dict(kwargs.get('attn_kwargs') or {}, max_freq=trained_max_freq)
            model = build_model(run.config['model'], dict(kwargs, attn_kwargs=attn_kwargs))
        model.load_state_dict(run.state_dict)
        return run.config['model'], model, run.config
    if source in timm.list_models():
        builtin = data_kind(args.data) == 'builtin'
        kwargs = model_kwargs(args, args.num_classes or (len(TASKS[args.task]) if builtin else 1000), source)
        return source, build_from_flags(args, source, kwargs), dict(model=source, model_kwargs=kwargs)
    raise FileNotFoundError(f'{source!r} is neither a checkpoint / run folder nor a registered model name')


def run_eval(args: argparse.Namespace, sources: Sequence[str]) -> List[Dict[str, Any]]:
    """Top-1 of every source at every ``--eval-res``, once per ``--positions`` mode (native first)."""
    accelerator = make_accelerator(0, mixed_precision=args.amp, cpu=args.cpu)
    rows = []
    for source in sources:
        label, model, config = load_for_eval(source, args, reads=data_paths(args.data))
        for res in args.eval_res:
            check_resolution(model, res, label)
        train_grid = tuple(model.patch_embed.grid_size)  # the grid of the training resolution
        model = accelerator.prepare(model)
        for positions in [mode for mode in POSITION_MODES if mode in args.positions]:
            if positions == 'interpolated':
                try:  # in place, after the native pass
                    interpolate_positions(accelerator.unwrap_model(model), train_grid)
                except ValueError as error:
                    accelerator.print(f'{label} seed={config.get("seed")}: evaluated with native positions only '
                                      f'({error})')
                    continue
            for res in args.eval_res:
                batches = eval_batches(args, accelerator.unwrap_model(model), res, accelerator)
                metrics = evaluate_classifier(model, batches, accelerator)
                rows.append(dict(source=source, model=label, seed=config.get('seed'), res=res_name(res),
                                 positions=positions, **metrics))
                accelerator.print(f'{label} seed={config.get("seed")} @ {res_name(res)} ({positions} positions): '
                                  f'top1 {metrics["top1"]:.2f}')
    return rows


# ---------------------------------------------------------------------------------------- report

def summarize(rows: List[Dict[str, Any]], resolutions: List[str]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """model -> res -> {mean, std, n} of top-1 over seeds."""
    table: Dict[str, Dict[str, Dict[str, float]]] = {}
    for model, mine in group_rows(rows, 'model').items():
        per_res = group_rows(mine, 'res')
        table[model] = {res: mean_std(r['top1'] for r in per_res[res]) for res in resolutions if res in per_res}
    return table


def format_table(table: Dict[str, Dict[str, Dict[str, float]]], resolutions: List[str], train_res: str) -> str:
    header = ['model'] + [f'{r}{" (train)" if r == train_res else ""}' for r in resolutions]
    return markdown_table(header, [[model] + [format_cell(per_res[r]) if r in per_res else '' for r in resolutions]
                                   for model, per_res in table.items()])


def plot_accuracy(tables: Dict[str, Dict[str, Dict[str, Dict[str, float]]]], resolutions: List[str],
                  train_res: str, path: Path, title: str) -> None:
    """One panel per positions mode: top-1 against resolution, one line per model, seed std as error bars."""
    def pixels(res: str) -> float:
        h, w = parse_resolution(res)
        return math.sqrt(h * w)

    fig, axes = figure(1, len(tables), size=(6.4 * len(tables), 4.2), sharey=True)
    for ax, (positions, table) in zip(axes[0], tables.items()):
        for model, per_res in table.items():
            shown = [r for r in resolutions if r in per_res]
            ax.errorbar([pixels(r) for r in shown], [per_res[r]['mean'] for r in shown],
                        yerr=[per_res[r]['std'] for r in shown], marker='o', capsize=3, label=model)
        ax.axvline(pixels(train_res), color='gray', linestyle='--', label=f'train res {train_res}')
        ax.set_xlabel('evaluation resolution (sqrt(H x W) pixels)')
        ax.set_ylabel('top-1 accuracy (%)')
        ax.set_title(f'{title}\n{positions} positions', fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def report(rows: List[Dict[str, Any]], args: argparse.Namespace, out_dir: Path, title: str) -> Dict[str, Any]:
    """A table per positions mode (printed, in results.json and the plot); ``summary`` is the first mode's."""
    resolutions = [res_name(r) for r in args.eval_res]
    by_mode = group_rows(rows, 'positions')
    tables = {mode: summarize(by_mode[mode], resolutions) for mode in POSITION_MODES if mode in by_mode}
    text = '\n\n'.join(f'{POSITION_TITLES[mode]}:\n\n{format_table(table, resolutions, res_name(args.train_res))}'
                        for mode, table in tables.items())
    print(text)
    summary = next(iter(tables.values()), {})
    results = write_results(out_dir, rows=rows, summary=summary, summaries=tables, table_markdown=text, args=args)
    plot_accuracy(tables, resolutions, res_name(args.train_res), out_dir / 'accuracy_vs_resolution.png', title)
    print(f'saved {results} and {out_dir / "accuracy_vs_resolution.png"}')
    return dict(rows=rows, summary=summary, summaries=tables, table_markdown=text)


# --------------------------------------------------------------------------------------- analyze

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
    if not Path(args.checkpoint).exists():
        raise FileNotFoundError(f'{args.checkpoint} does not exist (expected a GOAT run or checkpoint folder)')
    label, model, _ = load_for_eval(args.checkpoint, args)
    stats = spectral_statistics(model)
    print(markdown_table(['layer', 'mean amplitude', 'heads amp > 1', 'antisymmetric-dominant heads',
                          'median abs(beta)/abs(alpha)'],
                         [[r['layer'], f"{r['mean_amplitude']:.3f}", f"{r['heads_amplitude_gt_1']}/{r['heads']}",
                           f"{r['heads_antisymmetric_dominant']}/{r['heads']}", f"{r['median_beta_over_alpha']:.2f}"]
                          for r in stats]))
    res = args.analyze_res or model.patch_embed.img_size
    grid = (res[0] // model.patch_embed.patch_size[0], res[1] // model.patch_embed.patch_size[1])
    query = args.query if args.query is not None else (grid[0] // 2, grid[1] // 2)
    if not (0 <= query[0] < grid[0] and 0 <= query[1] < grid[1]):
        raise ValueError(f'query patch {query} is outside the {grid[0]}x{grid[1]} grid')
    layers = args.layers or [0, len(model.blocks) - 1]
    heads = args.heads or list(range(model.blocks[0].attn.num_heads))
    fig, axes = figure(len(layers), len(heads), size=(2.6 * len(heads), 2.4 * len(layers)))
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
    out = Path(args.out)
    save_figure(fig, out / 'prior_heads.png')
    write_json_atomic(out / 'spectral_statistics.json', stats)
    print(f'saved {out / "prior_heads.png"} and {out / "spectral_statistics.json"}')


# ------------------------------------------------------------------------------------------ main

def dispatch(args: argparse.Namespace) -> Any:
    out = Path(args.out)
    if args.command == 'train':
        ckpt = run_train(args, args.model, args.seed, out, args.resume)
        print(f'checkpoint: {ckpt}')
        return dict(checkpoint=str(ckpt))
    if args.command == 'eval':
        return report(run_eval(args, args.sources), args, out, 'evaluation')
    if args.command == 'analyze':
        return run_analyze(args)
    runs = sweep_folders(out, args.models, args.seeds, args.resume)
    train_sweep(run_train, args, runs)
    rows = run_eval(args, [str(run_dir) for _, _, run_dir in runs])
    return report(rows, args, out, f'trained at {res_name(args.train_res)}, {len(args.seeds)} seed(s)')


def main(argv: Optional[List[str]] = None) -> Any:
    return cli.run_main(build_parser(), dispatch, argv, validate)


if __name__ == '__main__':
    main()
    close_distributed()
