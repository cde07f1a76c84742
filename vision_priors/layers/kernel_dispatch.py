"""When the attention layers hand their fused path to the Triton kernels in ``kernels/`` (issue 6).

One rule for every layer: the Triton op runs when the backend resolves to Triton (``kernel_backend``
argument 'auto' | 'triton' | 'torch', then the ``VISION_PRIORS_KERNELS`` environment variable; 'auto'
means Triton on CUDA tensors), and the call is one the kernel computes exactly: no attention dropout
while training, and a mask that is either absent or a boolean key-padding mask (B, 1, 1, N). Everything
else (TorchScript, torch.fx tracing, CPU tensors without the interpreter, general masks) keeps the
exact PyTorch path.
"""
from typing import Optional

import torch
from torch import Tensor

from vision_priors.kernels._backend import BACKENDS, resolve_backend

__all__ = ['KERNEL_BACKENDS', 'check_kernel_backend', 'key_padding_mask', 'tracing_or_compiling', 'use_flash_kernel']

KERNEL_BACKENDS = BACKENDS


def check_kernel_backend(backend: str) -> str:
    """Validate a layer's ``kernel_backend`` argument."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f'kernel_backend must be one of {KERNEL_BACKENDS}, got {backend!r}')
    return backend


def key_padding_mask(attn_mask: Optional[Tensor]) -> Optional[Tensor]:
    """(B, 1, 1, N) boolean attend-mask (True = attend) -> the kernels' (B, N) padding mask (True = ignore)."""
    if attn_mask is None:
        return None
    return ~attn_mask[:, 0, 0]


@torch.jit.unused
def tracing_or_compiling() -> bool:
    """Under torch.fx symbolic tracing or torch.compile, where eager-only fast paths stand aside."""
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing() or torch.compiler.is_compiling()


@torch.jit.unused
def use_flash_kernel(backend: str, x: Tensor, attn_mask: Optional[Tensor], dropout_active: bool,
                     head_dim: int) -> bool:
    """Whether a layer's fused path should call the Triton kernel for input ``x``."""
    if tracing_or_compiling():
        return False
    if backend == 'torch' or dropout_active or head_dim > 128:
        return False
    if attn_mask is not None and not (
            attn_mask.dtype == torch.bool and attn_mask.dim() == 4 and attn_mask.shape[1] == 1
            and attn_mask.shape[2] == 1 and attn_mask.shape[0] == x.shape[0] and attn_mask.shape[3] == x.shape[1]):
        return False
    return resolve_backend(backend, x) == 'triton'
