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
from typing import Callable, Dict, List, Optional, Tuple

import torch
import timm
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import vision_priors  # noqa: F401  (registers our models)
from vision_priors.kernels.pope_cpu import compiled_op_isa, load_pope_cpu_op
from vision_priors.layers.pope import use_compiled_cpu_op

BASELINE = 'vit_small_patch16_224'
MODELS = [
    BASELINE,
    'vit_small_patch16_rope_224',
    'vit_small_patch16_rope_mixed_224',
    'vit_small_patch16_goat_224',
    'vit_small_patch16_pope_224',
    'vit_small_patch16_lavo_224',
]
# inference goals vs the baseline per resolution (issues 2 and 16; CPU, AVX2-only machines included)
GOALS = {'vit_small_patch16_goat_224': {224: 0.95, 384: 0.95, 768: 0.95},
         'vit_small_patch16_pope_224': {224: 0.85, 384: 0.80, 768: 0.70},
         'vit_small_patch16_lavo_224': {224: 0.70, 768: 1.50}}
VECTOR_FLAGS = ('avx2', 'fma', 'avx512f')
# glibc malloc with fixed (non-adaptive) thresholds: no mmap below 4 GiB, no heap trimming below 16 GiB
PINNED_MALLOC = 'glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=17179869184'


def cpu_description() -> str:
    """CPU model and vector extensions (/proc/cpuinfo flags avx2, fma, avx512f) and ATen's kernel level."""
    model, flags = platform.processor() or platform.machine(), set()
    if os.path.exists('/proc/cpuinfo'):
        with open('/proc/cpuinfo') as f:
            for line in f:
                key, _, value = line.partition(':')
                if key.strip() == 'model name' and model in ('', platform.machine(), platform.processor()):
                    model = value.strip()
                elif key.strip() == 'flags' and not flags:
                    flags = set(value.split())
    extensions = ', '.join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in VECTOR_FLAGS) if flags else \
        'flags unknown (no /proc/cpuinfo)'
    return (f'CPU {model} ({os.cpu_count()} logical cores; {extensions}; ATen kernels '
            f'{torch.backends.cpu.get_cpu_capability()})')


def pope_cpu_path() -> str:
    """Which PoPE CPU inference attention float32 dispatch picks here, and the compiled op's ISA."""
    isa = compiled_op_isa()
    if isa is None:
        return 'torch-op twin (compiled op not built)'
    chosen = 'compiled op (kernels/pope_cpu.cpp)' if use_compiled_cpu_op(torch.float32) else 'torch-op twin'
    return f'{chosen}; compiled op code for this CPU: {isa}'


def size_and_batch(text: str) -> Tuple[int, int]:
    """``'224'`` or ``'768:2'`` (resolution, optional batch size) for ``--sizes``; 0 = ``--batch-size``."""
    size, _, batch = text.partition(':')
    try:
        result = int(size), int(batch) if batch else 0
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected SIZE or SIZE:BATCH, got {text!r}') from None
    if result[0] < 16 or result[1] < 0:
        raise argparse.ArgumentTypeError(f'expected SIZE >= 16 and BATCH >= 1, got {text!r}')
    return result


def goal_verdict(goals: Dict[str, Dict[int, float]], model: str, size: int, ratio: float) -> str:
    """'>= 0.85x: met' / 'NOT met', or '' where no goal is set for this model and resolution."""
    goal = goals.get(model, {}).get(size)
    return '' if goal is None else f">= {goal:.2f}x: {'met' if ratio >= goal else 'NOT met'}"


def profile_table(call: Callable[[], object], rows: int = 15) -> str:
    """Markdown table of the ops that take the most self CPU time in one ``call()`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        call()
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    lines = ['| op | input shapes | calls | self CPU ms | share |', '|---|---|---|---|---|']
    for e in events[:rows]:
        shapes = str(e.input_shapes).replace('|', '/')[:80]
        lines.append(f'| {e.key} | {shapes} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} | '
                     f'{100 * e.self_cpu_time_total / max(total, 1):.1f} % |')
    lines.append(f'| total | | | {total / 1e3:.1f} | 100 % |')
    return '\n'.join(lines)


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
    # parameters frozen while counting: the counter's module tracker cannot hook views of parameters made
    # without autograd (LAVO pooling's expanded latent queries)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.requires_grad_(False)
    try:
        with torch.inference_mode(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            model(x)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
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


def build_parser() -> argparse.ArgumentParser:
    """The command line (checked by tests/test_readme.py against the README's commands)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--sizes', type=size_and_batch, nargs='+', default=[(224, 0), (384, 0), (768, 2)],
                        help='square input resolutions, SIZE or SIZE:BATCH (default: 224 384 768:2)')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--repeats', type=int, default=11, help='timed rounds per size (one pass per model each)')
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (default: torch)')
    parser.add_argument('--quick', action='store_true', help='batch 2, 2 repeats, 1 warm-up')
    parser.add_argument('--malloc', choices=['pinned', 'default'], default='pinned',
                        help='glibc malloc with fixed thresholds for every model (see above), or untouched')
    parser.add_argument('--json', type=Path, default=None, help='also write the measurements here')
    parser.add_argument('--models', nargs='+', default=MODELS, choices=MODELS, help='models besides the baseline')
    parser.add_argument('--profile', nargs='*', default=[], choices=MODELS,
                        help='also print where the time goes (top ops, one pass) for these models')
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    models_run = [BASELINE] + [name for name in args.models if name != BASELINE]
    allocator = pin_malloc_or_reexec() if args.malloc == 'pinned' else 'default'
    if args.quick:
        args.batch_size, args.repeats, args.warmup = 2, 2, 1
        args.sizes = [(size, min(batch, 2)) for size, batch in args.sizes]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pope_path = pope_cpu_path()

    rows, profiles = [], []
    for size, batch in args.sizes:
        batch = batch or args.batch_size
        x = torch.randn(batch, 3, size, size)
        models = {name: timm.create_model(name, img_size=size, num_classes=1000).eval() for name in models_run}
        with torch.inference_mode():
            per_model, faults = time_rounds({name: partial(model, x) for name, model in models.items()},
                                            args.repeats, args.warmup)
        flops = {name: count_flops(model, x) for name, model in models.items()}
        for name in args.profile:
            with torch.inference_mode():
                profiles.append((name, size, batch, profile_table(partial(models[name], x))))
        for name in models_run:
            seconds = statistics.median(per_model[name])
            ratio, ratio_q1, ratio_q3 = paired_ratios(per_model[BASELINE], per_model[name])
            rows.append(dict(model=name, size=size, batch=batch, seconds=seconds,
                             images_per_s=batch / seconds, ratio_vs_vit=ratio,
                             ratio_iqr=[ratio_q1, ratio_q3], seconds_per_round=per_model[name],
                             page_faults_per_pass=statistics.median(faults[name]), gflops=flops[name] / 1e9,
                             flop_ceiling=flops[BASELINE] / flops[name]))

    print(f'\nForward throughput, {cpu_description()}, {torch.get_num_threads()} threads, {args.repeats} rounds, '
          f'torch {torch.__version__}, timm {timm.__version__}, malloc: {allocator}, '
          f'PoPE CPU inference attention: {pope_path}\n')
    print(f'| model | res | batch | images/s | vs {BASELINE} (median [IQR] of per-round ratios) | FLOP ceiling | '
          f'page faults / pass | goal |')
    print('|---|---|---|---|---|---|---|---|')
    for row in rows:
        verdict = goal_verdict(GOALS, row['model'], row['size'], row['ratio_vs_vit'])
        q1, q3 = row['ratio_iqr']
        print(f"| {row['model']} | {row['size']} | {row['batch']} | {row['images_per_s']:.1f} | "
              f"{row['ratio_vs_vit']:.3f}x [{q1:.3f}, {q3:.3f}] | {row['flop_ceiling']:.3f}x | "
              f"{row['page_faults_per_pass']:.0f} | {verdict} |")
    for name, size, batch, table in profiles:
        print(f'\nWhere the time goes: {name}, {size} px, batch {batch}, one forward pass (self CPU time)\n')
        print(table)
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, allocator=allocator,
                                             pope_cpu_path=pope_path, cpu=cpu_description(),
                                             glibc_tunables=os.environ.get('GLIBC_TUNABLES'), rows=rows), indent=2))


if __name__ == '__main__':
    main()
