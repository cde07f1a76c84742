"""Position interpolation for the ViTs the package compares: patch positions measured on a reference grid.

Evaluated on a larger patch grid than it trained on, a ViT either extrapolates its positions (patch units: offsets
it never saw) or interpolates them (the grid rescaled onto the training grid, so offsets come in finer steps
within the trained range). timm's learned absolute embeddings only interpolate (``resample_abs_pos_embed``); its
EVA-style axial RoPE does either (``ref_feat_shape``); its mixed RoPE has no option; the package's GOAT, PoPE and
LAVO ViTs take ``ref_feat_shape`` too (LAVO: its 2D window and bias table rescaled). :func:`interpolate_positions`
switches a built model, whatever its family. :func:`rescale_coords_kwargs` is the training side: the constructor
argument that shows either family a range of position scales (DINOv3's coordinate rescale, timm's function).
"""
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from timm.layers import to_2tuple
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat, RotaryEmbeddingMixed, _build_grid, get_mixed_freqs

from .vision_transformer_priors import PriorVisionTransformer

__all__ = ['interpolate_positions', 'rescale_coords_kwargs', 'RotaryEmbeddingMixedOnGrid']


class RotaryEmbeddingMixedOnGrid(RotaryEmbeddingMixed):
    """timm's mixed (learned-frequency) RoPE with positions rescaled onto ``ref_feat_shape`` (rows, cols), with
    the grid rescaling timm's axial RoPE uses for its ``ref_feat_shape``. Same parameters and state dict."""

    ref_feat_shape: Tuple[int, int]

    def get_embed(self, shape: Optional[Sequence[int]] = None, dtype: Optional[torch.dtype] = None) -> Tensor:
        if shape is None or (self.training and self.aug_active):
            raise RuntimeError('RotaryEmbeddingMixedOnGrid evaluates on a given grid shape (dynamic_img_size), '
                               'without coordinate augmentation')
        grid = _build_grid(list(shape), grid_type='index', ref_feat_shape=list(self.ref_feat_shape),
                           grid_indexing=self.grid_indexing, device=self.freqs.device, ndim=2).reshape(-1, 2)
        return get_mixed_freqs(self.freqs, grid[:, 0].contiguous(), grid[:, 1].contiguous(), dtype=dtype)


def interpolate_positions(model: nn.Module, ref_feat_shape: Tuple[int, int]) -> None:
    """Measure ``model``'s patch positions on the (rows, cols) grid ``ref_feat_shape`` (usually the training
    grid), in place: GOAT / PoPE / LAVO ViTs (``set_ref_feat_shape``), timm's axial RoPE (its ``ref_feat_shape``) and
    mixed RoPE (:class:`RotaryEmbeddingMixedOnGrid`). A learned absolute embedding is resampled onto every grid
    already, so such a model is left as it is.

    Raises:
        ValueError: a model built without ``dynamic_img_size``, or a model with none of these position schemes.
    """
    rows, cols = to_2tuple(ref_feat_shape)
    if isinstance(model, PriorVisionTransformer):
        model.set_ref_feat_shape((rows, cols))
        return
    if not getattr(model, 'dynamic_img_size', False):
        raise ValueError(f'{type(model).__name__} was built without dynamic_img_size=True: it runs on one grid only')
    rope = getattr(model, 'rope', None)
    if isinstance(rope, RotaryEmbeddingCat):
        rope.ref_feat_shape = [int(rows), int(cols)]
        return
    if isinstance(rope, RotaryEmbeddingMixed):
        rope.__class__ = RotaryEmbeddingMixedOnGrid  # the same module and parameters, one method rescaled
        rope.ref_feat_shape = (int(rows), int(cols))
        return
    if rope is None and getattr(model, 'pos_embed', None) is not None:
        return  # a learned absolute table: timm resamples it onto every grid (already interpolated)
    raise ValueError(f'{type(model).__name__} has no position scheme interpolate_positions knows '
                     '(GOAT / PoPE ViT, timm axial or mixed RoPE, learned absolute embedding)')


def rescale_coords_kwargs(model: nn.Module, rescale: Optional[float]) -> Dict[str, Any]:
    """The constructor kwargs that train ``model``'s family with DINOv3's coordinate rescaling (a log-uniform factor
    in [1/rescale, rescale] per forward pass, timm's own augmentation): ``rope_rescale_coords`` for timm's RoPE ViTs,
    ``rescale_coords`` for GOAT / PoPE ViTs; {} for models without coordinate positions (a learned absolute table,
    LAVO) or ``rescale`` None or 1 (off)."""
    if rescale is None or rescale == 1:
        return {}
    if isinstance(model, PriorVisionTransformer):
        return {} if model.pos_attn == 'lavo' else {'rescale_coords': float(rescale)}
    if isinstance(getattr(model, 'rope', None), (RotaryEmbeddingCat, RotaryEmbeddingMixed)):
        return {'rope_rescale_coords': float(rescale)}
    return {}
