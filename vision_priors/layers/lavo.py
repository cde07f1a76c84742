"""LAVO: Linear Attention via Orthogonal Memory (Zhang et al., arXiv:2312.11135).

CODE compression (Eq. 3): with an orthogonal basis ``B in R^{r x d}`` (rows ``b_i``) and context
``X in R^{n x d}``, the memory is ``H = (1/n) sum_t B x_t`` and the ``r`` slots are
``X~ = diag(H) B`` (slot ``i`` is ``H_i b_i``). A query reads them with
``softmax(q X~^T) X~`` (slots are both keys and values).

Self-attention (Eq. 4, Secs. 3.2-3.3) adds a local branch over a window of ``w`` tokens with the
embedded relative position bias ``A_ij += P[j - i + w - 1]``, ``P in R^{2w-1}`` (EPE), compresses
locally aggregated features (context dissection, CD) and averages
``F_t = (F_local,t + F_global,t) / 2``. Causal: ``H_t = H_{t-1} + (B z_t - H_{t-1}) / t``.
Cross-attention (Sec. 3.4, Eqs. 5-6) compresses the source once and has no local branch.

Fast evaluation: a causal read never materialises the per-query slots (``q . (H_i b_i) = H_i (q . b_i)`` and
``sum_i p_i H_i b_i = (p * H) B``), so it costs ``O(r d)`` per query; a non-causal memory is shared by every
query, so its ``r`` slots (r x d per head) are the keys and values of one SDPA call. The non-causal mean is
taken first, ``H = B mean_t(z_t)``, and with block dissection on a grid only the sum of the tile aggregates is
formed: ``sum_i sum_j p_ij v_j = sum_j (sum_i p_ij) v_j`` (exact rewrites, tested in float64).

Choices where the paper is silent (all configurable):
    * CODE runs per head on ``head_dim`` features with one basis per head, so ``num_slots <= head_dim``.
    * What is compressed: the value projections (slots act as keys and values, Eq. 3), or with CD their
      local aggregates ``z_t`` (below); for cross-attention a linear projection of the source.
    * ``basis='fixed'`` (default): B is an orthogonally initialised buffer. W_q / W_v can absorb a
      rotation, so a fixed B costs little expressiveness and stays exactly orthogonal.
      ``'orthogonal'`` learns B through ``torch.nn.utils.parametrizations.orthogonal`` (exact);
      ``'penalty'`` learns a free B and exposes :meth:`orthogonality_penalty` to add to the loss.
    * Both branches scale logits by ``head_dim ** -0.5`` (Eq. 3 writes none); set ``qk_scale``.
    * CD aggregate ``z_t``: ``dissection='block'`` (default) attends within the token's own
      non-overlapping window of ``w`` tokens (causally when causal), the reading of "aggregate within
      historical windows"; ``'sliding'`` reuses the local-branch output ``F_local,t``. Every token
      ``s <= t`` enters ``H_t`` with weight ``1/t``, so the decoding state stays fixed in size.
    * EPE on a 2D grid: offsets ``|dy|, |dx| <= w2 - 1`` with a ``(2 w2 - 1)^2`` table;
      'block' CD uses ``w2 x w2`` tiles. Prefix tokens (e.g. class token) use local attention among
      prefix tokens only (no bias) and reach the patches through the global branch.
    * Padding: ``key_mask`` (B, L) bool, True = valid key (the package's one convention) removes tokens
      from local windows and from the mean H (the count is over valid tokens); a query with no valid key in
      a window gets 0 from that window.
    * Parallel form: blocks of w tokens, no loop over time; memory O(L (w + r)) per head. The 2D window runs
      in query tiles that each score their tile plus a halo of ``w2 - 1`` patches (:func:`local_window_2d`);
      on CUDA (``kernel_backend`` 'auto' / 'triton') in the Triton op ``vision_priors.kernels.lavo.lavo_local_2d``.

TorchScript: ``LavoAttention.forward`` (causal or not; ``grid_size`` as a list of two ints) and
``LavoCrossAttention.forward`` compile with ``torch.jit.script`` for the 'fixed' and 'penalty' bases
('orthogonal' does not: ``torch.nn.utils.parametrize`` is not scriptable). The decoding methods
(``init_state``, ``step``, ``prefill``) are ``@torch.jit.unused``: eager only.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.parametrizations import orthogonal

from vision_priors.kernels._backend import check_key_mask
from vision_priors.kernels.lavo_torch import code_memory, code_memory_from_sum, code_read as _code_read
from vision_priors.kernels.lavo_torch import code_slot_probs, finfo_min
from vision_priors.kernels.lavo_torch import lavo_local_windows
from vision_priors.kernels.lavo_torch import local_window_2d, tile_block_2d_sum, valid_count, window_tile_size

from .coords import grid_extents
from .kernel_dispatch import check_kernel_backend, use_flash_kernel

__all__ = ['LavoAttention', 'LavoCrossAttention', 'LavoState', 'OrthogonalBasis', 'code_read', 'rescale_window_2d']

_BASIS_MODES = ('fixed', 'orthogonal', 'penalty')
_DISSECTION_MODES = ('block', 'sliding')


class OrthogonalBasis(nn.Module):
    """Per-head orthogonal basis ``B in R^{heads x r x d}`` of CODE (Eq. 3).

    Args:
        num_heads: Number of heads, one basis each.
        num_slots: r, the number of memory slots (rows of B).
        head_dim: d, the feature dimension per head; needs ``num_slots <= head_dim``.
        mode: 'fixed' (buffer), 'orthogonal' (parametrised, exactly orthonormal rows) or 'penalty'
            (free parameter; add :meth:`orthogonality_penalty` to the loss). 'fixed' and 'penalty' work
            under ``torch.jit.script``; 'orthogonal' does not (``torch.nn.utils.parametrize`` is not
            scriptable).
    """

    def __init__(self, num_heads: int, num_slots: int, head_dim: int, mode: str = 'fixed') -> None:
        super().__init__()
        if mode not in _BASIS_MODES:
            raise ValueError(f'basis must be one of {_BASIS_MODES}, got {mode!r}')
        if num_slots < 1:
            raise ValueError(f'num_slots must be >= 1, got {num_slots}')
        if num_slots > head_dim:
            raise ValueError(
                f'num_slots (r={num_slots}) exceeds the per-head feature dimension (head_dim={head_dim}): '
                f'an orthogonal basis B in R^(r x d) needs r <= d. Use num_slots <= {head_dim} '
                f'or fewer heads.')
        self.mode = mode
        init = torch.empty(num_heads, num_slots, head_dim)
        for h in range(num_heads):
            nn.init.orthogonal_(init[h])
        if mode == 'fixed':
            self.register_buffer('weight', init)
        else:
            self.weight = nn.Parameter(init)
            if mode == 'orthogonal':
                orthogonal(self, 'weight')

    def forward(self) -> Tensor:
        """Returns B as a (heads, r, d) tensor."""
        return self.weight

    def orthogonality_penalty(self) -> Tensor:
        """``sum_h ||B_h B_h^T - I||_F^2`` (zero up to rounding for 'fixed' and 'orthogonal')."""
        b = self.weight
        eye = torch.eye(b.shape[-2], dtype=b.dtype, device=b.device)
        return ((b @ b.transpose(-1, -2) - eye) ** 2).sum()


def code_read(q: Tensor, h: Tensor, basis: Tensor, scale: float, attn_drop: Optional[nn.Module] = None) -> Tensor:
    """Read the CODE slots ``diag(H) B`` with softmax attention (Eqs. 3, 4, 6).

    Args:
        q: Queries (B, heads, L, d).
        h: Coefficients H, (B, heads, L, r) (one memory per query) or (B, heads, 1, r) (shared).
        basis: B, (heads, r, d).
        scale: Logit scale.
        attn_drop: Optional dropout on the slot weights.

    Returns:
        ``softmax(scale * q (diag(H) B)^T) diag(H) B`` as (B, heads, L, d), costing O(L r d)
        (``vision_priors.kernels.lavo_torch.code_read``, the ``lavo_global`` op's PyTorch backend).
    """
    if attn_drop is None:
        return _code_read(q, h, basis, scale)
    p = attn_drop(code_slot_probs(q, h, basis, scale))
    return (p * h) @ basis


def _masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last dim with excluded entries exactly 0; rows with no valid entry give 0."""
    scores = scores.masked_fill(~mask, finfo_min(scores.dtype))
    return scores.softmax(dim=-1) * mask.any(dim=-1, keepdim=True)


def dense_window_is_cheaper(gh: int, gw: int, w2: int) -> bool:
    """Whether one (N x N) masked attention over the whole grid scores fewer (weighted) pairs than the query
    tiles of :func:`window_tile_size` (small grids, e.g. 14 x 14 with w2 = 4: 38,416 against 54,756)."""
    tile = window_tile_size(gh, gw, w2)
    padded = (-(-gh // tile) * tile) * (-(-gw // tile) * tile)
    tiled = padded * (tile + 2 * (w2 - 1)) ** 2 * (1. + 2. * (w2 / tile) ** 2)
    return float((gh * gw) ** 2) <= tiled


def dense_window_mask(gh: int, gw: int, w2: int, num_prefix_tokens: int, rel_bias: Optional[Tensor],
                      dtype: torch.dtype, device: torch.device) -> Tensor:
    """(L, L) additive mask of the 2D local window over ``num_prefix_tokens`` prefix tokens + a row-major grid:
    ``P[(dy + w2 - 1) (2 w2 - 1) + dx + w2 - 1]`` (0 without P) where ``|dy|, |dx| <= w2 - 1``, 0 among the
    prefix tokens, ``-inf`` elsewhere (prefix tokens and patches do not see each other locally)."""
    n_pre, n = num_prefix_tokens, gh * gw
    kw = 2 * w2 - 1
    a = torch.arange(n, device=device)
    dy = torch.div(a, gw, rounding_mode='floor')
    dx = a - dy * gw
    dy, dx = dy[None, :] - dy[:, None], dx[None, :] - dx[:, None]
    in_window = (dy.abs() <= w2 - 1) & (dx.abs() <= w2 - 1)
    patches = torch.zeros(in_window.shape, dtype=dtype, device=device)
    if rel_bias is not None:
        patches = patches + rel_bias[((dy + w2 - 1) * kw + dx + w2 - 1).clamp(0, kw * kw - 1)]
    patches = patches.masked_fill(~in_window, float('-inf'))
    if n_pre == 0:
        return patches
    prefix = torch.zeros(n_pre, n_pre, dtype=dtype, device=device)
    top = torch.cat([prefix, torch.full((n_pre, n), float('-inf'), dtype=dtype, device=device)], dim=1)
    bottom = torch.cat([torch.full((n, n_pre), float('-inf'), dtype=dtype, device=device), patches], dim=1)
    return torch.cat([top, bottom], dim=0)


def _rescaled_axis(radius: int, scale: float, w2: int) -> Tuple[Tensor, Tensor, Tensor]:
    """For offsets -radius..radius on an axis scaled by ``scale``: the table rows below / above offset / scale (within
    the trained window, ``radius <= (w2 - 1) scale``) and the bilinear weight of the upper one."""
    pos = (torch.arange(-radius, radius + 1, dtype=torch.float64) / scale + (w2 - 1)).clamp(0, 2 * (w2 - 1))
    low = pos.floor().long()
    high = (low + 1).clamp(max=2 * (w2 - 1))
    return low, high, pos - low.to(torch.float64)


def rescale_window_2d(w2: int, rel_bias: Optional[Tensor], grid: Tuple[int, int],
                      ref_grid: Tuple[int, int]) -> Tuple[int, Optional[Tensor]]:
    """The 2D window of a layer trained on ``ref_grid`` patches, rescaled for ``grid`` (position interpolation).

    With scales ``s = grid / ref_grid`` per axis the window reaches ``(w2 - 1) s`` patches (radius
    ``floor((w2 - 1) s)``; the smaller scale where the axes differ, as the layer has one square window), and the
    relative bias of offset (dy, dx) is the trained table ``P`` (Sec. 3.3) read bilinearly at (dy / s_y, dx / s_x),
    as Swin resamples its relative-position table.

    Args:
        w2: The trained window (``|dy|, |dx| <= w2 - 1``).
        rel_bias: Its ``(2 w2 - 1)^2`` table (dy-major), or None without EPE.
        grid: (rows, cols) of the patch grid evaluated.
        ref_grid: (rows, cols) of the training grid.

    Returns:
        (w2', table') for ``grid``: the window and its ``(2 w2' - 1)^2`` table (None without EPE).
    """
    sy, sx = grid[0] / ref_grid[0], grid[1] / ref_grid[1]
    radius = int((w2 - 1) * min(sy, sx) + 1e-9)
    if rel_bias is None:
        return radius + 1, None
    kw = 2 * w2 - 1
    table = rel_bias.view(kw, kw)
    ly, hy, fy = _rescaled_axis(radius, sy, w2)
    lx, hx, fx = _rescaled_axis(radius, sx, w2)
    ly, hy, lx, hx = ly.to(table.device), hy.to(table.device), lx.to(table.device), hx.to(table.device)
    fy, fx = fy.to(table.device, table.dtype)[:, None], fx.to(table.device, table.dtype)[None, :]
    rows_low, rows_high = table[ly], table[hy]
    out = ((1 - fy) * ((1 - fx) * rows_low[:, lx] + fx * rows_low[:, hx])
           + fy * ((1 - fx) * rows_high[:, lx] + fx * rows_high[:, hx]))
    return radius + 1, out.reshape(-1)


@dataclass
class LavoState:
    """Fixed-size decoding state of causal :class:`LavoAttention` (Eq. 4).

    Attributes:
        h: Running mean H_t, (B, heads, r).
        count: Tokens seen t, (B,) int64.
        keys: Last w keys, oldest first, (B, heads, w, head_dim); slots before the start are zero.
        values: Last w values, same layout.
    """
    h: Tensor
    count: Tensor
    keys: Tensor
    values: Tensor

    def numel(self) -> int:
        """Total number of stored elements (constant over decoding)."""
        return self.h.numel() + self.count.numel() + self.keys.numel() + self.values.numel()


class LavoAttention(nn.Module):
    """LAVO self-attention: local window branch + CODE global branch (Eqs. 3-4, Secs. 3.2-3.3).

    Args:
        dim: Model width C.
        num_heads: Number of heads; ``head_dim = dim // num_heads``.
        num_slots: r, memory slots per head (<= head_dim).
        window: w, local window: causal keys ``t-w+1..t``; non-causal ``|j - i| <= w - 1``.
        causal: Causal (Eq. 4, with :meth:`step`) or non-causal (global mean over the whole sequence).
        num_spatial_dims: None (default) keeps both relative-bias tables, so the layer accepts 1D
            sequences and (non-causal) ``grid_size`` calls; 1 or 2 keeps only the table that layout
            uses (no parameter without gradient) and rejects the other layout.
        window_2d: w2 of the non-causal 2D window used when ``grid_size`` is passed: neighbours with
            ``|dy|, |dx| <= w2 - 1`` (default 4: a 7 x 7 neighbourhood, 4 x 4 dissection tiles).
            :meth:`set_ref_grid_size` rescales it (and its bias table) on grids other than a reference grid.
        use_epe: Embedded relative position bias P (Sec. 3.3).
        context_dissection: Compress local aggregates instead of raw values (Sec. 3.2).
        dissection: 'block' (within the own window of w tokens) or 'sliding' (the local-branch output).
        use_local: Keep the local branch (False gives F = F_global).
        basis: 'fixed' (default), 'orthogonal' or 'penalty'; see :class:`OrthogonalBasis`.
        qkv_bias: Bias in the q/k/v projection.
        qk_scale: Logit scale, default ``head_dim ** -0.5``.
        attn_drop: Dropout on attention / slot weights.
        proj_drop: Dropout after the output projection.
        kernel_backend: 'auto' (Triton kernels ``vision_priors.kernels.lavo`` on CUDA tensors, for 1D sequences and,
            through ``lavo_local_2d``, patch grids), 'triton' or 'torch'; ``VISION_PRIORS_KERNELS`` overrides 'auto'
            (see ``kernel_dispatch``).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            num_slots: int = 64,
            window: int = 64,
            causal: bool = True,
            window_2d: int = 4,
            num_spatial_dims: Optional[int] = None,
            use_epe: bool = True,
            context_dissection: bool = True,
            dissection: str = 'block',
            use_local: bool = True,
            basis: str = 'fixed',
            qkv_bias: bool = False,
            qk_scale: Optional[float] = None,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            kernel_backend: str = 'auto',
    ) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f'dim ({dim}) must be divisible by num_heads ({num_heads})')
        self.kernel_backend = check_kernel_backend(kernel_backend)
        if window < 1:
            raise ValueError(f'window must be >= 1, got {window}')
        if dissection not in _DISSECTION_MODES:
            raise ValueError(f'dissection must be one of {_DISSECTION_MODES}, got {dissection!r}')
        if context_dissection and dissection == 'sliding' and not use_local:
            raise ValueError("dissection='sliding' reuses the local branch; it needs use_local=True")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.num_slots = num_slots
        self.window = window
        self.window_2d = window_2d
        if self.window_2d < 1:
            raise ValueError(f'window_2d must be >= 1, got {self.window_2d}')
        self.causal = causal
        self.use_epe = use_epe
        self.context_dissection = context_dissection
        self.dissection = dissection
        self.use_local = use_local
        self.scale = qk_scale if qk_scale is not None else self.head_dim ** -0.5

        self.basis = OrthogonalBasis(num_heads, num_slots, self.head_dim, mode=basis)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        if num_spatial_dims not in (None, 1, 2) or (causal and num_spatial_dims == 2):
            raise ValueError(f'num_spatial_dims must be None, 1 or (non-causal only) 2, got {num_spatial_dims}')
        self.num_spatial_dims = 0 if num_spatial_dims is None else num_spatial_dims  # 0: both layouts
        needs_bias = use_epe and (use_local or context_dissection)
        # P in R^{2w-1} (Sec. 3.3); the causal form only uses P[0..w-1] (offsets j - i <= 0).
        self.rel_bias = (
            nn.Parameter(torch.zeros(2 * window - 1)) if needs_bias and num_spatial_dims != 2 else None)
        self.rel_bias_2d = (
            nn.Parameter(torch.zeros((2 * self.window_2d - 1) ** 2))
            if needs_bias and not causal and num_spatial_dims != 1 else None)
        self._ref_grid: List[int] = [0, 0]  # (rows, cols) the 2D window is measured on; 0: patches

    @torch.jit.ignore
    def set_ref_grid_size(self, ref_grid_size: Optional[Tuple[int, int]]) -> None:
        """Measure the 2D window on this (rows, cols) reference grid, usually the training grid: on another grid
        the window and its bias table are rescaled (:func:`rescale_window_2d`, position interpolation). None:
        in patches (the default)."""
        if ref_grid_size is None:
            self._ref_grid = [0, 0]
            return
        rows, cols = grid_extents(ref_grid_size, 'ref_grid_size')
        self._ref_grid = [rows, cols]

    def _window_2d_for(self, grid: Tuple[int, int]) -> Tuple[int, Optional[Tensor]]:
        """(w2, relative bias table or None) of the 2D window on ``grid``."""
        bias = self.rel_bias_2d if self.use_epe else None
        if self._ref_grid[0] == 0 or (grid[0] == self._ref_grid[0] and grid[1] == self._ref_grid[1]):
            return self.window_2d, bias
        return rescale_window_2d(self.window_2d, bias, grid, (self._ref_grid[0], self._ref_grid[1]))

    def extra_repr(self) -> str:
        return (f'dim={self.dim}, num_heads={self.num_heads}, num_slots={self.num_slots}, window={self.window}, '
                f'causal={self.causal}, use_epe={self.use_epe}, context_dissection={self.context_dissection}, '
                f'dissection={self.dissection!r}, basis={self.basis.mode!r}')

    def orthogonality_penalty(self) -> Tensor:
        """``||B B^T - I||_F^2`` summed over heads; add to the loss with ``basis='penalty'``."""
        return self.basis.orthogonality_penalty()

    def _qkv(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            if not torch.jit.is_scripting():
                raise ValueError(f'expected input features {self.dim}, got x of shape {tuple(x.shape)}')
            raise ValueError('expected input x of shape (B, L, dim)')
        b, length = x.shape[0], x.shape[1]
        qkv = self.qkv(x).reshape(b, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        return q, k, v

    def _out(self, f: Tensor) -> Tensor:
        b, length = f.shape[0], f.shape[2]
        return self.proj_drop(self.proj(f.transpose(1, 2).reshape(b, length, self.dim)))

    def _drop_p(self) -> float:
        """The attention-dropout probability in effect (0 in eval mode)."""
        return self.attn_drop.p if self.training else 0.

    def _read(self, q: Tensor, h: Tensor, basis: Tensor) -> Tensor:
        """:func:`code_read` with this module's scale and slot dropout."""
        return _code_read(q, h, basis, self.scale, self._drop_p())

    def _local_1d(
            self, q: Tensor, k: Tensor, v: Tensor, key_valid: Optional[Tensor], sliding: bool, block: bool,
    ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """Windowed attention in blocks of ``w = window`` tokens (Secs. 3.2-3.3), no loop over time: the
        ``lavo_local`` op's PyTorch backend (``vision_priors.kernels.lavo_torch.lavo_local_windows``).

        Returns:
            (sliding-window output or None, own-block output or None), each (B, H, L, d).
        """
        bias = self.rel_bias if self.use_epe else None
        return lavo_local_windows(q, k, v, bias, self.scale, self.window, self.causal, key_valid, sliding, block,
                                  self._drop_p())

    def _prefix_local(self, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor], n_pre: int) -> Tensor:
        """Local branch of the ``n_pre`` prefix tokens of a grid input: attention among themselves, no bias."""
        s = (q[:, :, :n_pre] @ k[:, :, :n_pre].transpose(-1, -2)) * self.scale
        if valid is None:
            pmask = torch.ones_like(s, dtype=torch.bool)
        else:
            pmask = valid[:, None, None, :n_pre].expand_as(s)
        p = self.attn_drop(_masked_softmax(s, pmask))
        return p @ v[:, :, :n_pre]

    def _local_2d(
            self, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor], grid: Tuple[int, int], n_pre: int,
    ) -> Tensor:
        """Local branch on a grid input: prefix tokens attend among themselves, patches to their 2D neighbourhood."""
        gh, gw = grid
        w2, bias = self._window_2d_for(grid)
        if valid is None and dense_window_is_cheaper(gh, gw, w2):
            # small grid: one fused (L x L) masked attention, prefix tokens included (same result)
            mask = dense_window_mask(gh, gw, w2, n_pre, bias, q.dtype, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self._drop_p(), scale=self.scale)
        outs: List[Tensor] = []
        if n_pre > 0:
            outs.append(self._prefix_local(q, k, v, valid, n_pre))
        pvalid = None if valid is None else valid[:, n_pre:]
        outs.append(local_window_2d(q[:, :, n_pre:], k[:, :, n_pre:], v[:, :, n_pre:], pvalid, gh, gw, w2, bias,
                                    self.scale, self._drop_p()))
        return torch.cat(outs, dim=2)

    def _branches(
            self, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor],
            grid: Optional[Tuple[int, int]], n_pre: int, basis: Tensor,
    ) -> Tuple[Optional[Tensor], Tensor]:
        """Returns (F_local or None, H): the local output and the CODE coefficients of the compressed features."""
        need_block = self.context_dissection and self.dissection == 'block'
        if grid is None:
            f_local, f_block = self._local_1d(q, k, v, valid, self.use_local, need_block)
        else:
            f_local = self._local_2d(q, k, v, valid, grid, n_pre) if self.use_local else None
            if need_block:  # a grid is non-causal: H needs only the sum of the tile aggregates
                return f_local, self._block_memory_2d(q, k, v, valid, grid, n_pre, basis)
            f_block = None
        if not self.context_dissection:
            z = v
        elif self.dissection == 'sliding':
            assert f_local is not None
            z = f_local
        else:
            assert f_block is not None
            z = f_block
        return f_local, code_memory(z, basis, valid, self.causal)  # Eq. 4 (causal) or Eq. 3

    def _block_memory_2d(
            self, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor], grid: Tuple[int, int], n_pre: int,
            basis: Tensor,
    ) -> Tensor:
        """H of Eq. 3 over the block-dissection aggregates of a grid input (the prefix tokens' own local
        outputs and the patches' ``w2 x w2`` tile outputs), from their sum (:func:`tile_block_2d_sum`)."""
        gh, gw = grid
        w2, bias = self._window_2d_for(grid)
        pvalid = None if valid is None else valid[:, n_pre:]
        z_sum = tile_block_2d_sum(q[:, :, n_pre:], k[:, :, n_pre:], v[:, :, n_pre:], pvalid, gh, gw,
                                  w2, bias, self.scale, self._drop_p())
        if n_pre > 0:
            z_pre = self._prefix_local(q, k, v, valid, n_pre)
            if valid is not None:
                z_pre = z_pre * valid[:, None, :n_pre, None].to(z_pre.dtype)
            z_sum = z_sum + z_pre.sum(dim=2, keepdim=True)
        return code_memory_from_sum(z_sum, valid_count(valid, n_pre + gh * gw, q.dtype, q.device), basis)

    @torch.jit.unused
    def _kernel_branches(self, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> Tensor:
        """Both branches through the Triton kernels (``vision_priors.kernels.lavo``; 1D sequences): the chunked CODE
        running mean with the slot softmax, and the windowed attention with the relative bias."""
        from vision_priors.kernels.lavo import lavo_global, lavo_local
        kw = dict(scale=self.scale, window=self.window, causal=self.causal, key_mask=valid, backend='triton')
        f_local = lavo_local(q, k, v, self.rel_bias, mode='sliding', **kw) if self.use_local else None
        if not self.context_dissection:
            z = v
        elif self.dissection == 'sliding':
            z = f_local
        else:
            z = lavo_local(q, k, v, self.rel_bias, mode='block', **kw)
        f_global = lavo_global(q, z, self.basis(), self.scale, key_mask=valid, causal=self.causal, backend='triton')
        return self._combine(f_local, f_global)

    @torch.jit.unused
    def _kernel_branches_2d(self, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor], grid: Tuple[int, int],
                            n_pre: int) -> Tensor:
        """Both branches through the Triton kernels on a patch grid (non-causal): the 2D window with the
        (2 w2 - 1)^2 relative bias of Sec. 3.3 (``lavo_local_2d``; the ``w2 x w2`` tiles for block dissection) on
        the patches, and the CODE mean over every valid token (``lavo_global``). The prefix tokens' local branch
        (attention among themselves) is the torch path's own code: it is n_pre x n_pre."""
        from vision_priors.kernels.lavo import lavo_global, lavo_local_2d
        w2, bias = self._window_2d_for(grid)
        pvalid = None if valid is None else valid[:, n_pre:]

        def local(mode: str) -> Tensor:
            f = lavo_local_2d(q[:, :, n_pre:], k[:, :, n_pre:], v[:, :, n_pre:], bias, self.scale, grid,
                              w2, key_mask=pvalid, mode=mode, backend='triton')
            return f if n_pre == 0 else torch.cat([self._prefix_local(q, k, v, valid, n_pre), f], dim=2)

        f_local = local('sliding') if self.use_local else None
        if not self.context_dissection:
            z = v
        elif self.dissection == 'sliding':
            z = f_local
        else:
            z = local('block')
        f_global = lavo_global(q, z, self.basis(), self.scale, key_mask=valid, causal=False, backend='triton')
        return self._combine(f_local, f_global)

    def _combine(self, f_local: Optional[Tensor], f_global: Tensor) -> Tensor:
        return f_global if f_local is None else torch.lerp(f_local, f_global, 0.5)  # (F_local + F_global) / 2, one pass

    def forward(
            self,
            x: Tensor,
            key_mask: Optional[Tensor] = None,
            grid_size: Optional[List[int]] = None,
            num_prefix_tokens: int = 0,
    ) -> Tensor:
        """Parallel LAVO over a whole sequence.

        Args:
            x: (B, L, C) tokens.
            key_mask: Optional (B, L) bool, True = valid key (the one key-mask convention of the package).
                Invalid tokens are left out of the local windows and of the mean H (the count is over
                valid tokens); a query whose window holds no valid key gets 0 from that window.
            grid_size: Non-causal only: (rows, cols) of the patch grid for the 2D local window; the
                tokens are ``num_prefix_tokens`` prefix tokens followed by rows * cols patches, row-major.
                A tuple or a list of two ints (a list under TorchScript).
            num_prefix_tokens: Number of leading non-grid tokens (only with ``grid_size``).

        Returns:
            (B, L, C).
        """
        if x.dim() != 3:
            if not torch.jit.is_scripting():
                raise ValueError(f'expected x of shape (B, L, {self.dim}), got {tuple(x.shape)}')
            raise ValueError('expected input x of shape (B, L, dim)')
        b, length = x.shape[0], x.shape[1]
        valid = check_key_mask(key_mask, b, length, device=x.device)
        grid = self._check_grid(grid_size, num_prefix_tokens, length)
        q, k, v = self._qkv(x)
        if not torch.jit.is_scripting() and use_flash_kernel(
                self.kernel_backend, x, None, self.training and self.attn_drop.p > 0, self.head_dim, family='lavo'):
            if grid is None:
                return self._out(self._kernel_branches(q, k, v, valid))
            return self._out(self._kernel_branches_2d(q, k, v, valid, grid, num_prefix_tokens))
        basis = self.basis()
        f_local, h = self._branches(q, k, v, valid, grid, num_prefix_tokens, basis)
        f_global = self._read(q, h, basis)
        return self._out(self._combine(f_local, f_global))

    def _check_grid(
            self, grid_size: Optional[List[int]], num_prefix_tokens: int, length: int,
    ) -> Optional[Tuple[int, int]]:
        if grid_size is None and self.num_spatial_dims == 2:
            raise ValueError('this layer was built with num_spatial_dims=2: pass grid_size')
        if grid_size is not None and self.num_spatial_dims == 1:
            raise ValueError('this layer was built with num_spatial_dims=1: grid_size is not accepted')
        if grid_size is None:
            if num_prefix_tokens != 0:
                if not torch.jit.is_scripting():
                    raise ValueError(f'num_prefix_tokens={num_prefix_tokens} is only used with grid_size')
                raise ValueError('num_prefix_tokens is only used with grid_size')
            return None
        if self.causal:
            raise ValueError('grid_size (2D local window) is only supported with causal=False')
        gh, gw = int(grid_size[0]), int(grid_size[1])
        if gh < 1 or gw < 1 or num_prefix_tokens < 0 or num_prefix_tokens + gh * gw != length:
            if not torch.jit.is_scripting():
                raise ValueError(
                    f'grid_size={tuple(grid_size)} with num_prefix_tokens={num_prefix_tokens} describes '
                    f'{num_prefix_tokens + gh * gw} tokens, but the sequence has L={length}')
            raise ValueError('grid_size with num_prefix_tokens does not describe the sequence length')
        return gh, gw

    # ----- recurrent form (causal decoding) -----

    def _check_causal(self, what: str) -> None:
        if not self.causal:
            raise RuntimeError(f'{what} is only defined for causal=True')

    @torch.jit.unused
    def init_state(self, batch_size: int, device: Optional[torch.device] = None,
                   dtype: Optional[torch.dtype] = None) -> LavoState:
        """Empty decoding state: H = 0, count 0, zero key/value caches of w tokens."""
        self._check_causal('init_state')
        ref = self.qkv.weight
        device = ref.device if device is None else device
        dtype = ref.dtype if dtype is None else dtype
        kv = (batch_size, self.num_heads, self.window, self.head_dim)
        return LavoState(
            h=torch.zeros(batch_size, self.num_heads, self.num_slots, device=device, dtype=dtype),
            count=torch.zeros(batch_size, dtype=torch.long, device=device),
            keys=torch.zeros(kv, device=device, dtype=dtype),
            values=torch.zeros(kv, device=device, dtype=dtype),
        )

    @torch.jit.unused
    def step(self, x_t: Tensor, state: LavoState) -> Tuple[Tensor, LavoState]:
        """One causal token with O(w d + r d) work, independent of the position (Eq. 4).

        Args:
            x_t: (B, 1, C) the next token.
            state: From :meth:`init_state`, :meth:`prefill` or a previous :meth:`step`.

        Returns:
            (y_t of shape (B, 1, C), the new state); y_t equals the parallel form at this position.
        """
        self._check_causal('step')
        if x_t.dim() != 3 or x_t.shape[1] != 1:
            raise ValueError(f'step expects one token of shape (B, 1, C), got {tuple(x_t.shape)}')
        q, k, v = self._qkv(x_t)  # (B, H, 1, d)
        w = self.window
        keys = torch.cat([state.keys[:, :, 1:], k], dim=2)
        values = torch.cat([state.values[:, :, 1:], v], dim=2)
        count = state.count + 1
        slot = torch.arange(w, device=x_t.device)
        scores = (q @ keys.transpose(-1, -2)) * self.scale  # (B, H, 1, w); cache slot b is offset b - (w-1)
        if self.use_epe and self.rel_bias is not None:
            scores = scores + self.rel_bias[:w]

        def attend(n_visible: Tensor) -> Tensor:
            mask = (slot[None, :] >= w - n_visible[:, None])[:, None, None, :]
            return self.attn_drop(_masked_softmax(scores, mask)) @ values

        f_local = attend(count.clamp(max=w)) if self.use_local else None
        if not self.context_dissection:
            z = v
        elif self.dissection == 'sliding':
            z = f_local
        else:
            z = attend((count - 1) % w + 1)  # tokens of the current window of w
        basis = self.basis()
        proj = (z @ basis.transpose(-1, -2)).squeeze(2)  # (B, H, r)
        h = state.h + (proj - state.h) / count[:, None, None].to(proj.dtype)  # Eq. 4
        f_global = self._read(q, h.unsqueeze(2), basis)
        return self._out(self._combine(f_local, f_global)), LavoState(h=h, count=count, keys=keys, values=values)

    @torch.jit.unused
    def prefill(self, x: Tensor) -> Tuple[Tensor, LavoState]:
        """Parallel forward over a prompt that also returns the decoding state after it.

        Args:
            x: (B, L, C) prompt, L >= 1, no padding.

        Returns:
            (forward(x), state) so that :meth:`step` continues the sequence.
        """
        self._check_causal('prefill')
        b, length, _ = x.shape
        if length < 1:
            raise ValueError('prefill needs at least one token')
        q, k, v = self._qkv(x)
        basis = self.basis()
        f_local, h = self._branches(q, k, v, None, None, 0, basis)
        y = self._out(self._combine(f_local, self._read(q, h, basis)))
        w = self.window
        pad = max(0, w - length)
        state = LavoState(
            h=h[:, :, -1],
            count=torch.full((b,), length, dtype=torch.long, device=x.device),
            keys=F.pad(k[:, :, -w:], (0, 0, pad, 0)),
            values=F.pad(v[:, :, -w:], (0, 0, pad, 0)),
        )
        return y, state


class LavoCrossAttention(nn.Module):
    """LAVO cross-attention (Sec. 3.4, Eqs. 5-6): compress the source once, each query reads r slots.

    ``Q = Y W_q``, ``X~ = CODE(X W_x)`` per head, output ``softmax(Q X~^T) X~``; no local branch.
    The source enters only through its masked mean (CODE is a mean after affine maps), so :meth:`compress`
    averages it first and projects once: O(n C_x + C_x C) for the source, O(m (C^2 + r C)) for the queries.
    For ViT ``global_pool='lavo'``, pass learned queries as ``x`` and the patch tokens as ``context``.

    Args:
        dim: Target (query) width C.
        num_heads: Number of heads.
        num_slots: r, memory slots per head (<= head_dim).
        context_dim: Source width, default ``dim``.
        basis: 'fixed' (default), 'orthogonal' or 'penalty'; see :class:`OrthogonalBasis`.
        qkv_bias: Bias in the query / source projections.
        qk_scale: Logit scale, default ``head_dim ** -0.5``.
        attn_drop: Dropout on slot weights.
        proj_drop: Dropout after the output projection.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            num_slots: int = 64,
            context_dim: Optional[int] = None,
            basis: str = 'fixed',
            qkv_bias: bool = False,
            qk_scale: Optional[float] = None,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
    ) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f'dim ({dim}) must be divisible by num_heads ({num_heads})')
        self.dim = dim
        self.context_dim = dim if context_dim is None else context_dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.num_slots = num_slots
        self.scale = qk_scale if qk_scale is not None else self.head_dim ** -0.5
        self.basis = OrthogonalBasis(num_heads, num_slots, self.head_dim, mode=basis)
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(self.context_dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def orthogonality_penalty(self) -> Tensor:
        """``||B B^T - I||_F^2`` summed over heads; add to the loss with ``basis='penalty'``."""
        return self.basis.orthogonality_penalty()

    def compress(self, context: Tensor, key_mask: Optional[Tensor] = None) -> Tensor:
        """CODE coefficients of the source (Eq. 3): masked mean of ``B x_s``, shape (B, heads, 1, r);
        zero for a sample without source tokens (n = 0 or all masked). ``key_mask``: (B, n) bool, True =
        valid source token.

        Mean first: ``x_s = W_x c_s + b_x`` is affine and CODE's ``H = mean_s B x_s`` linear, so
        ``H = B (W_x mean_s(c_s) + b_x)`` whenever the sample has a valid token. The (masked) mean of the
        context is taken first and projected once: O(n C) + O(C^2) per sample instead of O(n C^2). A sample
        without a valid token keeps H = 0 (the mean token is then masked out, so ``b_x`` does not enter)."""
        if context.dim() != 3 or context.shape[-1] != self.context_dim:
            if not torch.jit.is_scripting():
                raise ValueError(
                    f'context must be (B, n, {self.context_dim}) (context_dim), got {tuple(context.shape)}')
            raise ValueError('context must be (B, n, context_dim)')
        b, n = context.shape[0], context.shape[1]
        valid = check_key_mask(key_mask, b, n, device=context.device)
        present: Optional[Tensor] = None  # (B, 1) bool: whether the sample has a valid token; None = all do
        if valid is None:
            mean = context.sum(dim=1, keepdim=True) / max(n, 1)  # (B, 1, context_dim)
            if n == 0:
                present = torch.zeros(b, 1, dtype=torch.bool, device=context.device)
        else:
            # masked mean as one (1 x n) @ (n x C) product per sample; masked tokens get weight exactly 0
            count = valid.sum(dim=1, keepdim=True).clamp(min=1).to(context.dtype)
            weights = valid.to(context.dtype) / count
            mean = torch.bmm(weights.unsqueeze(1), context)
            present = valid.any(dim=1, keepdim=True)
        src = self.kv(mean).reshape(b, 1, self.num_heads, self.head_dim).transpose(1, 2)  # (B, heads, 1, d)
        # one "token" per sample, left out (H = 0) where the sample has none: n = 0 or all masked
        return code_memory(src, self.basis(), present, False)

    def forward(self, x: Tensor, context: Tensor, key_mask: Optional[Tensor] = None) -> Tensor:
        """Cross-attend targets to the compressed source.

        Args:
            x: (B, m, C) targets (queries).
            context: (B, n, context_dim) source (the keys).
            key_mask: Optional (B, n) bool, True = valid key (source token); the one key-mask convention.

        Returns:
            (B, m, C). A sample with no source token (an empty context, n = 0, or every token masked)
            has H = 0 and a zero attention output before the projection, so each of its queries gets
            ``proj(0)``, the projection bias (before ``proj_drop``); its gradients are finite (zero
            through the source and the queries).
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            if not torch.jit.is_scripting():
                raise ValueError(f'x must be (B, m, {self.dim}) (dim), got {tuple(x.shape)}')
            raise ValueError('x must be (B, m, dim)')
        if context.dim() == 3 and context.shape[0] != x.shape[0]:
            if not torch.jit.is_scripting():
                raise ValueError(f'batch sizes differ: x has {x.shape[0]}, context has {context.shape[0]}')
            raise ValueError('batch sizes of x and context differ')
        b, m = x.shape[0], x.shape[1]
        h = self.compress(context, key_mask)
        q = self.q(x).reshape(b, m, self.num_heads, self.head_dim).transpose(1, 2)
        out = _code_read(q, h, self.basis(), self.scale, self.attn_drop.p if self.training else 0.)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, m, self.dim)))
