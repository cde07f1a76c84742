"""Fusion cross-attention cost vs number of image tokens: softmax vs LAVO, in the multimodal block, CPU.

The cross-attention sub-layer of ``vision_priors.models.multimodal.CrossAttentionBlock`` as the spatial-VQA
fusion decoder uses it: ``--queries`` question tokens per sample (default 12 = 4 questions x 3 tokens) attend to
M image tokens, M = 64 .. 4,096 (a 256 px scene at patch 4 has 4,096). Timed: the block's cross path
``x + ls_cross(cross_attn(norm_cross(x), image))`` with ``cross_attn='softmax'`` (SDPA over the M keys, O(Q M))
and ``'lavo'`` (LAVO Sec. 3.4: compress the image once into r slots per head, O(r d (Q + M))), both built by
``create_cross_block`` with the same width and heads. Inputs and the timed call come from
``bench_cross_attention.py`` (``inputs`` / ``run_once``), timing from ``measure.py``.

One run prints forward and forward + backward wall time (best of ``--repeats``), the ratio and the goal
check: LAVO faster than softmax (forward and forward + backward) from 1,024 image tokens on.

    python benchmarks/bench_fusion_cross_attention.py --threads 1              # M = 64 .. 4096
    python benchmarks/bench_fusion_cross_attention.py --tokens 64 256 --repeats 1   # smoke run
"""
import argparse
import json
import os
import sys
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cross_attention import inputs, run_once  # noqa: E402
from measure import fmt, time_call  # noqa: E402
from vision_priors.models.multimodal import CONTENT_CROSS_ATTENTIONS, CrossAttentionBlock, create_cross_block  # noqa: E402


class CrossPath(nn.Module):
    """The cross-attention residual sub-layer of a multimodal block, callable as ``(x, context)``."""

    def __init__(self, block: CrossAttentionBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        b = self.block
        return x + b.drop_path_cross(b.ls_cross(b.cross_attn(b.norm_cross(x), context)))


def build(cross_attn: str, args: argparse.Namespace) -> CrossPath:
    torch.manual_seed(0)
    return CrossPath(create_cross_block('plain', args.dim, args.heads, cross_attn=cross_attn, qkv_bias=True))


def build_parser() -> argparse.ArgumentParser:
    """The command line (checked by tests/test_readme.py against the README's commands)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--tokens', type=int, nargs='+', default=[64, 256, 1024, 2048, 4096], help='image tokens M')
    p.add_argument('--queries', type=int, default=12, help='question tokens per sample (VQA: 4 questions x 3)')
    p.add_argument('--dim', type=int, default=128, help='width (the README VQA CPU runs: 128)')
    p.add_argument('--heads', type=int, default=4)
    p.add_argument('--batch', type=int, default=32, help='samples per call (the README VQA CPU runs: 32)')
    p.add_argument('--repeats', type=int, default=5, help='timed repeats per cell, minimum reported')
    p.add_argument('--threads', type=int, default=None, help='torch threads (default: torch default)')
    p.add_argument('--json', default=None, help='also write the rows to this JSON file')
    return p


def main(argv: Optional[List[str]] = None) -> List[Dict]:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f'torch {torch.__version__}, {torch.get_num_threads()} threads, float32 CPU; batch {args.batch}, '
          f'{args.queries} question tokens, width {args.dim}, {args.heads} heads; '
          f'load average {os.getloadavg()[0]:.2f}')
    rows = []
    for tokens in args.tokens:
        x, context = inputs(tokens, args)
        row: Dict = {'M': tokens}
        for cross_attn in CONTENT_CROSS_ATTENTIONS:
            model = build(cross_attn, args)
            for mode in ('fwd', 'fwdbwd'):
                row[f'{cross_attn}_{mode}_s'] = time_call(lambda: run_once(model, x, context, mode), args.repeats)
        rows.append(row)
    print('\n| image tokens | softmax fwd ms | LAVO fwd ms | softmax fwd+bwd ms | LAVO fwd+bwd ms '
          '| softmax / LAVO fwd | softmax / LAVO fwd+bwd |')
    print('|' + '---|' * 7)
    for r in rows:
        print(f"| {r['M']} | {fmt(r['softmax_fwd_s'], 'ms')} | {fmt(r['lavo_fwd_s'], 'ms')} | "
              f"{fmt(r['softmax_fwdbwd_s'], 'ms')} | {fmt(r['lavo_fwdbwd_s'], 'ms')} | "
              f"{r['softmax_fwd_s'] / r['lavo_fwd_s']:.2f}x | {r['softmax_fwdbwd_s'] / r['lavo_fwdbwd_s']:.2f}x |")
    large = [r for r in rows if r['M'] >= 1024]
    if large:
        faster = all(r['lavo_fwd_s'] < r['softmax_fwd_s'] and r['lavo_fwdbwd_s'] < r['softmax_fwdbwd_s']
                     for r in large)
        print('\nLAVO faster than softmax (fwd and fwd+bwd) from 1,024 image tokens on: '
              f'{"met" if faster else "NOT met"}')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == '__main__':
    main()
