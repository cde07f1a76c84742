"""CPU benchmark: causal LAVO attention vs ``F.scaled_dot_product_attention(is_causal=True)``.

Both sides are full attention layers with the same q/k/v and output projections, so the table
compares the attention mechanisms plus identical O(L d^2) projection cost.

Measured:
    * forward time (under ``torch.no_grad``) and forward+backward time (grads of input and weights),
      best (minimum) of ``--repeats`` runs after one warm-up, the ``timeit`` convention, which is the
      least sensitive to other processes on a shared machine;
    * peak memory of one forward / forward+backward: each measurement runs in a fresh subprocess that
      resets the kernel's resident-set high-water mark (``/proc/self/clear_refs``), then reports
      ``VmHWM - VmRSS`` before the call. This is the extra resident memory of the call (activations,
      gradients, temporaries, allocator overhead); model weights and the input are excluded.
    * per-token decode time at two context lengths: LAVO ``step`` on a state from ``prefill`` of the
      context, and, for reference, SDPA of one query over a KV cache of that length.

Goals (from the issue): LAVO time 16K/8K <= 2.2, SDPA/LAVO at 16K >= 2, LAVO decode 16K/1K <= 1.2.

Example:
    python benchmarks/bench_lavo.py            # full run, L = 1K..16K
    python benchmarks/bench_lavo.py --quick    # smoke run
"""
import argparse
import json
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import extra_peak_mib, fmt, probe_in_subprocess, time_call  # noqa: E402
from vision_priors.layers.lavo import LavoAttention  # noqa: E402


class SdpaAttention(nn.Module):
    """Causal softmax attention with the same projections as :class:`LavoAttention`."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def build(impl: str, args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    if impl == 'lavo':
        return LavoAttention(args.dim, args.heads, num_slots=args.slots, window=args.window, causal=True).eval()
    return SdpaAttention(args.dim, args.heads).eval()


def run_once(model: nn.Module, x: torch.Tensor, mode: str) -> None:
    if mode == 'fwd':
        with torch.no_grad():
            model(x)
    else:
        model.zero_grad(set_to_none=True)
        model(x.requires_grad_(True)).sum().backward()






def memory_probe(impl: str, length: int, mode: str, args: argparse.Namespace) -> float:
    """In this (fresh) process: extra peak resident MiB of one call. See the module docstring."""
    model = build(impl, args)
    x = torch.randn(1, length, args.dim)
    return extra_peak_mib(lambda: run_once(model, x, mode))


def measure_memory(impl: str, length: int, mode: str, args: argparse.Namespace) -> Optional[float]:
    return probe_in_subprocess(os.path.abspath(__file__), [
        '--_probe', f'{impl},{length},{mode}', '--threads', str(torch.get_num_threads()), '--dim', str(args.dim),
        '--heads', str(args.heads), '--slots', str(args.slots), '--window', str(args.window)])


def decode_time(impl: str, context: int, args: argparse.Namespace) -> float:
    """Seconds per generated token after ``context`` tokens (best of ``--repeats`` runs of N tokens)."""
    n = args.decode_tokens
    model = build(impl, args)
    torch.manual_seed(1)
    with torch.no_grad():
        if impl == 'lavo':
            _, state0 = model.prefill(torch.randn(1, context, args.dim))
            xs = torch.randn(n, 1, 1, args.dim)

            def fn():
                state = state0
                for i in range(n):
                    _, state = model.step(xs[i], state)
        else:
            hd = args.dim // args.heads
            k = torch.randn(1, args.heads, context + n, hd)
            v = torch.randn(1, args.heads, context + n, hd)
            xs = torch.randn(n, 1, 1, args.dim)

            def fn():
                for i in range(n):  # one query over the cache of the context plus earlier generated tokens
                    b, _, c = xs[i].shape
                    q = model.qkv(xs[i])[..., :c].reshape(1, 1, args.heads, hd).transpose(1, 2)
                    L = context + i + 1
                    out = F.scaled_dot_product_attention(q, k[:, :, :L], v[:, :, :L])
                    model.proj(out.transpose(1, 2).reshape(1, 1, c))

        return time_call(fn, args.repeats) / n




def build_parser() -> argparse.ArgumentParser:
    """The command line (checked by tests/test_readme.py against the README's commands)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--lengths', type=int, nargs='+', default=[1024, 2048, 4096, 8192, 16384],
                   help='sequence lengths (default: 1K 2K 4K 8K 16K)')
    p.add_argument('--decode-contexts', type=int, nargs=2, default=[1024, 16384], metavar=('SHORT', 'LONG'),
                   help='context lengths for per-token decode time (default: 1024 16384)')
    p.add_argument('--decode-tokens', type=int, default=200, help='tokens generated per decode timing')
    p.add_argument('--dim', type=int, default=256, help='d_model (default 256)')
    p.add_argument('--heads', type=int, default=4, help='attention heads (default 4)')
    p.add_argument('--slots', type=int, default=64, help='LAVO memory slots r (default 64)')
    p.add_argument('--window', type=int, default=64, help='LAVO local window w (default 64)')
    p.add_argument('--repeats', type=int, default=3, help='timed repeats per cell, minimum reported')
    p.add_argument('--no-memory', action='store_true', help='skip the peak-memory subprocesses')
    p.add_argument('--quick', action='store_true',
                   help='smoke run: L = 512 1K 2K, decode contexts 256 / 2K, 1 repeat, 50 decode tokens')
    p.add_argument('--threads', type=int, default=None,
                   help='torch intra-op threads (default: torch default); use 1 on a shared, busy machine')
    p.add_argument('--json', type=str, default=None, help='also write the results to this JSON file')
    p.add_argument('--_probe', type=str, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args._probe:
        impl, length, mode = args._probe.split(',')
        print(memory_probe(impl, int(length), mode, args))
        return
    if args.quick:
        args.lengths, args.decode_contexts, args.repeats, args.decode_tokens = [512, 1024, 2048], [256, 2048], 1, 50

    print(f'torch {torch.__version__}, {torch.get_num_threads()} threads, batch 1, d_model {args.dim}, '
          f'{args.heads} heads, LAVO r={args.slots} w={args.window}; float32 CPU; '
          f'load average before: {os.getloadavg()[0]:.2f}')
    print('times in ms (best of --repeats); memory = extra peak RSS of one call in MiB '
          '(fresh subprocess, VmHWM - VmRSS)\n')
    rows: List[Dict] = []
    for length in args.lengths:
        x = torch.randn(1, length, args.dim)
        row: Dict = {'L': length}
        for impl in ('lavo', 'sdpa'):
            model = build(impl, args)
            for mode in ('fwd', 'fwdbwd'):
                row[f'{impl}_{mode}_s'] = time_call(lambda: run_once(model, x, mode), args.repeats)
                row[f'{impl}_{mode}_mib'] = None if args.no_memory else measure_memory(impl, length, mode, args)
        rows.append(row)
        print(f'  L={length}: done', file=sys.stderr, flush=True)

    print('| L | LAVO fwd ms | SDPA fwd ms | LAVO fwd+bwd ms | SDPA fwd+bwd ms | LAVO fwd MiB | SDPA fwd MiB '
          '| LAVO fwd+bwd MiB | SDPA fwd+bwd MiB | fwd speedup | fwd+bwd speedup |')
    print('|' + '---|' * 11)
    for r in rows:
        print(f"| {r['L']} | {fmt(r['lavo_fwd_s'], 'ms')} | {fmt(r['sdpa_fwd_s'], 'ms')} "
              f"| {fmt(r['lavo_fwdbwd_s'], 'ms')} | {fmt(r['sdpa_fwdbwd_s'], 'ms')} "
              f"| {fmt(r['lavo_fwd_mib'])} | {fmt(r['sdpa_fwd_mib'])} "
              f"| {fmt(r['lavo_fwdbwd_mib'])} | {fmt(r['sdpa_fwdbwd_mib'])} "
              f"| {r['sdpa_fwd_s'] / r['lavo_fwd_s']:.2f}x | {r['sdpa_fwdbwd_s'] / r['lavo_fwdbwd_s']:.2f}x |")

    short, long_ = args.decode_contexts
    dec = {(impl, c): decode_time(impl, c, args) for impl in ('lavo', 'sdpa') for c in (short, long_)}
    print(f'\n| decode, ms/token | context {short} | context {long_} | ratio |\n|---|---|---|---|')
    for impl, name in (('lavo', 'LAVO step (O(1) state)'), ('sdpa', 'SDPA + KV cache')):
        a, b = dec[(impl, short)], dec[(impl, long_)]
        print(f'| {name} | {a * 1e3:.3f} | {b * 1e3:.3f} | {b / a:.2f} |')

    last, prev = rows[-1], rows[-2] if len(rows) > 1 else None
    checks = []
    if prev is not None:
        g = last['L'] / prev['L']
        for mode in ('fwd', 'fwdbwd'):
            ratio = last[f'lavo_{mode}_s'] / prev[f'lavo_{mode}_s']
            checks.append((f'LAVO {mode} time {last["L"]}/{prev["L"]}', ratio, f'<= {1.1 * g:.1f}', ratio <= 1.1 * g))
    for mode in ('fwd', 'fwdbwd'):
        s = last[f'sdpa_{mode}_s'] / last[f'lavo_{mode}_s']
        checks.append((f'SDPA/LAVO {mode} time at {last["L"]}', s, '>= 2', s >= 2))
    d = dec[('lavo', long_)] / dec[('lavo', short)]
    checks.append((f'LAVO decode ms/token {long_}/{short}', d, '<= 1.2', d <= 1.2))
    if args.quick:
        print('\n(--quick smoke run: the goals are stated for L = 8K/16K and decode contexts 1K/16K)')
    print('\n| check | measured | goal | met |\n|---|---|---|---|')
    for name, val, goal, ok in checks:
        print(f'| {name} | {val:.2f} | {goal} | {"yes" if ok else "NO"} |')
    load = os.getloadavg()[0]
    print(f'\nload average after: {load:.2f}' + (
        f'  WARNING: other processes shared the {os.cpu_count()} CPUs; timings (not memory) may be inflated; '
        'rerun on an idle machine' + (' or with --threads 1' if torch.get_num_threads() > 1 else '')
        if load > 0.5 * (os.cpu_count() or 1) else ''))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'rows': rows, 'decode_s_per_token': {f'{k[0]}@{k[1]}': v for k, v in dec.items()},
                       'checks': [dict(name=n, value=v, goal=g, met=o) for n, v, g, o in checks]}, f, indent=1)


if __name__ == '__main__':
    main()
