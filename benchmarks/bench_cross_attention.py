"""Cross-attention cost vs source length: softmax (SDPA) vs LAVO (``LavoCrossAttention``), CPU.

The PCN decoder's cross-attention (LAVO Sec. 3.4 / Table 7): ``--queries`` query tokens attend to S source
tokens (point proxies, image tokens, series embeddings), S = 128 .. 8,192. Softmax cross-attention costs
O(Q S) time and memory; LAVO compresses the source into r slots in O(S r), then the queries read the slots.
Both are the modules the models use (``vision_priors.models.point_completion.VanillaCrossAttention`` and
``vision_priors.layers.LavoCrossAttention``, r = min(64, head dim) slots), with the same width and heads.

Per S: forward and forward + backward wall time (best of ``--repeats``) and, unless ``--no-memory``, the
extra peak RSS of one call measured in a fresh process. One run prints both side by side, the ratio, and
the goal check: LAVO time linear in S (time(8K) / time(1K) <= 8 x 1.25) and faster than softmax from
1,024 source tokens on.

    python benchmarks/bench_cross_attention.py                  # S = 128 .. 8192
    python benchmarks/bench_cross_attention.py --sources 128 512 --repeats 1 --no-memory   # smoke run
"""
import argparse
import json
import os
import sys
from typing import Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import extra_peak_mib, fmt, probe_in_subprocess, time_call  # noqa: E402
from vision_priors.layers import LavoCrossAttention  # noqa: E402
from vision_priors.models.point_completion import VanillaCrossAttention  # noqa: E402

IMPLS = ('vanilla', 'lavo')


def build(impl: str, args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    if impl == 'vanilla':
        return VanillaCrossAttention(args.dim, args.heads)
    return LavoCrossAttention(args.dim, num_heads=args.heads, num_slots=min(64, args.dim // args.heads))


def inputs(sources: int, args: argparse.Namespace):
    gen = torch.Generator().manual_seed(sources)
    return (torch.randn(args.batch, args.queries, args.dim, generator=gen),
            torch.randn(args.batch, sources, args.dim, generator=gen))


def run_once(model: nn.Module, x: torch.Tensor, context: torch.Tensor, mode: str) -> None:
    if mode == 'fwd':
        with torch.no_grad():
            model(x, context)
        return
    model.zero_grad(set_to_none=True)
    model(x, context.requires_grad_(True)).sum().backward()


def memory_probe(impl: str, sources: int, mode: str, args: argparse.Namespace) -> float:
    model = build(impl, args)
    x, context = inputs(sources, args)
    return extra_peak_mib(lambda: run_once(model, x, context, mode))


def build_parser() -> argparse.ArgumentParser:
    """The command line (checked by tests/test_readme.py against the README's commands)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--sources', type=int, nargs='+', default=[128, 256, 512, 1024, 2048, 4096, 8192])
    p.add_argument('--queries', type=int, default=256, help='query tokens (PCN decoder: 256 = pointr_pcn)')
    p.add_argument('--dim', type=int, default=384, help='width (pointr_pcn: 384)')
    p.add_argument('--heads', type=int, default=6)
    p.add_argument('--batch', type=int, default=4)
    p.add_argument('--repeats', type=int, default=5, help='timed repeats per cell, minimum reported')
    p.add_argument('--threads', type=int, default=None, help='torch threads (default: torch default)')
    p.add_argument('--no-memory', action='store_true', help='skip the peak-memory subprocesses')
    p.add_argument('--json', default=None, help='also write the rows to this JSON file')
    p.add_argument('--_probe', default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> List[Dict]:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args._probe:
        impl, sources, mode = args._probe.split(',')
        print(memory_probe(impl, int(sources), mode, args))
        return []

    print(f'torch {torch.__version__}, {torch.get_num_threads()} threads, float32 CPU; batch {args.batch}, '
          f'{args.queries} queries, width {args.dim}, {args.heads} heads; load average {os.getloadavg()[0]:.2f}')
    rows = []
    for sources in args.sources:
        x, context = inputs(sources, args)
        row: Dict = {'S': sources}
        for impl in IMPLS:
            model = build(impl, args)
            for mode in ('fwd', 'fwdbwd'):
                row[f'{impl}_{mode}_s'] = time_call(lambda: run_once(model, x, context, mode), args.repeats)
                row[f'{impl}_{mode}_mib'] = None if args.no_memory else probe_in_subprocess(
                    os.path.abspath(__file__), ['--_probe', f'{impl},{sources},{mode}', '--threads',
                                                str(torch.get_num_threads()), '--queries', str(args.queries),
                                                '--dim', str(args.dim), '--heads', str(args.heads),
                                                '--batch', str(args.batch)])
        rows.append(row)
    print('\n| source tokens | softmax fwd ms | LAVO fwd ms | softmax fwd+bwd ms | LAVO fwd+bwd ms '
          '| softmax fwd+bwd MiB | LAVO fwd+bwd MiB | softmax / LAVO fwd | softmax / LAVO fwd+bwd |')
    print('|' + '---|' * 9)
    for r in rows:
        print(f"| {r['S']} | {fmt(r['vanilla_fwd_s'], 'ms')} | {fmt(r['lavo_fwd_s'], 'ms')} | "
              f"{fmt(r['vanilla_fwdbwd_s'], 'ms')} | {fmt(r['lavo_fwdbwd_s'], 'ms')} | "
              f"{fmt(r['vanilla_fwdbwd_mib'])} | "
              f"{fmt(r['lavo_fwdbwd_mib'])} | {r['vanilla_fwd_s'] / r['lavo_fwd_s']:.2f}x | "
              f"{r['vanilla_fwdbwd_s'] / r['lavo_fwdbwd_s']:.2f}x |")
    by_s = {r['S']: r for r in rows}
    if 1024 in by_s and 8192 in by_s:
        growth = by_s[8192]['lavo_fwd_s'] / by_s[1024]['lavo_fwd_s']
        faster = all(r['lavo_fwd_s'] < r['vanilla_fwd_s'] and r['lavo_fwdbwd_s'] < r['vanilla_fwdbwd_s']
                     for r in rows if r['S'] >= 1024)
        print(f'\nLAVO fwd time 8192 / 1024 sources: {growth:.2f} (linear: 8; goal <= 10): '
              f'{"met" if growth <= 10 else "NOT met"}; LAVO faster than softmax (fwd and fwd+bwd) from 1,024 '
              f'sources: {"met" if faster else "NOT met"}')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == '__main__':
    main()
