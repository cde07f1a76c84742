"""Triton kernel ops shared by the attention layers (issue 6), each with a naive reference beside it.

Every op follows one convention (issue 13): a ``backend`` choice (Triton on CUDA / the interpreter, or the
op's exact PyTorch path; ``_backend.py``), a key mask ``key_mask`` (B, L) bool with True = valid key, and a
dense reference with the same signature in ``<op>_ref.py`` (for tests).
"""

# --- flash_prior (positional flash attention; Triton op + dense reference) ---
from .flash_prior_ref import flash_prior_attention_ref  # noqa: E402,F401
try:  # the op needs Triton (Linux); the reference does not
    from .flash_prior import flash_prior_attention  # noqa: E402,F401
except ImportError:  # pragma: no cover - platform without Triton
    pass

# --- lavo, chamfer (LAVO CODE / local window in 1D and on a grid, Chamfer distance; ops + dense references) ---
from .chamfer import chamfer_distance, chamfer_nn  # noqa: E402,F401
from .chamfer_ref import chamfer_nn_reference  # noqa: E402,F401
from .lavo import lavo_global, lavo_local, lavo_local_2d  # noqa: E402,F401
from .lavo_ref import lavo_global_reference, lavo_local_2d_reference, lavo_local_reference  # noqa: E402,F401

# --- pope_cpu (compiled C++ op for PoPE CPU inference; its torch-op twin is in vision_priors/layers/pope.py) ---
from .pope_cpu import pope_cpu_attention  # noqa: E402,F401  (built on first call, not on import)

__all__ = ['chamfer_distance', 'chamfer_nn', 'chamfer_nn_reference', 'flash_prior_attention',
           'flash_prior_attention_ref', 'lavo_global', 'lavo_global_reference', 'lavo_local', 'lavo_local_2d',
           'lavo_local_2d_reference', 'lavo_local_reference', 'pope_cpu_attention']
