"""The one backend helper module of the kernel ops (flash_prior, lavo, chamfer) and the layers that call them.

What lives here, used by every op:

* Backend selection: Triton on CUDA (or in the interpreter) vs PyTorch. Precedence: an explicit
  ``backend='triton'|'torch'`` argument, then the environment variable ``VISION_PRIORS_KERNELS=triton|torch``,
  then 'auto' (Triton when every tensor is on CUDA and Triton imports, PyTorch otherwise). With
  ``TRITON_INTERPRET=1`` set *before* Triton is first imported, 'triton' also runs on CPU tensors (Triton's
  interpreter): :func:`interpreting`.
* The fp32 ``tl.dot`` precision rule (:func:`dot_precision`), the same for every kernel.
* Allocation of kernel outputs, with the NaN-poison test hook (:data:`POISON_OUTPUTS`, :func:`empty`).
* The torch -> Triton dtype table (:data:`TORCH_TO_TRITON`) and power-of-two tile widths
  (:func:`next_power_of_2`, Triton's ``triton.next_power_of_2`` with a floor).
* The key-mask convention of every public op and layer (:func:`check_key_mask`).
* Ahead-of-time signatures derived from a kernel's parameter list (:func:`aot_signature`, used by the
  modules' ``aot_specs()``; the compile tool itself is ``tools/aot.py``, development tooling outside the
  installed package).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

try:  # Triton is optional: without it every op runs its PyTorch backend.
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ['HAS_TRITON', 'ENV_VAR', 'BACKENDS', 'KEY_MASK_CONVENTION', 'TORCH_TO_TRITON', 'POISON_OUTPUTS',
           'FORCE_DOT_PRECISION', 'interpreting', 'requested_backend', 'resolve_backend', 'dot_precision',
           'gpu_dot_precision', 'next_power_of_2', 'empty', 'check_key_mask', 'nonfinite_message',
           'aot_signature', 'kernel_function']

ENV_VAR = 'VISION_PRIORS_KERNELS'
BACKENDS = ('auto', 'triton', 'torch')


# ------------------------------------------------------------------------------------------------
# backend selection

def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter.

    Triton decides once, when it is first imported (``TRITON_INTERPRET=1`` then), for its whole library;
    setting the variable later has no effect on the already decorated functions, so this looks at the
    library itself rather than at the environment.
    """
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.sum, InterpretedFunction)


def requested_backend(backend: str) -> str:
    """'auto', 'triton' or 'torch': the argument, or the environment variable where the argument is 'auto'.

    Raises:
        ValueError: an unknown backend name (argument or environment variable).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    env = os.environ.get(ENV_VAR, '').strip().lower()
    if env not in ('', 'auto', 'triton', 'torch'):
        raise ValueError(f"{ENV_VAR} must be 'triton', 'torch' or 'auto', got {env!r}")
    if backend == 'auto' and env in ('triton', 'torch'):
        return env
    return backend


def resolve_backend(backend: str, *tensors: Optional[Tensor]) -> str:
    """Returns 'triton' or 'torch' for these tensors (None entries are ignored).

    Raises:
        ValueError: an unknown backend name (argument or environment variable).
        RuntimeError: 'triton' requested where it cannot run (no Triton; CPU tensors without the
            interpreter).
    """
    choice = requested_backend(backend)
    ts = [t for t in tensors if t is not None]
    on_cuda = all(t.is_cuda for t in ts)
    if choice == 'auto':
        return 'triton' if HAS_TRITON and on_cuda and ts else 'torch'
    if choice == 'triton':
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' requested but triton is not importable")
        if not on_cuda and not interpreting():
            devices = sorted({str(t.device) for t in ts})
            raise RuntimeError(
                f"backend='triton' needs CUDA tensors (got {devices}) or Triton's interpreter "
                f"(TRITON_INTERPRET=1 set before triton is first imported)")
    return choice


# ------------------------------------------------------------------------------------------------
# fp32 dot precision: one rule for every kernel

# Test hook: when set ('ieee', 'tf32', 'tf32x3'), every kernel launch uses it (tests set 'ieee').
FORCE_DOT_PRECISION: Optional[str] = None


def gpu_dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """``tl.dot`` input precision on a GPU for kernels whose inputs have ``dtype``: THE rule of every kernel.

    * float32 inputs: 'ieee' (exact float32 products, PyTorch's default for float32 matmuls), or 'tf32'
      where ``allow_tf32`` (``torch.backends.cuda.matmul.allow_tf32``, PyTorch's opt-in to TF32 matmuls).
      Reason: a kernel then multiplies with the precision that the same call's PyTorch backend (cuBLAS)
      would use, so switching the backend never changes the precision class of a float32 result, and the
      exactness tests hold on a GPU as in the interpreter. 3xTF32 ('tf32x3') was the LAVO kernels'
      choice: close to float32 but not IEEE, and it needed a 'tf32' exception for large head dims; it
      stays available only as an explicit opt-in (:data:`FORCE_DOT_PRECISION`, or the
      ``input_precision`` argument of ``flash_prior_attention``). The float32 tile configurations are
      chosen for 'ieee' products (no register spills, ``tests/test_kernels_compile.py``).
    * 16-bit inputs: 'tf32'. Dots of 16-bit operands ignore the setting; dots of float32 intermediates
      made from 16-bit inputs (the LAVO CODE kernels) lose no more in TF32 (10-bit mantissa, as float16)
      than the inputs' own rounding.
    """
    if dtype == torch.float32 and not allow_tf32:
        return 'ieee'
    return 'tf32'


def dot_precision(dtype: torch.dtype) -> str:
    """The runtime's ``tl.dot`` input precision for inputs of ``dtype``: :data:`FORCE_DOT_PRECISION` if set,
    'ieee' in the interpreter (the only one it computes exactly), else :func:`gpu_dot_precision` with
    ``torch.backends.cuda.matmul.allow_tf32``."""
    if FORCE_DOT_PRECISION is not None:
        return FORCE_DOT_PRECISION
    if interpreting():
        return 'ieee'
    return gpu_dot_precision(dtype, torch.backends.cuda.matmul.allow_tf32)


# ------------------------------------------------------------------------------------------------
# tiles, dtypes, allocation

TORCH_TO_TRITON = {torch.float16: 'fp16', torch.bfloat16: 'bf16', torch.float32: 'fp32'}


def next_power_of_2(n: int, floor: int = 16) -> int:
    """``max(floor, triton.next_power_of_2(n))``: a tile width >= n (``tl.dot`` tiles need >= 16)."""
    n = int(n)
    p = triton.next_power_of_2(n) if HAS_TRITON else (1 << max(0, n - 1).bit_length())
    return max(floor, p)


# Test hook: when True, every buffer a kernel should fully write starts as NaN (floats) or the most negative
# integer, so an element a kernel forgets to write shows up.
POISON_OUTPUTS = False


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty`` for kernel outputs and intermediates; poisoned when :data:`POISON_OUTPUTS` is set."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if not POISON_OUTPUTS:
        return torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        return torch.full(shape, float('nan'), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


# ------------------------------------------------------------------------------------------------
# argument checks shared by every op and layer

KEY_MASK_CONVENTION = 'a bool tensor of shape (B, L) with True = valid key'


def check_key_mask(mask: Optional[Tensor], batch: int, length: int, name: str = 'key_mask',
                   device: Optional[torch.device] = None, valid: str = 'key') -> Optional[Tensor]:
    """THE key-mask check of every public op and layer: ``mask`` is None or a bool (B, L) tensor, True = valid.

    The convention everywhere: ``key_mask`` of shape (batch, number of keys), True where the key is a real
    token (attended to, counted in LAVO's mean), False where it is padding. Chamfer's ``x_mask`` /
    ``y_mask`` (True = valid point) use the same check with ``valid='point'``. TorchScript compiles it.

    Args:
        mask: The mask or None.
        batch, length: The expected (B, L).
        name: The argument's name, used in the messages.
        device: If given (eager only), the device the mask must be on.
        valid: What True marks ('key', or 'point' for Chamfer), used in the messages.

    Returns:
        ``mask`` unchanged.

    Raises:
        TypeError: not a bool tensor, stating the convention
            ("key_mask must be a bool tensor of shape (B, L) = (2, 8) with True = valid key, got torch.float32 (2, 8)").
        ValueError: the wrong shape (same message) or another device.
    """
    if mask is None:
        return mask
    if not torch.jit.is_scripting():
        if not isinstance(mask, Tensor):
            raise TypeError(f'{name} must be a bool tensor of shape (B, L) = ({batch}, {length}) with True = '
                            f'valid {valid}, got {type(mask).__name__}')
        got = f'got {mask.dtype} {tuple(mask.shape)}'
        if mask.dtype != torch.bool:
            raise TypeError(f'{name} must be a bool tensor of shape (B, L) = ({batch}, {length}) with True = '
                            f'valid {valid}, {got}')
        if tuple(mask.shape) != (batch, length):
            raise ValueError(f'{name} must be a bool tensor of shape (B, L) = ({batch}, {length}) with True = '
                             f'valid {valid}, {got}')
        if device is not None and mask.device != torch.device(device):
            raise ValueError(f'{name} is on {mask.device} but the inputs are on {device}')
    else:
        if mask.dtype != torch.bool:
            raise TypeError(name + ' must be a bool tensor of shape (B, L) with True = valid ' + valid)
        if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] != length:
            raise ValueError(name + ' must be a bool tensor of shape (B, L) with True = valid ' + valid)
    return mask


def nonfinite_message(t: Tensor, name: str) -> str:
    """``'<name> must be finite: <name>[i, j, k] = nan'`` for the first NaN / inf entry of ``t``; '' if none.

    Reads ``t`` back to the host: build it only once a cheap ``torch.isfinite(t).all()`` test has failed.
    """
    bad = (~torch.isfinite(t)).nonzero()
    if bad.shape[0] == 0:
        return ''
    pos = tuple(bad[0].tolist())
    return f'{name} must be finite: {name}[{", ".join(str(i) for i in pos)}] = {t[pos].item()}'


# ------------------------------------------------------------------------------------------------
# ahead-of-time signatures, derived from the kernels

def kernel_function(kernel: Any) -> Any:
    """The ``@triton.jit`` function under ``@triton.heuristics`` / ``@triton.autotune`` wrappers."""
    fn = kernel
    while not hasattr(fn, 'arg_names') or type(fn).__name__ in ('Heuristics', 'Autotuner'):
        fn = fn.fn
    return fn


_PARAMS_OF: Dict[Any, List[Any]] = {}


def _kernel_params(fn: Any) -> List[Any]:
    """A ``@triton.jit`` function's parameters (``KernelParam``), also for the interpreter's form."""
    if hasattr(fn, 'params'):
        return list(fn.params)
    if fn.fn not in _PARAMS_OF:  # InterpretedFunction (TRITON_INTERPRET=1): parse the same source
        from triton.runtime.jit import JITFunction
        _PARAMS_OF[fn.fn] = list(JITFunction(fn.fn).params)
    return _PARAMS_OF[fn.fn]


def aot_signature(kernel: Any, pointer_types: Dict[str, str], absent: Iterable[str] = (),
                  float_scalars: Iterable[str] = ('scale', 'sm_scale'),
                  constexprs: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, str], Dict[str, Any]]:
    """A kernel's ahead-of-time signature and constexprs, derived from its parameter list.

    The kernels follow one layout: their pointer parameters come first, up to the first scalar
    parameter written in lower case (a ``stride_*`` or the logit scale); every later non-constexpr
    parameter is an int32 size or stride, except ``float_scalars`` (fp32). Pointers are '*fp32' unless
    ``pointer_types`` names another element type (e.g. the input dtype for q / k / v / out, '*u8' for
    masks). Optional pointers listed in ``absent`` are passed as None, which Triton specialises as a
    constexpr None; the kernel's ``@triton.heuristics`` then compute their flags (``HAS_*``) from the same
    arguments the runtime would pass.

    Args:
        kernel: The ``@triton.jit`` kernel (possibly under ``@triton.heuristics``).
        pointer_types: Pointer parameter -> element type ('*fp16', '*u8', ...) where not '*fp32'; names
            this kernel does not have are skipped (one table can serve a kernel family).
        absent: Optional pointer parameters passed as None.
        float_scalars: Scalar parameters that are fp32.
        constexprs: Values of the other constexpr parameters (tiles, flags).

    Returns:
        (signature {param: type}, constexprs {param: value}) for ``tools/aot.py``.

    Raises:
        ValueError: a name in ``pointer_types`` / ``absent`` that is not one of the kernel's pointer
            parameters, or a constexpr without a value.
    """
    fn = kernel_function(kernel)
    params = _kernel_params(fn)
    constexprs = dict(constexprs or {})
    absent = set(absent)
    float_scalars = set(float_scalars)
    num_ptrs = 0  # the leading run of capitalised, non-constexpr parameters
    for p in params:
        if p.is_constexpr or p.name != p.name.upper() or p.name in float_scalars:
            break
        num_ptrs += 1
    pointers = {p.name for p in params[:num_ptrs]}
    names = {p.name for p in params}
    # a type table may serve several kernels (names a kernel lacks are skipped), but it must not name a
    # scalar; every absent tensor must be one of this kernel's pointers
    unknown = ((set(pointer_types) & names) | absent) - pointers
    if unknown:
        raise ValueError(f'{fn.__name__}: {sorted(unknown)} are not pointer parameters '
                         f'(pointers: {[p.name for p in params[:num_ptrs]]})')
    signature: Dict[str, str] = {}
    for i, p in enumerate(params):
        if p.is_constexpr:
            signature[p.name] = 'constexpr'
        elif p.name in absent:
            signature[p.name] = 'constexpr'
            constexprs[p.name] = None
        elif i < num_ptrs:
            signature[p.name] = pointer_types.get(p.name, '*fp32')
        elif p.name in float_scalars:
            signature[p.name] = 'fp32'
        else:
            signature[p.name] = 'i32'
    heuristics = getattr(kernel, 'values', None) if type(kernel).__name__ == 'Heuristics' else None
    if heuristics:
        args = {p.name: (None if p.name in absent else object()) for p in params}
        args.update(constexprs)
        for name, rule in heuristics.items():
            constexprs[name] = rule(args)
    missing = [p.name for p in params if p.is_constexpr and p.name not in constexprs and not p.has_default]
    if missing:
        raise ValueError(f'{fn.__name__}: no value for the constexpr(s) {missing}')
    return signature, constexprs
