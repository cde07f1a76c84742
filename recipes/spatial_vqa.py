"""CIFAR scan-order spatial VQA (GOAT paper, Sec. 6, Tables 9-10): canonical 2D coordinates vs sequence positions.

Commands (``python -m vision_priors.recipes.spatial_vqa COMMAND --help`` explains every option):

  train    train one positional method (nope, rope, goat, pope) on scenes in the training scan orders;
           CPU, one GPU or many through ``accelerate launch``; atomic checkpoints + ``--resume``.
  eval     evaluate run folders on test scenes in seen and unseen scan orders: answer NLL and exact
           answer accuracy per question type and per scan order; table, JSON and PNG plot.
  compare  train + eval several methods over seeds with one budget: mean +- spread tables, JSON (with
           the config and seeds) and a PNG plot.

The paper gives only "four CIFAR-10 images on a canonical 2x2 grid; test scan orders unseen during
training; 50k / 10k train / test scenes; answer-only spatial questions; image tokens use 2D
coordinates, text uses 1D positions". Everything else below is this recipe's own protocol.

Scenes. Four 32x32 images of four *distinct* classes on a 2x2 grid (a 64x64 scene): quadrants
top-left, top-right, bottom-left, bottom-right. Distinct classes make every question unambiguous (each
named class occurs exactly once). Training scenes draw their images from the train pool, test scenes
from a disjoint test pool, so no test image is ever seen in training. A scene's layout (classes,
images, quadrants) is fixed by (data seed, scene index); training scenes get a new scan order,
question arguments and horizontal flips of the four images every epoch (``PerSampleSeeds``: a
function of (seed, epoch, index), so a resumed run sees the same batches).

Tokens. The scene is cut into p x p patches (``--patch-size``, default 8: an 8x8 grid of 64 patches, 16
per image; p must divide 32 so no patch straddles two images). Each patch token carries its canonical
(x, y) patch coordinate on the whole scene (x = column, y = row), whatever the scan order. The *scan
order* is the order in which patches are laid into the token sequence. Orders (``SCAN_ORDERS``):

  quad_row, quad_col, quad_snake, quad_reverse   image blocks in reading order TL, TR, BL, BR; inside
      each block row-major / column-major / boustrophedon / reversed row-major   -> default TRAIN orders
  row_major, column_major, snake, reverse        over the whole scene (the images interleave)
  quad_blocks_col                                 blocks TL, BL, TR, BR, row-major inside
  hilbert, spiral, diagonal                       Hilbert curve, clockwise spiral from the outside,
                                                  JPEG-style zig-zag over anti-diagonals
                                                  -> these eight are the default held-out TEST orders

Why this split: every training order puts image q in the same sequence span, so a model with sequence
positions (rope) *can* locate the images in the seen orders (its best case); the held-out orders lay
the same patches out differently (interleaved rows or columns, another block order, curves). Seen and
unseen sets are disjoint (checked). ``--train-orders`` / ``--test-orders`` choose others.

Questions (one of each type per scene, answer = one token; question tokens ``'?'``-padded to T = 3):

  what  <position> ?     -> a class              (chance 10 %; 25 % knowing only which classes are present)
  where <class> ?        -> a position           (chance 25 %)
  left  <class a> <class b> -> yes / no: is a left of b? asked only for a pair in different columns
  above <class a> <class b> -> yes / no: is a above b? asked only for a pair in different rows (50 %)

Each question is its own segment after the image tokens (1D positions restart at 0; it attends to all
image tokens and causally to its own tokens), so the four answers are independent predictions sharing
one pass over the image (``vision_priors.models.spatial_vqa``). Loss: mean cross-entropy of the four
answer tokens over the whole vocabulary. Metrics on the answer only: answer NLL (nats) and exact answer
accuracy (argmax = answer).

Evaluation. Every test scene is evaluated twice with the same questions: once in a seen (training)
order and once in an unseen order (scene i gets order i mod K of each list), so seen / unseen is a
paired comparison; per-order numbers are over the scenes assigned to that order.

Models. One transformer, one budget (width, depth, heads, MLP, optimiser, updates); only the positional
method changes (``--method``): nope, rope (1D over the sequence index, timm's rotary helpers), goat
(2D axis-wise prior on canonical coordinates, text at (c + t, c + t)), pope (2D phases likewise).
Image tokens attend bidirectionally among themselves (``--image-attention prefix``, default), so goat,
pope and nope are exactly invariant to the scan order (tested); ``causal`` is available.
``--arch fusion`` (``compare --archs single fusion``) swaps the single transformer for a timm ViT image
encoder (goat, pope or lavo, by name) and a question decoder whose blocks cross-attend to the image tokens
(``--cross-attn softmax | lavo``, or the positional ``goat`` / ``pope`` with the same ``--method``: question tokens at
the single-stream model's text coordinates (c + t, c + t) cross-attend to the patches' canonical coordinates through
the GOAT prior / PoPE phases; ``vision_priors.models.spatial_vqa_fusion``); runs are labelled
``<method>-fusion-<cross-attn>``. ``compare`` pairs a positional cross-attention only with its own method.
Fusion runs default to a warm-up over half the updates and, with a content cross-attention, rotary image
positions (``run_args``; with the single-stream model's 5 % warm-up every fusion model stalled at the
position-blind level, and LAVO's mean-only memory cancels added sin / cos positions: README), with 8 LAVO
slots per head (``--cross-slots``).
``--prior-lr-scale`` (default 10) multiplies the learning rate of the positional-prior parameters (GOAT
alpha, beta, key default; PoPE delta; rope / nope have none; ``vision_priors.optim.prior_param_groups``).
GOAT's prior starts with ``--goat-prior-init offsets`` in the single-stream model (the default; fusion: zero):
each head a bump at its own 2D key offset. From a zero start the prior is uniform (the bidirectional image part is
permutation-equivariant), and the diagonal text coordinates plus the scenes' x <-> y symmetry keep its x and y
halves equal, a prior that cannot tell top-right from bottom-left; the seed then decided how far GOAT got (README
ablation: zero 63.7 +- 19.6 %, offsets 90.6 +- 10.8 % over three seeds, RoPE 81.8 % on seen orders).

Data (``--data``; readers in ``vision_priors.recipes.data.image_pools``, scenes in
``vision_priors.recipes.data.vqa_scenes``): a folder with CIFAR-10's python batches (``data_batch_1..5``,
``test_batch``, ``batches.meta``; read directly, no download, no checksum; train pool = the five data batches, test
pool = ``test_batch``), an ``.npz`` with ``images`` (N, 32, 32, 3) uint8 and ``labels`` (split per class,
deterministically by ``--data-seed``, into disjoint train / test pools, ``--npz-test-fraction``), or
nothing: built-in procedural 32x32 images in 10 classes (a colour and a texture per class, random
brightness, texture phase and noise), deterministic per ``--data-seed``, so the recipe runs anywhere.
Pixels are normalised with CIFAR-10's channel mean / std for every source.

Training evaluation: ``--eval-every N`` evaluates answer NLL / accuracy on validation scenes (train pool,
another layout stream, training orders; ``--val-scenes``), keeps the weights of the lowest NLL in
``RUN/best`` and, with ``--patience``, stops early. ``eval`` accepts ``RUN/best`` like any checkpoint.

Small CPU run on the built-in images (about 3 minutes per method on one busy core):

  python -m vision_priors.recipes.spatial_vqa compare --train-scenes 20000 --test-scenes 1000 --updates 900 \
      --batch-size 32 --patch-size 16 --embed-dim 128 --depth 2 --num-heads 4 --lr 2e-3 --threads 1 --cpu

Paper-scale protocol on real CIFAR-10 (e.g. on a GPU):

  python -m vision_priors.recipes.spatial_vqa compare --data /path/to/cifar-10-batches-py --train-scenes 50000 \\
      --test-scenes 10000 --epochs 30 --batch-size 128 --seeds 0 1 2 --out runs/spatial_vqa
"""
import argparse
import functools
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader
from timm.optim import create_optimizer_v2

from vision_priors.layers.goat import PRIOR_INITS
from vision_priors.optim import VISION_PRIOR_LR_SCALE, prior_param_groups
from vision_priors.models.spatial_vqa import (IMAGE_ATTENTION, POS_METHODS, VQA_GOAT_DEFAULTS, SpatialVQATransformer,
                                             count_parameters)
from vision_priors.models.multimodal import CONTENT_CROSS_ATTENTIONS, CROSS_ATTENTIONS, POSITIONAL_CROSS_ATTENTIONS
from vision_priors.models.spatial_vqa_fusion import FUSION_METHODS, IMAGE_POS, SpatialVQAFusion

from . import cli
from .data.vqa_scenes import (DEFAULT_TEST_ORDERS, DEFAULT_TRAIN_ORDERS, ORDER_NAMES, POSITION_BLIND_ACCURACY,
                              QUESTION_LEN, QUESTION_TYPES, SCENE_SIZE, build_sets, check_orders, check_patch_size)
from .engine import close_distributed, cosine_schedule, count_updates, fit, make_accelerator, train_loader
from .logs import JsonlLogger
from .plotting import figure, save_figure
from .report import format_cell, group_rows, mean_std, write_results
from .runs import RunFolder, data_fingerprints, load_finished_run, run_settings, sweep_folders, train_sweep

# evaluation-only flags: a resumed run may change them
EVAL_ONLY_FLAGS = ('test_scenes', 'test_orders')
ARCHS = ('single', 'fusion')  # one transformer over image + text, or image encoder + cross-attending decoder
FUSION_CROSS_SLOTS = 8  # LAVO cross-attention slots per head (README: spatial VQA fusion, rotary image positions)


def model_name(method: str, arch: str = 'single', cross_attn: str = 'softmax') -> str:
    """Run / table label: the method for the single-stream model, '<method>-fusion-<cross_attn>' otherwise."""
    return method if arch == 'single' else f'{method}-fusion-{cross_attn}'


def fusion_cross_attns(method: str, cross_attns: Sequence[str]) -> List[str]:
    """The cross-attentions a fusion model with encoder ``method`` runs: every content one, a positional one
    ('goat', 'pope') only with the same method."""
    return [c for c in cross_attns if c not in POSITIONAL_CROSS_ATTENTIONS or c == method]


def parse_model_name(name: str) -> tuple:
    """(method, arch, cross_attn) of a ``model_name`` label."""
    if '-fusion-' in name:
        method, cross_attn = name.split('-fusion-')
        return method, 'fusion', cross_attn
    return name, 'single', None


# ------------------------------------------------------------------------------------- arguments

def add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('data')
    g.add_argument('--data', type=cli.location, default=None,
                   help='CIFAR-10 python-batch folder (data_batch_1..5, test_batch, batches.meta), an .npz with '
                        'images (N, 32, 32, 3) uint8 + labels (split into disjoint pools), or nothing for the '
                        'built-in procedural images')
    g.add_argument('--train-scenes', type=cli.positive_int, default=50000, help='training scenes')
    g.add_argument('--val-scenes', type=cli.positive_int, default=1000,
                   help='validation scenes for --eval-every (train pool, another layout stream, training orders)')
    g.add_argument('--test-scenes', type=cli.positive_int, default=10000,
                   help='test scenes (each evaluated in one seen and one unseen scan order)')
    g.add_argument('--data-seed', type=cli.nonnegative_int, default=0,
                   help='scene layouts, npz split and built-in images')
    g.add_argument('--npz-test-fraction', type=cli.open_fraction, default=0.2,
                   help='share of each class in the npz test pool')
    g.add_argument('--synthetic-per-class', type=cli.positive_int, nargs=2, default=(500, 100),
                   metavar=('TRAIN', 'TEST'),
                   help='built-in images per class in the train / test pools')
    g.add_argument('--patch-size', type=cli.positive_int, default=8,
                   help='patch side p (divides 32): (64 / p)^2 image tokens')
    g.add_argument('--train-orders', nargs='+', default=DEFAULT_TRAIN_ORDERS, choices=ORDER_NAMES,
                   help='scan orders used in training (and for the "seen" evaluation)')
    g.add_argument('--test-orders', nargs='+', default=DEFAULT_TEST_ORDERS, choices=ORDER_NAMES,
                   help='held-out scan orders (the "unseen" evaluation); disjoint from --train-orders')
    g.add_argument('--no-flip', action='store_true', help='no random horizontal flips of the images in training')


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('model (the same for every method)')
    g.add_argument('--embed-dim', type=cli.positive_int, default=128)
    g.add_argument('--depth', type=cli.positive_int, default=4)
    g.add_argument('--num-heads', type=cli.positive_int, default=4)
    g.add_argument('--mlp-ratio', type=cli.positive_float, default=4.0)
    g.add_argument('--goat-modes', type=cli.positive_int, default=2,
                   help='GOAT Fourier modes R per axis (d_p = 4R + 2)')
    g.add_argument('--goat-prior-init', choices=PRIOR_INITS, default=None,
                   help='GOAT prior initialisation (paper Table 5): zero (uniform), random (seeded), alibi '
                        '(recency-like decay with distance), offsets (each head a bump at its own 2D key offset; '
                        'default for --arch single, README ablation); default for --arch fusion: zero (its '
                        'question decoder has 1D GOAT self-attention)')
    g.add_argument('--image-attention', choices=IMAGE_ATTENTION, default='prefix',
                   help='prefix: image tokens attend bidirectionally (scan-order invariance for goat / pope / '
                        'nope); causal: causal in scan order')
    g.add_argument('--drop-path', type=cli.probability, default=0.0, help='stochastic depth rate')
    g.add_argument('--image-pos', choices=IMAGE_POS, default=None,
                   help='fusion only: sincos adds fixed 2D sin / cos features of the canonical patch coordinates to '
                        'the patch embeddings; rotary turns the encoded image tokens by axial angles of their '
                        'coordinates before the cross-attention (a mean over them, as LAVO\'s memory, then keeps '
                        'where things are); default: rotary with a content cross-attention (softmax, lavo: without '
                        'image positions their keys carry no position), none with a positional one (goat, pope)')
    g.add_argument('--cross-slots', type=cli.positive_int, default=FUSION_CROSS_SLOTS,
                   help='fusion with --cross-attn lavo: memory slots r per head of the LAVO cross-attention (capped '
                        'at the head width; the README\'s ablation picked 8 of 4 / 8 / 32 at heads of 32)')
    cli.add_prior_lr_flag(g, default=VISION_PRIOR_LR_SCALE)


def add_training_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    add_data_args(p)
    add_model_args(p)
    cli.add_optim_flags(p, lr=1e-3, epochs=10, warmup_frac=None, clip_grad=1.0,
                        warmup_help='linear warm-up over this share of the updates (default: 0.05 for --arch '
                                    'single, 0.5 for fusion, whose encoder + decoder stall at the position-blind '
                                    'level after a short warm-up: README)')
    cli.add_device_flags(p, batch_size=64)
    cli.add_run_flags(p, out='outputs/spatial_vqa' + ('' if sweep else '/run'), sweep=sweep)


def build_parser() -> argparse.ArgumentParser:
    parser, add_command = cli.command_parser('vision-priors vqa', __doc__)
    p = add_command('train', 'train one positional method')
    p.add_argument('--method', choices=POS_METHODS, default='goat', help='how position enters attention')
    p.add_argument('--arch', choices=ARCHS, default='single',
                   help='single: one transformer over image + question tokens; fusion: a timm ViT image encoder '
                        f'(--method in {FUSION_METHODS}) and a question decoder cross-attending to the image tokens')
    p.add_argument('--cross-attn', choices=CROSS_ATTENTIONS, default='softmax',
                   help='fusion only: the decoder\'s cross-attention (softmax, or LAVO: linear in image tokens; goat / '
                        'pope: positional, text at (c + t, c + t) vs patch coordinates, with the same --method)')
    add_training_args(p, sweep=False)
    p = add_command('eval', 'evaluate run folders on seen and unseen scan orders')
    p.add_argument('runs', nargs='+', help='run folders, their checkpoint folders or their best/ folders')
    p.add_argument('--out', default='outputs/spatial_vqa/eval', help='folder for results.json and the plot')
    p.add_argument('--data', type=cli.location, default=None,
                   help="override the run's data source (CIFAR folder or .npz)")
    p.add_argument('--test-scenes', type=cli.positive_int, default=None,
                   help="override the run's number of test scenes")
    cli.add_device_flags(p, batch_size=64)
    p = add_command('compare', 'train + eval several methods over seeds')
    p.add_argument('--methods', nargs='+', choices=POS_METHODS, default=list(POS_METHODS))
    p.add_argument('--archs', nargs='+', choices=ARCHS, default=['single'],
                   help='architectures to compare; fusion runs one model per --cross-attns entry')
    p.add_argument('--cross-attns', nargs='+', choices=CROSS_ATTENTIONS, default=list(CONTENT_CROSS_ATTENTIONS),
                   help='fusion cross-attentions to compare (goat / pope run with the same method only)')
    add_training_args(p, sweep=True)
    return parser


def validate(args: argparse.Namespace) -> None:
    """Recipe-specific checks, before any folder is touched."""
    if args.command == 'eval':
        return
    check_patch_size(args.patch_size)
    fusion = args.arch == 'fusion' if args.command == 'train' else 'fusion' in args.archs
    methods = [args.method] if args.command == 'train' else args.methods
    if fusion and any(m not in FUSION_METHODS for m in methods):
        raise ValueError(f'--arch fusion needs --method(s) in {FUSION_METHODS} (the ViT image encoder), got {methods}')
    if fusion:
        cross_attns = [args.cross_attn] if args.command == 'train' else args.cross_attns
        for c in cross_attns:
            if c in POSITIONAL_CROSS_ATTENTIONS and c not in methods:
                raise ValueError(f'--cross-attn {c} is positional and needs --method {c} (the same method in the '
                                 f'image encoder), got {methods}')
    if not fusion and args.image_pos not in (None, 'none'):
        raise ValueError('--image-pos is an option of --arch fusion (the single-stream model has no image encoder)')
    if fusion and 'goat' in methods and args.goat_prior_init == 'offsets':
        raise ValueError("--goat-prior-init offsets is a 2D start; --arch fusion also builds GOAT's 1D "
                         'question-decoder self-attention from it: use zero, random or alibi with --arch fusion')
    if fusion and args.image_attention != 'prefix':
        raise ValueError('--arch fusion encodes the image bidirectionally: --image-attention must be prefix')
    check_orders(args.train_orders, args.test_orders, (SCENE_SIZE // args.patch_size,) * 2)


# ------------------------------------------------------------------------------------------ data

def data_config(args: argparse.Namespace) -> Dict[str, Any]:
    """Everything that fixes the data of a run (saved in config.json, reused by ``eval``)."""
    return dict(data=args.data, data_seed=args.data_seed, npz_test_fraction=args.npz_test_fraction,
                synthetic_per_class=list(args.synthetic_per_class), train_scenes=args.train_scenes,
                val_scenes=args.val_scenes, test_scenes=args.test_scenes, patch_size=args.patch_size,
                train_orders=list(args.train_orders), test_orders=list(args.test_orders), flip=not args.no_flip)


# ----------------------------------------------------------------------------------------- model

def model_config(args: argparse.Namespace, name: str, vocab_size: int) -> Dict[str, Any]:
    """The model's constructor arguments for the ``model_name`` label ``name``."""
    args = run_args(args, name)
    method, arch, cross_attn = parse_model_name(name)
    grid = SCENE_SIZE // args.patch_size
    cfg = dict(pos_method=method, vocab_size=vocab_size, patch_dim=3 * args.patch_size ** 2,
               grid_size=[grid, grid], question_len=QUESTION_LEN, embed_dim=args.embed_dim, depth=args.depth,
               num_heads=args.num_heads, mlp_ratio=args.mlp_ratio, goat_modes=args.goat_modes,
               drop_path_rate=args.drop_path, goat_kwargs=dict(prior_init=args.goat_prior_init))
    if arch == 'fusion':
        slots = {'cross_slots': args.cross_slots} if cross_attn == 'lavo' else {}
        return dict(cfg, arch='fusion', cross_attn=cross_attn, image_pos=args.image_pos, **slots)
    return dict(cfg, image_attention=args.image_attention)


# per-architecture defaults of flags whose parsed default is None (resolved per run, stored resolved in config.json)
ARCH_WARMUP_FRAC = {'single': 0.05, 'fusion': 0.5}


def run_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """``args`` for the run of model label ``name``: ``--goat-prior-init``, ``--warmup-frac`` and ``--image-pos`` left
    at their default get the architecture's value. Single stream: the 'offsets' start (``VQA_GOAT_DEFAULTS``), 0.05,
    none. Fusion: zero (its 1D decoder self-attention takes no 2D start), a warm-up over half the updates, and
    rotary image positions for a content cross-attention. Other flags are unchanged; run configs store the
    resolved values."""
    _, arch, cross_attn = parse_model_name(name)
    resolved = argparse.Namespace(**vars(args))
    if getattr(args, 'goat_prior_init', 'zero') is None:
        resolved.goat_prior_init = 'zero' if arch == 'fusion' else VQA_GOAT_DEFAULTS['prior_init']
    if getattr(args, 'warmup_frac', 0.0) is None:
        resolved.warmup_frac = ARCH_WARMUP_FRAC[arch]
    if getattr(args, 'image_pos', 'none') is None:
        resolved.image_pos = 'rotary' if arch == 'fusion' and cross_attn in CONTENT_CROSS_ATTENTIONS else 'none'
    return resolved


def build_model(cfg: Dict[str, Any]) -> nn.Module:
    kwargs = dict(cfg)
    kwargs['grid_size'] = tuple(kwargs['grid_size'])
    model_cls = SpatialVQAFusion if kwargs.pop('arch', 'single') == 'fusion' else SpatialVQATransformer
    return model_cls(kwargs.pop('pos_method'), **kwargs)


def make_optimizer(model: SpatialVQATransformer, args: argparse.Namespace) -> torch.optim.Optimizer:
    """timm optimizer over timm's weight-decay groups, the positional priors (GOAT alpha, beta, key default;
    PoPE delta) in a group of their own: no weight decay, ``lr_scale = --prior-lr-scale``
    (:func:`vision_priors.optim.prior_param_groups`)."""
    groups = functools.partial(prior_param_groups, weight_decay=args.weight_decay, lr_scale=args.prior_lr_scale)
    return create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay, param_group_fn=groups)


# ------------------------------------------------------------------------------------------ step

def answer_loss(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens (the only supervised tokens)."""
    logits = model(batch['patches'], batch['coords'], batch['text'])
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch['answers'].flatten())


# ------------------------------------------------------------------------------------ evaluation

@torch.no_grad()
def predict(model: nn.Module, loader: DataLoader, accelerator) -> Dict[str, np.ndarray]:
    """Per question: answer NLL and correctness, with the scan order of its scene (all processes)."""
    model.eval()
    nll, correct, orders = [], [], []
    for batch in loader:
        with accelerator.autocast():
            logits = model(batch['patches'], batch['coords'], batch['text'])
        logits, answers, order = accelerator.gather_for_metrics((logits.float(), batch['answers'], batch['order']))
        logp = logits.log_softmax(-1)
        nll.append((-logp.gather(-1, answers[..., None])[..., 0]).cpu().numpy())
        correct.append((logits.argmax(-1) == answers).cpu().numpy())
        orders.append(order.cpu().numpy())
    if not nll:
        raise ValueError('the evaluation set is empty')
    return dict(nll=np.concatenate(nll), correct=np.concatenate(correct), order=np.concatenate(orders))


def summarize_predictions(pred: Dict[str, np.ndarray]) -> Dict[str, Any]:
    """NLL / accuracy overall, per question type and per scan order."""
    def cell(nll: np.ndarray, correct: np.ndarray) -> Dict[str, float]:
        return dict(nll=float(nll.mean()), acc=float(correct.mean()), n=int(nll.size))
    out = cell(pred['nll'], pred['correct'])
    out['by_type'] = {t: cell(pred['nll'][:, k], pred['correct'][:, k]) for k, t in enumerate(QUESTION_TYPES)}
    out['by_order'] = {}
    for oid in np.unique(pred['order']):
        chosen = pred['order'] == oid
        out['by_order'][ORDER_NAMES[int(oid)]] = cell(pred['nll'][chosen], pred['correct'][chosen])
    return out


def eval_loader(dataset, args: argparse.Namespace, accelerator) -> DataLoader:
    return accelerator.prepare(DataLoader(dataset, batch_size=args.batch_size, shuffle=False,
                                          num_workers=args.num_workers))


# ----------------------------------------------------------------------------------------- train

def run_train(args: argparse.Namespace, method: str, seed: int, out_dir: Path, resume: bool) -> Path:
    """Train ``method`` with ``seed`` into ``out_dir``; returns the final checkpoint folder."""
    args = run_args(args, method)
    folder = RunFolder(out_dir, resume)
    accelerator = make_accelerator(seed, mixed_precision=args.amp, grad_accum=args.grad_accum, cpu=args.cpu)
    dcfg = data_config(args)
    sets, vocab = build_sets(dcfg, ['train', 'val'] if args.eval_every else ['train'])
    mcfg = model_config(args, method, len(vocab))
    model = build_model(mcfg)
    config = dict(method=method, seed=seed, model=mcfg, data=dcfg, vocab=vocab.tokens,
                  parameters=count_parameters(model), args=run_settings(args),
                  data_fingerprint=data_fingerprints([dcfg['data']]))  # CIFAR folder / npz; built-in: in memory
    loader = train_loader(sets['train'], args.batch_size, seed, args.num_workers)
    total_updates = count_updates(args.updates, args.epochs, len(loader), args.grad_accum)
    optimizer = make_optimizer(model, args)
    scheduler = cosine_schedule(optimizer, args.lr, total_updates, args.warmup_frac)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    evaluate = None
    if args.eval_every:
        val = eval_loader(sets['val'], args, accelerator)

        def evaluate() -> Dict[str, float]:
            summary = summarize_predictions(predict(model, val, accelerator))
            return dict(nll=summary['nll'], acc=summary['acc'])

    # the first write: loader, optimizer, schedule and evaluation data are built (a bad input has failed)
    folder.commit(config, may_change=EVAL_ONLY_FLAGS, write=accelerator.is_main_process)
    logger = JsonlLogger(out_dir / 'log.jsonl', enabled=accelerator.is_main_process)
    logger.log(event='start', method=method, seed=seed, total_updates=total_updates, parameters=config['parameters'],
               processes=accelerator.num_processes, device=str(accelerator.device))
    result = fit(accelerator, model, optimizer, scheduler, loader, None, total_updates, out_dir,
                 step_fn=answer_loss, clip_grad=args.clip_grad, checkpoint_every=args.checkpoint_every,
                 keep_checkpoints=args.keep_checkpoints,
                 resume=resume, stop_after=args.stop_after, logger=logger, log_every=args.log_every,
                 eval_every=args.eval_every, evaluate=evaluate, best_metric='nll' if evaluate else None,
                 best_mode='min', patience=args.patience)
    logger.log(event='end', **{k: str(v) for k, v in result.items()})
    return Path(result['checkpoint'])


# ------------------------------------------------------------------------------------------ eval

def run_eval(args: argparse.Namespace, runs: Sequence[str], overrides: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Evaluate each run on its seen and unseen test scenes (``overrides``: data config entries to replace)."""
    accelerator = make_accelerator(0, mixed_precision=args.amp, cpu=args.cpu)
    rows = []
    # --data given: the stored data are not read (unless it names the same path, which is then checked)
    reads = None if overrides.get('data') is None else [overrides['data']]
    for run in runs:
        loaded = load_finished_run(Path(run), 'spatial_vqa', reads=reads)
        config = loaded.config
        model = build_model(config['model'])
        model.load_state_dict(loaded.state_dict)
        dcfg = dict(config['data'], **{k: v for k, v in overrides.items() if v is not None})
        sets, _ = build_sets(dcfg, ['seen', 'unseen'])
        model = accelerator.prepare(model)
        row = dict(run=str(run), method=config['method'], seed=config['seed'], parameters=config['parameters'])
        for split in ('seen', 'unseen'):
            row[split] = summarize_predictions(predict(model, eval_loader(sets[split], args, accelerator), accelerator))
        accelerator.print(f"{config['method']} seed={config['seed']}: seen acc {100 * row['seen']['acc']:.2f} "
                          f"nll {row['seen']['nll']:.3f} | unseen acc {100 * row['unseen']['acc']:.2f} "
                          f"nll {row['unseen']['nll']:.3f}")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------- report

def aggregate(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """method -> split -> {nll, acc, by_type, by_order}: mean / std over seeds of every number."""
    table: Dict[str, Any] = {}
    for method, mine in group_rows(rows, 'method').items():
        table[method] = {'parameters': mine[0]['parameters'], 'seeds': [r['seed'] for r in mine]}
        for split in ('seen', 'unseen'):
            entry: Dict[str, Any] = {m: mean_std([r[split][m] for r in mine]) for m in ('nll', 'acc')}
            for group in ('by_type', 'by_order'):
                keys = list(dict.fromkeys(k for r in mine for k in r[split][group]))
                entry[group] = {k: {m: mean_std([r[split][group][k][m] for r in mine if k in r[split][group]])
                                    for m in ('nll', 'acc')} for k in keys}
            table[method][split] = entry
    return table


def format_tables(table: Dict[str, Any]) -> str:
    """Markdown: method x {seen, unseen} x {NLL, accuracy}; accuracy per question type; per scan order."""
    lines = ['| method | params | seen NLL | seen acc % | unseen NLL | unseen acc % |', '|---|---|---|---|---|---|']
    for method, t in table.items():
        lines.append(f"| {method} | {t['parameters']:,} | {format_cell(t['seen']['nll'], digits=3)} | "
                     f"{format_cell(t['seen']['acc'], 100)} | {format_cell(t['unseen']['nll'], digits=3)} | "
                     f"{format_cell(t['unseen']['acc'], 100)} |")
    lines += ['', '| method | ' + ' | '.join(f'{q} seen | {q} unseen' for q in QUESTION_TYPES) + ' |',
              '|---|' + '---|---|' * len(QUESTION_TYPES)]
    for metric, scale, digits, label in (('acc', 100, 1, 'acc %'), ('nll', 1, 3, 'NLL')):
        for method, t in table.items():
            cells = [format_cell(t[s]['by_type'][q][metric], scale, digits) for q in QUESTION_TYPES
                     for s in ('seen', 'unseen')]
            lines.append(f'| {method} {label} | ' + ' | '.join(cells) + ' |')
    lines.append('| position-blind | ' + ' | '.join(f'{100 * POSITION_BLIND_ACCURACY[q]:.0f}'
                                                 for q in QUESTION_TYPES for _ in range(2)) + ' |')
    orders = list(dict.fromkeys(o for t in table.values() for s in ('seen', 'unseen') for o in t[s]['by_order']))
    seen_orders = set(o for t in table.values() for o in t['seen']['by_order'])
    lines += ['', '| method | ' + ' | '.join(f"{o}{' (seen)' if o in seen_orders else ''}" for o in orders) + ' |',
              '|---|' + '---|' * len(orders)]
    for method, t in table.items():
        cells = []
        for o in orders:
            cell = t['seen' if o in t['seen']['by_order'] else 'unseen']['by_order'].get(o)
            cells.append('' if cell is None else format_cell(cell['acc'], 100, 1))
        lines.append(f'| {method} acc % | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def plot_results(table: Dict[str, Any], path: Path, title: str) -> None:
    """Three panels: accuracy seen / unseen per method; unseen accuracy per question type; per scan order."""
    methods = list(table)
    fig, axes = figure(1, 3, size=(15, 4.2), gridspec_kw=dict(width_ratios=[1, 1.4, 2.2]))
    width = 0.8 / max(1, len(methods))
    ax = axes[0][0]
    for i, split in enumerate(('seen', 'unseen')):
        means = [100 * table[m][split]['acc']['mean'] for m in methods]
        stds = [100 * table[m][split]['acc']['std'] for m in methods]
        ax.bar(np.arange(len(methods)) + (i - 0.5) * 0.4, means, 0.4, yerr=stds, capsize=3,
               label=f'{split} scan orders', hatch='' if split == 'seen' else '//')
    blind = 100 * float(np.mean(list(POSITION_BLIND_ACCURACY.values())))
    ax.axhline(blind, color='gray', linestyle='--', label='position-blind')
    ax.set_xticks(np.arange(len(methods)), methods)
    ax.set_ylabel('exact answer accuracy (%)')
    ax.set_title('all questions')
    ax.legend(fontsize=7)
    ax = axes[0][1]
    for i, m in enumerate(methods):
        means = [100 * table[m]['unseen']['by_type'][q]['acc']['mean'] for q in QUESTION_TYPES]
        ax.bar(np.arange(len(QUESTION_TYPES)) + (i - (len(methods) - 1) / 2) * width, means, width, label=m)
    ax.scatter(np.arange(len(QUESTION_TYPES)), [100 * POSITION_BLIND_ACCURACY[q] for q in QUESTION_TYPES],
               marker='_', s=400, color='gray', label='position-blind', zorder=3)
    ax.set_xticks(np.arange(len(QUESTION_TYPES)), QUESTION_TYPES)
    ax.set_title('unseen scan orders, per question type')
    ax.legend(fontsize=7)
    ax = axes[0][2]
    orders = list(dict.fromkeys(o for m in methods for s in ('seen', 'unseen') for o in table[m][s]['by_order']))
    for m in methods:
        ys = []
        for o in orders:
            cell = table[m]['seen' if o in table[m]['seen']['by_order'] else 'unseen']['by_order'].get(o)
            ys.append(math.nan if cell is None else 100 * cell['acc']['mean'])
        ax.plot(np.arange(len(orders)), ys, marker='o', label=m)
    num_seen = len(table[methods[0]]['seen']['by_order'])
    ax.axvspan(-0.5, num_seen - 0.5, color='gray', alpha=0.12, label='seen in training')
    ax.set_xticks(np.arange(len(orders)), orders, rotation=45, ha='right', fontsize=7)
    ax.set_title('per scan order')
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def report(rows: List[Dict[str, Any]], args: argparse.Namespace, out_dir: Path, title: str) -> Dict[str, Any]:
    table = aggregate(rows)
    text = format_tables(table)
    print(text)
    results = write_results(out_dir, rows=rows, summary=table, table_markdown=text, args=args)
    plot_results(table, out_dir / 'spatial_vqa.png', title)
    print(f'saved {results} and {out_dir / "spatial_vqa.png"}')
    return dict(rows=rows, summary=table, table_markdown=text)


# ------------------------------------------------------------------------------------------ main

def dispatch(args: argparse.Namespace) -> Dict[str, Any]:
    """Run the parsed ``train`` / ``eval`` / ``compare`` command; returns its result (checkpoint or report)."""
    out = Path(args.out)
    if args.command == 'train':
        ckpt = run_train(args, model_name(args.method, args.arch, args.cross_attn), args.seed, out, args.resume)
        print(f'checkpoint: {ckpt}')
        return dict(checkpoint=str(ckpt))
    if args.command == 'eval':
        rows = run_eval(args, args.runs, dict(data=args.data, test_scenes=args.test_scenes))
        return report(rows, args, out, 'evaluation')
    names = [model_name(m, arch, c) for m in args.methods for arch in args.archs
             for c in (fusion_cross_attns(m, args.cross_attns) if arch == 'fusion' else ['softmax'])]
    runs = sweep_folders(out, names, args.seeds, args.resume, flag='--methods')
    train_sweep(run_train, args, runs)
    rows = run_eval(args, [str(run_dir) for _, _, run_dir in runs], {})
    return report(rows, args, out, f'spatial VQA, {len(args.seeds)} seed(s), train orders '
                                   f'{", ".join(args.train_orders)}')


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    return cli.run_main(build_parser(), dispatch, argv, validate)


if __name__ == '__main__':
    main()
    close_distributed()
