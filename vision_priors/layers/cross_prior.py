"""Positional cross-attention: GOAT's prior and PoPE's phases between query and context coordinates.

Queries come from x (B, N, C) at coordinates ``coords``, keys / values from a second sequence ``context``
(B, n, context_dim) at its own coordinates ``context_coords`` (1D text positions, a 2D patch grid, ...),
in the same coordinate frame. Both layers compute their logits exactly as the package's self-attention
layers, with the query-side positional terms taken from the query coordinates and the key-side ones from
the context coordinates, in ONE ``F.scaled_dot_product_attention`` call (CPU / SDPA path; no Triton kernel):

  GOAT (Litman & Guo, Eqs. 11-27)::

      z_ij = q_c,i . k_c,j / sqrt(d_c) + K_rel(p_i - p'_j) + u_h(p'_j)

  p_i the query coordinates, p'_j the context coordinates; ``GoatPrior.qk_coordinates`` gives the d_p
  positional query coordinates of p_i and key coordinates of p'_j (their dot product is the prior,
  Eqs. 13-19 / 23-27), appended to the content q / k as in :class:`~vision_priors.layers.GoatAttention`.

  PoPE (Gopalakrishnan et al., Eqs. 3-6)::

      a_ts = sum_c softplus(q_tc) softplus(k_sc) cos((s_c - t_c) w_c + delta_c) / sqrt(d)

  with t the query and s the context coordinates (2D: half the channels rotate with x, half with y), the
  learned phase bias delta on the key side as in :class:`~vision_priors.layers.PopeAttention`; the width-2d
  real features (Eq. 10) go to SDPA, v widened to 2d by repetition.

Leading query prefix tokens (``num_prefix_tokens``: class / register tokens) have no coordinates, as in
the self-attention layers: GOAT gives them the key default u_h(p'_j) only, PoPE phase 0. Context tokens
all have coordinates.

Masks: ``key_mask`` (B, n) bool, True = valid context token (the package's one convention,
``check_key_mask``). Masked context tokens have no effect on the output or on any gradient. A sample with
no valid context token (all masked, or n = 0) gets a zero attention output before the projection, so each
of its queries gets ``proj(0)`` (the projection bias), with finite (zero) gradients through its context,
as :class:`~vision_priors.layers.LavoCrossAttention` and the softmax cross-attention of
``vision_priors.models.multimodal``.
"""
from typing import Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_priors.kernels._backend import check_key_mask

from .coords import resolve_token_coords
from .goat import GoatPrior, goat_head_dims
from .kernel_dispatch import key_mask_to_attn_mask
from .pope import PopePhases, magnitude_features, phase_table, pope_features

# leaf call under torch.fx symbolic tracing: it runs on concrete values, checks included
torch.fx.wrap('resolve_token_coords')

__all__ = ['GoatCrossAttention', 'PopeCrossAttention', 'POSITIONAL_CROSS_LAYERS']


def check_prefix_tokens(num_prefix_tokens: int) -> None:
    if num_prefix_tokens < 0:
        raise ValueError(f'num_prefix_tokens must be >= 0, got {num_prefix_tokens}')


def _check_context(x: Tensor, context: Tensor, context_dim: int) -> None:
    """context must be (B, n, context_dim) with the batch size of x."""
    if context.dim() != 3 or context.shape[0] != x.shape[0] or context.shape[2] != context_dim:
        if not torch.jit.is_scripting():
            raise ValueError(f'context must be (B, n, context_dim) = ({x.shape[0]}, n, {context_dim}), '
                             f'got {tuple(context.shape)}')
        raise ValueError('context must be (B, n, context_dim) with the batch size of x')


def _check_cross_inputs(
        x: Tensor,
        context: Tensor,
        key_mask: Optional[Tensor],
        coords: Optional[Tensor],
        context_coords: Optional[Tensor],
        context_dim: int,
        num_spatial_dims: int,
        num_prefix_tokens: int,
        dtype: torch.dtype,
        layer: str,
) -> Tuple[Tensor, Tensor]:
    """Checks the context shape and ``key_mask`` (the package's key-mask convention); returns the validated
    (query coords, context coords) in ``dtype``: (N - P, D) / (n, D) shared or (B, ., D) per sample."""
    _check_context(x, context, context_dim)
    batch_size, num_queries, num_context, device = x.shape[0], x.shape[1], context.shape[1], x.device
    check_key_mask(key_mask, batch_size, num_context, 'context_mask', device=device)
    if coords is None or context_coords is None:
        raise ValueError(f'{layer} is positional: it needs coords (the queries\' coordinates) and context_coords '
                         f'(the context tokens\' coordinates)')
    if not torch.jit.is_scripting():
        c = context_coords.unsqueeze(-1) if context_coords.dim() == 1 and num_spatial_dims == 1 else context_coords
        if c.dim() not in (2, 3) or c.shape[-2] != num_context or c.shape[-1] != num_spatial_dims:
            raise ValueError(
                f'context_coords has shape {tuple(context_coords.shape)}, expected ({num_context}, '
                f'{num_spatial_dims}) shared by the batch or (B, {num_context}, {num_spatial_dims}) per sample')
    query = resolve_token_coords(coords, num_queries - num_prefix_tokens, num_spatial_dims, num_prefix_tokens, None,
                                 device, dtype, batch_size)
    context = resolve_token_coords(context_coords, num_context, num_spatial_dims, 0, None, device, dtype, batch_size)
    return query, context


def init_cross_layers(module: nn.Module, dim: int, num_heads: int, context_dim: Optional[int], num_spatial_dims: int,
                      num_prefix_tokens: int, qk_width: int, kv_out: int, qkv_bias: bool, qk_norm: bool,
                      attn_drop: float, proj_drop: float, norm_layer: Type[nn.Module]) -> None:
    """The attributes and layers both positional cross-attentions share: ``q`` (dim -> heads x ``qk_width``), ``kv``
    (context_dim -> ``kv_out``), optional q / k norms over ``qk_width``, dropouts and the output projection."""
    module.dim = dim
    module.context_dim = dim if context_dim is None else context_dim
    module.num_heads = num_heads
    module.head_dim = dim // num_heads
    module.num_spatial_dims = num_spatial_dims
    module.num_prefix_tokens = num_prefix_tokens
    module.q = nn.Linear(dim, num_heads * qk_width, bias=qkv_bias)
    module.kv = nn.Linear(module.context_dim, kv_out, bias=qkv_bias)
    module.q_norm = norm_layer(qk_width) if qk_norm else nn.Identity()
    module.k_norm = norm_layer(qk_width) if qk_norm else nn.Identity()
    module.attn_drop = nn.Dropout(attn_drop)
    module.proj = nn.Linear(dim, dim)
    module.proj_drop = nn.Dropout(proj_drop)
    module.takes_coordinates = True  # the multimodal block passes query / context coordinates


class GoatCrossAttention(nn.Module):
    """Multi-head cross-attention with the GOAT log-prior between query and context coordinates (Eqs. 11-27).

    ``forward(x, context, key_mask=None, coords=None, context_coords=None)``; logits
    ``q_c,i . k_c,j / sqrt(d_c) + K_rel(p_i - p'_j) + u_h(p'_j)`` in one SDPA call (module docstring).
    No Triton kernel: the fused path is SDPA (CPU or CUDA).

    Args:
        dim: Query width C.
        num_heads: Heads H; head width d_h = C / H must exceed d_p = 2 R D + 2.
        context_dim: Context width (default ``dim``).
        num_spatial_dims: D, 1 or 2, of both coordinate sets.
        num_modes: Fourier modes R per axis.
        num_prefix_tokens: Leading query tokens without coordinates (key default only).
        qkv_bias: Bias in the ``q`` and ``kv`` projections.
        qk_norm: Norm on the content part of q and k.
        attn_drop: Attention-probability dropout.
        proj_drop: Output dropout.
        norm_layer: Norm used by ``qk_norm``.
        **prior_kwargs: ``GoatPrior`` options (freq_base, learn_freqs, prior_init, key_mlp_hidden, ...).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            context_dim: Optional[int] = None,
            num_spatial_dims: int = 2,
            num_modes: int = 4,
            num_prefix_tokens: int = 0,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Type[nn.Module] = nn.LayerNorm,
            **prior_kwargs,
    ) -> None:
        super().__init__()
        check_prefix_tokens(num_prefix_tokens)
        head_dim, content_dim = goat_head_dims(dim, num_heads, num_modes, num_spatial_dims)
        self.content_dim = content_dim
        self.content_scale = content_dim ** -0.5
        init_cross_layers(self, dim, num_heads, context_dim, num_spatial_dims, num_prefix_tokens, content_dim,
                          num_heads * (content_dim + head_dim), qkv_bias, qk_norm, attn_drop, proj_drop, norm_layer)
        # the query prefix rows are added here (the context has none), so the prior itself has no prefix tokens
        self.prior = GoatPrior(num_heads, num_spatial_dims=num_spatial_dims, num_modes=num_modes, **prior_kwargs)

    def forward(
            self,
            x: Tensor,
            context: Tensor,
            key_mask: Optional[Tensor] = None,
            coords: Optional[Tensor] = None,
            context_coords: Optional[Tensor] = None,
    ) -> Tensor:
        """x (B, N, C) attends to context (B, n, context_dim).

        Args:
            x: Queries; the last N - P have coordinates ``coords``.
            context: Keys / values.
            key_mask: (B, n) bool, True = valid context token.
            coords: (N - P, D) shared or (B, N - P, D) per sample (1D also (N - P,)); required.
            context_coords: (n, D) shared or (B, n, D) per sample; required.

        Returns:
            (B, N, C); ``proj(0)`` for every query of a sample without a valid context token.
        """
        B, N, C = x.shape
        coords, context_coords = _check_cross_inputs(
            x, context, key_mask, coords, context_coords, self.context_dim, self.num_spatial_dims,
            self.num_prefix_tokens, self.prior.alpha.dtype, 'GoatCrossAttention')
        n = context.shape[1]
        if n == 0:
            return self.proj_drop(self.proj(x.new_zeros(B, N, C)))
        H, dc, dh = self.num_heads, self.content_dim, self.head_dim
        q = self.q_norm(self.q(x).reshape(B, N, H, dc).transpose(1, 2))
        k, v = self.kv(context).split([H * dc, H * dh], dim=-1)
        k = self.k_norm(k.reshape(B, n, H, dc).transpose(1, 2))
        v = v.reshape(B, n, H, dh).transpose(1, 2)

        # query-side coordinates from the query positions, key-side from the context positions (Eqs. 13-22)
        q_pos = self.prior.qk_coordinates(coords)[0]  # (H, N - P, d_p) or (B, H, N - P, d_p)
        k_pos = self.prior.qk_coordinates(context_coords)[1]  # (H, n, d_p) or (B, H, n, d_p)
        if self.num_prefix_tokens:
            # a prefix query: no relative coordinates, the constant 1 against the key default u_h(j)
            pre = torch.zeros_like(q_pos[..., :1, :]).repeat_interleave(self.num_prefix_tokens, dim=-2)
            pre = torch.cat([pre[..., :-2], torch.ones_like(pre[..., :1]), pre[..., :1]], dim=-1)
            q_pos = torch.cat([pre, q_pos], dim=-2)
        # SDPA's scale 1 / sqrt(d_c) is meant for the content part: pre-divide the positional query
        # coordinates by it, so q'.k' * scale = content / sqrt(d_c) + prior exactly (Eqs. 23-27)
        q_pos = q_pos.to(x.dtype) / self.content_scale
        q = torch.cat([q, q_pos.expand(B, -1, -1, -1)], dim=-1)  # adds the batch dim to shared coords
        k = torch.cat([k, k_pos.to(x.dtype).expand(B, -1, -1, -1)], dim=-1)
        attn_mask, _, has_key = key_mask_to_attn_mask(key_mask, None, False, N)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.content_scale,
                                             dropout_p=self.attn_drop.p if self.training else 0.)
        if has_key is not None:
            out = out * has_key
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))


class PopeCrossAttention(nn.Module):
    """Multi-head cross-attention with PoPE phases of query and context coordinates (Eqs. 3-6, 10).

    ``forward(x, context, key_mask=None, coords=None, context_coords=None)``; logits
    ``sum_c softplus(q_tc) softplus(k_sc) cos((s - t) w_c + delta_c) / sqrt(d_h)`` in one SDPA call
    (v widened to 2d, as :class:`~vision_priors.layers.PopeAttention`). No Triton kernel: SDPA (CPU or CUDA).

    Args:
        dim: Query width C.
        num_heads: Heads H (d_h = C / H real channels per head; even in 2D).
        context_dim: Context width (default ``dim``).
        num_spatial_dims: D, 1 or 2, of both coordinate sets.
        num_prefix_tokens: Leading query tokens without coordinates (phase 0).
        freq_base: theta (``PopePhases``; default 10000 in 1D, 100 in 2D).
        learn_bias: Learn the phase bias delta.
        qkv_bias, qk_norm, attn_drop, proj_drop, norm_layer: As ``PopeAttention`` (qk_norm acts on the
            pre-softplus q, k).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            context_dim: Optional[int] = None,
            num_spatial_dims: int = 2,
            num_prefix_tokens: int = 0,
            freq_base: Optional[float] = None,
            learn_bias: bool = True,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Type[nn.Module] = nn.LayerNorm,
    ) -> None:
        super().__init__()
        check_prefix_tokens(num_prefix_tokens)
        if dim % num_heads != 0:
            raise ValueError(f'dim ({dim}) must be divisible by num_heads ({num_heads})')
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        init_cross_layers(self, dim, num_heads, context_dim, num_spatial_dims, num_prefix_tokens, head_dim, 2 * dim,
                          qkv_bias, qk_norm, attn_drop, proj_drop, norm_layer)
        # the query prefix rows are added here (the context has none), so the phases have no prefix tokens
        self.phases = PopePhases(num_heads, head_dim, num_spatial_dims=num_spatial_dims, freq_base=freq_base,
                                 learn_bias=learn_bias)

    def forward(
            self,
            x: Tensor,
            context: Tensor,
            key_mask: Optional[Tensor] = None,
            coords: Optional[Tensor] = None,
            context_coords: Optional[Tensor] = None,
    ) -> Tensor:
        """x (B, N, C) attends to context (B, n, context_dim); arguments and result as
        :meth:`GoatCrossAttention.forward`."""
        B, N, C = x.shape
        coords, context_coords = _check_cross_inputs(
            x, context, key_mask, coords, context_coords, self.context_dim, self.num_spatial_dims,
            self.num_prefix_tokens, self.phases.phase_bias_raw.dtype, 'PopeCrossAttention')
        n = context.shape[1]
        if n == 0:
            return self.proj_drop(self.proj(x.new_zeros(B, N, C)))
        H, dh = self.num_heads, self.head_dim
        q = self.q_norm(self.q(x).reshape(B, N, H, dh).transpose(1, 2))
        k, v = self.kv(context).reshape(B, n, 2, H, dh).permute(2, 0, 3, 1, 4).unbind(0)
        k = self.k_norm(k)

        # query phases t w_c from the query positions, key phases s w_c + delta_c from the context's (Eqs. 4-6)
        q_phase = self.phases.phases(coords)[0]  # (1, N - P, d) or (B, 1, N - P, d)
        k_phase = self.phases.phases(context_coords)[1]  # (H, n, d) or (B, H, n, d)
        if self.num_prefix_tokens:
            pre = torch.zeros_like(q_phase[..., :1, :]).repeat_interleave(self.num_prefix_tokens, dim=-2)
            q_phase = torch.cat([pre, q_phase], dim=-2)  # prefix queries: phase 0
        q_table = phase_table(q_phase, self.scale).to(q.dtype)
        k_table = phase_table(k_phase).to(k.dtype)
        # (B, H, N, 2d) with the scale folded in, and (B, H, n, 2d)
        if torch.jit.is_scripting():
            q, k = pope_features(F.softplus(q), q_table), pope_features(F.softplus(k), k_table)
        else:
            q, k = magnitude_features(q, q_table), magnitude_features(k, k_table)
        attn_mask, _, has_key = key_mask_to_attn_mask(key_mask, None, False, N)
        # SDPA's fused kernels need equal q / k / v widths: v repeated to 2d, the first d outputs kept
        out = F.scaled_dot_product_attention(q, k, torch.cat([v, v], dim=-1), attn_mask=attn_mask, scale=1.0,
                                             dropout_p=self.attn_drop.p if self.training else 0.)
        out = out[..., :dh]
        if has_key is not None:
            out = out * has_key
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))


POSITIONAL_CROSS_LAYERS = {'goat': GoatCrossAttention, 'pope': PopeCrossAttention}
