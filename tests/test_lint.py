"""The code base stays lint-clean under ruff (``[tool.ruff]`` in pyproject.toml): lines of at most 120 columns,
as timm keeps, no unused imports, no undefined names, no syntax errors. ruff is a test dependency (``.[test]``)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    cmd = [sys.executable, '-m', 'ruff', 'check', 'vision_priors', 'recipes', 'kernels', 'benchmarks', 'tests']
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f'ruff check found problems:\n{result.stdout}{result.stderr}'
