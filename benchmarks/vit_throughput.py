"""Forward throughput of our GOAT / PoPE ViT-S/16 against timm's ViT-S baselines, side by side.

Every model is timed in the same process on the same inputs: warm-up, then the median of
``--repeats`` timed forward passes (inference mode) per resolution; images/s and the ratio to timm's
``vit_small_patch16_224`` are printed as a markdown table. Goals (issue 2, CPU): GOAT >= 0.95x,
PoPE >= 0.85x of the plain ViT-S.

    ./run.sh bench vit_throughput                 # 224 and 384, batch 8
    ./run.sh bench vit_throughput --quick         # a fast smoke run
"""
import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Dict, List

import torch
import timm

import vision_priors  # noqa: F401  (registers our models)

BASELINE = 'vit_small_patch16_224'
MODELS = [
    BASELINE,
    'vit_small_patch16_rope_224',
    'vit_small_patch16_rope_mixed_224',
    'vit_small_patch16_goat_224',
    'vit_small_patch16_pope_224',
]
GOALS = {'vit_small_patch16_goat_224': 0.95, 'vit_small_patch16_pope_224': 0.85}


def time_models(models: Dict[str, torch.nn.Module], x: torch.Tensor, warmup: int, repeats: int) -> Dict[str, float]:
    """Median seconds of one forward pass per model; repeats are interleaved across models so that
    drifting machine load hits every model alike."""
    times: Dict[str, List[float]] = {name: [] for name in models}
    with torch.inference_mode():
        for _ in range(warmup):
            for model in models.values():
                model(x)
        for _ in range(repeats):
            for name, model in models.items():
                start = time.perf_counter()
                model(x)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--sizes', type=int, nargs='+', default=[224, 384], help='square input resolutions')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--repeats', type=int, default=7, help='timed passes per model and size (median)')
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (default: torch)')
    parser.add_argument('--quick', action='store_true', help='batch 2, 2 repeats, 1 warm-up')
    parser.add_argument('--json', type=Path, default=None, help='also write the measurements here')
    args = parser.parse_args()
    if args.quick:
        args.batch_size, args.repeats, args.warmup = 2, 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    rows = []
    for size in args.sizes:
        x = torch.randn(args.batch_size, 3, size, size)
        models = {name: timm.create_model(name, img_size=size, num_classes=1000).eval() for name in MODELS}
        per_model = time_models(models, x, args.warmup, args.repeats)
        base = per_model[BASELINE]
        for name in MODELS:
            seconds = per_model[name]
            rows.append(dict(model=name, size=size, batch=args.batch_size, seconds=seconds,
                             images_per_s=args.batch_size / seconds, ratio_vs_vit=base / seconds))

    print(f'\nForward throughput, CPU ({platform.processor() or platform.machine()}, '
          f'{torch.get_num_threads()} threads), batch {args.batch_size}, median of {args.repeats}, '
          f'torch {torch.__version__}, timm {timm.__version__}\n')
    print('| model | res | images/s | vs vit_small_patch16_224 | goal |')
    print('|---|---|---|---|---|')
    for row in rows:
        goal = GOALS.get(row['model'])
        verdict = '' if goal is None else f">= {goal:.2f}x: {'met' if row['ratio_vs_vit'] >= goal else 'NOT met'}"
        print(f"| {row['model']} | {row['size']} | {row['images_per_s']:.1f} | {row['ratio_vs_vit']:.3f}x | {verdict} |")
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, rows=rows), indent=2))


if __name__ == '__main__':
    main()
