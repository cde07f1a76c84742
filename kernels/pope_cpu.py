"""PoPE attention for CPU inference as a compiled C++ op (``kernels/pope_cpu.cpp``).

The op computes exactly what ``vision_priors.layers.pope.pope_cpu_inference_attention`` (its plain
PyTorch twin and reference, same signature) computes, in float32: per sample the width-2d softplus-phase
features of q and k in one pass, then per head group QK^T (ATen/MKL), a fused row softmax, and PV
with v at width d. It removes the seven-op softplus, the broadcast feature products and the Python loop
of the torch-op version (``./run.sh bench pope_cpu_attention`` times all three paths).

It is built on first use with ``torch.utils.cpp_extension`` (a C++ compiler with OpenMP and ``ninja``;
about 15 s, then cached under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). Where it
cannot be built, :func:`load_pope_cpu_op` warns once and returns None and the layers keep the torch-op
path; ``VISION_PRIORS_KERNELS=torch`` (or ``kernel_backend='torch'``) skips it altogether. The layers also skip
it on CPUs where its code lost to the torch-op twin (``vision_priors.layers.pope.COMPILED_OP_FASTER_ON``:
it wins with AVX-512, loses with AVX2 + FMA); :func:`compiled_op_isa` says which code this CPU runs.
"""
from __future__ import annotations

import os
import re
import threading
import warnings
from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ['SOURCE', 'check_inputs', 'compiled_op_isa', 'load_pope_cpu_op', 'pope_cpu_attention']

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'pope_cpu.cpp')
# torch's extension cache keys builds by name and source hash, not by torch version: the version goes in
# the name so that an upgraded torch builds afresh instead of loading a library built against another ABI
EXTENSION_NAME = 'vision_priors_pope_cpu_' + re.sub(r'\W', '_', torch.__version__)
# VISION_PRIORS_POPE_CPU_ISA=x86-64-v3 (or x86-64-v4) builds the op for that ISA only instead of runtime clones:
# a measuring aid (time the AVX2 + FMA code on an AVX-512 CPU); the CPU must support the ISA.
PINNED_ISAS = {'x86-64-v3': '-DVP_PIN_X86_64_V3', 'x86-64-v4': '-DVP_PIN_X86_64_V4'}

# logits kept per matmul: about one core's L2 cache (the torch-op twin uses the same budget)
DEFAULT_LOGITS_BYTES = 2 ** 21

_lock = threading.Lock()
_op: Optional[Callable[..., Tensor]] = None
_build_error: Optional[str] = None


def load_pope_cpu_op() -> Optional[Callable[..., Tensor]]:
    """The registered op ``torch.ops.vision_priors_cpu.pope_attention``, building it on the first call;
    None (with one warning saying why) where it cannot be built."""
    global _op, _build_error
    if _op is not None or _build_error is not None:
        return _op
    with _lock:
        if _op is None and _build_error is None:
            try:
                from torch.utils import cpp_extension
                pinned = os.environ.get('VISION_PRIORS_POPE_CPU_ISA', '')
                if pinned and pinned not in PINNED_ISAS:
                    raise ValueError(f'VISION_PRIORS_POPE_CPU_ISA must be one of {sorted(PINNED_ISAS)}, got {pinned!r}')
                flags = [PINNED_ISAS[pinned]] if pinned else []
                cpp_extension.load(
                    name=EXTENSION_NAME + (f'_{pinned.replace("-", "_")}' if pinned else ''), sources=[SOURCE],
                    extra_cflags=['-O3', '-fopenmp'] + flags,
                    extra_ldflags=['-fopenmp'], is_python_module=False, verbose=False)
                _op = torch.ops.vision_priors_cpu.pope_attention
            except Exception as exc:  # no compiler, no ninja, no OpenMP: keep the torch-op path
                _build_error = f'{type(exc).__name__}: {exc}'
                warnings.warn(
                    f'vision_priors: the compiled PoPE CPU attention ({SOURCE}) could not be built, so PoPE '
                    f'CPU inference uses the slower torch-op path. Cause: {_build_error[:500]}', RuntimeWarning)
    return _op


def compiled_op_isa() -> Optional[str]:
    """The instruction set of the op's code on this CPU: 'x86-64-v4' (AVX-512), 'x86-64-v3' (AVX2 + FMA),
    'x86-64' (baseline) or 'native' (a compiler without target_clones); None where the op cannot be built."""
    if load_pope_cpu_op() is None:
        return None
    return str(torch.ops.vision_priors_cpu.pope_isa())


def check_inputs(q: Tensor, k: Tensor, v: Tensor, q_table: Tensor, k_table: Tensor) -> None:
    """Raise ValueError naming the offending device, dtype or shape before the compiled op sees the inputs.

    The op checks the same things itself (``TORCH_CHECK``), but an exception thrown inside a compiled
    extension crossed back into Python as a segmentation fault under torch 2.11 on the H200 machine
    (``benchmarks/results/h200_2026-12-04/pytest_pope_cpu.log``), so callers never rely on that path.
    """
    if not all(t.device.type == 'cpu' for t in (q, k, v)):
        raise ValueError(f'pope_cpu_attention: CPU tensors expected, got {q.device} / {k.device} / {v.device}')
    if not all(t.dtype == torch.float32 for t in (q, k, v, q_table, k_table)):
        raise ValueError(f'pope_cpu_attention: float32 tensors expected, got q {q.dtype}, k {k.dtype}, v {v.dtype}, '
                         f'tables {q_table.dtype} / {k_table.dtype}')
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f'pope_cpu_attention: q, k, v must all be (B, H, N, d), got {tuple(q.shape)}, '
                         f'{tuple(k.shape)}, {tuple(v.shape)}')
    B, H, N, d = q.shape
    for name, table in (('q_table', q_table), ('k_table', k_table)):
        t = table.unsqueeze(0) if table.dim() == 4 else table
        if not (t.dim() == 5 and t.shape[0] in (1, B) and t.shape[1] in (1, H) and tuple(t.shape[2:]) == (N, 2, d)):
            raise ValueError(f'pope_cpu_attention: {name} of shape {tuple(table.shape)} does not match B={B}, H={H}, '
                             f'N={N}, d={d}: expected (1 or H, N, 2, d) or (B, 1 or H, N, 2, d)')


def pope_cpu_attention(q: Tensor, k: Tensor, v: Tensor, q_table: Tensor, k_table: Tensor,
                       logits_bytes: int = DEFAULT_LOGITS_BYTES) -> Tensor:
    """PoPE attention on CPU, float32, without autograd (see the module docstring).

    Args:
        q, k: (B, H, N, d) pre-softplus queries and keys.
        v: (B, H, N, d) values.
        q_table, k_table: ``phase_table`` outputs, (1 or H, N, 2, d) shared or (B, 1 or H, N, 2, d) per
            sample; the attention scale is folded into ``q_table``.
        logits_bytes: Heads per matmul are as many as keep their (N, N) logits within this (one at least).

    Returns:
        (B, H, N, d), a view of a (B, N, H, d) tensor.

    Raises:
        RuntimeError: the op could not be built, or an input needs gradients (the op has no backward).
        ValueError: wrong device, dtype or shapes (the message names them; :func:`check_inputs`).
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, q_table, k_table)):
        raise RuntimeError('pope_cpu_attention has no backward: call it under torch.no_grad() / '
                           'torch.inference_mode(), or use the SDPA path for training')
    check_inputs(q, k, v, q_table, k_table)
    op = load_pope_cpu_op()
    if op is None:
        raise RuntimeError(f'the compiled PoPE CPU attention is unavailable ({_build_error})')
    return op(q, k, v, q_table, k_table, int(logits_bytes))
