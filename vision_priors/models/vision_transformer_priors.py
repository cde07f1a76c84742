"""Vision Transformers whose attention carries positional priors (GOAT, PoPE) or LAVO, as timm models.

The models follow timm's ``VisionTransformer`` contract (they subclass it) without any learned
absolute position table: every block receives the per-token (x, y) patch coordinates of the current
grid, so a model trained at 224 evaluates at any resolution (square or not) with no interpolation.

Papers: GOAT (Litman & Guo, Sec. 4, Eq. 12 / 20 axis-wise 2D prior); PoPE (Gopalakrishnan et al.,
Eqs. 3-6, applied axis-wise over (x, y)); LAVO (non-causal self-attention with a 2D local window over
the patch grid, and ``global_pool='lavo'``: learned queries cross-attend to the compressed patches,
Sec. 3.4), which makes the whole model linear in the number of patches.
"""
import inspect
from contextlib import nullcontext
from functools import lru_cache, partial
from typing import Any, Dict, List, Optional, Set, Tuple, Type, Union

import torch
from torch import Tensor, nn

from timm.layers import DropPath, LayerScale, Mlp, to_2tuple
from timm.layers.pos_embed_sincos import _apply_coord_augs, _coord_aug_config
from timm.models import (
    build_model_with_cfg, generate_default_cfgs, register_model, register_notrace_function, register_notrace_module)
from timm.models._features import feature_take_indices
from timm.models._manipulate import checkpoint
from timm.models.vision_transformer import VisionTransformer
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from ..layers import GoatAttention, LavoAttention, LavoCrossAttention, PopeAttention, grid_coords
from ..layers.coords import grid_extents

__all__ = ['PriorBlock', 'LavoBlock', 'LavoPool', 'PriorVisionTransformer', 'patch_grid_coords', 'vit_goat_max_freq']

POSITIONAL_ATTENTION = {'goat': GoatAttention, 'pope': PopeAttention, 'lavo': LavoAttention}

# LAVO's windowed attention depends on the grid (data under torch.fx): trace it as one leaf call
register_notrace_module(LavoAttention)
register_notrace_module(LavoCrossAttention)


@lru_cache(maxsize=32)
def _cached_grid_coords(rows: int, cols: int, device: torch.device, ref_rows: int, ref_cols: int) -> Tensor:
    # a normal tensor even when first requested under torch.inference_mode: an inference tensor in the
    # cache could not be saved for backward by a later training step (e.g. under grad checkpointing)
    with torch.inference_mode(False):
        return grid_coords((rows, cols), device=device, ref_grid_size=(ref_rows, ref_cols) if ref_rows else None)


@torch.fx.wrap
@register_notrace_function
def patch_grid_coords(rows: int, cols: int, device: torch.device, ref_rows: int = 0, ref_cols: int = 0) -> Tensor:
    """(rows * cols, 2) (x, y) coordinates of a patch grid, cached per grid and device in eager mode.

    ``ref_rows`` / ``ref_cols`` > 0: rescaled onto that reference grid (``grid_coords``' ``ref_grid_size``).
    A leaf for torch.fx (the grid comes from the input shape), plain code under TorchScript.
    """
    if torch.jit.is_scripting():
        if ref_rows > 0:
            return grid_coords((rows, cols), device=device, ref_grid_size=(ref_rows, ref_cols))
        return grid_coords((rows, cols), device=device)
    return _cached_grid_coords(int(rows), int(cols), torch.device(device), int(ref_rows), int(ref_cols))


class PriorBlock(nn.Module):
    """Pre-norm transformer block whose attention takes token coordinates.

    Accepts the keyword arguments timm's ``VisionTransformer`` passes to ``block_fn``.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            mlp_ratio: float = 4.,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_attn_norm: bool = False,
            scale_mlp_norm: bool = False,
            proj_bias: bool = True,
            proj_drop: float = 0.,
            attn_drop: float = 0.,
            init_values: Optional[float] = None,
            drop_path: float = 0.,
            act_layer: Type[nn.Module] = nn.GELU,
            norm_layer: Type[nn.Module] = nn.LayerNorm,
            mlp_layer: Type[nn.Module] = Mlp,
            attn_layer: Type[nn.Module] = GoatAttention,
            depth: int = 0,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        if scale_attn_norm or not proj_bias:
            raise ValueError('PriorBlock supports neither scale_attn_norm nor proj_bias=False')
        self.num_prefix_tokens = int(getattr(attn_layer, 'keywords', {}).get('num_prefix_tokens', 0))
        with torch.device(device) if device is not None else nullcontext():
            self.norm1 = norm_layer(dim)
            self.attn = attn_layer(
                dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, attn_drop=attn_drop,
                proj_drop=proj_drop, norm_layer=norm_layer)
            self.ls1 = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
            self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
            self.norm2 = norm_layer(dim)
            self.mlp = mlp_layer(
                in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer,
                norm_layer=norm_layer if scale_mlp_norm else None, drop=proj_drop)
            self.ls2 = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
            self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        if dtype is not None:
            self.to(dtype)

    def forward(
            self,
            x: Tensor,
            coords: Optional[Tensor] = None,
            grid_size: Optional[List[int]] = None,
            attn_mask: Optional[Tensor] = None,
            is_causal: bool = False,
    ) -> Tensor:
        """``coords``: patch coordinates (used); ``grid_size``: unused here (a LavoBlock needs it)."""
        y = self.attn(self.norm1(x), coords, attn_mask, is_causal, False)
        if torch.jit.is_scripting():
            assert isinstance(y, Tensor)  # refine the Union return for TorchScript
            x = x + self.drop_path1(self.ls1(y))
        else:
            x = x + self.drop_path1(self.ls1(y))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


def _lavo_attention(
        dim: int,
        num_heads: int,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        attn_drop: float = 0.,
        proj_drop: float = 0.,
        norm_layer: Optional[Type[nn.Module]] = None,
        num_prefix_tokens: int = 0,
        **lavo_kwargs,
) -> LavoAttention:
    """Non-causal LAVO attention from the arguments a timm block passes (qk_norm is not supported)."""
    if qk_norm:
        raise ValueError('LAVO ViT blocks do not support qk_norm')
    lavo_kwargs.setdefault('num_slots', min(64, dim // num_heads))
    return LavoAttention(dim, num_heads=num_heads, causal=False, num_spatial_dims=2, qkv_bias=qkv_bias,
                         attn_drop=attn_drop, proj_drop=proj_drop, **lavo_kwargs)


@torch.fx.wrap
def reject_dense_mask(attn_mask: Optional[Tensor], is_causal: bool) -> None:
    """LAVO ViT blocks are non-causal and take no (N, N) mask: say so instead of ignoring it."""
    if attn_mask is not None or is_causal:
        raise ValueError('LAVO ViT blocks are non-causal and accept no attn_mask / is_causal')


class LavoBlock(PriorBlock):
    """Pre-norm block with non-causal LAVO self-attention over the 2D patch grid (linear in N).

    The attention gets the grid layout (rows, cols) and the number of prefix tokens from the model;
    the local branch is a 2D window over the grid, the global branch the CODE memory (LAVO Eqs. 3-4).
    """

    def forward(
            self,
            x: Tensor,
            coords: Optional[Tensor] = None,
            grid_size: Optional[List[int]] = None,
            attn_mask: Optional[Tensor] = None,
            is_causal: bool = False,
    ) -> Tensor:
        reject_dense_mask(attn_mask, is_causal)
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), None, grid_size, self.num_prefix_tokens)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class LavoPool(nn.Module):
    """``global_pool='lavo'``: learned queries cross-attend to the compressed patch tokens (LAVO Sec. 3.4).

    Cost O(r d (n + m)) for n patches and m queries; the queries' outputs are averaged, then a
    residual MLP as in timm's ``AttentionPoolLatent``.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            num_queries: int = 1,
            num_slots: int = 64,
            mlp_ratio: float = 4.,
            norm_layer: Type[nn.Module] = nn.LayerNorm,
            act_layer: Type[nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        self.latent = nn.Parameter(torch.zeros(1, num_queries, dim))
        nn.init.trunc_normal_(self.latent, std=dim ** -0.5)
        self.attn = LavoCrossAttention(dim, num_heads=num_heads, num_slots=min(num_slots, dim // num_heads))
        self.norm = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer)

    def forward(self, x: Tensor) -> Tensor:
        queries = self.latent.expand(x.shape[0], -1, -1)
        y = queries + self.attn(queries, x)
        y = y + self.mlp(self.norm(y))
        return y.mean(dim=1)


# GOAT in these ViTs is relative only by default: no key-default MLP g_h(phi_abs(p_j)) (Eq. 21), an absolute-position
# term whose inputs leave their training range when the patch grid grows, where it extrapolates arbitrarily. The
# README's ablation (main job, 3 seeds): with the MLP 96.9 +- 4.6 / 63.3 +- 30.9 / 47.6 +- 32.4 % at 1x / 1.5x / 2x,
# without it 99.8 +- 0.2 / 93.7 +- 4.1 / 85.3 +- 8.9 %. ``attn_kwargs=dict(key_mlp_hidden=32)`` restores it.
VIT_GOAT_DEFAULTS: Dict[str, Any] = dict(key_mlp_hidden=0)
# The ladder's top frequency (``max_freq``) follows the training grid: see ``vit_goat_max_freq``.


def vit_goat_max_freq(grid_size: Tuple[int, int]) -> float:
    """The GOAT ViTs' default top frequency (rad per patch) for a model built on a ``grid_size`` patch grid.

    0.4 on a 4 x 4 grid, scaled by 7 / (2 G - 1) on a G x G one (G the longer side): the top mode turns
    2.8 rad (< pi) over the largest offset of a grid twice the training one (2 G - 1 patches), so no offset up
    to 2x the training grid aliases onto a shorter one. The paper's ladder (1 rad per patch) and a fixed 0.4 alias
    there (README ablations, main job at 2x: max_freq 1 vs 0.4 on a 4 x 4 grid, 74.6 vs 90.8 % over six seeds;
    on an 8 x 8 grid 0.4 vs this rule's 0.19, 70.9 +- 33.9 vs 89.0 +- 12.2 % over six; on 14 x 14 level, with one
    of four seeds slower to learn at the training resolution)."""
    side = max(int(grid_size[0]), int(grid_size[1]))
    if side < 1:
        raise ValueError(f'grid_size must be positive, got {tuple(grid_size)}')
    return 0.4 * (7.0 / (2 * side - 1))


def _patch_grid(vit_kwargs: Dict[str, Any]) -> Tuple[int, int]:
    """The patch grid a ``VisionTransformer`` built with ``vit_kwargs`` starts on (timm's defaults otherwise)."""
    defaults = inspect.signature(VisionTransformer.__init__).parameters
    img = to_2tuple(vit_kwargs.get('img_size', defaults['img_size'].default))
    patch = to_2tuple(vit_kwargs.get('patch_size', defaults['patch_size'].default))
    return img[0] // patch[0], img[1] // patch[1]


class PriorVisionTransformer(VisionTransformer):
    """timm ``VisionTransformer`` with a positional-prior attention in every block and no position table.

    Args:
        pos_attn: 'goat' or 'pope'.
        attn_kwargs: Extra options of the attention layer (e.g. ``num_modes``, ``prior_init``,
            ``freq_base``, ``learn_freqs`` for GOAT; ``freq_base``, ``learn_bias`` for PoPE). GOAT starts from
            ``VIT_GOAT_DEFAULTS`` (no key-default MLP: a purely relative 2D prior that extrapolates to larger grids)
            and a top frequency set by the patch grid of ``img_size`` (``vit_goat_max_freq``: 0.4 rad per patch
            on 4 x 4, about 0.1 on 14 x 14), so offsets up to twice the grid do not alias; ``goat_max_freq``
            holds the value used.
        dynamic_img_size: Accept any input size divisible by the patch (default True: these
            models have nothing to resample).
        ref_feat_shape: (rows, cols) of a reference patch grid, usually the training grid: the patch
            coordinates of any grid are rescaled to span it (position interpolation, timm EVA's
            ``ref_feat_shape``; a model trained on 4 x 4 evaluated on 8 x 8 then sees offsets in steps of
            0.5). None (default): patch units, so offsets beyond the training grid are extrapolated.
            LAVO: its 2D window and relative bias table are rescaled instead (``rescale_window_2d``).
            ``set_ref_feat_shape`` changes it.
        shift_coords, jitter_coords, rescale_coords: training-only augmentation of the patch coordinates, as
            timm's RoPE ViTs have it (``rope_*_coords``, from DINOv3; timm's own function): one random shift
            (patches), per-axis scale or shared scale (log-uniform in [1/r, r]) per forward pass. GOAT and PoPE
            only (LAVO's window counts patches). None (default): off.
        **kwargs: Everything timm's ``VisionTransformer`` accepts, except a learned ``pos_embed``
            and ``patch_drop_rate`` (dropping patches would need per-sample coordinates).
    """

    def __init__(
            self,
            pos_attn: str = 'goat',
            attn_kwargs: Optional[Dict[str, Any]] = None,
            dynamic_img_size: bool = True,
            global_pool: str = 'token',
            ref_feat_shape: Optional[Tuple[int, int]] = None,
            shift_coords: Optional[float] = None,
            jitter_coords: Optional[float] = None,
            rescale_coords: Optional[float] = None,
            **kwargs,
    ) -> None:
        if pos_attn not in POSITIONAL_ATTENTION:
            raise ValueError(f'pos_attn must be one of {sorted(POSITIONAL_ATTENTION)}, got {pos_attn!r}')
        coord_augs = _coord_aug_config(shift_coords, jitter_coords, rescale_coords)  # timm's checks
        if coord_augs[3] and pos_attn == 'lavo':
            raise ValueError('shift_coords / jitter_coords / rescale_coords are not supported by LAVO ViTs: the '
                             'local window counts patches')
        if kwargs.get('pos_embed', 'none') not in ('', 'none'):
            raise ValueError(f"{pos_attn} ViTs carry position in attention; pos_embed must be 'none', "
                             f"got {kwargs['pos_embed']!r}")
        if kwargs.get('patch_drop_rate', 0.) > 0:
            raise ValueError('patch_drop_rate > 0 is not supported: it would need per-sample token coordinates')
        num_prefix_tokens = int(kwargs.get('class_token', True)) + int(kwargs.get('reg_tokens', 0))
        if pos_attn == 'goat':
            attn_kwargs = dict(VIT_GOAT_DEFAULTS, **(attn_kwargs or {}))
            if 'max_freq' not in attn_kwargs:
                attn_kwargs['max_freq'] = vit_goat_max_freq(_patch_grid(kwargs))
        if pos_attn == 'lavo':
            attn_layer = partial(_lavo_attention, num_prefix_tokens=num_prefix_tokens, **(attn_kwargs or {}))
            block_fn: Type[nn.Module] = LavoBlock
        else:
            attn_layer = partial(
                POSITIONAL_ATTENTION[pos_attn], num_spatial_dims=2, num_prefix_tokens=num_prefix_tokens,
                **(attn_kwargs or {}))
            block_fn = PriorBlock
        kwargs['pos_embed'] = 'none'
        lavo_pool = global_pool == 'lavo'
        super().__init__(
            dynamic_img_size=dynamic_img_size, block_fn=block_fn, attn_layer=attn_layer,
            global_pool='map' if lavo_pool else global_pool, **kwargs)
        if lavo_pool:
            self._make_lavo_pool()
        self.pos_attn = pos_attn
        self._ref_grid: List[int] = [0, 0]  # (rows, cols) of ref_feat_shape; 0 = patch units
        self.shift_coords, self.jitter_coords, self.rescale_coords, self.coord_augs_active = coord_augs
        self.set_ref_feat_shape(ref_feat_shape)
        self._set_block_grid_size()

    @torch.jit.ignore
    def set_ref_feat_shape(self, ref_feat_shape: Optional[Tuple[int, int]]) -> None:
        """Measure patch positions on this (rows, cols) reference grid (position interpolation), or in patch
        units (None): GOAT / PoPE coordinates, LAVO's 2D window. Raises ValueError for a shape that is not two
        positive integers."""
        if ref_feat_shape is None:
            self._ref_grid = [0, 0]
            self._set_block_ref_grid(None)
            return
        rows, cols = grid_extents(to_2tuple(ref_feat_shape), 'ref_feat_shape')
        self._ref_grid = [rows, cols]
        self._set_block_ref_grid((rows, cols))

    def _set_block_ref_grid(self, ref_grid: Optional[Tuple[int, int]]) -> None:
        for blk in self.blocks:
            if hasattr(blk.attn, 'set_ref_grid_size'):  # LAVO: the 2D window is rescaled
                blk.attn.set_ref_grid_size(ref_grid)

    @property
    @torch.jit.unused
    def ref_feat_shape(self) -> Optional[Tuple[int, int]]:
        """The reference grid patch positions are measured on (``set_ref_feat_shape``); None: patch units."""
        return (self._ref_grid[0], self._ref_grid[1]) if self._ref_grid[0] else None

    __jit_unused_properties__ = ['goat_max_freq', 'ref_feat_shape']

    @property
    def goat_max_freq(self) -> Optional[float]:
        """The GOAT ladder's top frequency (rad per patch) in the blocks; None for PoPE / LAVO (or no blocks)."""
        if self.pos_attn != 'goat' or not len(self.blocks):
            return None
        return self.blocks[0].attn.prior.max_freq

    def _make_lavo_pool(self) -> None:
        num_heads = self.blocks[0].attn.num_heads if len(self.blocks) else 1
        device = self.patch_embed.proj.weight.device
        with torch.device(device):
            self.attn_pool = LavoPool(self.embed_dim, num_heads=num_heads)
        self.global_pool = 'lavo'
        self.pool_include_prefix = False

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """As timm's, plus ``global_pool='lavo'`` (kept, or switched to from another pool)."""
        if global_pool == 'lavo' or (global_pool is None and self.global_pool == 'lavo'):
            if self.global_pool != 'lavo':
                self._make_lavo_pool()
            super().reset_classifier(num_classes, None)
            return
        if self.global_pool == 'lavo' and global_pool is not None:
            self.global_pool = 'map'  # let timm remove the attention pool
        super().reset_classifier(num_classes, global_pool)

    def _set_block_grid_size(self) -> None:
        grid = tuple(self.patch_embed.grid_size)
        for blk in self.blocks:
            if hasattr(blk.attn, 'set_grid_size'):
                blk.attn.set_grid_size(grid)

    def set_input_size(
            self,
            img_size: Optional[Tuple[int, int]] = None,
            patch_size: Optional[Tuple[int, int]] = None,
    ) -> None:
        """Change the default input resolution; the priors need no resampling, only the new grid."""
        super().set_input_size(img_size=img_size, patch_size=patch_size)
        self._set_block_grid_size()

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Class / register tokens and every positional-prior parameter (alpha, beta, biases, delta)."""
        skip = set(super().no_weight_decay())
        for name, _ in self.named_parameters():
            if '.attn.prior.' in name or '.attn.phases.' in name:
                skip.add(name)
        return skip

    def _embed_with_coords(self, x: Tensor) -> Tuple[Tensor, Tensor, List[int]]:
        """Patch tokens (NHWC or NLC) -> prefix + patch tokens (NLC), patch coordinates, [rows, cols]."""
        if self.dynamic_img_size:
            B, H, W, C = x.shape
            x = x.reshape(B, H * W, C)
        else:
            H, W = self.patch_embed.grid_size[0], self.patch_embed.grid_size[1]
        coords = patch_grid_coords(H, W, x.device, self._ref_grid[0], self._ref_grid[1])
        if self.training and self.coord_augs_active:
            coords = _apply_coord_augs(coords, self.shift_coords, self.jitter_coords, self.rescale_coords)
        to_cat: List[Tensor] = []
        if self.cls_token is not None:
            to_cat.append(self.cls_token.expand(x.shape[0], -1, -1))
        if self.reg_token is not None:
            to_cat.append(self.reg_token.expand(x.shape[0], -1, -1))
        if len(to_cat) > 0:
            x = torch.cat(to_cat + [x], dim=1)
        return self.pos_drop(x), coords, [H, W]

    def forward_features(
            self,
            x: Tensor,
            attn_mask: Optional[Tensor] = None,
            is_causal: bool = False,
    ) -> Tensor:
        x = self.patch_embed(x)
        x, coords, grid = self._embed_with_coords(x)
        x = self.norm_pre(x)
        for blk in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, coords, grid, attn_mask, is_causal)
            else:
                x = blk(x, coords, grid, attn_mask, is_causal)
        return self.norm(x)

    def forward_intermediates(
            self,
            x: Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            return_prefix_tokens: bool = False,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
            output_dict: bool = False,
            attn_mask: Optional[Tensor] = None,
            is_causal: bool = False,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]], Dict[str, Any]]:
        """Forward features returning intermediates (timm's ``forward_intermediates`` contract)."""
        assert output_fmt in ('NCHW', 'NLC'), 'Output format must be one of NCHW or NLC.'
        reshape = output_fmt == 'NCHW'
        intermediates = []
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)

        B, _, height, width = x.shape
        x = self.patch_embed(x)
        x, coords, grid = self._embed_with_coords(x)
        x = self.norm_pre(x)

        if torch.jit.is_scripting() or not stop_early:  # can't slice blocks in torchscript
            blocks = self.blocks
        else:
            blocks = self.blocks[:max_index + 1]
        for i, blk in enumerate(blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, coords, grid, attn_mask, is_causal)
            else:
                x = blk(x, coords, grid, attn_mask, is_causal)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)

        if self.num_prefix_tokens:
            prefix_tokens = [y[:, 0:self.num_prefix_tokens] for y in intermediates]
            intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        else:
            prefix_tokens = None

        if reshape:
            H, W = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]

        if output_dict:
            result_dict = {}
            result_dict['image_intermediates'] = intermediates
            if prefix_tokens is not None and return_prefix_tokens:
                result_dict['image_intermediates_prefix'] = prefix_tokens
            if not intermediates_only:
                result_dict['image_features'] = self.norm(x)
            return result_dict

        if not torch.jit.is_scripting() and return_prefix_tokens and prefix_tokens is not None:
            intermediates = list(zip(intermediates, prefix_tokens))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates


def _cfg(url: str = '', **kwargs) -> Dict[str, Any]:
    return {
        'url': url,
        'num_classes': 1000,
        'input_size': (3, 224, 224),
        'pool_size': None,
        'crop_pct': 0.9,
        'interpolation': 'bicubic',
        'fixed_input_size': False,
        'mean': IMAGENET_DEFAULT_MEAN,
        'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.proj',
        'classifier': 'head',
        'license': 'apache-2.0',
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    'vit_tiny_patch16_goat_224.untrained': _cfg(),
    'vit_small_patch16_goat_224.untrained': _cfg(),
    'vit_base_patch16_goat_224.untrained': _cfg(),
    'vit_tiny_patch16_pope_224.untrained': _cfg(),
    'vit_small_patch16_pope_224.untrained': _cfg(),
    'vit_base_patch16_pope_224.untrained': _cfg(),
    'vit_tiny_patch16_lavo_224.untrained': _cfg(),
    'vit_small_patch16_lavo_224.untrained': _cfg(),
    'vit_base_patch16_lavo_224.untrained': _cfg(),
})


def _create_prior_vit(variant: str, pretrained: bool = False, **kwargs) -> PriorVisionTransformer:
    out_indices = kwargs.pop('out_indices', 3)
    return build_model_with_cfg(
        PriorVisionTransformer, variant, pretrained,
        feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
        **kwargs,
    )


SIZES = {
    'tiny': dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    'small': dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    'base': dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
}


def _entry(size: str, pos_attn: str, pretrained: bool, kwargs: Dict[str, Any]) -> PriorVisionTransformer:
    model_args = dict(SIZES[size], pos_attn=pos_attn)
    if pos_attn == 'lavo':
        model_args['global_pool'] = "lavo"
    return _create_prior_vit(f'vit_{size}_patch16_{pos_attn}_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_tiny_patch16_goat_224(pretrained: bool = False, **kwargs) -> PriorVisionTransformer:
    """ViT-Ti/16 with the 2D GOAT prior (R = 4 modes per axis: d_p = 18 of 64 head dims)."""
    return _entry('tiny', 'goat', pretrained, kwargs)


@register_model
def vit_small_patch16_goat_224(pretrained: bool = False, **kwargs) -> PriorVisionTransformer:
    """ViT-S/16 with the 2D GOAT prior (the paper's Fig. 5 model)."""
    return _entry('small', 'goat', pretrained, kwargs)


@register_model
def vit_base_patch16_goat_224(pretrained: bool = False, **kwargs) -> PriorVisionTransformer:
    """ViT-B/16 with the 2D GOAT prior."""
    return _entry('base', 'goat', pretrained, kwargs)


@register_model
def vit_tiny_patch16_pope_224(pretrained: bool = False, **kwargs) -> PriorVisionTransformer:
    """ViT-Ti/16 with 2D PoPE phases."""
    return _entry('tiny', 'pope', pretrained, kwargs)


@register_model
def vit_small_patch16_pope_224(pretrained: bool = False, **kwargs) -> PriorVisionTransformer:
    """ViT-S/16 with 2D PoPE phases."""
    return _entry('small', 'pope', pretrained, kwargs)


@register_model
def vit_base_patch16_pope_224(pretrained: bool = False, **kwargs) -> PriorVisionTransformer:
    """ViT-B/16 with 2D PoPE phases."""
    return _entry('base', 'pope', pretrained, kwargs)


@register_model
def vit_tiny_patch16_lavo_224(pretrained: bool = False, **kwargs) -> PriorVisionTransformer:
    """ViT-Ti/16 with non-causal LAVO blocks (2D local window + CODE memory) and LAVO pooling."""
    return _entry('tiny', 'lavo', pretrained, kwargs)


@register_model
def vit_small_patch16_lavo_224(pretrained: bool = False, **kwargs) -> PriorVisionTransformer:
    """ViT-S/16 with non-causal LAVO blocks and LAVO pooling: linear in the number of patches."""
    return _entry('small', 'lavo', pretrained, kwargs)


@register_model
def vit_base_patch16_lavo_224(pretrained: bool = False, **kwargs) -> PriorVisionTransformer:
    """ViT-B/16 with non-causal LAVO blocks and LAVO pooling."""
    return _entry('base', 'lavo', pretrained, kwargs)
