"""Forward throughput of our GOAT / PoPE ViT-S/16 against timm's ViT-S baselines, side by side.

Every model is timed in the same process on the same inputs: warm-up, then ``--repeats`` rounds in
which each model runs one timed forward pass (inference mode), back to back (the order rotates by
one model every round). Images/s is the median
over rounds; the ratio to timm's ``vit_small_patch16_224`` is the median of the per-round ratios
(baseline time / model time within one round), with its interquartile range, so that load drifting
on a shared machine hits both sides of every ratio alike. Goals (issue 2, CPU): GOAT >= 0.95x,
PoPE >= 0.85x of the plain ViT-S.

glibc's malloc, by default, returns the top of the heap to the system whenever more than twice its
(adaptive) mmap threshold lies free, and a ViT block frees and re-takes tens of MB every pass, so each
block then page-faults fresh memory in; how often depends on every model's allocation order, not on
its arithmetic, and swings the ratios by 10 % and more between runs. By default (``--malloc
pinned``) the script therefore re-runs itself with glibc's mmap and trim thresholds fixed high
(``GLIBC_TUNABLES``), the same for every model, so that the table compares compute; ``--malloc
default`` measures the untouched allocator. Minor page faults per pass are printed either way, and so
is each model's FLOP ceiling: baseline FLOPs / model FLOPs (matmuls, convolutions and attention, as
counted by torch's FLOP counter), the ratio a purely compute-bound run would reach.

    ./run.sh bench vit_throughput                 # 224 and 384, batch 8
    ./run.sh bench vit_throughput --malloc default
    ./run.sh bench vit_throughput --quick         # a fast smoke run
"""
import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
import timm
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import vision_priors  # noqa: F401  (registers our models)
from vision_priors.kernels.pope_cpu import load_pope_cpu_op
from vision_priors.layers.pope import use_compiled_cpu_op

BASELINE = 'vit_small_patch16_224'
MODELS = [
    BASELINE,
    'vit_small_patch16_rope_224',
    'vit_small_patch16_rope_mixed_224',
    'vit_small_patch16_goat_224',
    'vit_small_patch16_pope_224',
]
GOALS = {'vit_small_patch16_goat_224': 0.95, 'vit_small_patch16_pope_224': 0.85}
# glibc malloc with fixed (non-adaptive) thresholds: no mmap below 4 GiB, no heap trimming below 16 GiB
PINNED_MALLOC = 'glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=17179869184'


def time_rounds(calls: Dict[str, Callable[[], object]], rounds: int,
                warmup: int) -> Tuple[Dict[str, List[float]], Dict[str, List[int]]]:
    """Seconds and minor page faults of one call per variant and round; within a round the variants run
    back to back, in an order rotated by one variant every round (no variant always first or last)."""
    names = list(calls)
    times: Dict[str, List[float]] = {name: [] for name in names}
    faults: Dict[str, List[int]] = {name: [] for name in names}
    for _ in range(warmup):
        for call in calls.values():
            call()
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
    return times, faults


def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """FLOPs of CPU SDPA's fused kernel (torch's FLOP counter has no formula for the CPU variant)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _pope_cpu_attention_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """FLOPs of the compiled PoPE CPU op: QK^T at width 2d (cos and sin features), PV at width d."""
    batch, heads, tokens, head_dim = query_shape
    return 2 * batch * heads * tokens * tokens * (2 * head_dim + value_shape[-1])


def count_flops(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Matmul / convolution / attention FLOPs of one forward pass (elementwise work is not counted)."""
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops}
    if load_pope_cpu_op() is not None:  # its matmuls run inside C++, out of the counter's sight
        mapping[torch.ops.vision_priors_cpu.pope_attention] = _pope_cpu_attention_flops
    with torch.inference_mode(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(x)
    return counter.get_total_flops()


def pin_malloc_or_reexec() -> str:
    """Re-run this script with ``PINNED_MALLOC`` unless it is already set; returns the allocator label."""
    if os.environ.get('GLIBC_TUNABLES') == PINNED_MALLOC:
        return 'glibc, pinned thresholds'
    if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
        return f'{platform.system()} default (no glibc: not pinned)'
    env = dict(os.environ, GLIBC_TUNABLES=PINNED_MALLOC)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable] + sys.argv, env)
    raise AssertionError('unreachable')


def paired_ratios(base: List[float], other: List[float]) -> Tuple[float, float, float]:
    """(median, 25th, 75th percentile) of the per-round speed ratios base / other."""
    ratios = sorted(b / o for b, o in zip(base, other))
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q1, q2, q3 = statistics.quantiles(ratios, n=4, method='inclusive')
    return q2, q1, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--sizes', type=int, nargs='+', default=[224, 384], help='square input resolutions')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--repeats', type=int, default=11, help='timed rounds per size (one pass per model each)')
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (default: torch)')
    parser.add_argument('--quick', action='store_true', help='batch 2, 2 repeats, 1 warm-up')
    parser.add_argument('--malloc', choices=['pinned', 'default'], default='pinned',
                        help='glibc malloc with fixed thresholds for every model (see above), or untouched')
    parser.add_argument('--json', type=Path, default=None, help='also write the measurements here')
    args = parser.parse_args()
    allocator = pin_malloc_or_reexec() if args.malloc == 'pinned' else 'default'
    if args.quick:
        args.batch_size, args.repeats, args.warmup = 2, 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pope_cpu_path = 'compiled op (kernels/pope_cpu.cpp)' if use_compiled_cpu_op(torch.float32) else 'torch ops'

    rows = []
    for size in args.sizes:
        x = torch.randn(args.batch_size, 3, size, size)
        models = {name: timm.create_model(name, img_size=size, num_classes=1000).eval() for name in MODELS}
        with torch.inference_mode():
            per_model, faults = time_rounds({name: partial(model, x) for name, model in models.items()},
                                            args.repeats, args.warmup)
        flops = {name: count_flops(model, x) for name, model in models.items()}
        for name in MODELS:
            seconds = statistics.median(per_model[name])
            ratio, ratio_q1, ratio_q3 = paired_ratios(per_model[BASELINE], per_model[name])
            rows.append(dict(model=name, size=size, batch=args.batch_size, seconds=seconds,
                             images_per_s=args.batch_size / seconds, ratio_vs_vit=ratio,
                             ratio_iqr=[ratio_q1, ratio_q3], seconds_per_round=per_model[name],
                             page_faults_per_pass=statistics.median(faults[name]), gflops=flops[name] / 1e9,
                             flop_ceiling=flops[BASELINE] / flops[name]))

    print(f'\nForward throughput, CPU ({platform.processor() or platform.machine()}, '
          f'{torch.get_num_threads()} threads), batch {args.batch_size}, {args.repeats} rounds, '
          f'torch {torch.__version__}, timm {timm.__version__}, malloc: {allocator}, '
          f'PoPE CPU inference attention: {pope_cpu_path}\n')
    print(f'| model | res | images/s | vs {BASELINE} (median [IQR] of per-round ratios) | FLOP ceiling | '
          f'page faults / pass | goal |')
    print('|---|---|---|---|---|---|---|')
    for row in rows:
        goal = GOALS.get(row['model'])
        verdict = '' if goal is None else f">= {goal:.2f}x: {'met' if row['ratio_vs_vit'] >= goal else 'NOT met'}"
        q1, q3 = row['ratio_iqr']
        print(f"| {row['model']} | {row['size']} | {row['images_per_s']:.1f} | "
              f"{row['ratio_vs_vit']:.3f}x [{q1:.3f}, {q3:.3f}] | {row['flop_ceiling']:.3f}x | "
              f"{row['page_faults_per_pass']:.0f} | {verdict} |")
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, allocator=allocator,
                                             pope_cpu_path=pope_cpu_path,
                                             glibc_tunables=os.environ.get('GLIBC_TUNABLES'), rows=rows), indent=2))


if __name__ == '__main__':
    main()
