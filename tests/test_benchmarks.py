"""The CPU benchmark scripts' own arithmetic: paired ratios, the FLOP count behind the FLOP ceiling, and
a one-round smoke run of the PoPE attention benchmark (which checks its two paths agree). No timing is
asserted anywhere."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import vision_priors  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f'bench_{name}', ROOT / 'benchmarks' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_ratios_are_per_round():
    vit_throughput = _load('vit_throughput')
    # base / other per round: 2, 1, 0.5, 1, 1 -> median 1, quartiles 1 and 1
    median, q1, q3 = vit_throughput.paired_ratios([2.0, 1.0, 1.0, 3.0, 2.0], [1.0, 1.0, 2.0, 3.0, 2.0])
    assert (median, q1, q3) == (1.0, 1.0, 1.0)
    assert vit_throughput.paired_ratios([1.0], [4.0]) == (0.25, 0.25, 0.25)


def test_flop_count_includes_cpu_attention():
    """Baseline ViT-S at 64 px (16 patches + class token): linear / conv FLOPs plus 4 B H N^2 d per block
    for attention, which torch's counter alone misses on CPU."""
    vit_throughput = _load('vit_throughput')
    x = torch.randn(2, 3, 64, 64)
    model = timm.create_model('vit_small_patch16_224', img_size=64).eval()
    with torch.inference_mode(), torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        model(x)
    batch, heads, tokens, head_dim, depth = 2, 6, 17, 64, 12
    attention = depth * 4 * batch * heads * tokens * tokens * head_dim
    assert vit_throughput.count_flops(model, x) == counter.get_total_flops() + attention
    # PoPE: q / k of width 2d, v of width d -> 1.5x the attention FLOPs, same projections and MLPs
    pope = timm.create_model('vit_small_patch16_pope_224', img_size=64).eval()
    assert vit_throughput.count_flops(pope, x) == counter.get_total_flops() + attention * 3 // 2


@pytest.mark.parametrize('script, args', [('pope_cpu_attention', ['--grids', '3', '--rounds', '1', '--warmup', '0',
                                                                  '--batch-size', '2'])])
def test_benchmark_smoke(script, args):
    result = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / f'{script}.py')] + args,
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert '| 10 |' in result.stdout  # 3 x 3 grid + class token


def test_cross_attention_benchmark_smoke():
    """One tiny run of the softmax vs LAVO cross-attention benchmark, with a peak-memory probe."""
    args = ['--sources', '16', '40', '--repeats', '1', '--batch', '1', '--queries', '8', '--dim', '32', '--heads', '2',
            '--threads', '1']
    result = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'bench_cross_attention.py')] + args,
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith('| 16 |') or line.startswith('| 40 |')]
    assert len(rows) == 2 and all(line.count('|') == 10 and ' - ' not in line for line in rows)
