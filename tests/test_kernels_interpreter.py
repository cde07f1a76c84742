"""Runs the Triton kernel tests in Triton's CPU interpreter, in a child process, on machines without CUDA.

Triton chooses between its interpreter and its compiler for its whole library when it is first
imported (``TRITON_INTERPRET=1`` at that moment), so one process cannot both interpret kernels and
compile them (``test_kernels_compile.py``). Without CUDA, the files in ``FILES`` (``test_kernels_lavo.py``,
``test_kernels_chamfer.py``, ...) skip themselves unless the variable was set before pytest started; this
test runs them in a child with it set, and fails with the child's report if any of them fails.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FILES = ('test_kernels_lavo.py', 'test_kernels_lavo_2d.py', 'test_kernels_chamfer.py', 'test_kernels_flash_prior.py',
         'test_kernel_dispatch.py')


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get('TRITON_INTERPRET') == '1',
                    reason='the kernel tests run in this process (CUDA, or TRITON_INTERPRET=1 already set)')
@pytest.mark.timeout(900)
def test_kernel_tests_pass_in_the_triton_interpreter():
    pytest.importorskip('triton')
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET='1')
    cmd = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *(str(here / f) for f in FILES)]
    res = subprocess.run(cmd, cwd=here.parent, env=env, capture_output=True, text=True, timeout=880)
    report = res.stdout[-8000:] + res.stderr[-2000:]
    assert res.returncode == 0, report
    assert ' passed' in res.stdout and ' skipped' not in res.stdout.splitlines()[-1], report
