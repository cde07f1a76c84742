"""PyTorch backend of the LAVO ops, shared with ``vision_priors.layers.LavoAttention``: one implementation.

The fastest exact PyTorch paths of the two LAVO branches (Zhang et al., arXiv:2312.11135), used by the ops
``lavo_local`` / ``lavo_global`` for ``backend='torch'`` (and CPU tensors) and by the layer's own forward,
so the layer and the ops cannot drift apart:

* :func:`lavo_local_windows`: windowed softmax attention with the relative bias ``P[j - i + w - 1]``
  (Secs. 3.2-3.3) in blocks of w tokens: queries of block c score the keys of blocks c-1, c (and c+1),
  memory O(L w), no loop over time. The same scores restricted to block c give the context-dissection
  aggregate (``mode='block'``).
* :func:`local_window_2d` / :func:`tile_block_2d`: the same on a row-major patch grid (``lavo_local_2d``,
  the layer's ``grid_size`` path): keys with ``|dy|, |dx| <= w2 - 1`` and the bias
  ``P[(dy + w2 - 1) (2 w2 - 1) + dx + w2 - 1]`` of Sec. 3.3, in query tiles with a halo; or the keys of the
  query's own ``w2 x w2`` tile (the 2D context-dissection aggregate).
* :func:`code_memory` and :func:`code_read`: the CODE branch (Eqs. 3-4), the (running) mean
  ``H_t = (1/n_t) sum_{s<=t} m_s B z_s`` by a cumulative sum and its read
  ``softmax(scale (q B^T) * H) (H * .) B``, O(L r d) without materialising the slots.

The dense O(L^2) references written from the equations are in ``lavo_ref.py`` (tests only). Every
function here compiles with ``torch.jit.script`` (the layer is scriptable) and runs in the inputs' dtype
(float64 included). Padding follows the one convention: ``key_mask`` (B, L) bool, True = valid key.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ['code_memory', 'code_memory_from_sum', 'code_read', 'code_slot_probs', 'finfo_min', 'lavo_global_torch',
           'lavo_local_2d_torch', 'lavo_local_torch', 'lavo_local_windows', 'local_window_2d', 'tile_block_2d',
           'tile_block_2d_sum', 'valid_count', 'window_tile_size']


def finfo_min(dtype: torch.dtype) -> float:
    """``torch.finfo(dtype).min`` for floating dtypes, written so that TorchScript compiles it."""
    if not torch.jit.is_scripting():
        return torch.finfo(dtype).min
    if dtype == torch.float64:
        return -1.7976931348623157e+308
    if dtype == torch.float16:
        return -65504.0
    if dtype == torch.bfloat16:
        return -3.3895313892515355e+38
    return -3.4028234663852886e+38  # float32


def _dropout(p: Tensor, dropout_p: float) -> Tensor:
    return F.dropout(p, dropout_p, True) if dropout_p > 0. else p


# ------------------------------------------------------------------------------------------------
# local window branch

def _to_blocks(t: Tensor, pad: int, nb: int, w: int) -> Tensor:
    """(B, H, L, d) -> (B, H, nb, w, d), zero-padded at the end."""
    b, nh, _, d = t.shape
    return F.pad(t, (0, 0, 0, pad)).reshape(b, nh, nb, w, d)


def _gather_blocks(t: Tensor, dim: int, offsets: List[int], nb: int) -> Tensor:
    """Concatenates blocks ``c + o`` (o in offsets, zero outside) of block dim ``dim`` along ``dim + 1``."""
    if len(offsets) == 1:
        return t
    lo_off, hi_off = offsets[0], offsets[-1]
    tp = F.pad(t, [0, 0] * (t.dim() - dim - 1) + [-lo_off, hi_off])
    return torch.cat([tp.narrow(dim, o - lo_off, nb) for o in offsets], dim=dim + 1)


def _attend_blocks(s: Tensor, values: Tensor, in_range: Tensor, valid: Tensor, masked: bool, length: int,
                   dropout_p: float) -> Tensor:
    """Softmax over the gathered keys of each block; (B, H, nb, w, K) scores -> (B, H, L, d)."""
    b, nh, nb, w, d = values.shape[0], values.shape[1], s.shape[2], s.shape[3], values.shape[-1]
    p = s.softmax(dim=-1)
    if masked:  # rows without any valid key give 0, not a uniform average
        p = p * (in_range[None, None] & valid[:, :, None, :]).any(-1, keepdim=True)[:, None]
    p = _dropout(p, dropout_p)
    return (p @ values).reshape(b, nh, nb * w, d)[:, :, :length]


def lavo_local_windows(q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], scale: float, window: int,
                       causal: bool, key_mask: Optional[Tensor], sliding: bool, block: bool,
                       dropout_p: float = 0.) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """LAVO's local branch and / or the context-dissection aggregate, blocked: O(L w) memory, exact.

    Query i sees keys j with ``-(w-1) <= j - i <= 0`` (causal) or ``|j - i| <= w - 1`` (sliding), or the keys
    of its own block of w tokens ``j // w == i // w`` (and ``j <= i`` if causal; block), with logit
    ``scale q_i . k_j + P[j - i + w - 1]``. Invalid keys are dropped; a query without a valid key gets 0.

    Args:
        q, k, v: (B, heads, L, d).
        rel_bias: P, (2w - 1,), or None.
        scale: Logit scale.
        window: w >= 1.
        causal: Keys ``j <= i`` only.
        key_mask: Optional (B, L) bool, True = valid key.
        sliding: Compute the sliding-window output.
        block: Compute the own-block output.
        dropout_p: Dropout on the attention weights (the layer's ``attn_drop`` while training).

    Returns:
        (sliding-window output or None, own-block output or None), each (B, heads, L, d).
    """
    b, length = q.shape[0], q.shape[2]
    w = window
    nb = -(-length // w)
    pad = nb * w - length
    if sliding:
        offsets = [-1, 0] if causal else [-1, 0, 1]
    else:
        offsets = [0]
    own = offsets.index(0) * w  # column offset of block c among the gathered keys
    qb, kb, vb = _to_blocks(q * scale, pad, nb, w), _to_blocks(k, pad, nb, w), _to_blocks(v, pad, nb, w)

    neg = finfo_min(q.dtype) / 2  # two of these still sum to a finite number: no NaN rows
    a = torch.arange(w, device=q.device)
    rel = torch.cat([o * w + a for o in offsets])[None, :] - a[:, None]  # (w, K): j - i
    in_range = (rel >= -(w - 1)) & (rel <= (0 if causal else w - 1))
    static = torch.zeros(in_range.shape, dtype=q.dtype, device=q.device)
    if rel_bias is not None:
        static = static + rel_bias[(rel + w - 1).clamp(0, rel_bias.numel() - 1)]
    static = static.masked_fill(~in_range, neg)
    valid = torch.ones(b, length, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    valid = _gather_blocks(F.pad(valid, (0, pad)).reshape(b, nb, w), 1, offsets, nb)  # (B, nb, K)
    scores = qb @ _gather_blocks(kb, 2, offsets, nb).transpose(-1, -2) + static
    scores = scores + torch.zeros_like(valid, dtype=q.dtype).masked_fill(~valid, neg)[:, None, :, None, :]

    masked = key_mask is not None
    f_slide: Optional[Tensor] = None
    f_block: Optional[Tensor] = None
    if sliding:
        f_slide = _attend_blocks(scores, _gather_blocks(vb, 2, offsets, nb), in_range, valid, masked, length,
                                 dropout_p)
    if block:
        f_block = _attend_blocks(scores[..., own:own + w], vb, in_range[:, own:own + w], valid[:, :, own:own + w],
                                 masked, length, dropout_p)
    return f_slide, f_block


def lavo_local_torch(q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], scale: float, window: int,
                     causal: bool = True, mode: str = 'sliding', key_mask: Optional[Tensor] = None) -> Tensor:
    """The PyTorch backend of ``lavo_local`` (arguments as there, less ``backend``): :func:`lavo_local_windows`."""
    f_slide, f_block = lavo_local_windows(q, k, v, rel_bias, scale, window, causal, key_mask, mode == 'sliding',
                                          mode == 'block')
    out = f_slide if mode == 'sliding' else f_block
    assert out is not None
    return out


# ------------------------------------------------------------------------------------------------
# 2D local window over a row-major patch grid (the layer's ``grid_size`` path; ``lavo_local_2d``)

def _tiles(t: Tensor, gh: int, gw: int, w2: int) -> Tensor:
    """(B, H, gh * gw, c) row-major patches -> (B, H, T, w2 * w2, c) non-overlapping ``w2 x w2`` tiles."""
    b0, b1, c = t.shape[0], t.shape[1], t.shape[-1]
    nh_t, nw_t = -(-gh // w2), -(-gw // w2)
    ph, pw = nh_t * w2 - gh, nw_t * w2 - gw
    t = t.reshape(b0, b1, gh, gw, c)
    if ph > 0 or pw > 0:  # (F.pad copies even when it pads nothing)
        t = F.pad(t, (0, 0, 0, pw, 0, ph))
    t = t.reshape(b0, b1, nh_t, w2, nw_t, w2, c).transpose(3, 4)
    return t.reshape(b0, b1, nh_t * nw_t, w2 * w2, c)


def _halo_tiles(t: Tensor, gh: int, gw: int, tile: int, halo: int) -> Tensor:
    """(B, H, gh * gw, c) row-major patches -> (B, H, T, (tile + 2 halo)^2, c): for each ``tile x tile``
    query tile (the layout of :func:`_tiles`), the patches within ``halo`` rows / columns of it, zero
    outside the grid. Each patch is copied ``(1 + 2 halo / tile)^2`` times, not ``(2 halo + 1)^2``."""
    b0, b1, c = t.shape[0], t.shape[1], t.shape[-1]
    nh_t, nw_t = -(-gh // tile), -(-gw // tile)
    span = tile + 2 * halo
    t = F.pad(t.reshape(b0, b1, gh, gw, c), (0, 0, halo, nw_t * tile - gw + halo, halo, nh_t * tile - gh + halo))
    t = t.unfold(2, span, tile).unfold(3, span, tile)  # (B, H, nh_t, nw_t, c, span, span), a strided view
    return t.permute(0, 1, 2, 3, 5, 6, 4).reshape(b0, b1, nh_t * nw_t, span * span, c)


def window_tile_size(gh: int, gw: int, w2: int) -> int:
    """Query tile side of :func:`local_window_2d`, from ``w2`` to ``3 w2``: the fewest scored (query, key)
    pairs, ``padded queries * (tile + 2 (w2 - 1))^2``, weighted by ``1 + 2 (w2 / tile)^2`` for the per-tile cost
    of small matmuls and halo copies (a fit to CPU timings of 14 x 14, 24 x 24 and 48 x 48 grids, w2 = 4)."""
    span_extra = 2 * (w2 - 1)
    best, best_cost = w2, -1.
    for tile in range(w2, 3 * w2 + 1):
        padded = (-(-gh // tile) * tile) * (-(-gw // tile) * tile)
        cost = padded * (tile + span_extra) ** 2 * (1. + 2. * (w2 / tile) ** 2)
        if best_cost < 0 or cost < best_cost:
            best, best_cost = tile, cost
    return best


def local_window_2d(q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor], gh: int, gw: int, w2: int,
                    rel_bias: Optional[Tensor], scale: float, dropout_p: float = 0., tile: int = 0) -> Tensor:
    """2D local window of LAVO (Secs. 3.2-3.3): patch i attends to the patches j with ``|dy|, |dx| <= w2 - 1``,
    logit ``scale q_i . k_j + P[(dy + w2 - 1) (2 w2 - 1) + dx + w2 - 1]``; invalid keys are left out and a
    query without a valid key gets 0.

    Blocked: queries in ``tile x tile`` tiles score the keys of their tile plus a halo of ``w2 - 1``
    patches (one matmul per tile), so no ``(2 w2 - 1)^2`` copies of the keys and values are made.

    Args:
        q, k, v: (B, H, gh * gw, d) row-major patches.
        valid: (B, gh * gw) bool, True = valid key, or None.
        gh, gw: Grid rows and columns.
        w2: Window half-width plus one (neighbourhood ``(2 w2 - 1)^2``).
        rel_bias: P, ((2 w2 - 1)^2,), or None.
        scale: Logit scale.
        dropout_p: Dropout on the attention weights (the layer's ``attn_drop`` while training).
        tile: Query tile side; 0 picks :func:`window_tile_size`.

    Returns:
        (B, H, gh * gw, d).
    """
    b, nh, d = q.shape[0], q.shape[1], q.shape[-1]
    halo = w2 - 1
    kw = 2 * w2 - 1
    tile = window_tile_size(gh, gw, w2) if tile < 1 else tile
    span = tile + 2 * halo
    nh_t, nw_t = -(-gh // tile), -(-gw // tile)
    # static (tile^2, span^2) part: in-window mask and bias; key (ky, kx) of the span sits at offset
    # (ky - halo - qy, kx - halo - qx) from query (qy, qx) of the tile
    a_q = torch.arange(tile, device=q.device)
    a_k = torch.arange(span, device=q.device)
    qy, qx = a_q[:, None].expand(tile, tile).reshape(-1), a_q[None, :].expand(tile, tile).reshape(-1)
    ky, kx = a_k[:, None].expand(span, span).reshape(-1), a_k[None, :].expand(span, span).reshape(-1)
    dy, dx = ky[None, :] - halo - qy[:, None], kx[None, :] - halo - qx[:, None]
    in_window = (dy.abs() <= halo) & (dx.abs() <= halo)
    neg = finfo_min(q.dtype) / 2  # two of these still sum to a finite number: no NaN rows
    static = torch.zeros(in_window.shape, dtype=q.dtype, device=q.device)
    if rel_bias is not None:
        static = static + rel_bias[((dy + halo) * kw + dx + halo).clamp(0, kw * kw - 1)]
    static = static.masked_fill(~in_window, neg)
    # keys outside the grid (halo padding) or masked out
    key_ok = torch.ones(1, gh * gw, dtype=torch.bool, device=q.device) if valid is None else valid
    key_ok = _halo_tiles(key_ok[:, None, :, None].to(q.dtype), gh, gw, tile, halo)[:, 0, :, :, 0] > 0.5
    # static + key part, (B or 1, T, tile^2, span^2): added to the scores in one pass
    bias_all = static + torch.zeros(key_ok.shape, dtype=q.dtype, device=q.device).masked_fill(~key_ok, neg)[:, :, None]

    tq = _tiles(q * scale, gh, gw, tile)  # (B, H, T, tile^2, d)
    s = tq @ _halo_tiles(k, gh, gw, tile, halo).transpose(-1, -2) + bias_all[:, None]
    p = s.softmax(dim=-1)
    if valid is not None:  # queries without any valid key get 0, not a uniform average
        p = p * (in_window[None, None] & key_ok[:, :, None, :]).any(dim=-1, keepdim=True)[:, None]
    if dropout_p > 0.:
        p = F.dropout(p, dropout_p, True)
    o = p @ _halo_tiles(v, gh, gw, tile, halo)  # (B, H, T, tile^2, d)
    o = o.reshape(b, nh, nh_t, nw_t, tile, tile, d).transpose(3, 4).reshape(b, nh, nh_t * tile, nw_t * tile, d)
    return o[:, :, :gh, :gw].reshape(b, nh, gh * gw, d)


def _tile_block_probs(q: Tensor, k: Tensor, valid: Optional[Tensor], gh: int, gw: int, w2: int,
                      rel_bias: Optional[Tensor], scale: float, dropout_p: float) -> Tuple[Tensor, Tensor]:
    """Attention weights of :func:`tile_block_2d`, (B, H, T, w2^2, w2^2) per ``w2 x w2`` tile, and the tiles'
    valid patches (B, T, w2^2) (patches outside the grid are invalid)."""
    b = q.shape[0]
    kw = 2 * w2 - 1
    pvalid = torch.ones(b, gh * gw, dtype=torch.bool, device=q.device) if valid is None else valid
    tq, tk = _tiles(q, gh, gw, w2), _tiles(k, gh, gw, w2)
    tvalid = _tiles(pvalid[:, None, :, None].float(), gh, gw, w2)
    tvalid = tvalid.squeeze(-1).to(torch.bool)[:, 0]  # (B, T, w2*w2); patches outside the grid are invalid
    a = torch.arange(w2, device=q.device)
    yy, xx = torch.meshgrid(a, a, indexing='ij')
    yy, xx = yy.reshape(-1), xx.reshape(-1)
    idx = (yy[None, :] - yy[:, None] + w2 - 1) * kw + (xx[None, :] - xx[:, None] + w2 - 1)
    s = (tq @ tk.transpose(-1, -2)) * scale
    if rel_bias is not None:
        s = s + rel_bias[idx]
    mask = tvalid[:, None, :, None, :]
    s = s.masked_fill(~mask, finfo_min(s.dtype))
    return _dropout(s.softmax(dim=-1) * mask.any(dim=-1, keepdim=True), dropout_p), tvalid


def _untile(t: Tensor, gh: int, gw: int, w2: int) -> Tensor:
    """Inverse of :func:`_tiles`: (B, H, T, w2 * w2, c) -> (B, H, gh * gw, c), the grid's patches only."""
    b, nh, c = t.shape[0], t.shape[1], t.shape[-1]
    nh_t, nw_t = -(-gh // w2), -(-gw // w2)
    t = t.reshape(b, nh, nh_t, nw_t, w2, w2, c).transpose(3, 4).reshape(b, nh, nh_t * w2, nw_t * w2, c)
    return t[:, :, :gh, :gw].reshape(b, nh, gh * gw, c)


def tile_block_2d(q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor], gh: int, gw: int, w2: int,
                  rel_bias: Optional[Tensor], scale: float, dropout_p: float = 0.) -> Tensor:
    """2D context-dissection aggregate (Sec. 3.2 with the bias of Sec. 3.3): patch i attends to the patches
    of its own non-overlapping ``w2 x w2`` tile, logit ``scale q_i . k_j + P[(dy + w2 - 1) (2 w2 - 1) + dx
    + w2 - 1]``; invalid keys are left out and a query without a valid key gets 0.

    Args:
        q, k, v: (B, H, gh * gw, d) row-major patches.
        valid: (B, gh * gw) bool, True = valid key, or None.
        gh, gw: Grid rows and columns.
        w2: Tile side (the 2D window's half-width plus one).
        rel_bias: P, ((2 w2 - 1)^2,), or None.
        scale: Logit scale.
        dropout_p: Dropout on the attention weights (the layer's ``attn_drop`` while training).

    Returns:
        (B, H, gh * gw, d).
    """
    p, _ = _tile_block_probs(q, k, valid, gh, gw, w2, rel_bias, scale, dropout_p)
    return _untile(p @ _tiles(v, gh, gw, w2), gh, gw, w2)


def tile_block_2d_sum(q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor], gh: int, gw: int, w2: int,
                      rel_bias: Optional[Tensor], scale: float, dropout_p: float = 0.) -> Tensor:
    """``sum_i z_i`` over the valid patches i of :func:`tile_block_2d`'s aggregates z, (B, H, 1, d), without
    forming z: ``sum_i sum_j p_ij v_j = sum_j (sum_i p_ij) v_j`` (what the non-causal CODE mean of Eq. 3 needs).
    Arguments as :func:`tile_block_2d`."""
    p, tvalid = _tile_block_probs(q, k, valid, gh, gw, w2, rel_bias, scale, dropout_p)
    col = tvalid[:, None, :, None, :].to(p.dtype) @ p  # (B, H, T, 1, w2^2): weight of each key, valid queries
    col = _untile(col.transpose(-1, -2), gh, gw, w2)  # (B, H, gh * gw, 1)
    return col.transpose(-1, -2) @ v


def lavo_local_2d_torch(q: Tensor, k: Tensor, v: Tensor, rel_bias: Optional[Tensor], scale: float,
                        grid_size: Tuple[int, int], window: int, key_mask: Optional[Tensor] = None,
                        mode: str = 'sliding') -> Tensor:
    """The PyTorch backend of ``lavo_local_2d`` (arguments as there, less ``backend``): :func:`local_window_2d`
    (``mode='sliding'``) or :func:`tile_block_2d` (``mode='block'``), the layer's own functions."""
    gh, gw = grid_size
    if mode == 'block':
        return tile_block_2d(q, k, v, key_mask, gh, gw, window, rel_bias, scale)
    return local_window_2d(q, k, v, key_mask, gh, gw, window, rel_bias, scale)


# ------------------------------------------------------------------------------------------------
# CODE global branch

def code_memory(z: Tensor, basis: Tensor, key_mask: Optional[Tensor], causal: bool) -> Tensor:
    """CODE coefficients H (Eqs. 3-4): the mean of ``B z_s`` over the valid tokens.

    Args:
        z: Features to compress, (B, heads, L, d).
        basis: B, (heads, r, d).
        key_mask: Optional (B, L) bool, True = valid (left out of the mean and its count otherwise).
        causal: Running mean ``H_t`` over ``s <= t`` ((B, heads, L, r)), else one mean ((B, heads, 1, r)).
            A prefix (or a sequence) without a valid token has H = 0.
    """
    length = z.shape[2]
    if not causal:  # mean first: (1/n) sum_t B z_t = B z_bar, one (r x d) product per head
        if key_mask is None:
            z_sum = z.sum(dim=2, keepdim=True)
        else:
            z_sum = key_mask[:, None, None, :].to(z.dtype) @ z  # (B, 1, 1, L) @ (B, heads, L, d)
        return code_memory_from_sum(z_sum, valid_count(key_mask, length, z.dtype, z.device), basis)
    proj = z @ basis.transpose(-1, -2)  # B z_t, (B, heads, L, r)
    m: Optional[Tensor] = None
    if key_mask is not None:
        m = key_mask[:, None, :, None].to(proj.dtype)
        proj = proj * m
    if m is None:
        cnt = torch.arange(1, length + 1, device=z.device, dtype=proj.dtype)[:, None]
    else:
        cnt = m.cumsum(dim=2).clamp(min=1)
    return proj.cumsum(dim=2) / cnt


def valid_count(key_mask: Optional[Tensor], length: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Number of valid tokens, at least 1 (a count of 0 divides a zero sum): (1,) without a mask, else (B, 1, 1, 1)
    from the (B, L) bool ``key_mask``."""
    if key_mask is None:
        return torch.full((1,), max(length, 1), dtype=dtype, device=device)
    return key_mask.sum(dim=1).to(dtype).clamp(min=1)[:, None, None, None]


def code_memory_from_sum(z_sum: Tensor, count: Tensor, basis: Tensor) -> Tensor:
    """Non-causal CODE coefficients ``H = B (z_sum / count)`` (Eq. 3), (B, heads, 1, r), from the sum of the
    compressed features over the valid tokens (B, heads, 1, d) and their number (broadcastable, >= 1)."""
    return (z_sum / count) @ basis.transpose(-1, -2)


def code_slot_probs(q: Tensor, h: Tensor, basis: Tensor, scale: float) -> Tensor:
    """Slot weights ``softmax(scale * q (diag(H) B)^T)`` of :func:`code_read`, (B, heads, L, r)."""
    logits = (q @ basis.transpose(-1, -2)) * h * scale
    return logits.softmax(dim=-1)


def code_read(q: Tensor, h: Tensor, basis: Tensor, scale: float, dropout_p: float = 0.) -> Tensor:
    """Read the CODE slots ``diag(H) B`` with softmax attention (Eqs. 3, 4, 6): ``(p * H) B``, O(L r d).

    Args:
        q: Queries (B, heads, L, d).
        h: H, (B, heads, L, r) (one memory per query) or (B, heads, 1, r) (shared).
        basis: B, (heads, r, d).
        scale: Logit scale.
        dropout_p: Dropout on the slot weights.
    """
    if h.shape[-2] == 1 and q.shape[-2] > 1:
        # one memory for every query: the r slots diag(H) B are keys and values of one SDPA call
        slots = h.transpose(-1, -2) * basis  # (B, heads, r, d)
        return F.scaled_dot_product_attention(q, slots, slots, dropout_p=dropout_p, scale=scale)
    p = _dropout(code_slot_probs(q, h, basis, scale), dropout_p)
    return (p * h) @ basis


def lavo_global_torch(q: Tensor, z: Tensor, basis: Tensor, scale: float, key_mask: Optional[Tensor] = None,
                      causal: bool = True) -> Tensor:
    """The PyTorch backend of ``lavo_global`` (arguments as there, less ``backend``)."""
    return code_read(q, code_memory(z, basis, key_mask, causal), basis, scale)
