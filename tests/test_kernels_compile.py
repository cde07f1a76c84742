"""Every Triton kernel configuration compiles for sm_80 and sm_90, without a GPU, within its resources.

For each spec of each kernel module's ``aot_specs()`` (see ``tools/aot.py``, development tooling outside the
installed package) and each target it is meant for: ``triton.compile`` down to the cubin must succeed, a
default configuration must not spill registers (``ptxas -v`` spill stores / loads == 0), and every configuration's
shared memory must fit in a block (163 KiB on sm_80, 227 KiB on sm_90). Test ids are ``<spec name>-sm<capability>``.
The cases compile once, in parallel worker processes (``VISION_PRIORS_AOT_JOBS``, default: the usable
CPUs); ``VISION_PRIORS_AOT_FILTER=<regex>`` restricts them to matching spec names. To keep CI short, sm_80
skips the bf16 and causal specs whose fp16 / non-causal twin it compiles (same tiles, stages and element size,
hence the same shared memory); sm_90 compiles every spec; ``VISION_PRIORS_AOT_FULL=1`` compiles every case.

The second half checks the machinery itself on small kernels defined here (a vector add, a tiled
``tl.dot`` matmul in fp16 and bf16): sane reports that agree with ``cuobjdump`` on Triton's cubin,
and that the checks do fail on a configuration that spills, one whose tiles overflow shared
memory, a kernel that does not compile, a malformed spec and a broken kernel module.
"""
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

triton = pytest.importorskip('triton')
tl = pytest.importorskip('triton.language')

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed: the repository root
from tools import aot  # noqa: E402

CAPABILITIES = (80, 90)
_DISCOVERY_ERRORS: Dict[str, str] = {}
# discovered in a fresh process: the kernel modules are never imported here, whatever TRITON_INTERPRET
# other test modules set (the compile workers import them in compiler mode)
SPECS = aot.discover_specs_isolated(errors=_DISCOVERY_ERRORS)
# VISION_PRIORS_AOT_FILTER=<regex> keeps only the matching spec names (a quick local run, e.g. '_d64_')
_FILTER = re.compile(os.environ.get('VISION_PRIORS_AOT_FILTER', ''))
# CI budget: sm_90 compiles every spec. sm_80 compiles one spec per group of twins with the same tiles, stages and
# element size, hence the same shared memory: a bf16 spec whose fp16 twin is compiled and a causal spec whose
# non-causal twin is compiled are left out there (their own register use is checked on sm_90).
# VISION_PRIORS_AOT_FULL=1 compiles all of them.
_FULL = os.environ.get('VISION_PRIORS_AOT_FULL', '') == '1'
_NAMES = {s['name'] for s in SPECS}


def sm80_representative(name: str) -> str:
    """The spec compiled on sm_80 for ``name``'s group of twins (itself when it has no twin)."""
    return name.replace('_bf16', '_fp16').replace('_causal', '')


def _in_ci_set(spec: dict, capability: int) -> bool:
    twin = sm80_representative(spec['name'])
    return _FULL or capability != 80 or twin == spec['name'] or twin not in _NAMES


CASES: List[Tuple[dict, int]] = [(s, c) for s in SPECS for c in CAPABILITIES
                                 if c in s['capabilities'] and _FILTER.search(s['name']) and _in_ci_set(s, c)]


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh Triton cache for this module: every spec really compiles, nothing lands in the repo."""
    return str(tmp_path_factory.mktemp('triton_cache'))


def check_report(report: aot.CompileReport) -> None:
    """The CI constraints on one compiled configuration (see the module docstring)."""
    assert report.registers > 0 and report.ptx_size > 0 and report.cubin_size > 0, report
    if report.default:
        assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, (
            f'{report.name} sm_{report.capability} spills: {report.problems()}')
    assert report.shared_bytes <= aot.shared_limit(report.capability), (
        f'{report.name} sm_{report.capability} shared memory: {report.problems()}')


# ------------------------------------------------------------------------------------------------
# the real kernels

@pytest.mark.parametrize('module', sorted(_DISCOVERY_ERRORS) or ['(none)'])
def test_kernel_modules_load(module: str) -> None:
    """Every kernels/*.py with aot_specs imports and returns well-formed specs."""
    assert module not in _DISCOVERY_ERRORS, f'vision_priors.kernels.{module}: {_DISCOVERY_ERRORS.get(module)}'
    assert len({s['name'] for s in SPECS}) == len(SPECS)


@pytest.fixture(scope='module')
def spec_reports(cache_dir: str) -> Dict[Tuple[str, int], object]:
    """Every (spec, capability) compiled once, in ``aot.default_jobs()`` worker processes
    (``VISION_PRIORS_AOT_JOBS`` overrides): report or exception per case."""
    wanted = {s['name'] for s, _ in CASES}
    specs = [s for s in SPECS if s['name'] in wanted]
    results = aot.compile_all(specs, CAPABILITIES, cache_dir=cache_dir, jobs=aot.default_jobs())
    return {(s['name'], c): r for (s, c), r in zip(CASES, results)}


@pytest.mark.timeout(3600)  # the first case compiles them all (about 3 s per case and CPU core)
@pytest.mark.skipif(not CASES, reason='no kernel module defines aot_specs() yet')
@pytest.mark.parametrize('spec,capability', CASES, ids=[f'{s["name"]}-sm{c}' for s, c in CASES])
def test_spec_compiles_within_resources(spec: dict, capability: int, spec_reports: dict) -> None:
    result = spec_reports[(spec['name'], capability)]
    if isinstance(result, Exception):
        pytest.fail(str(result), pytrace=False)
    check_report(result)


# ------------------------------------------------------------------------------------------------
# self-check of the compile machinery on kernels defined here

@triton.jit
def _vadd(x, y, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)


@triton.jit
def _matmul(a, b, c, K, stride_am, stride_bk, stride_cm,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(a + rm[:, None] * stride_am + (k0 + rk)[None, :])
        w = tl.load(b + (k0 + rk)[:, None] * stride_bk + rn[None, :])
        acc = tl.dot(x, w, acc)
    tl.store(c + rm[:, None] * stride_cm + rn[None, :], acc.to(c.dtype.element_ty))


@triton.jit
def _normalize(x, out, BLOCK: tl.constexpr):
    """All BLOCK values stay live across the reduction: with one warp they cannot fit in registers."""
    offs = tl.arange(0, BLOCK)
    v = tl.load(x + offs)
    tl.store(out + offs, v / tl.sum(v * v))


@triton.jit
def _broken(x, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, tl.dot(tl.load(x + offs), tl.load(x + offs)))  # 1-D dot: a compile error


def _matmul_spec(name: str, dtype: str, bm: int, bn: int, bk: int, warps: int, stages: int, **kw) -> dict:
    sig = {'a': f'*{dtype}', 'b': f'*{dtype}', 'c': f'*{dtype}', 'K': 'i32:16',
           'stride_am': 'i32:16', 'stride_bk': 'i32:16', 'stride_cm': 'i32:16'}
    return dict(name=name, fn=_matmul, signature=sig, constexprs={'BM': bm, 'BN': bn, 'BK': bk},
                num_warps=warps, num_stages=stages, **kw)


EXAMPLES = [
    dict(name='example_vadd_fp32', fn=_vadd, signature={'x': '*fp32', 'y': '*fp32', 'out': '*fp32', 'n': 'i32'},
         constexprs={'BLOCK': 1024}, num_warps=4, num_stages=1),
    _matmul_spec('example_matmul_fp16', 'fp16', 64, 64, 32, 4, 2),
    _matmul_spec('example_matmul_bf16', 'bf16', 64, 64, 32, 4, 3),
]


@pytest.mark.parametrize('capability', CAPABILITIES)
@pytest.mark.parametrize('spec', EXAMPLES, ids=[s['name'] for s in EXAMPLES])
def test_example_reports(spec: dict, capability: int, cache_dir: str) -> None:
    report = aot.compile_spec(spec, capability, cache_dir=cache_dir)
    check_report(report)
    assert (report.name, report.capability, report.kernel) == (spec['name'], capability, spec['fn'].__name__)
    assert (report.num_warps, report.num_stages) == (spec['num_warps'], spec['num_stages'])
    assert 0 < report.registers <= 255
    kernel = aot.compile_kernel(spec, capability, cache_dir=cache_dir)  # a cache hit
    target = 'sm_90a' if capability == 90 else 'sm_80'
    assert f'.target {target}' in kernel.asm['ptx']
    # our `ptxas -v` run reads the same binary Triton built: registers agree with its cubin
    assert aot.cubin_resources(kernel.asm['cubin'])['reg'] == report.registers
    if 'matmul' in spec['name']:
        assert report.shared_bytes > 0  # the pipelined tiles live in shared memory


def test_spilling_config_is_caught(cache_dir: str) -> None:
    spec = dict(name='example_spill', fn=_normalize, signature={'x': '*fp32', 'out': '*fp32'},
                constexprs={'BLOCK': 8192}, num_warps=1, num_stages=1)
    report = aot.compile_spec(spec, 80, cache_dir=cache_dir)
    assert report.spill_store_bytes > 0 and report.spill_load_bytes > 0
    assert any('spills' in p for p in report.problems())
    with pytest.raises(AssertionError, match='spills'):
        check_report(report)
    # the same config marked as a non-default tuning candidate may spill
    relaxed = aot.compile_spec(dict(spec, default=False), 80, cache_dir=cache_dir)
    check_report(relaxed)


def test_shared_memory_overflow_is_caught(cache_dir: str) -> None:
    # 4 stages of a 128 x 256 and a 256 x 128 fp16 tile: 3-4 x 128 KiB, over both limits
    spec = _matmul_spec('example_huge_tiles', 'fp16', 128, 128, 256, 8, 4)
    report = aot.compile_spec(spec, 90, cache_dir=cache_dir)
    assert report.shared_bytes > aot.shared_limit(90) > aot.shared_limit(80)
    with pytest.raises(AssertionError, match='shared memory'):
        check_report(report)


def test_compile_error_names_the_spec(cache_dir: str) -> None:
    spec = dict(name='example_broken', fn=_broken, signature={'x': '*fp16'}, constexprs={'BLOCK': 16})
    with pytest.raises(aot.AotCompileError, match=r"spec 'example_broken' \(_broken, sm_80"):
        aot.compile_spec(spec, 80, cache_dir=cache_dir)


def test_malformed_specs_are_rejected() -> None:
    good = EXAMPLES[0]
    with pytest.raises(aot.AotSpecError, match="'example_vadd_fp32'.*'n'.*missing"):
        aot.normalize_spec(dict(good, signature={k: v for k, v in good['signature'].items() if k != 'n'}))
    with pytest.raises(aot.AotSpecError, match="constexpr 'BLOCK'.*no value"):
        aot.normalize_spec(dict(good, signature=dict(good['signature'], BLOCK='constexpr'), constexprs={}))
    with pytest.raises(aot.AotSpecError, match="'nope' is not a parameter"):
        aot.normalize_spec(dict(good, constexprs={'BLOCK': 8, 'nope': 1}))
    with pytest.raises(aot.AotSpecError, match='power of 2'):
        aot.normalize_spec(dict(good, num_warps=3))
    with pytest.raises(aot.AotSpecError, match='unknown key'):
        aot.normalize_spec(dict(good, num_wraps=4))
    from triton.runtime.interpreter import InterpretedFunction
    interpreted = aot.normalize_spec(dict(good, fn=InterpretedFunction(_vadd.fn)))  # TRITON_INTERPRET=1 import
    assert hasattr(interpreted['fn'], 'params') and interpreted['fn'].arg_names == _vadd.arg_names
    spec = aot.normalize_spec(good)
    assert spec['divisibility'] == ['x', 'y', 'out'] and spec['capabilities'] == CAPABILITIES
    assert spec['signature']['BLOCK'] == 'constexpr' and spec['constexprs'] == {'BLOCK': 1024}


_GOOD_MODULE = '''
import triton
import triton.language as tl


@triton.jit
def scale(x, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs, mask=offs < n) * 2, mask=offs < n)


def aot_specs():
    return [dict(name=f'scale_{b}', fn=scale, signature={'x': '*fp16', 'n': 'i32'}, constexprs={'BLOCK': b},
                 num_warps=1, num_stages=1, capabilities=(90,)) for b in (32, 64)]
'''


def test_discovery(tmp_path: Path) -> None:
    (tmp_path / 'good.py').write_text(_GOOD_MODULE)
    (tmp_path / 'plain.py').write_text('X = 1\n')  # no aot_specs: contributes nothing
    (tmp_path / 'aot.py').write_text('raise RuntimeError("aot.py must be skipped")\n')
    (tmp_path / 'broken.py').write_text('import not_a_real_module_xyz\n')
    errors: Dict[str, str] = {}
    specs = aot.discover_specs(tmp_path, errors=errors)
    assert [s['name'] for s in specs] == ['scale_32', 'scale_64']
    assert {s['module'] for s in specs} == {'good'} and specs[0]['capabilities'] == (90,)
    assert list(errors) == ['broken'] and 'not_a_real_module_xyz' in errors['broken']
    with pytest.raises(aot.AotSpecError, match="kernel module 'broken'"):
        aot.discover_specs(tmp_path)
    # the same in a fresh process, then compiled by a worker process from the records alone
    isolated_errors: Dict[str, str] = {}
    records = aot.discover_specs_isolated(tmp_path, errors=isolated_errors)
    assert [(r['name'], r['kernel'], r['capabilities']) for r in records] == [
        ('scale_32', 'scale', (90,)), ('scale_64', 'scale', (90,))]
    assert list(isolated_errors) == ['broken']
    in_worker = aot.compile_all(records, CAPABILITIES, jobs=1)
    assert [(r.name, r.capability, r.module) for r in in_worker] == [('scale_32', 90, 'good'), ('scale_64', 90, 'good')]
    (tmp_path / 'broken.py').write_text(_GOOD_MODULE)  # the same names again
    with pytest.raises(aot.AotSpecError, match="'scale_32' is defined twice"):
        aot.discover_specs(tmp_path, errors={})
    report = [r for r in aot.compile_all(specs, CAPABILITIES) if not isinstance(r, Exception)]
    assert [(r.name, r.capability, r.module) for r in report] == [('scale_32', 90, 'good'), ('scale_64', 90, 'good')]
