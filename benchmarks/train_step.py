"""Training-step throughput of our GOAT / PoPE / LAVO ViT-S/16 against timm's ViT-S, side by side (issue 16).

One step is what a training loop does per batch: forward, cross-entropy on random labels, backward and an
AdamW update (timm's ``create_optimizer_v2``), batch 8 at 224 px by default. The timing is
``vit_throughput``'s: warm-up steps, then ``--repeats`` rounds in which every model takes one timed step,
back to back, in an order rotated by one model each round; images/s is the median over rounds and the ratio
to timm's ``vit_small_patch16_224`` the median [IQR] of the per-round ratios (baseline time / model time),
so that load drifting on a shared machine hits both sides of every ratio alike. The FLOP ceiling counts the
matmuls, convolutions and attention of forward + backward (torch's FLOP counter). Goals: GOAT >= 0.95x,
PoPE >= 0.85x, LAVO >= 0.6x (on the CPU). The header names the CPU and its vector extensions, or the GPU.

On a GPU (``--device cuda``, e.g. with ``--amp bf16 --batch-size 128``) every step ends with the loss read
back to the host, so each timed step includes its GPU work; ``benchmarks/gpu_check.sh`` runs it there.

    ./run.sh bench train_step                                  # batch 8 at 224
    python benchmarks/train_step.py --device cuda --amp bf16 --batch-size 128 --malloc default
    ./run.sh bench train_step --profile vit_small_patch16_lavo_224   # plus where one step's time goes
    ./run.sh bench train_step --quick                          # a fast smoke run
"""
import argparse
import json
import os
import statistics
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional

import timm
import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import vision_priors  # noqa: F401  (registers our models)
from vision_priors.recipes.cli import parse_checked
from vit_throughput import (BASELINE, cpu_description, goal_verdict, paired_ratios, pin_malloc_or_reexec,
                            profile_table, time_rounds)  # same directory: the shared timing helpers

MODELS = [BASELINE, 'vit_small_patch16_goat_224', 'vit_small_patch16_pope_224', 'vit_small_patch16_lavo_224']
GOALS = {'vit_small_patch16_goat_224': {224: 0.95}, 'vit_small_patch16_pope_224': {224: 0.85},
         'vit_small_patch16_lavo_224': {224: 0.60}}


def make_train_step(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor,
                    amp: str = 'no') -> Callable[[], float]:
    """One AdamW training step of ``model`` on (x, labels), under bf16 autocast with ``amp='bf16'``; returns the
    loss (read back to the host, which waits for a GPU step to finish)."""
    optimizer = create_optimizer_v2(model, 'adamw', lr=1e-4, weight_decay=0.05)
    model.train()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp == 'bf16'):
            loss = F.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        return loss.item()
    return step


def _cpu_flash_forward_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def count_train_flops(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor) -> int:
    """Matmul / convolution / attention FLOPs of one forward + backward (the optimizer's elementwise work
    is not counted); gradients are cleared afterwards."""
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward_flops,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        F.cross_entropy(model(x), labels).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def build_parser() -> argparse.ArgumentParser:
    """The command line (checked by tests/test_readme.py against the README's commands)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--size', type=int, default=224, help='square input resolution')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--repeats', type=int, default=9, help='timed rounds (one step per model each)')
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (default: torch)')
    parser.add_argument('--models', nargs='+', default=MODELS, choices=MODELS, help='models besides the baseline')
    parser.add_argument('--profile', nargs='*', default=[], choices=MODELS,
                        help='also print where the time goes (top ops, one step) for these models')
    parser.add_argument('--quick', action='store_true', help='64 px, batch 2, 2 rounds, 1 warm-up')
    parser.add_argument('--malloc', choices=['pinned', 'default'], default='pinned',
                        help="glibc malloc with fixed thresholds for every model (see vit_throughput), or untouched")
    parser.add_argument('--device', choices=['cpu', 'cuda'], default='cpu', help='where the models train')
    parser.add_argument('--amp', choices=['no', 'bf16'], default='no', help='bf16 autocast in every step')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--json', type=Path, default=None, help='also write the measurements here')
    return parser


def validate(args: argparse.Namespace) -> None:
    """Checks argparse cannot express; ValueError names the flag."""
    for name in ('size', 'batch_size', 'repeats'):
        if getattr(args, name) < 1:
            raise ValueError(f'--{name.replace("_", "-")} must be >= 1, got {getattr(args, name)}')


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command-line arguments, checked before anything runs (a bad value exits with the parser's usage)."""
    return parse_checked(build_parser(), validate, argv)


def main() -> None:
    args = parse_args()
    if args.device == 'cuda' and not torch.cuda.is_available():  # the machine, not the arguments
        raise SystemExit('train_step.py: --device cuda: no CUDA device is available here')
    allocator = pin_malloc_or_reexec() if args.malloc == 'pinned' else 'default'
    if args.quick:
        args.size, args.batch_size, args.repeats, args.warmup = 64, 2, 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    names = [BASELINE] + [name for name in args.models if name != BASELINE]

    x = torch.randn(args.batch_size, 3, args.size, args.size).to(args.device)
    labels = torch.randint(0, 1000, (args.batch_size,)).to(args.device)
    models = {name: timm.create_model(name, img_size=args.size, num_classes=1000).to(args.device) for name in names}
    flops = {name: count_train_flops(model, x, labels) for name, model in models.items()}
    steps: Dict[str, Callable[[], float]] = {name: make_train_step(model, x, labels, args.amp)
                                             for name, model in models.items()}
    times, faults = time_rounds(steps, args.repeats, args.warmup)
    profiles = [(name, profile_table(partial(steps[name]))) for name in args.profile]

    where = (f'GPU {torch.cuda.get_device_name()}, autocast {args.amp}' if args.device == 'cuda'
             else f'{cpu_description()}, {torch.get_num_threads()} threads')
    print(f'\nTraining step (forward + backward + AdamW), {where}, '
          f'{args.size} px, batch {args.batch_size}, {args.repeats} rounds, seed {args.seed}, torch '
          f'{torch.__version__}, timm {timm.__version__}, malloc: {allocator}\n')
    print(f'| model | images/s | vs {BASELINE} (median [IQR] of per-round ratios) | FLOP ceiling | '
          f'page faults / step | goal |')
    print('|---|---|---|---|---|---|')
    rows = []
    for name in names:
        seconds = statistics.median(times[name])
        ratio, q1, q3 = paired_ratios(times[BASELINE], times[name])
        rows.append(dict(model=name, size=args.size, batch=args.batch_size, seconds=seconds,
                         images_per_s=args.batch_size / seconds, ratio_vs_vit=ratio, ratio_iqr=[q1, q3],
                         seconds_per_round=times[name], page_faults_per_step=statistics.median(faults[name]),
                         gflops=flops[name] / 1e9, flop_ceiling=flops[BASELINE] / flops[name]))
        print(f'| {name} | {args.batch_size / seconds:.2f} | {ratio:.3f}x [{q1:.3f}, {q3:.3f}] | '
              f'{flops[BASELINE] / flops[name]:.3f}x | {statistics.median(faults[name]):.0f} | '
              f'{goal_verdict(GOALS, name, args.size, ratio) if args.device == "cpu" else "-"} |')
    for name, table in profiles:
        print(f'\nWhere the time goes: {name}, one training step (self CPU time)\n')
        print(table)
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, allocator=allocator,
                                             cpu=cpu_description(), device=where,
                                             glibc_tunables=os.environ.get('GLIBC_TUNABLES'),
                                             rows=rows), indent=2))


if __name__ == '__main__':
    main()
