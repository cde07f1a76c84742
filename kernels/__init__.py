"""Triton kernels shared by the attention layers (issue 6); each with a naive reference beside it."""

# --- flash_prior (issue 6, kernel 1: positional flash attention; Triton op + dense reference) ---
from .flash_prior_ref import flash_prior_attention_ref  # noqa: E402,F401
try:  # the op needs Triton (Linux); the reference does not
    from .flash_prior import flash_prior_attention  # noqa: E402,F401
except ImportError:  # pragma: no cover - platform without Triton
    pass

# --- lavo, chamfer (issue 6, kernels 2-3: LAVO CODE / local window, Chamfer distance; ops + references) ---
from .chamfer import chamfer_distance, chamfer_nn, chamfer_nn_reference  # noqa: E402,F401
from .lavo import lavo_global, lavo_global_reference, lavo_local, lavo_local_reference  # noqa: E402,F401

# --- pope_cpu (compiled C++ op for PoPE CPU inference; its torch-op twin is in vision_priors/layers/pope.py) ---
from .pope_cpu import pope_cpu_attention  # noqa: E402,F401  (built on first call, not on import)

__all__ = ['chamfer_distance', 'chamfer_nn', 'chamfer_nn_reference', 'flash_prior_attention',
           'flash_prior_attention_ref', 'lavo_global', 'lavo_global_reference', 'lavo_local', 'lavo_local_reference',
           'pope_cpu_attention']
