"""Backend selection shared by the LAVO and Chamfer ops: Triton on CUDA (or the interpreter) vs PyTorch.

Precedence: an explicit ``backend='triton'|'torch'`` argument, then the environment variable
``VISION_PRIORS_KERNELS=triton|torch``, then 'auto' (Triton when every tensor is on CUDA and Triton
imports, PyTorch otherwise). With ``TRITON_INTERPRET=1`` set *before* Triton is first imported,
'triton' also runs on CPU tensors (Triton's interpreter).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

try:  # Triton is optional: without it every op falls back to its PyTorch reference.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the platform
    HAS_TRITON = False

ENV_VAR = 'VISION_PRIORS_KERNELS'
BACKENDS = ('auto', 'triton', 'torch')


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


def resolve_backend(backend: str, *tensors: Optional[torch.Tensor]) -> str:
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


# Tests set this to 'ieee' so that float32 products are exact on a GPU as in the interpreter.
FORCE_DOT_PRECISION: Optional[str] = None


def gpu_dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """``tl.dot`` input precision on a GPU for kernels whose inputs have ``dtype``.

    'tf32' for 16-bit inputs (float32 intermediates multiplied in TF32 lose about what the inputs' own
    rounding does; 16-bit operands ignore the setting) and for float32 when ``allow_tf32``; otherwise
    'tf32x3' (three TF32 products: float32 accuracy on tensor cores, where Triton's 'ieee' float32
    dot is an FMA loop that needs far more registers).
    """
    return 'tf32x3' if dtype == torch.float32 and not allow_tf32 else 'tf32'


def dot_precision(dtype: torch.dtype) -> str:
    """The runtime's ``tl.dot`` input precision: :data:`FORCE_DOT_PRECISION` if set, 'ieee' in the
    interpreter, else :func:`gpu_dot_precision` with ``torch.backends.cuda.matmul.allow_tf32``."""
    if FORCE_DOT_PRECISION is not None:
        return FORCE_DOT_PRECISION
    if interpreting():
        return 'ieee'
    return gpu_dot_precision(dtype, torch.backends.cuda.matmul.allow_tf32)


def next_pow2(n: int, floor: int = 16) -> int:
    """Smallest power of two >= max(n, floor)."""
    p = floor
    while p < n:
        p *= 2
    return p


# Tests set this to True: every buffer a kernel should fully write starts as NaN (floats) or the most
# negative integer, so an element a kernel forgets to write shows up.
POISON_OUTPUTS = False


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs and intermediates; poisoned when :data:`POISON_OUTPUTS` is set."""
    if not POISON_OUTPUTS:
        return torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        return torch.full(shape, float('nan'), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


TORCH_TO_TRITON = {torch.float16: 'fp16', torch.bfloat16: 'bf16', torch.float32: 'fp32'}


def nonfinite_message(t: torch.Tensor, name: str) -> str:
    """``'<name> must be finite: <name>[i, j, k] = nan'`` for the first NaN / inf entry of ``t``; '' if none.

    Reads ``t`` back to the host: build it only once a cheap ``torch.isfinite(t).all()`` test has failed.
    """
    bad = (~torch.isfinite(t)).nonzero()
    if bad.shape[0] == 0:
        return ''
    pos = tuple(bad[0].tolist())
    return f'{name} must be finite: {name}[{", ".join(str(i) for i in pos)}] = {t[pos].item()}'
