"""Spatial VQA, fusion variant: a ViT image encoder and a question decoder that cross-attends to the image.

The single-stream :class:`~vision_priors.models.spatial_vqa.SpatialVQATransformer` runs one transformer over
image and question tokens. :class:`SpatialVQAFusion` separates the modalities (same inputs, same outputs):

  image encoder   the blocks and final norm of the package's timm ViT ``vit_tiny_patch16_<method>_224``
                  (created by name through ``timm.create_model`` with this model's width / depth / heads,
                  no class token, no pooling), over the M patch tokens (a linear patch embedding, as the
                  single-stream model). ``goat`` / ``pope``: 2D prior / phases on the canonical (x, y) patch
                  coordinates, tokens in the sample's scan order. ``lavo``: the tokens are first put in
                  row-major grid order by their coordinates (LAVO's 2D local window is defined on the grid).
  question decoder  ``depth`` :class:`~vision_priors.models.multimodal.CrossAttentionBlock` s over the Q T
                  question tokens: causal self-attention inside each question (1D positions restarting at
                  t = 0; GOAT / PoPE 1D for ``goat`` / ``pope``, plain softmax for ``lavo``: a causal LAVO
                  running mean would mix the independent questions of a scene), then cross-attention to the
                  encoded image tokens (``cross_attn``: ``'softmax'`` or ``'lavo'``, LAVO Sec. 3.4, or the
                  positional ``'goat'`` / ``'pope'``, below), MLP.

Positional cross-attention (``cross_attn='goat'`` with ``pos_method='goat'``, ``'pope'`` with ``'pope'``): the
decoder's cross-attention is :class:`~vision_priors.layers.GoatCrossAttention` /
:class:`~vision_priors.layers.PopeCrossAttention` in 2D. Question token t of every question sits at (c + t, c + t),
c = max(rows, cols) (``vqa_text_coords``, exactly the single-stream model's text coordinates), the image tokens at
their canonical (x, y) in the encoder's output order; so a question token can reach an image region through the
GOAT prior / PoPE phases between its coordinate and the patches', as in the single-stream model, instead of
having to learn that routing bilinearly from the features. The decoder's self-attention keeps its 1D
within-question positions t.

Image positions (``image_pos``): ``'none'`` (default) leaves position to the encoder's attention only. The
content cross-attentions (``'softmax'``, ``'lavo'``) have no positional term, and LAVO's compression averages over the
image, so with ``'none'`` a question can reach a region only through what the encoder writes into the token features
(with a relative prior: mostly boundary effects). ``'sincos'`` adds fixed 2D sin / cos features of the canonical (x, y)
(:func:`coordinate_features`, as MAE's 2D sin-cos table but per token) to the patch embeddings, so every image
token carries its absolute position into its features, which both cross-attentions can read. ``'rotary'``
rotates the *encoded* image tokens by their canonical (x, y) before the cross-attention (axial 2D rotary
angles, :mod:`vision_priors.layers.rotary`; RoFormer Sec. 3.3 rotates the keys of linear attention before they
are summed, the same move): channel pair k of token t turns by w_k x_t (first half of the pairs) or w_k y_t
(second half). LAVO's CODE reads the context only through its mean (Eq. 3), and the mean of added positions is a
constant, so with ``'sincos'`` it keeps no trace of where anything is; the mean of rotated tokens is a set of
spatial Fourier coefficients ``sum_t exp(i w_k x_t) c_t`` of the feature maps, which does. The softmax
cross-attention reads the same rotated tokens.

The answer is read at the last token of each question, as in the single-stream model. Every position the
model sees is a canonical coordinate or a within-question index, never the scan-order index, so the
answers do not depend on the scan order (tested), like goat / pope single-stream with prefix attention.
"""
import math
from typing import Any, Dict, Optional, Set, Tuple

import torch
from torch import Tensor, nn

import timm
from timm.layers import trunc_normal_
from timm.models._manipulate import checkpoint

from ..layers.rotary import rotate_by_coords
from .multimodal import CROSS_ATTENTIONS, POSITIONAL_CROSS_ATTENTIONS, create_cross_block
from .spatial_vqa import vqa_text_coords
from . import vision_transformer_priors  # noqa: F401  (registers the timm models built by name below)

__all__ = ['SpatialVQAFusion', 'FUSION_METHODS', 'IMAGE_POS', 'coordinate_features', 'question_self_attention_mask']

FUSION_METHODS = ('goat', 'pope', 'lavo')
IMAGE_POS = ('none', 'sincos', 'rotary')


def coordinate_features(coords: Tensor, dim: int, temperature: float = 10000.) -> Tensor:
    """Fixed 2D Fourier features (..., dim) of (x, y) ``coords`` (..., 2): for each axis a and frequency
    w_k = temperature^(-4k / dim), k < dim / 4: [sin(w_k x), cos(w_k x), sin(w_k y), cos(w_k y)] blocks."""
    if dim % 4:
        raise ValueError(f'coordinate features need a width divisible by 4, got {dim}')
    bands = temperature ** (-4. / dim * torch.arange(dim // 4, dtype=coords.dtype, device=coords.device))
    angles = coords[..., :, None] * bands  # (..., 2, dim / 4)
    return torch.cat([angles.sin(), angles.cos()], dim=-1).flatten(-2)


def question_self_attention_mask(num_questions: int, question_len: int,
                                 device: Optional[torch.device] = None) -> Tensor:
    """(Q T, Q T) bool, True = may attend: causal inside each question, nothing across questions."""
    causal = torch.ones(question_len, question_len, dtype=torch.bool, device=device).tril()
    return torch.block_diag(*([causal] * num_questions))


def raster_permutation(coords: Tensor, grid_size: Tuple[int, int]) -> Tensor:
    """(B, M) indices that put tokens with canonical (x, y) ``coords`` (B, M, 2) in row-major grid order.

    Raises ValueError unless the coordinates of every sample are exactly the grid's M integer points.
    """
    rows, cols = grid_size
    x, y = coords[..., 0], coords[..., 1]
    index = (y * cols + x).round().long()
    exact = (x == x.round()) & (y == y.round()) & (x >= 0) & (x < cols) & (y >= 0) & (y < rows)
    order = index.argsort(dim=-1)
    expected = torch.arange(rows * cols, device=coords.device)
    if not bool(exact.all()) or not bool((index.gather(-1, order) == expected).all()):
        raise ValueError(f'coords must be a permutation of the {rows}x{cols} grid points (x, y) for the LAVO encoder')
    return order


class SpatialVQAFusion(nn.Module):
    """ViT image encoder + question decoder with cross-attention; one answer per question.

    Args:
        pos_method: 'goat', 'pope' or 'lavo': the encoder's 2D method (and the decoder's 1D one for goat / pope).
        vocab_size, patch_dim, grid_size, question_len, embed_dim, num_heads, mlp_ratio, goat_modes,
            goat_kwargs, pope_kwargs, drop_path_rate, qkv_bias: as ``SpatialVQATransformer``.
        depth: Encoder blocks.
        decoder_depth: Decoder blocks (default ``depth``).
        cross_attn: 'softmax' or 'lavo'; or 'goat' / 'pope' (the same as ``pos_method``): positional
            cross-attention between text coordinates (c + t, c + t) and the patches' canonical coordinates.
        cross_slots: LAVO cross-attention slots r per head (capped at the head dim).
        image_pos: 'none', 'sincos' or 'rotary' (module docstring). The rotary ladder runs from pi rad per
            patch down to pi / (4 max(rows, cols)), an eighth of a turn across the longest side of the grid.
    """

    def __init__(
            self,
            pos_method: str,
            vocab_size: int,
            patch_dim: int,
            grid_size: Tuple[int, int] = (8, 8),
            question_len: int = 3,
            embed_dim: int = 128,
            depth: int = 4,
            num_heads: int = 4,
            mlp_ratio: float = 4.,
            cross_attn: str = 'softmax',
            decoder_depth: Optional[int] = None,
            cross_slots: int = 64,
            goat_modes: int = 2,
            goat_kwargs: Optional[Dict[str, Any]] = None,
            pope_kwargs: Optional[Dict[str, Any]] = None,
            drop_path_rate: float = 0.,
            qkv_bias: bool = True,
            image_pos: str = 'none',
    ) -> None:
        super().__init__()
        if pos_method not in FUSION_METHODS:
            raise ValueError(f'pos_method must be one of {FUSION_METHODS} for the fusion model, got {pos_method!r}')
        if cross_attn not in CROSS_ATTENTIONS:
            raise ValueError(f'cross_attn must be one of {CROSS_ATTENTIONS}, got {cross_attn!r}')
        if cross_attn in POSITIONAL_CROSS_ATTENTIONS and cross_attn != pos_method:
            raise ValueError(f"cross_attn={cross_attn!r} is positional and needs pos_method={cross_attn!r} (the same "
                             f"method in the encoder and the cross-attention), got pos_method={pos_method!r}")
        if image_pos not in IMAGE_POS:
            raise ValueError(f'image_pos must be one of {IMAGE_POS}, got {image_pos!r}')
        if image_pos != 'none' and embed_dim % 4:
            raise ValueError(f"image_pos={image_pos!r} needs embed_dim divisible by 4, got {embed_dim}")
        if embed_dim % num_heads:
            raise ValueError(f'embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})')
        if question_len < 1 or vocab_size < 2 or patch_dim < 1:
            raise ValueError(f'need question_len >= 1, vocab_size >= 2, patch_dim >= 1; got {question_len}, '
                             f'{vocab_size}, {patch_dim}')
        self.pos_method = pos_method
        self.cross_attn = cross_attn
        self.image_pos = image_pos
        self.grid_size = (int(grid_size[0]), int(grid_size[1]))
        self.num_image_tokens = self.grid_size[0] * self.grid_size[1]
        self.question_len = question_len
        self.vocab_size = vocab_size
        self.patch_dim = patch_dim
        self.grad_checkpointing = False
        decoder_depth = depth if decoder_depth is None else decoder_depth
        method_kwargs = {'goat': dict(num_modes=goat_modes, **(goat_kwargs or {})), 'pope': dict(pope_kwargs or {}),
                         'lavo': {}}[pos_method]

        self.patch_embed = nn.Linear(patch_dim, embed_dim)
        # the image tokens arrive as patch vectors: a 1x1-patch ViT over the (rows, cols) grid gives the timm
        # model the grid; only its blocks and final norm are kept
        # the scenes' grid never grows, so the GOAT encoder keeps the 0.4 rad per patch top frequency it was
        # measured with on every grid (the ViTs' grid-dependent default serves extrapolation to larger grids)
        encoder_kwargs = dict({'max_freq': 0.4} if pos_method == 'goat' else {}, **method_kwargs)
        vit = timm.create_model(
            f'vit_tiny_patch16_{pos_method}_224', img_size=self.grid_size, patch_size=1, in_chans=1,
            embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
            class_token=False, global_pool='', num_classes=0, drop_path_rate=drop_path_rate,
            attn_kwargs=encoder_kwargs)
        self.image_blocks = vit.blocks
        self.image_norm = vit.norm

        self.text_embed = nn.Embedding(vocab_size, embed_dim)
        rates = torch.linspace(0, drop_path_rate, decoder_depth).tolist()
        decoder_attn = pos_method if pos_method in ('goat', 'pope') else 'plain'
        self.positional_cross = cross_attn in POSITIONAL_CROSS_ATTENTIONS
        self.decoder_blocks = nn.ModuleList([
            create_cross_block(decoder_attn, embed_dim, num_heads, cross_attn=cross_attn, num_spatial_dims=1,
                               attn_kwargs=method_kwargs if decoder_attn != 'plain' else None, cross_slots=cross_slots,
                               mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop_path=rates[i],
                               **({'cross_spatial_dims': 2, 'cross_kwargs': dict(method_kwargs)}
                                  if self.positional_cross else {}))
            for i in range(decoder_depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, vocab_size)
        self.init_weights()

    def init_weights(self) -> None:
        """Truncated-normal (std 0.02) Linear / Embedding weights, zero biases; GOAT priors keep their own init."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                trunc_normal_(module.weight, std=.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                trunc_normal_(module.weight, std=.02)
        for module in self.modules():
            prior = getattr(module, 'prior', None)
            if isinstance(prior, nn.Module) and hasattr(prior, 'reset_parameters'):
                prior.reset_parameters()

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Positional-prior parameters (GOAT alpha, beta, key defaults; PoPE delta) get no weight decay."""
        return {name for name, _ in self.named_parameters() if 'attn.prior.' in name or 'attn.phases.' in name}

    def encode_image(self, patches: Tensor, coords: Tensor) -> Tensor:
        """(B, M, C) encoded image tokens (normed), in scan order (goat / pope) or row-major order (lavo)."""
        x = self.patch_embed(patches)
        if self.image_pos == 'sincos':
            x = x + coordinate_features(coords, x.shape[-1]).to(x.dtype)
        grid = [self.grid_size[0], self.grid_size[1]]
        block_coords: Optional[Tensor] = coords
        if self.pos_method == 'lavo':
            coords = coords.expand(x.shape[0], -1, -1)
            order = raster_permutation(coords, self.grid_size)
            x = x.gather(1, order[..., None].expand(-1, -1, x.shape[-1]))
            coords = coords.gather(1, order[..., None].expand(-1, -1, 2))  # the tokens' coordinates, grid order
            block_coords = None
        for blk in self.image_blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, block_coords, grid, None, False)
            else:
                x = blk(x, block_coords, grid, None, False)
        x = self.image_norm(x)
        if self.image_pos == 'rotary':
            x = rotate_by_coords(x, coords, min_freq=math.pi / (4 * max(self.grid_size)))
        return x

    def forward(self, patches: Tensor, coords: Tensor, text: Tensor) -> Tensor:
        """Answer logits (B, Q, vocab_size); arguments as ``SpatialVQATransformer.forward``."""
        B, M, P = patches.shape
        if M != self.num_image_tokens or P != self.patch_dim:
            raise ValueError(f'patches have shape {tuple(patches.shape)}, expected (B, {self.num_image_tokens}, '
                             f'{self.patch_dim}) for a {self.grid_size[0]}x{self.grid_size[1]} patch grid')
        if coords.shape[-2:] != (M, 2) or coords.dim() not in (2, 3) or (coords.dim() == 3 and coords.shape[0] != B):
            raise ValueError(f'coords have shape {tuple(coords.shape)}, expected ({B}, {M}, 2) or ({M}, 2)')
        if not coords.is_floating_point():
            raise ValueError(f'coords must be floating point, got dtype {coords.dtype}')
        if text.dim() != 3 or text.shape[0] != B or text.shape[2] != self.question_len:
            raise ValueError(f'text has shape {tuple(text.shape)}, expected ({B}, Q, {self.question_len})')
        num_questions, T = text.shape[1], self.question_len
        image = self.encode_image(patches, coords)
        x = self.text_embed(text.flatten(1))
        positions = torch.arange(T, device=x.device, dtype=x.dtype).repeat(num_questions)[:, None]
        mask = question_self_attention_mask(num_questions, T, x.device)
        image_coords: Optional[Tensor] = None
        text_coords: Optional[Tensor] = None
        if self.positional_cross:
            # goat / pope encoders keep the scan order: the image tokens' coordinates are the input coords
            image_coords = coords
            text_coords = vqa_text_coords(num_questions, T, self.grid_size, device=x.device, dtype=coords.dtype)
        for blk in self.decoder_blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, image, positions, None, mask, False, None, image_coords, text_coords)
            else:
                x = blk(x, image, positions, None, mask, False, None, image_coords, text_coords)
        answer_index = torch.arange(num_questions, device=x.device) * T + T - 1
        return self.head(self.norm(x[:, answer_index]))
