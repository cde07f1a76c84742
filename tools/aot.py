"""Ahead-of-time compilation of the Triton kernels for NVIDIA targets, on a machine without a GPU.

Development tooling: this module lives in the repository's ``tools/`` folder, outside the installed
package (``vision_priors``); ``tests/test_kernels_compile.py`` and ``benchmarks/kernel_resources.py`` import
it as ``tools.aot`` with the repository root on ``sys.path``.

Every kernel module under ``kernels/`` (installed as ``vision_priors.kernels``) may expose
``aot_specs() -> list[dict]``, one dict per configuration its runtime dispatcher can choose on a GPU::

    {'name': 'flash_fwd_goat_d64_fp16',      # unique over all modules
     'fn': <triton.jit function, possibly under @triton.heuristics>,
     'signature': {'Q': '*fp16', 'N': 'i32', 'BLOCK_M': 'constexpr', ...},
     'constexprs': {'BLOCK_M': 128, ...},
     'num_warps': 4, 'num_stages': 3,
     # optional:
     'capabilities': (80, 90),   # targets the dispatcher uses this config on (default: both)
     'default': True,            # False: a tuning candidate; compiled, but allowed to spill
     'divisibility': ['Q', 'N'], # args known to be multiples of 16 (default: every pointer arg)
     'options': {'maxnreg': 128}}  # any other triton CUDAOptions field

:func:`compile_spec` runs ``triton.compile`` for ``GPUTarget('cuda', capability, 32)`` (the full
pipeline down to the cubin, with Triton's bundled ``ptxas``), then runs the same ``ptxas -v`` on the
PTX to read registers, spill stores / loads and static shared memory, which Triton discards.
``shared_bytes`` is the static shared memory plus the kernel's dynamic ``metadata.shared``, the
amount a launch requests; :data:`SHARED_LIMITS` holds the per-block maxima it must fit into.

Nothing is cached in the repository: compilations go to a per-process temporary Triton cache
(removed at exit) unless ``cache_dir`` is given.

    python -m tools.aot                        # (repository root) compile every spec for sm_80 and sm_90
    python benchmarks/kernel_resources.py      # the same, as a table

The kernel modules derive their signatures from the kernels' parameter lists
(``vision_priors.kernels._backend.aot_signature``).
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

DEFAULT_CAPABILITIES = (80, 90)
_KERNELS_PACKAGE = 'vision_priors.kernels'


def kernels_dir() -> Path:
    """The directory of the ``vision_priors.kernels`` package (the repository's ``kernels/`` folder in an
    editable install). Looked up, not imported: importing the kernel modules is left to the workers."""
    spec = importlib.util.find_spec(_KERNELS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AotSpecError(f'cannot find the {_KERNELS_PACKAGE} package; install the project (pip install -e .)')
    return Path(list(spec.submodule_search_locations)[0]).resolve()

# Maximum shared memory per block (opt-in), bytes: 163 KiB on A100 (sm_80), 227 KiB on H100 / H200
# (sm_90), 99 KiB on sm_86 / sm_89 / sm_120, 227 KiB on sm_100.
SHARED_LIMITS: Dict[int, int] = {
    75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024,
    90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024,
}

_REQUIRED_KEYS = ('name', 'fn', 'signature')
_OPTIONAL_KEYS = ('constexprs', 'num_warps', 'num_stages', 'capabilities', 'default', 'divisibility',
                  'options', 'module', 'module_file')


class AotSpecError(ValueError):
    """A spec dict (or the module that makes it) is malformed."""


class AotCompileError(RuntimeError):
    """Triton or ptxas failed on a spec; the message names the spec and the target."""


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """Resources of one spec compiled for one target.

    Attributes:
        name: the spec's name.
        capability: compute capability, e.g. 80 or 90.
        registers: 32-bit registers per thread.
        spill_store_bytes: bytes spilled to local memory (stores), per thread.
        spill_load_bytes: bytes reloaded from spills, per thread.
        shared_bytes: static + dynamic shared memory a launch requests, per block.
        ptx_size: characters of PTX.
        cubin_size: bytes of cubin.
        kernel: the Triton function's name.
        module: the module that defined the spec ('' if unknown).
        num_warps: warps per block.
        num_stages: software-pipelining stages.
        stack_bytes: stack frame bytes per thread (local arrays and spills).
        default: whether the spec is a default (must not spill) configuration.
        compile_seconds: wall time of triton.compile plus the ptxas -v run.
    """

    name: str
    capability: int
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    ptx_size: int
    cubin_size: int
    kernel: str = ''
    module: str = ''
    num_warps: int = 4
    num_stages: int = 3
    stack_bytes: int = 0
    default: bool = True
    compile_seconds: float = 0.0

    @property
    def shared_limit(self) -> int:
        """Per-block shared-memory maximum of this report's target, bytes."""
        return shared_limit(self.capability)

    def problems(self) -> List[str]:
        """Constraint violations: spills (default configs only) and shared memory over the limit."""
        out = []
        if self.default and (self.spill_store_bytes or self.spill_load_bytes):
            out.append(f'{self.name} sm_{self.capability}: spills {self.spill_store_bytes} B stores / '
                       f'{self.spill_load_bytes} B loads ({self.registers} registers, {self.num_warps} warps)')
        if self.shared_bytes > self.shared_limit:
            out.append(f'{self.name} sm_{self.capability}: shared memory {self.shared_bytes} B '
                       f'({self.shared_bytes / 1024:.1f} KiB) > {self.shared_limit // 1024} KiB per block')
        return out


def shared_limit(capability: int) -> int:
    """Per-block (opt-in) shared-memory maximum in bytes for a compute capability.

    Raises:
        KeyError: for a capability not in :data:`SHARED_LIMITS`.
    """
    if capability not in SHARED_LIMITS:
        raise KeyError(f'no shared-memory limit known for sm_{capability}; known: {sorted(SHARED_LIMITS)}')
    return SHARED_LIMITS[capability]


# ----------------------------------------------------------------------------------------------
# spec validation

def normalize_spec(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Check a spec dict and fill its defaults.

    Constexprs named only in ``constexprs`` are added to the signature as ``'constexpr'``;
    ``'constexpr'`` signature entries missing from ``constexprs`` take the parameter's default.

    Returns:
        A new dict with every key of the spec format set.

    Raises:
        AotSpecError: naming the spec and what is wrong with it.
    """
    if not isinstance(spec, dict):
        raise AotSpecError(f'a spec must be a dict, got {type(spec).__name__}')
    name = spec.get('name', '<unnamed>')
    missing = [k for k in _REQUIRED_KEYS if k not in spec]
    if missing:
        raise AotSpecError(f'spec {name!r}: missing key(s) {missing}')
    unknown = sorted(set(spec) - set(_REQUIRED_KEYS) - set(_OPTIONAL_KEYS))
    if unknown:
        raise AotSpecError(f'spec {name!r}: unknown key(s) {unknown}; allowed: '
                           f'{list(_REQUIRED_KEYS) + list(_OPTIONAL_KEYS)}')
    if not isinstance(name, str) or not name:
        raise AotSpecError(f'spec name must be a non-empty string, got {name!r}')
    fn = _as_jit(spec['fn'])
    arg_names = getattr(fn, 'arg_names', None)
    if arg_names is None or not hasattr(fn, 'params'):
        raise AotSpecError(f'spec {name!r}: fn must be a @triton.jit function, got {type(fn).__name__}')

    signature = dict(spec['signature'])
    constexprs = dict(spec.get('constexprs') or {})
    for key in list(signature) + list(constexprs):
        if key not in arg_names:
            raise AotSpecError(f'spec {name!r}: {key!r} is not a parameter of {fn.__name__}{tuple(arg_names)}')
    for key in constexprs:
        signature[key] = 'constexpr'
    for param in fn.params:
        if param.name not in signature:
            if param.is_constexpr and _has_default(param):
                signature[param.name] = 'constexpr'
            else:
                raise AotSpecError(f'spec {name!r}: parameter {param.name!r} of {fn.__name__} is missing '
                                   f'from the signature')
        if signature[param.name] == 'constexpr' and param.name not in constexprs:
            if not _has_default(param):
                raise AotSpecError(f'spec {name!r}: constexpr {param.name!r} of {fn.__name__} has no value '
                                   f'in constexprs and no default')
            constexprs[param.name] = param.default
    for key, ty in signature.items():
        if not isinstance(ty, str) or not ty:
            raise AotSpecError(f'spec {name!r}: type of {key!r} must be a string like "*fp16", "i32", '
                               f'"constexpr"; got {ty!r}')

    # divisibility hints: explicit list, or a ':16' suffix, or (default) every pointer argument
    hinted = {k for k, ty in signature.items() if ty.endswith(':16')}
    signature = {k: (ty[:-3] if ty.endswith(':16') else ty) for k, ty in signature.items()}
    divisibility = spec.get('divisibility')
    if divisibility is None:
        divisibility = [k for k, ty in signature.items() if ty.startswith('*')]
    divisibility = sorted(set(divisibility) | hinted, key=arg_names.index)
    for key in divisibility:
        if key not in signature or signature[key] == 'constexpr':
            raise AotSpecError(f'spec {name!r}: divisibility hint on {key!r}, which is not a runtime argument')

    num_warps = int(spec.get('num_warps', 4))
    num_stages = int(spec.get('num_stages', 3))
    if num_warps <= 0 or num_warps & (num_warps - 1):
        raise AotSpecError(f'spec {name!r}: num_warps must be a power of 2, got {num_warps}')
    if num_stages < 1:
        raise AotSpecError(f'spec {name!r}: num_stages must be >= 1, got {num_stages}')
    caps = tuple(int(c) for c in spec.get('capabilities') or DEFAULT_CAPABILITIES)
    return {
        'name': name, 'fn': fn, 'signature': signature, 'constexprs': constexprs,
        'num_warps': num_warps, 'num_stages': num_stages, 'capabilities': caps,
        'default': bool(spec.get('default', True)), 'divisibility': divisibility,
        'options': dict(spec.get('options') or {}), 'module': spec.get('module', ''),
        'module_file': spec.get('module_file', ''),
    }


_JIT_OF: Dict[Any, Any] = {}


def _as_jit(fn: Any) -> Any:
    """The compiler form of a kernel: the ``@triton.jit`` function under ``@triton.heuristics`` /
    ``@triton.autotune`` wrappers (their values are the spec's constexprs), and for a module imported under
    ``TRITON_INTERPRET=1``, which holds ``InterpretedFunction`` objects that ``triton.compile`` cannot take,
    a compiler-form copy."""
    while type(fn).__name__ in ('Heuristics', 'Autotuner'):
        fn = fn.fn
    if hasattr(fn, 'params') or not hasattr(fn, 'fn') or not hasattr(fn, 'rewriter'):
        return fn
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    if not isinstance(fn, InterpretedFunction):
        return fn
    if fn.fn not in _JIT_OF:
        _JIT_OF[fn.fn] = JITFunction(fn.fn)
    return _JIT_OF[fn.fn]


def _has_default(param: Any) -> bool:
    return param.default is not inspect.Parameter.empty


# ----------------------------------------------------------------------------------------------
# compilation

_TMP_CACHE: Optional[str] = None


def _default_cache_dir() -> str:
    """A per-process temporary Triton cache, removed at exit."""
    global _TMP_CACHE
    if _TMP_CACHE is None:
        _TMP_CACHE = tempfile.mkdtemp(prefix='vision_priors_aot_')
        atexit.register(shutil.rmtree, _TMP_CACHE, True)
    return _TMP_CACHE


def ptxas_path(capability: int) -> str:
    """Path of the ``ptxas`` Triton uses for this target (its bundled one unless TRITON_PTXAS_PATH)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(capability).path
    except Exception:  # pragma: no cover - older/newer layouts
        import triton
        name = 'ptxas-blackwell' if capability >= 100 else 'ptxas'
        return str(Path(triton.__file__).parent / 'backends' / 'nvidia' / 'bin' / name)


def _sm_arch(capability: int) -> str:
    try:
        from triton.backends.nvidia.compiler import sm_arch_from_capability
        return sm_arch_from_capability(capability)
    except Exception:  # pragma: no cover
        return f'sm_{capability}' + ('a' if capability >= 90 else '')


def parse_ptxas_log(log: str) -> Dict[str, int]:
    """Registers (max over functions), spill stores / loads, stack and static smem (sums) from ``ptxas -v``.

    Raises:
        ValueError: if the log has no register count (not a ``ptxas -v`` log).
    """
    regs = [int(x) for x in re.findall(r'Used (\d+) registers', log)]
    if not regs:
        raise ValueError(f'no "Used N registers" line in the ptxas log:\n{log}')

    def total(pattern: str) -> int:
        return sum(int(x) for x in re.findall(pattern, log))

    return {
        'registers': max(regs),
        'spill_store_bytes': total(r'(\d+) bytes spill stores'),
        'spill_load_bytes': total(r'(\d+) bytes spill loads'),
        'stack_bytes': total(r'(\d+) bytes stack frame'),
        'static_shared_bytes': total(r'(\d+) bytes smem'),
    }


def ptxas_resources(ptx: str, capability: int, options: Any = None) -> Dict[str, int]:
    """Run Triton's ``ptxas -v`` (same flags as Triton's own cubin step) on PTX; return the parsed usage.

    Raises:
        RuntimeError: if ptxas fails (with its log).
    """
    cmd = [ptxas_path(capability), '-lineinfo', '-v', '--regAllocOptLevel=2']
    if options is not None and not getattr(options, 'enable_fp_fusion', True):
        cmd.append('--fmad=false')
    extra = getattr(options, 'ptx_options', None) if options is not None else None
    if extra:
        cmd += extra.split(' ')
    with tempfile.TemporaryDirectory(prefix='vp_ptxas_') as tmp:
        src = os.path.join(tmp, 'k.ptx')
        with open(src, 'w') as f:
            f.write(ptx)
        cmd += [f'--gpu-name={_sm_arch(capability)}', src, '-o', os.path.join(tmp, 'k.cubin')]
        res = subprocess.run(cmd, capture_output=True, text=True)
    log = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f'ptxas failed ({res.returncode}): {" ".join(cmd)}\n{log}')
    return parse_ptxas_log(log)


def cubin_resources(cubin: bytes) -> Dict[str, int]:
    """Registers, stack, static shared and local bytes of a cubin's kernel (``cuobjdump --dump-resource-usage``).

    A cross-check of :func:`ptxas_resources`: it reads the binary Triton produced.
    """
    import triton
    tool = Path(triton.__file__).parent / 'backends' / 'nvidia' / 'bin' / 'cuobjdump'
    with tempfile.TemporaryDirectory(prefix='vp_cuobjdump_') as tmp:
        path = os.path.join(tmp, 'k.cubin')
        with open(path, 'wb') as f:
            f.write(cubin)
        res = subprocess.run([str(tool), '--dump-resource-usage', path], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f'cuobjdump failed ({res.returncode}): {res.stdout}{res.stderr}')
    fields = dict(re.findall(r'\b(REG|STACK|SHARED|LOCAL):(\d+)', res.stdout))
    if 'REG' not in fields:
        raise RuntimeError(f'no resource usage in cuobjdump output:\n{res.stdout}')
    return {k.lower(): int(v) for k, v in fields.items()}


def compile_kernel(spec: Dict[str, Any], capability: int, cache_dir: Optional[str] = None) -> Any:
    """``triton.compile`` one (normalized or raw) spec for ``cuda:capability``; returns the CompiledKernel.

    Raises:
        AotSpecError: malformed spec.
        AotCompileError: Triton or ptxas failed; the message names the spec and target.
    """
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = normalize_spec(spec)
    fn = spec['fn']
    attrs = {(fn.arg_names.index(k),): [['tt.divisibility', 16]] for k in spec['divisibility']}
    options = dict(spec['options'], num_warps=spec['num_warps'], num_stages=spec['num_stages'])
    try:
        with knobs.cache.scope():
            knobs.cache.dir = cache_dir or _default_cache_dir()
            src = ASTSource(fn, spec['signature'], spec['constexprs'], attrs)
            return triton.compile(src, target=GPUTarget('cuda', capability, 32), options=options)
    except Exception as exc:
        hint = ''
        if os.environ.get('TRITON_INTERPRET', '0') not in ('', '0'):
            hint = (' [TRITON_INTERPRET is set: kernels imported in interpreter mode call interpreted '
                    'helpers; compile in a fresh process, e.g. compile_all(..., jobs=2)]')
        raise AotCompileError(f'spec {spec["name"]!r} ({fn.__name__}, sm_{capability}, '
                              f'num_warps={spec["num_warps"]}, num_stages={spec["num_stages"]}, '
                              f'constexprs={spec["constexprs"]}) failed to compile: '
                              f'{type(exc).__name__}: {_short(exc)}{hint}') from exc


def compile_spec(spec: Dict[str, Any], capability: int, cache_dir: Optional[str] = None) -> CompileReport:
    """Compile one spec for ``sm_<capability>`` and report its resources.

    Args:
        spec: a spec dict (see the module docstring).
        capability: compute capability, e.g. 80 (A100) or 90 (H100 / H200).
        cache_dir: Triton cache directory (default: a per-process temporary one).

    Returns:
        The :class:`CompileReport`.

    Raises:
        AotSpecError: malformed spec.
        AotCompileError: Triton or ptxas failed; the message names the spec and target.
    """
    spec = normalize_spec(spec)
    start = time.perf_counter()
    kernel = compile_kernel(spec, capability, cache_dir)
    ptx, cubin = kernel.asm['ptx'], kernel.asm['cubin']
    try:
        usage = ptxas_resources(ptx, capability, _options_of(kernel))
    except Exception as exc:
        raise AotCompileError(f'spec {spec["name"]!r} (sm_{capability}): ptxas -v on the PTX failed: '
                              f'{_short(exc)}') from exc
    elapsed = time.perf_counter() - start
    return CompileReport(
        name=spec['name'], capability=capability, registers=usage['registers'],
        spill_store_bytes=usage['spill_store_bytes'], spill_load_bytes=usage['spill_load_bytes'],
        shared_bytes=usage['static_shared_bytes'] + int(kernel.metadata.shared or 0),
        ptx_size=len(ptx), cubin_size=len(cubin), kernel=spec['fn'].__name__, module=spec['module'],
        num_warps=spec['num_warps'], num_stages=spec['num_stages'], stack_bytes=usage['stack_bytes'],
        default=spec['default'], compile_seconds=elapsed)


def _options_of(kernel: Any) -> Any:
    meta = kernel.metadata
    return type('Opts', (), {'enable_fp_fusion': getattr(meta, 'enable_fp_fusion', True),
                             'ptx_options': getattr(meta, 'ptx_options', None)})()


def _short(exc: BaseException, limit: int = 4000) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + f'... [{len(text) - limit} more characters]'


# ----------------------------------------------------------------------------------------------
# discovery

def discover_specs(directory: Optional[Path] = None, errors: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    """Specs of every kernel module (``*.py`` defining ``aot_specs``) in ``directory``.

    Args:
        directory: where to look (default: the ``vision_priors.kernels`` package, imported as
            ``vision_priors.kernels.<name>``; another directory's files are loaded by path).
            ``__init__.py``, ``aot.py`` and private modules (``_*.py``) are skipped;
            a module that does not exist is simply not found, and one without ``aot_specs`` adds nothing.
        errors: if given, a module that fails to import, whose ``aot_specs()`` raises, or whose specs
            are malformed is recorded here (module name -> message) and skipped instead of raising.

    Returns:
        Normalized spec dicts (see :func:`normalize_spec`) with ``'module'`` (the file's stem) and
        ``'module_file'`` set, sorted by module then in each module's order.

    Raises:
        AotSpecError: a module failed (when ``errors`` is None) or two specs share a name.
    """
    directory = Path(directory).resolve() if directory is not None else kernels_dir()
    specs: List[Dict[str, Any]] = []
    seen: Dict[str, str] = {}
    for path in sorted(directory.glob('*.py')):
        if path.name in ('__init__.py', 'aot.py') or path.name.startswith('_'):
            continue
        try:
            module = _import(path)
            if not hasattr(module, 'aot_specs'):
                continue
            found = [dict(normalize_spec(s), module=path.stem, module_file=str(path)) for s in module.aot_specs()]
        except Exception as exc:  # noqa: BLE001 - reported with the module's name
            msg = f'{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}'
            if errors is None:
                raise AotSpecError(f'kernel module {path.stem!r}: {msg}') from exc
            errors[path.stem] = msg
            continue
        for spec in found:
            if spec['name'] in seen:
                raise AotSpecError(f'spec name {spec["name"]!r} is defined twice ({seen[spec["name"]]} and '
                                   f'{path.stem}); names must be unique')
            seen[spec['name']] = path.stem
        specs.extend(found)
    return specs


def _import(path: Path) -> Any:
    """Import a kernel module: ``vision_priors.kernels.<stem>`` from that package, else by path under a unique name."""
    path = Path(path).resolve()
    if path.parent == kernels_dir():
        return importlib.import_module(f'{_KERNELS_PACKAGE}.{path.stem}')
    modname = f'_vp_aot_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}'
    loader_spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[modname] = module  # triton.jit reads the source through the module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[modname]
        raise
    return module


SUMMARY_KEYS = ('name', 'module', 'module_file', 'capabilities', 'default', 'num_warps', 'num_stages')


def summarize(spec: Dict[str, Any]) -> Dict[str, Any]:
    """The picklable part of a normalized spec (no Triton function): what :func:`compile_all`'s worker
    processes need to find the spec again, plus its launch parameters and kernel name."""
    return dict({k: spec[k] for k in SUMMARY_KEYS}, kernel=spec['fn'].__name__)


def discover_specs_isolated(directory: Optional[Path] = None,
                            errors: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    """:func:`discover_specs` in a fresh process; returns :func:`summarize` records.

    The kernel modules are then never imported into this process, so they cannot be imported here in
    the wrong Triton mode (``@triton.jit`` chooses the interpreter or the compiler at import time from
    ``TRITON_INTERPRET``; test modules of the kernels set it when there is no GPU). The child process
    imports them with ``TRITON_INTERPRET`` unset.

    Raises:
        AotSpecError: as :func:`discover_specs` (a module's failure only when ``errors`` is None).
    """
    import concurrent.futures
    import multiprocessing
    ctx = multiprocessing.get_context('spawn')
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        records, child_errors = pool.submit(_discover_worker, str(directory) if directory else None).result()
    if child_errors and errors is None:
        mod, msg = next(iter(child_errors.items()))
        raise AotSpecError(f'kernel module {mod!r}: {msg}')
    if errors is not None:
        errors.update(child_errors)
    return records


def _discover_worker(directory: Optional[str]) -> Tuple[List[Dict[str, Any]], Dict[str, str]]:
    os.environ.pop('TRITON_INTERPRET', None)
    errors: Dict[str, str] = {}
    specs = discover_specs(Path(directory) if directory else None, errors=errors)
    return [summarize(s) for s in specs], errors


def compile_all(specs: Sequence[Dict[str, Any]], capabilities: Sequence[int] = DEFAULT_CAPABILITIES,
                cache_dir: Optional[str] = None, jobs: int = 1) -> List[Any]:
    """Compile every spec for each of its capabilities in ``capabilities``.

    Args:
        specs: spec dicts, or :func:`summarize` records (from :func:`discover_specs_isolated`), which
            are always compiled in worker processes. Worker processes re-import the spec's module
            (``module_file``, set by discovery) and look the spec up by name.
        capabilities: targets; a spec is compiled only for those in its own ``capabilities``.
        cache_dir: Triton cache directory (default: a temporary one per process).
        jobs: worker processes (spawned; each pays one torch / triton import, a few seconds); with
            ``jobs <= 1`` full specs compile in this process.

    Returns:
        One entry per (spec, capability), in order: a :class:`CompileReport`, or the
        :class:`AotCompileError` / :class:`AotSpecError` raised for it (so one failure does not hide
        the others).
    """
    prepared = [normalize_spec(s) if 'fn' in s else s for s in specs]
    tasks = [(spec, cap) for spec in prepared for cap in capabilities
             if cap in tuple(spec.get('capabilities') or DEFAULT_CAPABILITIES)]
    if not tasks:
        return []
    if jobs <= 1 and all('fn' in spec for spec, _ in tasks):
        return [_compile_or_error(spec, cap, cache_dir) for spec, cap in tasks]
    missing = [spec['name'] for spec, _ in tasks if not spec.get('module_file')]
    if missing:
        raise AotSpecError(f'compiling in worker processes needs specs from discovery (module_file set); '
                           f'not: {missing[:5]}')
    import concurrent.futures
    import multiprocessing
    cache_dir = cache_dir or _default_cache_dir()  # the workers' exit skips atexit: share ours
    ctx = multiprocessing.get_context('spawn')  # no fork of a process that holds LLVM / torch threads
    with concurrent.futures.ProcessPoolExecutor(max(1, min(jobs, len(tasks))), mp_context=ctx) as pool:
        futures = [pool.submit(_compile_by_name, spec['module_file'], spec['name'], cap, cache_dir)
                   for spec, cap in tasks]
        out = []
        for (spec, cap), fut in zip(tasks, futures):
            try:
                out.append(fut.result())
            except Exception as exc:  # noqa: BLE001 - a crashed worker is reported for its spec
                out.append(AotCompileError(f'spec {spec["name"]!r} (sm_{cap}): worker failed: '
                                           f'{type(exc).__name__}: {_short(exc)}'))
        return out


def _compile_or_error(spec: Dict[str, Any], capability: int, cache_dir: Optional[str]) -> Any:
    try:
        return compile_spec(spec, capability, cache_dir)
    except (AotCompileError, AotSpecError) as exc:
        return exc


def _compile_by_name(module_file: str, name: str, capability: int, cache_dir: Optional[str]) -> Any:
    """Worker of :func:`compile_all`: import the module, find the spec, compile; errors as values."""
    os.environ.pop('TRITON_INTERPRET', None)  # @triton.jit must build compiler-form kernels here
    try:
        module = _import(Path(module_file))
        matches = [s for s in module.aot_specs() if s.get('name') == name]
        if len(matches) != 1:
            raise AotSpecError(f'spec {name!r}: found {len(matches)} times in {module_file} by the worker '
                               f'process (did the module change since discovery?)')
        spec = dict(normalize_spec(matches[0]), module=Path(module_file).stem, module_file=module_file)
    except AotSpecError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001
        return AotSpecError(f'spec {name!r}: importing {module_file} failed: {type(exc).__name__}: {exc}')
    result = _compile_or_error(spec, capability, cache_dir)
    if isinstance(result, Exception):  # keep only the message: the cause chain may not pickle
        return type(result)(str(result))
    return result


def default_jobs() -> int:
    """Worker count for :func:`compile_all`: ``VISION_PRIORS_AOT_JOBS``, else the usable CPUs."""
    env = os.environ.get('VISION_PRIORS_AOT_JOBS')
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: compile every discovered spec; exit 1 on a compile error or a violated constraint."""
    import argparse
    parser = argparse.ArgumentParser(description='AOT-compile every kernel spec (no GPU needed).')
    parser.add_argument('--capability', type=int, nargs='+', default=list(DEFAULT_CAPABILITIES))
    parser.add_argument('--jobs', type=int, default=default_jobs(), help='worker processes')
    args = parser.parse_args(argv)
    errors: Dict[str, str] = {}
    specs = discover_specs(errors=errors)
    bad = len(errors)
    for mod, msg in errors.items():
        print(f'ERROR importing {_KERNELS_PACKAGE}.{mod}: {msg}')
    for item in compile_all(specs, args.capability, jobs=args.jobs):
        if isinstance(item, Exception):
            bad += 1
            print(f'ERROR {item}')
            continue
        problems = item.problems()
        bad += bool(problems)
        print(f'{item.name} sm_{item.capability}: {item.registers} regs, spills {item.spill_store_bytes}/'
              f'{item.spill_load_bytes} B, smem {item.shared_bytes} B, {item.compile_seconds:.1f} s'
              + ''.join(f'\n  PROBLEM {p}' for p in problems))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
