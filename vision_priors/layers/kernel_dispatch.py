"""When the attention layers hand their fused path to the Triton kernels in ``kernels/`` (issue 6).

One rule for every layer: the Triton op runs when the backend resolves to Triton (``kernel_backend``
argument 'auto' | 'triton' | 'torch', then the ``VISION_PRIORS_KERNELS`` environment variable; 'auto'
means Triton on CUDA tensors for the layers whose kernels beat their SDPA path, see
``AUTO_PICKS_KERNEL``), and the call is one the kernel computes exactly: no attention dropout
while training, and a general ``attn_mask`` that is either absent or a boolean (B, 1, 1, N) one (which
is a key mask). Everything else (TorchScript, torch.fx tracing, CPU tensors without the interpreter,
general masks) keeps the exact PyTorch path.

Key masks: every layer and op takes ``key_mask`` (B, N) bool, True = valid key (``check_key_mask``).
On the SDPA / dense paths :func:`key_mask_to_attn_mask` folds it into the general SDPA ``attn_mask``;
on the kernel path :func:`kernel_key_mask` merges it with a (B, 1, 1, N) boolean ``attn_mask``. Either
way a query without any valid key outputs zeros (the kernels' rule), never NaN.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from vision_priors.kernels._backend import BACKENDS, requested_backend, resolve_backend

__all__ = ['AUTO_PICKS_KERNEL', 'KERNEL_BACKENDS', 'check_kernel_backend', 'kernel_key_mask', 'key_mask_to_attn_mask',
           'tracing_or_compiling', 'use_flash_kernel']

KERNEL_BACKENDS = BACKENDS


def check_kernel_backend(backend: str) -> str:
    """Validate a layer's ``kernel_backend`` argument."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f'kernel_backend must be one of {KERNEL_BACKENDS}, got {backend!r}')
    return backend


def kernel_key_mask(key_mask: Optional[Tensor], attn_mask: Optional[Tensor]) -> Optional[Tensor]:
    """The kernels' (B, N) ``key_mask`` (True = valid key) from a layer's ``key_mask`` and a (B, 1, 1, N)
    boolean SDPA ``attn_mask`` (True = attend; the only kind ``use_flash_kernel`` lets through): their AND."""
    from_attn = None if attn_mask is None else attn_mask[:, 0, 0]
    if key_mask is None:
        return from_attn
    if from_attn is None:
        return key_mask
    return key_mask & from_attn


def key_mask_to_attn_mask(key_mask: Optional[Tensor], attn_mask: Optional[Tensor], is_causal: bool,
                          num_queries: int) -> Tuple[Optional[Tensor], bool, Optional[Tensor]]:
    """Fold a (B, N) ``key_mask`` (True = valid key) into SDPA's arguments.

    Args:
        key_mask: (B, N) bool or None (checked by the caller).
        attn_mask: The general SDPA mask (boolean, True = attend, or additive), broadcastable to
            (B, H, num_queries, N), or None.
        is_causal: SDPA's causal flag.
        num_queries: Query count (rows of the causal mask).

    Returns:
        (attn_mask, is_causal, has_key): unchanged with ``has_key`` None when ``key_mask`` is None; else one
        mask (boolean unless ``attn_mask`` is additive) that also drops the invalid keys (and the future keys
        when causal; ``is_causal`` is then False), and ``has_key`` (B, 1, num_queries, 1) bool: False for
        queries with no valid key. Their rows attend to every key here (finite softmax); multiply the
        attention output (and probabilities) by ``has_key`` to give them zeros.
    """
    if key_mask is None:
        return attn_mask, is_causal, None
    keep = key_mask[:, None, None, :]  # (B, 1, 1, N)
    if is_causal:
        n = key_mask.shape[1]
        keep = keep & torch.ones(num_queries, n, dtype=torch.bool, device=key_mask.device).tril()
        has_key = keep.any(dim=-1, keepdim=True)  # (B, 1, M, 1)
    else:
        has_key = key_mask.any(dim=-1)[:, None, None, None].expand(key_mask.shape[0], 1, num_queries, 1)
    keep = keep | ~has_key  # no valid key: attend everywhere (finite), zeroed by the caller
    if attn_mask is None:
        return keep, False, has_key
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep, False, has_key
    return torch.where(keep, attn_mask, torch.full_like(attn_mask, float('-inf'))), False, has_key


@torch.jit.unused
def tracing_or_compiling() -> bool:
    """Under torch.fx symbolic tracing or torch.compile, where eager-only fast paths stand aside."""
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing() or torch.compiler.is_compiling()


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernels take

# Whether 'auto' picks each layer family's Triton kernel on CUDA, from benchmarks/gpu_check.sh on an H200
# (bf16, README "Results / GPU", benchmarks/results/h200_2026-12-04): the flash-prior kernel ran GOAT at
# 0.17-0.37x (forward) and 0.24-0.28x (forward + backward) the speed of SDPA's flash backend without a prior,
# which is the very call GOAT's SDPA path makes (its positional coordinates come out of the head width), and
# PoPE at 0.11-0.29x of SDPA on the materialised width-2d q / k; so 'auto' keeps both on SDPA and the kernels
# run when asked for ('triton' or VISION_PRIORS_KERNELS=triton). LAVO's kernels passed SDPA causal from 8K
# tokens (1.07-1.82x), where its O(N) form matters, and stay the 'auto' choice.
AUTO_PICKS_KERNEL = {'goat': False, 'pope': False, 'lavo': True}


@torch.jit.unused
def use_flash_kernel(backend: str, x: Tensor, attn_mask: Optional[Tensor], dropout_active: bool,
                     head_dim: int, family: str) -> bool:
    """Whether a layer's fused path should call the Triton kernel for input ``x``; ``family`` ('goat',
    'pope' or 'lavo') says whether 'auto' wants the kernel at all (``AUTO_PICKS_KERNEL``)."""
    if tracing_or_compiling():
        return False
    if backend == 'torch' or dropout_active or head_dim > 128:
        return False
    if requested_backend(backend) == 'auto' and (not AUTO_PICKS_KERNEL[family] or x.dtype not in KERNEL_DTYPES):
        return False  # 'auto' keeps the torch path for GOAT / PoPE, and e.g. for float64 on CUDA ('triton' lets
        # the kernel refuse it)
    if attn_mask is not None and not (
            attn_mask.dtype == torch.bool and attn_mask.dim() == 4 and attn_mask.shape[1] == 1
            and attn_mask.shape[2] == 1 and attn_mask.shape[0] == x.shape[0] and attn_mask.shape[3] == x.shape[1]):
        return False
    return resolve_backend(backend, x) == 'triton'
