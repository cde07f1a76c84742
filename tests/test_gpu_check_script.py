"""The GPU benchmark script runs end to end on the CPU (``--dry-run``) and prints every row.

``benchmarks/bench_kernels.py --dry-run`` uses the tiniest shapes, ``TRITON_INTERPRET=1`` and
``time.perf_counter``; this checks the plumbing the GPU check relies on (header, one table row per
kernel row type x shape x pass, the JSON file, SKIP rows that say why, ERROR rows instead of an
abort), not any speed.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'benchmarks' / 'bench_kernels.py'


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location('_bench_kernels_under_test', SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _module_present(name: str) -> bool:
    return (ROOT / 'kernels' / f'{name}.py').exists()


@pytest.mark.timeout(900)
def test_dry_run_prints_every_row(tmp_path: Path) -> None:
    bench = _load_bench()
    out_json = tmp_path / 'bench.json'
    env = dict(os.environ, TRITON_INTERPRET='1', OMP_NUM_THREADS='1')
    res = subprocess.run([sys.executable, str(SCRIPT), '--dry-run', '--warmup', '0', '--repeats', '1',
                          '--json', str(out_json)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=850)
    assert res.returncode == 0, f'stdout:\n{res.stdout}\nstderr:\n{res.stderr[-4000:]}'
    assert 'torch ' in res.stdout and 'triton ' in res.stdout and 'interpreter' in res.stdout

    data = json.loads(out_json.read_text())
    rows = {(r['section'], r['shape'], r['pass_']): r for r in data['rows']}
    expected = {(section, shape.label, p) for section in bench.SECTIONS for shape in bench.dry_shapes()
                for p in bench.PASSES if shape.causal or section not in bench.CAUSAL_ONLY}
    assert set(rows) == expected
    table_lines = [line for line in res.stdout.splitlines() if line.startswith('| ')]
    assert len(table_lines) == 1 + len(expected)  # header + one line per row
    for (section, shape, p), r in rows.items():
        line = next(l for l in table_lines if l.startswith(f'| {section} | {shape} | {p} |'))
        assert r['result'] in ('dry-run', 'SKIP'), (section, shape, p, r['note'])
        if r['result'] == 'SKIP':  # only for an absent kernel module, and the row says so
            assert 'absent' in r['note'] and 'absent' in line, r
        else:
            assert r['kernel_ms'] > 0 and r['baseline_ms'] > 0, r
    needs = {'goat': 'flash_prior', 'pope': 'flash_prior', 'plain': 'flash_prior', 'lavo_kernel': 'lavo'}
    for (section, _, _), r in rows.items():
        if section in needs and _module_present(needs[section]):
            assert r['result'] == 'dry-run', f'{section}: kernels.{needs[section]} exists but the row is {r}'


def test_failures_become_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row type whose module is absent SKIPs with the reason; an exception gives an ERROR row; the
    rest still run; goals give PASS / MISS."""
    import torch
    bench = _load_bench()
    x = torch.ones(2, requires_grad=True)

    def fake_build(section, shape, device, dtype):
        if section == 'goat':
            return bench._import('vision_priors.kernels.no_such_kernel_module')
        if section == 'pope':
            raise RuntimeError('boom')
        speed = 2.0 if section == 'plain' else 1.0
        return (lambda: x * speed, [x], lambda: x * 3, [x])

    monkeypatch.setattr(bench, 'build', fake_build)
    times = iter([1.0, 2.0] * 100)  # kernel 1 ms, baseline 2 ms: speed-up 2x
    rows = bench.run(['goat', 'pope', 'plain', 'lavo'], bench.dry_shapes(), torch.device('cpu'), torch.float32,
                     lambda fn: (fn(), next(times))[1], budget_s=60, log=lambda s: None)
    by = {}
    for r in rows:
        by.setdefault(r.section, []).append(r)
    assert [r.result for r in by['goat']] == ['SKIP'] * 4
    assert all('no_such_kernel_module is absent' in r.note for r in by['goat'])
    assert [r.result for r in by['pope']] == ['ERROR'] * 4 and all('boom' in r.note for r in by['pope'])
    assert [r.result for r in by['plain']] == ['-'] * 4  # no goal
    assert [r.ratio for r in by['plain']] == [2.0] * 4
    lavo_shapes = [s for s in bench.dry_shapes() if s.causal]
    assert len(by['lavo']) == 2 * len(lavo_shapes)
    goal_n = bench.GOALS['lavo'][1]
    assert all(r.result == ('PASS' if r.N >= goal_n else '-') for r in by['lavo'])
    text = bench.table(rows)
    assert text.count('\n') == len(rows) + 1 and '| SKIP |' in text and '| ERROR |' in text
    # out of time: the remaining rows are SKIPped, not run
    late = bench.run(['plain'], bench.dry_shapes(), torch.device('cpu'), torch.float32,
                     lambda fn: 1.0, budget_s=-1, log=lambda s: None)
    assert all(r.result == 'SKIP' and 'time budget' in r.note for r in late)


def test_without_cuda_it_stops_with_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    """No GPU and no --dry-run: argparse's usage error (exit 2) naming the way out, not a traceback."""
    bench = _load_bench()
    monkeypatch.setattr(bench.torch.cuda, 'is_available', lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench.main([])
    assert exc.value.code == 2
    assert 'no CUDA device: run on a GPU machine, or pass --dry-run' in capsys.readouterr().err
