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
    """One tiny run of the softmax vs LAVO cross-attention benchmark, with its peak-memory probes (one source size:
    each probe is a fresh process)."""
    args = ['--sources', '40', '--repeats', '1', '--batch', '1', '--queries', '8', '--dim', '32', '--heads', '2',
            '--threads', '1']
    result = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'bench_cross_attention.py')] + args,
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith('| 40 |')]
    assert len(rows) == 1 and all(line.count('|') == 10 and ' - ' not in line for line in rows)


def test_size_batch_goal_and_cpu_helpers():
    """``--sizes`` entries, goal verdicts per resolution, and the CPU header with its vector extensions."""
    vit_throughput = _load('vit_throughput')
    assert vit_throughput.size_and_batch('224') == (224, 0) and vit_throughput.size_and_batch('768:2') == (768, 2)
    for bad in ('x', '768:y', '8', '224:-1'):
        with pytest.raises(Exception, match='SIZE'):
            vit_throughput.size_and_batch(bad)
    goals = vit_throughput.GOALS
    assert vit_throughput.goal_verdict(goals, 'vit_small_patch16_lavo_224', 768, 1.49) == '>= 1.50x: NOT met'
    assert vit_throughput.goal_verdict(goals, 'vit_small_patch16_pope_224', 384, 0.8) == '>= 0.80x: met'
    assert vit_throughput.goal_verdict(goals, 'vit_small_patch16_lavo_224', 384, 0.1) == ''
    header = vit_throughput.cpu_description()
    assert all(flag in header for flag in ('avx2', 'fma', 'avx512f')) or 'flags unknown' in header
    assert torch.backends.cpu.get_cpu_capability() in header


def test_train_flop_count_includes_cpu_attention(one_thread):
    """Baseline ViT-S at 64 px: forward + backward FLOPs of the counter plus CPU flash attention's forward
    (4 B H N^2 d) and backward per block, which torch's counter alone misses."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
    train_step = _load_beside('train_step')
    torch.manual_seed(0)
    x, labels = torch.randn(2, 3, 64, 64), torch.randint(0, 1000, (2,))
    model = timm.create_model('vit_small_patch16_224', img_size=64)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x), labels).backward()
    model.zero_grad(set_to_none=True)
    shape = (2, 6, 17, 64)
    attention = 12 * (sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape))
    assert train_step.count_train_flops(model, x, labels) == counter.get_total_flops() + attention
    assert all(p.grad is None for p in model.parameters())


def _load_beside(name: str):
    """A benchmark script that imports its sibling ``vit_throughput`` (benchmarks/ put on sys.path)."""
    sys.path.insert(0, str(ROOT / 'benchmarks'))
    try:
        return _load(name)
    finally:
        sys.path.remove(str(ROOT / 'benchmarks'))


def test_train_step_benchmark_smoke():
    """One tiny side-by-side round of the training-step benchmark (baseline and LAVO, 32 px)."""
    args = ['--size', '32', '--batch-size', '1', '--repeats', '1', '--warmup', '0', '--threads', '1',
            '--models', 'vit_small_patch16_lavo_224', '--malloc', 'default']
    result = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'train_step.py')] + args,
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith('| vit_small')]
    assert [row.split(' | ')[0] for row in rows] == ['| vit_small_patch16_224', '| vit_small_patch16_lavo_224']
    assert 'avx2' in result.stdout and '1.000x [1.000, 1.000]' in rows[0]


def test_train_step_rejects_bad_arguments(capsys):
    train_step = _load_beside('train_step')
    for flag in ('--batch-size', '--size', '--repeats'):
        with pytest.raises(SystemExit):
            train_step.parse_args([flag, '0'])
        assert f'{flag} must be >= 1, got 0' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_step.parse_args(['--models', 'vit_no_such_model'])
    assert train_step.parse_args(['--quick']).quick
    assert train_step.parse_args(['--amp', 'bf16', '--device', 'cuda']).amp == 'bf16'
    with pytest.raises(SystemExit):
        train_step.parse_args(['--device', 'tpu'])


def test_train_step_without_cuda_stops_before_building_anything(monkeypatch):
    train_step = _load_beside('train_step')
    monkeypatch.setattr(train_step.torch.cuda, 'is_available', lambda: False)
    monkeypatch.setattr(sys, 'argv', ['train_step.py', '--device', 'cuda', '--malloc', 'default'])
    monkeypatch.setattr(train_step.timm, 'create_model', lambda *a, **k: pytest.fail('built a model'))
    with pytest.raises(SystemExit, match='--device cuda: no CUDA device is available here'):
        train_step.main()
