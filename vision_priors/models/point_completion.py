"""PoinTr-style point-cloud completion transformer with vanilla or LAVO decoder cross-attention.

The model follows PoinTr (Yu et al., ICCV 2021, "PoinTr: Diverse Point Cloud Completion with
Geometry-Aware Transformers"; github.com/yuxumin/PoinTr ``models/PoinTr.py``, ``models/Transformer.py``)
in a compact form, for the LAVO paper's PCN experiment (Table 7: PCN with a PoinTr backbone, the
decoder's cross-attention vanilla vs LAVO, Sec. 3.4):

1. **Point proxies.** Farthest point sampling picks ``num_proxies`` centres of the partial cloud
   (:func:`farthest_point_sample`, deterministic, starting at point 0); each centre's ``knn_k`` nearest
   input points, in coordinates relative to the centre, go through a two-stage mini-PointNet
   (shared MLP -> max pool -> concat with the pooled feature -> shared MLP -> max pool). PoinTr uses
   a two-level DGCNN grouper instead; this keeps the same role (a local feature per proxy).
   A positional embedding (MLP of the centre's xyz) is added before every encoder block, as in PoinTr.
2. **Geometry-aware encoder.** Pre-norm self-attention blocks; the first ``knn_layers`` blocks add
   PoinTr's kNN branch: for the ``geo_k`` nearest proxies (by centre), ``[f_j - f_i, f_i]`` -> linear ->
   LeakyReLU -> max over neighbours, merged with the attention output by a linear layer.
3. **Query generation.** ``global = max_i MLP(x_i)``; ``coarse = MLP(global)`` reshaped to
   ``num_queries`` missing-part centres (B, Q, 3); query features ``MLP([global, coarse_q])``.
4. **Decoder.** Blocks of self-attention (kNN branch over the coarse centres in the first
   ``knn_layers`` blocks) + cross-attention to the encoder's proxies + MLP. ``cross_attn='vanilla'``
   is multi-head softmax attention (:class:`VanillaCrossAttention`, ``scaled_dot_product_attention``);
   ``cross_attn='lavo'`` is the package's :class:`~vision_priors.layers.LavoCrossAttention` (LAVO
   Sec. 3.4, Eqs. 5-6: the proxies are compressed once into ``r`` CODE slots per head and every query
   reads them, O(r d (n + m)) instead of O(n m d)). PoinTr's extra kNN branch inside the cross-attention
   is left out so that the two variants differ only in the cross-attention.
5. **Rebuild head.** As PoinTr: ``max`` over an MLP of the decoder output gives a global feature;
   ``[global, q, coarse]`` -> linear -> PoinTr's two-stage folding from a ``fold_step x fold_step``
   2D grid seed in [-1, 1]^2, giving ``fold_step ** 2`` offsets added to the query's coarse centre.
   Initialisation as PoinTr: trunc-normal(0.02) in the transformer, PyTorch's default in the rebuild head.

``forward(partial)`` returns ``(coarse (B, Q, 3), fine (B, Q * fold_step ** 2, 3))``. With
``concat_input=True`` (PoinTr's own output layout) the input is appended: fine gets the N input
points and coarse ``Q`` FPS points of the input, i.e. (B, 2Q, 3) and (B, Q * fold_step ** 2 + N, 3);
PoinTr's PCN set-up is ``num_queries=224, fold_step=8, concat_input=True`` with 2,048 input points
(224 * 64 + 2048 = 16,384). BatchNorm is not used (PoinTr has it in a few MLPs), so a sample's
output does not depend on the rest of its batch.

The training loss is PoinTr's: :func:`completion_loss` = CD-L1(coarse, gt) + CD-L1(fine, gt)
(:mod:`vision_priors.metrics`).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels._backend import check_key_mask
from ..layers.lavo import LavoCrossAttention
from ..metrics import chamfer_l1

__all__ = ['PointCompletionTransformer', 'VanillaCrossAttention', 'CompletionDecoderBlock',
           'CompletionEncoderBlock', 'COMPLETION_MODELS', 'CROSS_ATTENTIONS', 'create_completion_model',
           'completion_model_names', 'completion_loss', 'farthest_point_sample', 'knn_indices', 'gather_points']

CROSS_ATTENTIONS = ('vanilla', 'lavo')


# ----------------------------------------------------------------------------------------------------
# point operations
# ----------------------------------------------------------------------------------------------------

def gather_points(points: Tensor, idx: Tensor) -> Tensor:
    """``points[b, idx[b, ...]]``: (B, N, C) gathered by (B, *S) indices into (B, *S, C)."""
    bsz, c = points.shape[0], points.shape[-1]
    flat = idx.reshape(bsz, -1)
    out = torch.gather(points, 1, flat[..., None].expand(-1, -1, c))
    return out.reshape(*idx.shape, c)


@torch.no_grad()
def farthest_point_sample(points: Tensor, num_samples: int) -> Tensor:
    """Farthest point sampling (batched, deterministic): indices (B, S) of S points of (B, N, D).

    Starts at index 0; each next point maximises the (Euclidean) distance to the points chosen so far,
    the first index among ties. With at least S distinct points the S chosen points are distinct.
    Equivalent to PoinTr's ``pointnet2_ops.furthest_point_sample`` (which also starts at index 0).
    Cost O(S N D) time, O(B N) memory.
    """
    if points.dim() != 3:
        raise ValueError(f'points must be (B, N, D), got {tuple(points.shape)}')
    bsz, n = points.shape[0], points.shape[1]
    if not 1 <= num_samples <= n:
        raise ValueError(f'num_samples must be in [1, N={n}], got {num_samples}')
    pts = points.detach()
    idx = torch.zeros(bsz, num_samples, dtype=torch.long, device=points.device)
    min_d = torch.full((bsz, n), float('inf'), dtype=pts.dtype, device=points.device)
    cur = torch.zeros(bsz, dtype=torch.long, device=points.device)
    batch = torch.arange(bsz, device=points.device)
    for s in range(num_samples):
        idx[:, s] = cur
        if s + 1 == num_samples:
            break
        d = ((pts - pts[batch, cur][:, None, :]) ** 2).sum(-1)
        min_d = torch.minimum(min_d, d)
        cur = min_d.argmax(dim=1)  # first index among ties
    return idx


@torch.no_grad()
def knn_indices(query: Tensor, points: Tensor, k: int) -> Tensor:
    """Indices (B, S, k) of the k nearest ``points`` (B, N, D) of every ``query`` (B, S, D), nearest first
    (a query that is itself in ``points`` gets itself first)."""
    if k > points.shape[1]:
        raise ValueError(f'k={k} exceeds the number of points N={points.shape[1]}')
    d = ((query[:, :, None, :] - points[:, None, :, :]) ** 2).sum(-1)
    return d.topk(k, dim=-1, largest=False, sorted=True).indices


# ----------------------------------------------------------------------------------------------------
# layers
# ----------------------------------------------------------------------------------------------------

class _Mlp(nn.Sequential):
    """Linear layers with an activation between them (none after the last)."""

    def __init__(self, dims: List[int], act: Callable[[], nn.Module] = nn.GELU) -> None:
        layers: List[nn.Module] = []
        for i in range(len(dims) - 1):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < len(dims) - 2:
                layers.append(act())
        super().__init__(*layers)


class _SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class VanillaCrossAttention(nn.Module):
    """Multi-head softmax cross-attention (PoinTr's ``CrossAttention``): ``softmax(Q K^T / sqrt(d)) V``.

    Args:
        dim: Target (query) width C.
        num_heads: Number of heads.
        context_dim: Source width, default ``dim``.
        qkv_bias: Bias in the q / k / v maps (PoinTr: none).
    """

    def __init__(self, dim: int, num_heads: int = 8, context_dim: Optional[int] = None, qkv_bias: bool = False) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f'dim ({dim}) must be divisible by num_heads ({num_heads})')
        self.dim, self.num_heads = dim, num_heads
        self.context_dim = dim if context_dim is None else context_dim
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(self.context_dim, 2 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, context: Tensor, key_mask: Optional[Tensor] = None) -> Tensor:
        """x (B, m, C) attends to context (B, n, context_dim); ``key_mask`` (B, n) bool, True = valid key.
        A query whose keys are all masked gets ``proj(0)``."""
        b, m, c = x.shape
        n = context.shape[1]
        h, d = self.num_heads, c // self.num_heads
        q = self.q(x).reshape(b, m, h, d).transpose(1, 2)
        k, v = self.kv(context).reshape(b, n, 2, h, d).permute(2, 0, 3, 1, 4)
        mask = None
        if key_mask is not None:
            check_key_mask(key_mask, b, n)
            mask = key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if key_mask is not None:  # all-masked rows: SDPA gives nan; make them 0 like LAVO's empty source
            out = out.masked_fill(~key_mask.any(dim=1)[:, None, None, None], 0.)
        return self.proj(out.transpose(1, 2).reshape(b, m, c))


class _KnnBranch(nn.Module):
    """PoinTr's geometric branch: ``max_j LeakyReLU(W [f_j - f_i, f_i])`` over the k nearest neighbours."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.knn_map = nn.Sequential(nn.Linear(2 * dim, dim), nn.LeakyReLU(negative_slope=0.2))
        self.merge = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor, attn_out: Tensor, knn_idx: Tensor) -> Tensor:
        nb = gather_points(x, knn_idx)  # (B, L, k, C)
        centre = x[:, :, None, :].expand_as(nb)
        local = self.knn_map(torch.cat([nb - centre, centre], dim=-1)).amax(dim=2)
        return self.merge(torch.cat([attn_out, local], dim=-1))


class CompletionEncoderBlock(nn.Module):
    """Pre-norm self-attention + MLP block, with PoinTr's optional kNN geometric branch."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, geometric: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _SelfAttention(dim, num_heads)
        self.knn = _KnnBranch(dim) if geometric else None
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = _Mlp([dim, int(dim * mlp_ratio), dim])

    def forward(self, x: Tensor, knn_idx: Optional[Tensor] = None) -> Tensor:
        h = self.norm1(x)
        a = self.attn(h)
        if self.knn is not None:
            a = self.knn(h, a, knn_idx)
        x = x + a
        return x + self.mlp(self.norm2(x))


class CompletionDecoderBlock(nn.Module):
    """PoinTr decoder block: self-attention (+ kNN branch), cross-attention to the proxies, MLP.

    ``cross_attn`` picks :class:`VanillaCrossAttention` or :class:`~vision_priors.layers.LavoCrossAttention`
    (``lavo_slots`` CODE slots per head, ``lavo_basis`` its basis mode).
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, geometric: bool, cross_attn: str,
                 lavo_slots: int, lavo_basis: str = 'fixed') -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.self_attn = _SelfAttention(dim, num_heads)
        self.knn = _KnnBranch(dim) if geometric else None
        self.norm_q = nn.LayerNorm(dim)
        self.norm_v = nn.LayerNorm(dim)
        self.cross_attn: nn.Module
        if cross_attn == 'vanilla':
            self.cross_attn = VanillaCrossAttention(dim, num_heads)
        elif cross_attn == 'lavo':
            self.cross_attn = LavoCrossAttention(dim, num_heads=num_heads, num_slots=lavo_slots, basis=lavo_basis)
        else:
            raise ValueError(f'cross_attn must be one of {CROSS_ATTENTIONS}, got {cross_attn!r}')
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = _Mlp([dim, int(dim * mlp_ratio), dim])

    def forward(self, q: Tensor, v: Tensor, knn_idx: Optional[Tensor] = None) -> Tensor:
        h = self.norm1(q)
        a = self.self_attn(h)
        if self.knn is not None:
            a = self.knn(h, a, knn_idx)
        q = q + a
        # no mask (every proxy is valid): the call is the same under either mask-argument name
        q = q + self.cross_attn(self.norm_q(q), self.norm_v(v))
        return q + self.mlp(self.norm2(q))


class _Fold(nn.Module):
    """PoinTr's folding head: two MLP stages from a 2D grid seed to ``step ** 2`` 3D offsets.

    PoinTr applies each stage to ``[seed_s, f]`` (resp. ``[fold1_s, f]``) for every grid point s; the
    first linear layer of a stage is split here as ``W_f f + W_s seed_s`` (the same function and
    parameter count), so that the ``W_f f`` part is computed once per query instead of once per point.
    """

    def __init__(self, in_dim: int, step: int, hidden: int) -> None:
        super().__init__()
        lin = torch.linspace(-1., 1., steps=step) if step > 1 else torch.zeros(1)
        a = lin.view(1, step).expand(step, step).reshape(-1)
        b = lin.view(step, 1).expand(step, step).reshape(-1)
        self.register_buffer('seed', torch.stack([a, b], dim=-1), persistent=False)  # (S, 2)
        self.feat1 = nn.Linear(in_dim, hidden)
        self.seed1 = nn.Linear(2, hidden, bias=False)
        self.folding1 = _Mlp([hidden, hidden // 2, 3], act=nn.ReLU)
        self.feat2 = nn.Linear(in_dim, hidden)
        self.seed2 = nn.Linear(3, hidden, bias=False)
        self.folding2 = _Mlp([hidden, hidden // 2, 3], act=nn.ReLU)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyTorch's default start, as PoinTr's ``Fold`` has (its convolutions are outside the trunc-normal
        init of its transformer): every layer uniform in +- 1 / sqrt(fan_in), with the split first layers
        sharing the fan-in of the concatenated layer they stand for (``in_dim + 2``, ``in_dim + 3``)."""
        for mlp in (self.folding1, self.folding2):
            for layer in mlp:
                if isinstance(layer, nn.Linear):
                    layer.reset_parameters()
        for feat, seed in ((self.feat1, self.seed1), (self.feat2, self.seed2)):
            bound = (feat.in_features + seed.in_features) ** -0.5
            for weight in (feat.weight, feat.bias, seed.weight):
                nn.init.uniform_(weight, -bound, bound)

    def forward(self, f: Tensor) -> Tensor:
        """f (..., C) -> offsets (..., S, 3)."""
        seed = self.seed.to(f.dtype)
        fd1 = self.folding1(F.relu(self.feat1(f)[..., None, :] + self.seed1(seed)))
        return self.folding2(F.relu(self.feat2(f)[..., None, :] + self.seed2(fd1)))


# ----------------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------------

def _pos_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f'{name} must be an integer >= {minimum}, got {value!r}')
    return value


class PointCompletionTransformer(nn.Module):
    """PoinTr-style completion transformer (see the module docstring), decoder cross-attention vanilla or LAVO.

    Args:
        embed_dim: Transformer width C.
        num_heads: Attention heads (C divisible by it).
        encoder_depth: Encoder blocks over the proxies.
        decoder_depth: Decoder blocks over the queries.
        num_proxies: Point proxies (FPS centres) of the partial cloud.
        num_queries: Q, coarse missing-part centres / decoder queries.
        fold_step: Folding grid side; each query gives ``fold_step ** 2`` fine points.
        knn_k: Input points grouped per proxy.
        geo_k: Neighbours of the kNN geometric branch.
        knn_layers: Encoder / decoder blocks (the first ones) with the kNN branch (PoinTr: 1).
        mlp_ratio: Hidden width of the block MLPs, times C.
        global_dim: Width of the max-pooled global features (PoinTr: 1024).
        fold_hidden: Hidden width of the folding MLPs (PoinTr: 256).
        cross_attn: 'vanilla' or 'lavo'.
        lavo_slots: r, CODE slots per head for 'lavo' (default: head_dim, the most allowed).
        lavo_basis: Basis mode of :class:`~vision_priors.layers.LavoCrossAttention`.
        concat_input: Append the input (and Q FPS input points to coarse), as PoinTr does.
    """

    def __init__(self, embed_dim: int = 128, num_heads: int = 4, encoder_depth: int = 2, decoder_depth: int = 2,
                 num_proxies: int = 64, num_queries: int = 32, fold_step: int = 8, knn_k: int = 16, geo_k: int = 8,
                 knn_layers: int = 1, mlp_ratio: float = 2.0, global_dim: int = 256, fold_hidden: int = 128,
                 cross_attn: str = 'vanilla', lavo_slots: Optional[int] = None, lavo_basis: str = 'fixed',
                 concat_input: bool = False) -> None:
        super().__init__()
        for name in ('embed_dim', 'num_heads', 'encoder_depth', 'decoder_depth', 'num_proxies', 'num_queries',
                     'fold_step', 'knn_k', 'geo_k', 'global_dim', 'fold_hidden'):
            _pos_int(name, locals()[name])
        _pos_int('knn_layers', knn_layers, 0)
        if embed_dim % num_heads != 0:
            raise ValueError(f'embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})')
        if cross_attn not in CROSS_ATTENTIONS:
            raise ValueError(f'cross_attn must be one of {CROSS_ATTENTIONS}, got {cross_attn!r}')
        if not (isinstance(mlp_ratio, (int, float)) and mlp_ratio > 0 and int(embed_dim * mlp_ratio) >= 1):
            raise ValueError(f'mlp_ratio must be > 0, got {mlp_ratio!r}')
        head_dim = embed_dim // num_heads
        lavo_slots = head_dim if lavo_slots is None else _pos_int('lavo_slots', lavo_slots)
        if lavo_slots > head_dim:
            raise ValueError(f'lavo_slots ({lavo_slots}) must be <= head_dim = embed_dim / num_heads = {head_dim}')
        if fold_hidden < 2:
            raise ValueError(f'fold_hidden must be >= 2, got {fold_hidden}')
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.num_proxies, self.num_queries, self.fold_step = num_proxies, num_queries, fold_step
        self.knn_k, self.geo_k, self.knn_layers = knn_k, geo_k, knn_layers
        self.cross_attn, self.lavo_slots, self.concat_input = cross_attn, lavo_slots, bool(concat_input)

        c = embed_dim
        # point proxies: two-stage mini-PointNet over the kNN group of each centre, + xyz embedding
        self.group_mlp1 = _Mlp([3, 64, 128], act=nn.ReLU)
        self.group_mlp2 = _Mlp([256, 256, c], act=nn.ReLU)
        self.pos_embed = _Mlp([3, 128, c])
        self.input_proj = _Mlp([c, c, c])
        self.encoder = nn.ModuleList(
            CompletionEncoderBlock(c, num_heads, mlp_ratio, i < knn_layers) for i in range(encoder_depth))
        self.norm = nn.LayerNorm(c)
        # query generation
        self.increase_dim = _Mlp([c, global_dim, global_dim], act=lambda: nn.LeakyReLU(0.2))
        self.coarse_pred = _Mlp([global_dim, global_dim, 3 * num_queries], act=nn.ReLU)
        self.mlp_query = _Mlp([global_dim + 3, global_dim, global_dim, c], act=lambda: nn.LeakyReLU(0.2))
        self.decoder = nn.ModuleList(
            CompletionDecoderBlock(c, num_heads, mlp_ratio, i < knn_layers, cross_attn, lavo_slots, lavo_basis)
            for i in range(decoder_depth))
        # rebuild head
        self.increase_dim_q = _Mlp([c, global_dim, global_dim], act=lambda: nn.LeakyReLU(0.2))
        self.reduce_map = nn.Linear(global_dim + c + 3, c)
        self.fold = _Fold(c, fold_step, fold_hidden)
        # PoinTr: trunc-normal(0.02) for the transformer (its PCTransformer); the rebuild head (increase_dim,
        # reduce_map, the folding net) keeps PyTorch's default start. With 0.02 there the offsets start at
        # ~1e-5 with a spread of ~2e-7 over the grid (default: ~0.08 and ~1e-4), and after 300 updates the
        # validation CD-L1 was 58 against 47-52 (README, PCN initialisation ablation).
        self.apply(self._init_weights)
        for head in (self.increase_dim_q, self.reduce_map):
            for layer in head.modules():
                if isinstance(layer, nn.Linear):
                    layer.reset_parameters()
        self.fold.reset_parameters()

    @staticmethod
    def _init_weights(m: nn.Module) -> None:  # PoinTr's transformer: trunc-normal(0.02) linears, zero biases
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    @property
    def points_per_query(self) -> int:
        """Fine points generated per query, ``fold_step ** 2``."""
        return self.fold_step ** 2

    @property
    def min_input_points(self) -> int:
        """Fewest input points the model accepts (proxies, grouping, and Q for ``concat_input``)."""
        return max(self.num_proxies, self.knn_k, self.num_queries if self.concat_input else 1)

    def num_fine_points(self, num_input_points: int = 0) -> int:
        """Fine points per output cloud (``concat_input`` adds the input's points)."""
        return self.num_queries * self.points_per_query + (num_input_points if self.concat_input else 0)

    def extra_repr(self) -> str:
        return (f'cross_attn={self.cross_attn!r}, num_proxies={self.num_proxies}, num_queries={self.num_queries}, '
                f'fold_step={self.fold_step}, lavo_slots={self.lavo_slots}, concat_input={self.concat_input}')

    def _check_input(self, partial: Tensor) -> None:
        if not isinstance(partial, Tensor):
            raise TypeError(f'partial must be a tensor (B, N, 3), got {type(partial).__name__}')
        if partial.dim() != 3 or partial.shape[-1] != 3:
            raise ValueError(f'partial must be a (B, N, 3) point cloud, got shape {tuple(partial.shape)}')
        if partial.shape[0] < 1:
            raise ValueError('partial has an empty batch (B = 0)')
        if not partial.is_floating_point():
            raise TypeError(f'partial must be a floating tensor, got {partial.dtype}')
        if partial.shape[1] < self.min_input_points:
            raise ValueError(
                f'partial has {partial.shape[1]} points per cloud, but this model needs at least '
                f'{self.min_input_points} (num_proxies={self.num_proxies}, knn_k={self.knn_k}'
                + (f', num_queries={self.num_queries} with concat_input' if self.concat_input else '') + ')')
        if not torch.compiler.is_compiling() and not partial.is_meta and not bool(torch.isfinite(partial).all()):
            bad = (~torch.isfinite(partial)).nonzero()[0].tolist()
            raise ValueError(f'partial must be finite: partial[{bad[0]}, {bad[1]}, {bad[2]}] = '
                             f'{partial[bad[0], bad[1], bad[2]].item()}')

    def proxies(self, partial: Tensor) -> Tuple[Tensor, Tensor]:
        """Point proxies: centres (B, P, 3) by FPS and their local features (B, P, C)."""
        centres = gather_points(partial, farthest_point_sample(partial, self.num_proxies))
        group = gather_points(partial, knn_indices(centres, partial, self.knn_k)) - centres[:, :, None, :]
        f = self.group_mlp1(group)  # (B, P, k, 128)
        f = torch.cat([f, f.amax(dim=2, keepdim=True).expand_as(f)], dim=-1)
        return centres, self.group_mlp2(f).amax(dim=2)

    def forward(self, partial: Tensor) -> Tuple[Tensor, Tensor]:
        """Complete partial clouds.

        Args:
            partial: (B, N, 3) finite points, N >= :attr:`min_input_points`.

        Returns:
            ``(coarse, fine)``: (B, Q, 3) missing-part centres and (B, Q * fold_step ** 2, 3) dense points
            (with ``concat_input``: (B, 2Q, 3) and (B, Q * fold_step ** 2 + N, 3)).
        """
        self._check_input(partial)
        bsz = partial.shape[0]
        centres, feat = self.proxies(partial)
        pos = self.pos_embed(centres)
        x = self.input_proj(feat)
        knn_enc = knn_indices(centres, centres, min(self.geo_k, self.num_proxies)) if self.knn_layers else None
        for blk in self.encoder:
            x = blk(x + pos, knn_enc)
        x = self.norm(x)

        global_feat = self.increase_dim(x).amax(dim=1)  # (B, G)
        coarse = self.coarse_pred(global_feat).reshape(bsz, self.num_queries, 3)
        q = self.mlp_query(torch.cat([global_feat[:, None, :].expand(-1, self.num_queries, -1), coarse], dim=-1))
        knn_dec = (knn_indices(coarse.detach(), coarse.detach(), min(self.geo_k, self.num_queries))
                   if self.knn_layers else None)
        for blk in self.decoder:
            q = blk(q, x, knn_dec)

        g = self.increase_dim_q(q).amax(dim=1)
        rebuild = self.reduce_map(torch.cat([g[:, None, :].expand(-1, self.num_queries, -1), q, coarse], dim=-1))
        fine = (self.fold(rebuild) + coarse[:, :, None, :]).reshape(bsz, -1, 3)
        if self.concat_input:
            coarse = torch.cat([coarse, gather_points(partial, farthest_point_sample(partial, self.num_queries))], 1)
            fine = torch.cat([fine, partial], dim=1)
        return coarse, fine


def completion_loss(coarse: Tensor, fine: Tensor, gt: Tensor) -> Tensor:
    """PoinTr's PCN training loss: ``CD-L1(coarse, gt) + CD-L1(fine, gt)``, averaged over the batch (scalar).

    CD-L1 is PoinTr's ``ChamferDistanceL1`` (:func:`vision_priors.metrics.chamfer_l1`, unscaled).
    """
    return chamfer_l1(coarse, gt).mean() + chamfer_l1(fine, gt).mean()


# ----------------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------------

COMPLETION_MODELS: Dict[str, Dict[str, Any]] = {
    # Every config keeps PoinTr's output layout (concat_input=True: the input points are part of the
    # completion, and Q FPS input points join the coarse centres).
    # CPU default: learns the built-in task on 2 cores in minutes; 32 queries x 64 + the N input points
    # (512 by default: 2,560 fine points)
    'pointr_cpu': dict(embed_dim=128, num_heads=4, encoder_depth=2, decoder_depth=2, num_proxies=64,
                       num_queries=32, fold_step=8, knn_k=16, geo_k=8, global_dim=256, fold_hidden=128,
                       concat_input=True),
    # between: 64 queries x 64 + N
    'pointr_small': dict(embed_dim=256, num_heads=8, encoder_depth=4, decoder_depth=4, num_proxies=128,
                         num_queries=64, fold_step=8, knn_k=16, geo_k=8, global_dim=512, fold_hidden=256,
                         concat_input=True),
    # PCN scale, PoinTr's (trans_dim 384, 6 heads, depth [6, 8], 1024 global, fold hidden 256, 128 proxies,
    # 224 queries): 224 x 64 + the 2,048 input points = 16,384 fine points
    'pointr_pcn': dict(embed_dim=384, num_heads=6, encoder_depth=6, decoder_depth=8, num_proxies=128,
                       num_queries=224, fold_step=8, knn_k=16, geo_k=8, global_dim=1024, fold_hidden=256,
                       concat_input=True),
}

_DEFAULTS = {k: v.default for k, v in inspect.signature(
    PointCompletionTransformer.__init__).parameters.items() if k != 'self'}


def completion_model_names() -> List[str]:
    """Names in :data:`COMPLETION_MODELS`, sorted."""
    return sorted(COMPLETION_MODELS)


def create_completion_model(name: str, **overrides: Any) -> PointCompletionTransformer:
    """Build a registered completion model, e.g. ``create_completion_model('pointr_cpu', cross_attn='lavo')``.

    Args:
        name: One of :func:`completion_model_names`.
        **overrides: Constructor arguments of :class:`PointCompletionTransformer` replacing the config's.

    Raises:
        ValueError: an unknown name or override key (the message lists the choices), or a bad value.
    """
    if name not in COMPLETION_MODELS:
        raise ValueError(f'unknown completion model {name!r}; choose one of {completion_model_names()}')
    unknown = sorted(set(overrides) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f'unknown override(s) {unknown} for {name!r}; valid keys: {sorted(_DEFAULTS)}')
    return PointCompletionTransformer(**{**COMPLETION_MODELS[name], **overrides})
