"""Multimodal ViT blocks: self-attention, then cross-attention to a second modality, then the MLP.

A :class:`CrossAttentionBlock` is a :class:`~vision_priors.models.vision_transformer_priors.PriorBlock` (pre-norm,
timm's layer scale / drop path / norm and MLP layers, the same constructor keywords) with one more residual
sub-layer between the self-attention and the MLP::

    x = x + drop_path1(ls1(self_attn(norm1(x), coords, ...)))          # GOAT / PoPE / LAVO / plain
    x = x + drop_path_cross(ls_cross(cross_attn(norm_cross(x), context, context_mask[, cross_coords, context_coords])))
    x = x + drop_path2(ls2(mlp(norm2(x))))

Self-attention (``self_attn``): ``'goat'`` (GOAT Eqs. 12 / 20-27, 1D or axis-wise 2D prior on ``coords``),
``'pope'`` (PoPE Eqs. 3-6 on ``coords``), ``'lavo'`` (LAVO Eqs. 3-4, causal 1D or non-causal 2D over
``grid_size``), ``'plain'`` (timm ``Attention``, no position). Cross-attention (``cross_attn``):

  ``'softmax'``  ``softmax(Q K^T / sqrt(d)) V`` over the context tokens (:class:`SoftmaxCrossAttention`),
                 O(m n) for m queries and n context tokens.
  ``'lavo'``     :class:`~vision_priors.layers.LavoCrossAttention` (LAVO Sec. 3.4, Eqs. 5-6): the context is
                 compressed once into r slots per head (masked mean of ``B x_s``), every query reads the
                 slots; O(r d (m + n)). Non-causal CODE is a masked mean and every map before it is linear,
                 so this output depends on the context only through its masked mean token (tested): a query
                 cannot single out one context token, only read what the average carries.

  ``'goat'``     :class:`~vision_priors.layers.GoatCrossAttention` (GOAT Eqs. 11-27): content logits plus the GOAT
                 log-prior ``K_rel(p_i - p'_j) + u_h(p'_j)`` between the query coordinates p_i and the context
                 coordinates p'_j, one SDPA call; O(m n).
  ``'pope'``     :class:`~vision_priors.layers.PopeCrossAttention` (PoPE Eqs. 3-6): softplus magnitudes, phases of
                 the query and context coordinates (learned delta on the key side); O(m n).

``'softmax'`` and ``'lavo'`` use no positions (``CONTENT_CROSS_ATTENTIONS``): the context carries its position in its
features (e.g. a GOAT / PoPE image encoder's output); the query stream's coordinates go to the self-attention
only, ``context_coords`` is ignored. ``'goat'`` and ``'pope'`` (``POSITIONAL_CROSS_ATTENTIONS``) need coordinates of
both sides in one frame (``cross_spatial_dims`` axes, default the self-attention's): the context's
``context_coords`` and the queries' ``cross_coords`` (default: ``coords``, the self-attention's, when both use the
same frame); a positional cross-attention called without them raises ValueError.

The context is used as given (no norm inside the block: pass an encoder's final-norm output).
``context_mask`` is the package's one key-mask convention: bool (B, n), True = valid context token,
checked by :func:`vision_priors.kernels._backend.check_key_mask`. Masked context tokens have no effect on
the output or on any gradient. A sample with no valid context token (all masked, or n = 0) gets a zero
attention output before the projection in every form, so its cross-attention sub-layer adds
``drop_path_cross(ls_cross(proj.bias))``: the same constant for every query, independent of the context,
with finite (zero) gradients through the context.
"""
from contextlib import nullcontext
from functools import partial
from typing import Any, Dict, List, Optional, Type

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from timm.layers import Attention, DropPath, LayerScale
from timm.models import register_notrace_function, register_notrace_module

from vision_priors.kernels._backend import check_key_mask

from ..layers import (GoatAttention, GoatCrossAttention, LavoAttention, LavoCrossAttention, PopeAttention,
                      PopeCrossAttention)
from .point_completion import VanillaCrossAttention
from .vision_transformer_priors import PriorBlock

__all__ = ['SELF_ATTENTIONS', 'CROSS_ATTENTIONS', 'CONTENT_CROSS_ATTENTIONS', 'POSITIONAL_CROSS_ATTENTIONS',
           'SoftmaxCrossAttention', 'CrossAttentionBlock', 'LavoCrossAttentionBlock', 'PlainCrossAttentionBlock',
           'create_cross_block']

SELF_ATTENTIONS = ('goat', 'pope', 'lavo', 'plain')
CONTENT_CROSS_ATTENTIONS = ('softmax', 'lavo')  # no positions: forward(x, context, key_mask)
POSITIONAL_CROSS_ATTENTIONS = ('goat', 'pope')  # query and context coordinates
CROSS_ATTENTIONS = CONTENT_CROSS_ATTENTIONS + POSITIONAL_CROSS_ATTENTIONS


class SoftmaxCrossAttention(VanillaCrossAttention):
    """Multi-head softmax cross-attention with the package's context mask, scriptable, with timm's dropouts.

    Same parameters (``q``, ``kv``, ``proj``) as :class:`~vision_priors.models.point_completion.VanillaCrossAttention`.
    A sample without any valid context token (all masked, or n = 0) gets ``proj(0)`` for every query, like
    :class:`~vision_priors.layers.LavoCrossAttention`, with finite gradients: its keys are attended
    uniformly and the result is multiplied by 0 (no NaN from an empty softmax).
    """

    def __init__(self, dim: int, num_heads: int = 8, context_dim: Optional[int] = None, qkv_bias: bool = False,
                 attn_drop: float = 0., proj_drop: float = 0.) -> None:
        super().__init__(dim, num_heads=num_heads, context_dim=context_dim, qkv_bias=qkv_bias)
        self.head_dim = dim // num_heads
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, context: Tensor, key_mask: Optional[Tensor] = None) -> Tensor:
        """x (B, m, C) attends to context (B, n, context_dim); ``key_mask`` (B, n) bool, True = valid token."""
        b, m, n = x.shape[0], x.shape[1], context.shape[1]
        if context.dim() != 3 or context.shape[0] != b or context.shape[2] != self.context_dim:
            if not torch.jit.is_scripting():
                raise ValueError(f'context must be (B, n, context_dim) = ({b}, n, {self.context_dim}), '
                                 f'got {tuple(context.shape)}')
            raise ValueError('context must be (B, n, context_dim) with the batch size of x')
        check_key_mask(key_mask, b, n, 'context_mask', device=x.device)
        h, d = self.num_heads, self.head_dim
        if n == 0:
            return self.proj_drop(self.proj(x.new_zeros(b, m, self.dim)))
        q = self.q(x).reshape(b, m, h, d).transpose(1, 2)
        k, v = self.kv(context).reshape(b, n, 2, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        mask: Optional[Tensor] = None
        has_key: Optional[Tensor] = None
        if key_mask is not None:
            any_key = key_mask.any(dim=1, keepdim=True)
            mask = (key_mask | ~any_key)[:, None, None, :]  # an empty sample attends all (result zeroed below)
            has_key = any_key.to(q.dtype)[:, :, None, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             dropout_p=self.attn_drop.p if self.training else 0.)
        if has_key is not None:
            out = out * has_key
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, m, self.dim)))


# the mask checks depend on data (the mask) under torch.fx: trace the cross-attention as one leaf call
register_notrace_module(SoftmaxCrossAttention)
register_notrace_module(GoatCrossAttention)
register_notrace_module(PopeCrossAttention)


@torch.fx.wrap
@register_notrace_function
def check_positional_cross_call(coords: Optional[Tensor], context_coords: Optional[Tensor], kind: str) -> None:
    """A positional cross-attention needs the queries' and the context's coordinates."""
    if coords is None:
        raise ValueError("cross_attn='" + kind + "' is positional: pass the queries' coordinates (coords, or "
                         "cross_coords) to the block's forward")
    if context_coords is None:
        raise ValueError("cross_attn='" + kind + "' is positional: pass context_coords (the context tokens' "
                         "coordinates) to the block's forward")


@torch.fx.wrap
@register_notrace_function
def check_lavo_self_call(attn_mask: Optional[Tensor], is_causal: bool, causal: bool) -> None:
    """LAVO self-attention takes no (N, N) mask, and its causality is fixed when it is built."""
    if attn_mask is not None:
        raise ValueError('LAVO self-attention accepts no attn_mask (use a causal LAVO layer for 1D text)')
    if is_causal and not causal:
        raise ValueError('is_causal=True but this LAVO self-attention was built non-causal (causal=False)')


class CrossAttentionBlock(PriorBlock):
    """Pre-norm block: GOAT / PoPE self-attention on ``coords``, cross-attention to ``context``, MLP.

    Args:
        cross_attn: 'softmax', 'lavo', 'goat' or 'pope' (module docstring).
        context_dim: Width of the context tokens (default ``dim``).
        cross_slots: r, LAVO memory slots per head (capped at the head dim; 'lavo' only).
        cross_basis: LAVO basis mode ('fixed', 'orthogonal', 'penalty'; 'lavo' only).
        cross_spatial_dims: 'goat' / 'pope': axes D of the query and context coordinates (default: the
            self-attention's ``num_spatial_dims``, else 2).
        cross_kwargs: 'goat' / 'pope': extra options of the cross layer (``num_modes``, ``freq_base``,
            ``prior_init``, ...); its query prefix tokens are the block's ``num_prefix_tokens``.
        **block_kwargs: :class:`PriorBlock`'s arguments (``attn_layer`` builds the self-attention;
            ``init_values`` / ``drop_path`` / ``norm_layer`` / ``proj_drop`` / ``attn_drop`` apply to the
            cross sub-layer too).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            cross_attn: str = 'softmax',
            context_dim: Optional[int] = None,
            cross_slots: int = 64,
            cross_basis: str = 'fixed',
            qkv_bias: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            init_values: Optional[float] = None,
            drop_path: float = 0.,
            norm_layer: Type[nn.Module] = nn.LayerNorm,
            device=None,
            dtype=None,
            cross_spatial_dims: Optional[int] = None,
            cross_kwargs: Optional[Dict[str, Any]] = None,
            **block_kwargs,
    ) -> None:
        if cross_attn not in CROSS_ATTENTIONS:
            raise ValueError(f'cross_attn must be one of {CROSS_ATTENTIONS}, got {cross_attn!r}')
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop,
                         init_values=init_values, drop_path=drop_path, norm_layer=norm_layer, device=device,
                         **block_kwargs)
        self.cross_attn_kind = cross_attn
        if cross_kwargs and cross_attn not in POSITIONAL_CROSS_ATTENTIONS:
            raise ValueError(f'cross_kwargs are options of the positional cross-attentions '
                             f'{POSITIONAL_CROSS_ATTENTIONS}, not of {cross_attn!r}')
        if cross_spatial_dims is None:
            cross_spatial_dims = int(getattr(self.attn, 'num_spatial_dims', 2))
        with torch.device(device) if device is not None else nullcontext():
            self.norm_cross = norm_layer(dim)
            self.cross_attn: nn.Module
            if cross_attn == 'softmax':
                self.cross_attn = SoftmaxCrossAttention(dim, num_heads=num_heads, context_dim=context_dim,
                                                        qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
            elif cross_attn in POSITIONAL_CROSS_ATTENTIONS:
                layer = GoatCrossAttention if cross_attn == 'goat' else PopeCrossAttention
                self.cross_attn = layer(
                    dim, num_heads=num_heads, context_dim=context_dim, num_spatial_dims=cross_spatial_dims,
                    num_prefix_tokens=self.num_prefix_tokens, qkv_bias=qkv_bias, attn_drop=attn_drop,
                    proj_drop=proj_drop, norm_layer=norm_layer, **(cross_kwargs or {}))
            else:
                self.cross_attn = LavoCrossAttention(
                    dim, num_heads=num_heads, num_slots=min(cross_slots, dim // num_heads), context_dim=context_dim,
                    basis=cross_basis, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
            self.ls_cross = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
            self.drop_path_cross = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        if dtype is not None:
            self.to(dtype)

    def self_attention(self, x: Tensor, coords: Optional[Tensor], grid_size: Optional[List[int]],
                       attn_mask: Optional[Tensor], is_causal: bool) -> Tensor:
        """The self-attention of the normed tokens (GOAT / PoPE: ``coords`` of the non-prefix tokens)."""
        y = self.attn(x, coords, attn_mask, is_causal, False)
        if torch.jit.is_scripting():
            assert isinstance(y, Tensor)  # refine the Union return for TorchScript
            return y
        return y

    def cross_attention(self, x: Tensor, context: Tensor, context_mask: Optional[Tensor], coords: Optional[Tensor],
                        context_coords: Optional[Tensor]) -> Tensor:
        """The cross-attention of the normed tokens; ``coords`` / ``context_coords`` for 'goat' / 'pope' only."""
        # hasattr on a submodule is resolved when compiling (TorchScript skips the other branch)
        if hasattr(self.cross_attn, 'takes_coordinates'):
            check_positional_cross_call(coords, context_coords, self.cross_attn_kind)
            return self.cross_attn(x, context, context_mask, coords, context_coords)
        return self.cross_attn(x, context, context_mask)

    def forward(
            self,
            x: Tensor,
            context: Tensor,
            coords: Optional[Tensor] = None,
            grid_size: Optional[List[int]] = None,
            attn_mask: Optional[Tensor] = None,
            is_causal: bool = False,
            context_mask: Optional[Tensor] = None,
            context_coords: Optional[Tensor] = None,
            cross_coords: Optional[Tensor] = None,
    ) -> Tensor:
        """x (B, N, C) tokens; context (B, n, context_dim) the other modality; ``context_mask`` (B, n) bool,
        True = valid. ``coords`` / ``grid_size`` / ``attn_mask`` / ``is_causal`` go to the self-attention.
        'goat' / 'pope' cross-attention: ``context_coords`` (n, D) or (B, n, D) of the context tokens, and the
        queries' coordinates ``cross_coords`` (default ``coords``), same layout as ``coords``."""
        x = x + self.drop_path1(self.ls1(self.self_attention(self.norm1(x), coords, grid_size, attn_mask, is_causal)))
        query_coords = coords if cross_coords is None else cross_coords
        x = x + self.drop_path_cross(self.ls_cross(self.cross_attention(
            self.norm_cross(x), context, context_mask, query_coords, context_coords)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class LavoCrossAttentionBlock(CrossAttentionBlock):
    """:class:`CrossAttentionBlock` with LAVO self-attention: causal 1D (text) or non-causal 2D over
    ``grid_size`` (rows, cols of the patch grid after ``num_prefix_tokens`` prefix tokens); no ``attn_mask``."""

    def self_attention(self, x: Tensor, coords: Optional[Tensor], grid_size: Optional[List[int]],
                       attn_mask: Optional[Tensor], is_causal: bool) -> Tensor:
        check_lavo_self_call(attn_mask, is_causal, self.attn.causal)
        return self.attn(x, None, grid_size, self.num_prefix_tokens)


class PlainCrossAttentionBlock(CrossAttentionBlock):
    """:class:`CrossAttentionBlock` with timm's ``Attention`` (no positional signal; ``coords`` unused)."""

    def self_attention(self, x: Tensor, coords: Optional[Tensor], grid_size: Optional[List[int]],
                       attn_mask: Optional[Tensor], is_causal: bool) -> Tensor:
        return self.attn(x, attn_mask=attn_mask, is_causal=is_causal)


def _lavo_self_attention(
        dim: int,
        num_heads: int,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        attn_drop: float = 0.,
        proj_drop: float = 0.,
        norm_layer: Optional[Type[nn.Module]] = None,
        num_prefix_tokens: int = 0,
        causal: bool = False,
        num_spatial_dims: int = 2,
        **lavo_kwargs,
) -> LavoAttention:
    """LAVO self-attention from the arguments a timm block passes (qk_norm is not supported)."""
    if qk_norm:
        raise ValueError('LAVO self-attention does not support qk_norm')
    lavo_kwargs.setdefault('num_slots', min(64, dim // num_heads))
    return LavoAttention(dim, num_heads=num_heads, causal=causal, num_spatial_dims=num_spatial_dims,
                         qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop, **lavo_kwargs)


def create_cross_block(
        self_attn: str,
        dim: int,
        num_heads: int,
        cross_attn: str = 'softmax',
        num_spatial_dims: int = 2,
        causal: bool = False,
        num_prefix_tokens: int = 0,
        attn_kwargs: Optional[Dict[str, Any]] = None,
        **block_kwargs,
) -> CrossAttentionBlock:
    """A multimodal block by name.

    Args:
        self_attn: 'goat', 'pope', 'lavo' or 'plain'.
        dim, num_heads: Width and heads (shared by self- and cross-attention).
        cross_attn: 'softmax', 'lavo', 'goat' or 'pope'.
        num_spatial_dims: 1 (text, series: ``coords`` (N, 1)) or 2 (patches: (x, y)) for goat / pope / lavo; also
            the default ``cross_spatial_dims`` of a 'goat' / 'pope' cross-attention.
        causal: LAVO only: build a causal self-attention (1D); goat / pope / plain take ``is_causal`` per call.
        num_prefix_tokens: Leading tokens without coordinates (goat / pope / lavo 2D).
        attn_kwargs: Extra options of the self-attention layer (e.g. ``num_modes`` for GOAT, ``window`` for LAVO).
        **block_kwargs: :class:`CrossAttentionBlock` / :class:`PriorBlock` arguments.
    """
    attn_kwargs = dict(attn_kwargs or {})
    if block_kwargs.get('cross_spatial_dims') is None:
        block_kwargs['cross_spatial_dims'] = num_spatial_dims
    if self_attn in ('goat', 'pope'):
        layer = GoatAttention if self_attn == 'goat' else PopeAttention
        return CrossAttentionBlock(dim, num_heads, cross_attn=cross_attn, attn_layer=partial(
            layer, num_spatial_dims=num_spatial_dims, num_prefix_tokens=num_prefix_tokens, **attn_kwargs),
            **block_kwargs)
    if self_attn == 'lavo':
        if causal and num_spatial_dims != 1:
            raise ValueError('causal LAVO self-attention is 1D: pass num_spatial_dims=1')
        return LavoCrossAttentionBlock(dim, num_heads, cross_attn=cross_attn, attn_layer=partial(
            _lavo_self_attention, num_prefix_tokens=num_prefix_tokens, causal=causal,
            num_spatial_dims=num_spatial_dims, **attn_kwargs), **block_kwargs)
    if self_attn == 'plain':
        return PlainCrossAttentionBlock(dim, num_heads, cross_attn=cross_attn,
                                        attn_layer=partial(Attention, **attn_kwargs), **block_kwargs)
    raise ValueError(f'self_attn must be one of {SELF_ATTENTIONS}, got {self_attn!r}')
