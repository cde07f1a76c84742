"""timm's own model test suite (tests/test_models.py of timm's sdist) on every model we register.

``./run.sh`` fetches the suite for the pinned timm version into ``.cache/timm-<version>/``; it runs
in a subprocess with ``-p vision_priors`` so our models are registered before timm collects.
Covers forward, backward, default_cfgs, torchscript, fx forward/backward and fx + torchscript, on the tiny and
small variants of each method (CI budget: the base variants are the same classes at another size, built and run by
``tests/test_vit_models.py``; ``VISION_PRIORS_TIMM_SUITE_ALL=1`` adds them).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / '.cache' / f'timm-{timm.__version__}' / 'tests' / 'test_models.py'
ALL_SIZES = os.environ.get('VISION_PRIORS_TIMM_SUITE_ALL', '') == '1'


@pytest.mark.skipif(not SUITE.exists(), reason=f'{SUITE} missing: ./run.sh fetches it (timm sdist from PyPI)')
def test_timm_model_suite_passes_on_our_models():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    select = 'goat or pope or lavo' if ALL_SIZES else '(goat or pope or lavo) and not vit_base'
    cmd = [sys.executable, '-m', 'pytest', '-q', '-p', 'vision_priors', '-p', 'no:cacheprovider',
           str(SUITE), '-k', select, '-W', 'ignore::FutureWarning']
    result = subprocess.run(cmd, cwd=SUITE.parent.parent, env=env, capture_output=True, text=True, timeout=1200)
    tail = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    summary = result.stdout.strip().splitlines()[-1]
    passed = int(summary.split(' passed')[0].split()[-1])
    # (9 or 6) models x (forward, backward, default_cfgs_non_std, torchscript, fx fwd, fx bwd, fx+torchscript)
    assert passed >= (63 if ALL_SIZES else 42) and 'failed' not in summary, summary
