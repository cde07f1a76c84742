"""Informer (Zhou et al., AAAI 2021) for long-sequence forecasting, with full or LAVO decoder cross-attention,
and the one-layer linear baseline.

Architecture as in ``zhouhaoyi/Informer2020`` (``models/{embed,attn,encoder,decoder,model}.py``; the code here
is ours), for the LAVO paper's time-series experiment (Table 8: Informer backbone, the decoder's
cross-attention vanilla vs LAVO):

- **Embedding**: value embedding (1D conv, kernel 3, circular padding, with bias, Kaiming-normal weights) +
  sinusoidal positional embedding + time-feature embedding (``timeF``: a linear map of the time features, with
  bias), then dropout.
- **ProbSparse self-attention** (Informer Sec. 3.1, Eqs. 3-4): per head, ``U_part = c ln L_K`` keys are
  sampled for every query, the sparsity measure ``M(q_i) = max_j s_ij - sum_j s_ij / L_K`` (Eq. 4, over
  the sampled keys) picks the top ``u = c ln L_Q`` queries (both ``c * ceil(ln L)``, capped at L); those
  attend to all keys with softmax, the others output the mean of the values (unmasked) or their cumulative
  sum (masked; Informer's "lazy" queries). With ``u >= L_Q`` it is exactly full attention. As in
  Informer2020, no dropout is applied to the ProbSparse attention weights (its ``attention_dropout`` is
  accepted and unused); full attention drops them.
  In the masked (decoder) form the key samples of query ``i`` are drawn from positions ``<= i``, so that its
  measure ``M(q_i)``, like its attention, never looks ahead (Informer2020 samples from all positions). The
  top-u ranking itself is over all queries, as in the paper: a later query can still displace an earlier one
  from the top u (which then outputs its lazy cumulative sum); with ``u >= L`` the layer is exactly causal.
- **Encoder**: blocks of attention + 1x1-conv feed-forward (GELU) with post-LayerNorm; between blocks,
  self-attention distilling (Sec. 3.2, Eq. 5): conv (kernel 3, circular) -> BatchNorm -> ELU -> max-pool
  (kernel 3, stride 2), halving the length; a final LayerNorm.
- **Decoder** (Sec. 3.3, generative inference): input = the last ``label_len`` known steps (start tokens)
  followed by ``pred_len`` zero placeholders, with their time features; blocks of masked ProbSparse
  self-attention, cross-attention to the encoder output and the feed-forward; one forward pass; a linear
  projection to ``c_out``; the last ``pred_len`` steps are the forecast. ``cross_attn='full'`` is softmax
  attention (Informer's ``FullAttention``); ``cross_attn='lavo'`` is the package's
  :class:`~vision_priors.layers.lavo.LavoCrossAttention` (LAVO Sec. 3.4, Eqs. 5-6: the encoder output is
  compressed once into ``r`` orthogonal-memory slots per head, each query reads them).
  ``mix=True`` reproduces Informer2020's head-mixing reshape of the decoder self-attention output
  (``AttentionLayer(mix=True)``); it moves values across positions (position 0 receives later ones), so it
  is off by default here; the ``informer_mid`` configuration turns it on, as Informer2020's runs had it.
- ``attn='full'`` replaces ProbSparse by full attention everywhere (Informer's ablation, "Informer+" rows).
- **Encoder stack** (``e_layers`` a list, Informer2020's ``informerstack``): encoder ``i`` has ``e_layers[i]``
  blocks and reads the last ``L // 2**i`` steps of the embedded input; their outputs are concatenated along time
  (the paper's experimental details describe such a stack: a 3-layer stack and a 1-layer stack on a quarter of
  the input). Each encoder of the stack has its own distilling convs and final LayerNorm.

:class:`LinearForecaster` is the DLinear-style baseline: one linear map from the last ``seq_len`` steps to
the ``pred_len`` next ones, shared across channels.

Every model is called as ``model(x_enc, x_mark_enc, x_dec, x_mark_dec) -> (B, pred_len, c_out)``;
:func:`create_forecast_model` builds a registered configuration.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers.lavo import LavoCrossAttention
from ..layers.rotary import rotate_by_coords

__all__ = ['PositionalEmbedding', 'TokenEmbedding', 'DataEmbedding', 'ProbAttention', 'FullAttention',
           'AttentionLayer', 'EncoderLayer', 'DistilConv', 'Encoder', 'EncoderStack', 'DecoderLayer', 'Decoder',
           'Informer', 'LinearForecaster', 'FORECAST_MODELS', 'ATTENTIONS', 'CROSS_ATTENTIONS', 'MEMORY_POS',
           'create_forecast_model', 'forecast_model_names', 'sample_count', 'decoder_input']

ATTENTIONS = ('prob', 'full')
CROSS_ATTENTIONS = ('full', 'lavo')
MEMORY_POS = ('none', 'rotary')  # how the decoder's cross-attention sees the encoder positions (Informer: none)


# ------------------------------------------------------------------------------------------ embedding

class PositionalEmbedding(nn.Module):
    """Sinusoidal position embedding (Vaswani et al.), a fixed buffer of ``max_len`` positions."""

    def __init__(self, d_model: int, max_len: int = 5000) -> None:
        super().__init__()
        position = torch.arange(max_len, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)[:, :d_model // 2]
        self.register_buffer('pe', pe, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.pe[:x.shape[1]][None].to(x.dtype)


class TokenEmbedding(nn.Module):
    """Value embedding: Conv1d over time (kernel 3, circular padding, with bias), Kaiming-normal weights
    (Informer2020's ``TokenEmbedding``; the bias keeps PyTorch's default init)."""

    def __init__(self, c_in: int, d_model: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, d_model, kernel_size=3, padding=1, padding_mode='circular')
        nn.init.kaiming_normal_(self.conv.weight, mode='fan_in', nonlinearity='leaky_relu')

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class DataEmbedding(nn.Module):
    """Token + positional + time-feature (``timeF``: linear, with bias) embeddings, then dropout."""

    def __init__(self, c_in: int, d_model: int, mark_dim: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.value = TokenEmbedding(c_in, d_model)
        self.position = PositionalEmbedding(d_model)
        self.time = nn.Linear(mark_dim, d_model) if mark_dim > 0 else None
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, x_mark: Tensor) -> Tensor:
        out = self.value(x) + self.position(x)
        if self.time is not None:
            out = out + self.time(x_mark)
        return self.dropout(out)


# ------------------------------------------------------------------------------------------ attention

def sample_count(factor: int, length: int) -> int:
    """Informer's ``c * ceil(ln L)``, capped at ``L`` (sampled keys per query, and selected queries)."""
    return min(length, factor * math.ceil(math.log(length))) if length > 1 else length


class ProbAttention(nn.Module):
    """ProbSparse attention (Informer Eqs. 3-4) on (B, L, H, D) queries / keys / values.

    Args:
        mask_flag: Causal (decoder self-attention; needs L_Q == L_K).
        factor: c in ``u = c ln L``.
        scale: Logit scale, default ``D ** -0.5``.
        attention_dropout: Accepted for the common signature and unused: Informer2020's ProbAttention builds
            this dropout but never applies it.
    """

    def __init__(self, mask_flag: bool = True, factor: int = 5, scale: Optional[float] = None,
                 attention_dropout: float = 0.1) -> None:
        super().__init__()
        self.mask_flag, self.factor, self.scale = mask_flag, factor, scale

    def select_queries(self, q: Tensor, k: Tensor, u: int) -> Tensor:
        """(B, H, u) indices of the queries with the largest sparsity measure M (Eq. 4) on sampled keys."""
        l_q, l_k = q.shape[2], k.shape[2]
        if u >= l_q:
            return torch.arange(l_q, device=q.device).expand(q.shape[0], q.shape[1], l_q)
        samples = sample_count(self.factor, l_k)
        if self.mask_flag:  # keys at positions <= i only, so the selection never looks ahead
            limit = torch.arange(1, l_q + 1, device=q.device, dtype=torch.float32)[:, None]
            index = (torch.rand(l_q, samples, device=q.device) * limit).long()
        else:
            index = torch.randint(l_k, (l_q, samples), device=q.device)
        # the sampled scores q_i . k_index[i, s]; gathered from the full product, which at these lengths is
        # cheaper than Informer2020's gather of the sampled keys (same values)
        qk = (q @ k.transpose(-2, -1)).gather(-1, index.expand(q.shape[0], q.shape[1], l_q, samples))
        measure = qk.max(-1).values - qk.sum(-1) / l_k
        return measure.topk(u, dim=-1, sorted=False).indices

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        b, l_q, h, d = queries.shape
        l_k = keys.shape[1]
        if self.mask_flag and l_q != l_k:
            raise ValueError(f'masked ProbSparse attention needs L_Q == L_K, got {l_q} and {l_k}')
        q, k, v = (t.transpose(1, 2) for t in (queries, keys, values))  # (B, H, L, D)
        top = self.select_queries(q, k, sample_count(self.factor, l_q))  # (B, H, u)
        q_top = q.gather(2, top[..., None].expand(-1, -1, -1, d))
        scores = (q_top @ k.transpose(-2, -1)) * (self.scale or d ** -0.5)  # (B, H, u, L_K)
        if self.mask_flag:
            future = torch.arange(l_k, device=q.device)[None, None, None, :] > top[..., None]
            scores = scores.masked_fill(future, float('-inf'))
        attn = torch.softmax(scores, dim=-1)
        lazy = v.cumsum(dim=2) if self.mask_flag else v.mean(dim=2, keepdim=True).expand(-1, -1, l_q, -1)
        context = lazy.scatter(2, top[..., None].expand(-1, -1, -1, v.shape[-1]), (attn @ v).to(v.dtype))
        return context.transpose(1, 2)  # (B, L_Q, H, D)


class FullAttention(nn.Module):
    """Softmax attention on (B, L, H, D) tensors (``scaled_dot_product_attention``), optionally causal."""

    def __init__(self, mask_flag: bool = True, factor: int = 5, scale: Optional[float] = None,
                 attention_dropout: float = 0.1) -> None:
        super().__init__()
        self.mask_flag, self.scale, self.dropout_p = mask_flag, scale, attention_dropout

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        q, k, v = (t.transpose(1, 2) for t in (queries, keys, values))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p if self.training else 0.0,
                                             is_causal=self.mask_flag, scale=self.scale)
        return out.transpose(1, 2)


class AttentionLayer(nn.Module):
    """Multi-head projections around an inner attention (Informer's ``AttentionLayer``).

    ``mix=True``: Informer2020's reshape of the (B, H, L, D) output straight to (B, L, H * D) (mixes positions).
    """

    def __init__(self, attention: nn.Module, d_model: int, n_heads: int, mix: bool = False) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f'd_model ({d_model}) must be divisible by n_heads ({n_heads})')
        self.inner, self.n_heads, self.mix = attention, n_heads, mix
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        b, l, _ = queries.shape
        s, h = keys.shape[1], self.n_heads
        out = self.inner(self.query(queries).view(b, l, h, -1), self.key(keys).view(b, s, h, -1),
                         self.value(values).view(b, s, h, -1))  # (B, L, H, D)
        if self.mix:
            out = out.transpose(2, 1).contiguous()
        return self.out(out.reshape(b, l, -1))


class LavoCrossAttentionLayer(nn.Module):
    """Adapter: ``(queries, keys, values) -> LavoCrossAttention(queries, keys)`` (keys = values = encoder output)."""

    def __init__(self, d_model: int, n_heads: int, num_slots: int) -> None:
        super().__init__()
        self.attn = LavoCrossAttention(d_model, num_heads=n_heads, num_slots=num_slots, qkv_bias=True)

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        return self.attn(queries, keys)


def _attention(kind: str, mask_flag: bool, factor: int, dropout: float) -> nn.Module:
    if kind not in ATTENTIONS:
        raise ValueError(f"attn must be one of {ATTENTIONS}, got {kind!r}")
    return (ProbAttention if kind == 'prob' else FullAttention)(mask_flag, factor, attention_dropout=dropout)


# ------------------------------------------------------------------------------------ encoder / decoder

def _activation(name: str) -> nn.Module:
    if name not in ('gelu', 'relu'):
        raise ValueError(f"activation must be 'gelu' or 'relu', got {name!r}")
    return nn.GELU() if name == 'gelu' else nn.ReLU()


class EncoderLayer(nn.Module):
    """``x = norm1(x + attn(x))``; ``norm2(x + conv2(act(conv1(x))))`` (1x1 convs, dropout after each)."""

    def __init__(self, attention: nn.Module, d_model: int, d_ff: int, dropout: float = 0.1,
                 activation: str = 'gelu') -> None:
        super().__init__()
        self.attention = attention
        self.conv1, self.conv2 = nn.Conv1d(d_model, d_ff, 1), nn.Conv1d(d_ff, d_model, 1)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout, self.act = nn.Dropout(dropout), _activation(activation)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm1(x + self.dropout(self.attention(x, x, x)))
        y = self.dropout(self.act(self.conv1(x.transpose(1, 2))))
        y = self.dropout(self.conv2(y).transpose(1, 2))
        return self.norm2(x + y)


class DistilConv(nn.Module):
    """Self-attention distilling (Informer Eq. 5): Conv1d (kernel 3, circular) -> BatchNorm -> ELU -> MaxPool
    (kernel 3, stride 2, padding 1): length L -> ceil(L / 2)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d_model, d_model, kernel_size=3, padding=1, padding_mode='circular')
        self.norm = nn.BatchNorm1d(d_model)
        self.act = nn.ELU()
        self.pool = nn.MaxPool1d(kernel_size=3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(self.act(self.norm(self.conv(x.transpose(1, 2))))).transpose(1, 2)


class Encoder(nn.Module):
    """Attention blocks with a distilling conv between consecutive ones, then LayerNorm."""

    def __init__(self, layers: List[nn.Module], distils: Optional[List[nn.Module]], d_model: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.distils = nn.ModuleList(distils or [])
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.distils):
                x = self.distils[i](x)
        return self.norm(x)


class EncoderStack(nn.Module):
    """Encoders on shrinking suffixes of one input (Informer2020's ``EncoderStack``): encoder ``i`` reads the last
    ``L // 2**i`` steps; the outputs are concatenated along time."""

    def __init__(self, encoders: List[nn.Module]) -> None:
        super().__init__()
        self.encoders = nn.ModuleList(encoders)

    def input_lengths(self, length: int) -> List[int]:
        """How many of the last steps each encoder reads."""
        return [length // 2 ** i for i in range(len(self.encoders))]

    def forward(self, x: Tensor) -> Tensor:
        lengths = self.input_lengths(x.shape[1])
        if min(lengths) < 1:
            raise ValueError(f'an encoder stack of {len(self.encoders)} needs at least {2 ** (len(self.encoders) - 1)} '
                             f'input steps, got {x.shape[1]}')
        return torch.cat([encoder(x[:, -n:]) for n, encoder in zip(lengths, self.encoders)], dim=1)


class DecoderLayer(nn.Module):
    """``x = norm1(x + self_attn(x))``; ``x = norm2(x + cross_attn(x, memory))``; ``norm3(x + ffn(x))``."""

    def __init__(self, self_attention: nn.Module, cross_attention: nn.Module, d_model: int, d_ff: int,
                 dropout: float = 0.1, activation: str = 'gelu') -> None:
        super().__init__()
        self.self_attention, self.cross_attention = self_attention, cross_attention
        self.conv1, self.conv2 = nn.Conv1d(d_model, d_ff, 1), nn.Conv1d(d_ff, d_model, 1)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout, self.act = nn.Dropout(dropout), _activation(activation)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        x = self.norm1(x + self.dropout(self.self_attention(x, x, x)))
        x = self.norm2(x + self.dropout(self.cross_attention(x, memory, memory)))
        y = self.dropout(self.act(self.conv1(x.transpose(1, 2))))
        y = self.dropout(self.conv2(y).transpose(1, 2))
        return self.norm3(x + y)


class Decoder(nn.Module):
    """Decoder blocks, LayerNorm, linear projection to ``c_out``."""

    def __init__(self, layers: List[nn.Module], d_model: int, c_out: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(d_model)
        self.projection = nn.Linear(d_model, c_out)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, memory)
        return self.projection(self.norm(x))


# ------------------------------------------------------------------------------------------- models

def decoder_input(y: Tensor, label_len: int, pred_len: int) -> Tensor:
    """Generative decoder input: the first ``label_len`` steps of ``y`` (start tokens), then ``pred_len`` zeros."""
    return torch.cat([y[:, :label_len], y.new_zeros(y.shape[0], pred_len, y.shape[2])], dim=1)


class Informer(nn.Module):
    """Informer with ProbSparse (or full) self-attention and full or LAVO decoder cross-attention.

    Args:
        enc_in, dec_in, c_out: Encoder / decoder input channels, output channels.
        seq_len, label_len, pred_len: Encoder length, decoder start tokens, horizon.
        mark_dim: Time features per step (Informer ``timeF``: 4 for hourly data).
        factor: ProbSparse c.
        d_model, n_heads, e_layers, d_layers, d_ff: Widths and depths (Informer: 512, 8, 2, 1, 2048). A list of
            depths for ``e_layers`` builds an encoder stack (:class:`EncoderStack`; ``informerstack``: [3, 2, 1]).
        dropout: Dropout everywhere (Informer: 0.05).
        attn: 'prob' (ProbSparse) or 'full' self-attention.
        cross_attn: 'full' (softmax) or 'lavo' (:class:`LavoCrossAttention`).
        lavo_slots: LAVO memory slots per head (capped at the head width).
        activation: 'gelu' (Informer) or 'relu'.
        distil: Self-attention distilling between encoder blocks.
        mix: Informer2020's head-mixing reshape in the decoder self-attention (breaks causality; off).
        memory_pos: 'none' (Informer) or 'rotary': the encoder output is turned by its token index before the
            decoder's cross-attention reads it (:mod:`vision_priors.layers.rotary`, ladder pi .. pi / (4 n) rad per
            token). LAVO's cross-attention reads the memory through its mean (Eq. 3), where Informer's added
            positions cancel; rotated ones survive it. Not in either paper: an ablation (README, Forecasting).
    """

    def __init__(self, enc_in: int, dec_in: int, c_out: int, seq_len: int, label_len: int, pred_len: int,
                 mark_dim: int = 4, factor: int = 5, d_model: int = 512, n_heads: int = 8,
                 e_layers: Union[int, Sequence[int]] = 2,
                 d_layers: int = 1, d_ff: int = 2048, dropout: float = 0.05, attn: str = 'prob',
                 cross_attn: str = 'full', lavo_slots: int = 64, activation: str = 'gelu', distil: bool = True,
                 mix: bool = False, memory_pos: str = 'none') -> None:
        super().__init__()
        if memory_pos not in MEMORY_POS:
            raise ValueError(f'memory_pos must be one of {MEMORY_POS}, got {memory_pos!r}')
        if memory_pos == 'rotary' and d_model % 2:
            raise ValueError(f"memory_pos='rotary' needs an even d_model, got {d_model}")
        self.memory_pos = memory_pos
        if cross_attn not in CROSS_ATTENTIONS:
            raise ValueError(f'cross_attn must be one of {CROSS_ATTENTIONS}, got {cross_attn!r}')
        if not 0 <= label_len <= seq_len or pred_len < 1:
            raise ValueError('need 0 <= label_len <= seq_len and pred_len >= 1, '
                             f'got {seq_len}, {label_len}, {pred_len}')
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len
        self.attn, self.cross_attn = attn, cross_attn
        self.enc_embedding = DataEmbedding(enc_in, d_model, mark_dim, dropout)
        self.dec_embedding = DataEmbedding(dec_in, d_model, mark_dim, dropout)
        depths = [e_layers] if isinstance(e_layers, int) else list(e_layers)
        if not depths or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in depths):
            raise ValueError(f'e_layers must be a positive int or a non-empty list of them, got {e_layers!r}')
        if seq_len < 2 ** (len(depths) - 1):
            raise ValueError(f'an encoder stack of {len(depths)} needs seq_len >= {2 ** (len(depths) - 1)}, '
                             f'got {seq_len}')

        def encoder(depth: int) -> Encoder:
            return Encoder(
                [EncoderLayer(AttentionLayer(_attention(attn, False, factor, dropout), d_model, n_heads), d_model,
                              d_ff, dropout, activation) for _ in range(depth)],
                [DistilConv(d_model) for _ in range(depth - 1)] if distil else None, d_model)

        self.encoder = encoder(e_layers) if isinstance(e_layers, int) else EncoderStack([encoder(n) for n in depths])

        def cross() -> nn.Module:
            if cross_attn == 'lavo':
                return LavoCrossAttentionLayer(d_model, n_heads, min(lavo_slots, d_model // n_heads))
            return AttentionLayer(FullAttention(False, factor, attention_dropout=dropout), d_model, n_heads)

        self.decoder = Decoder(
            [DecoderLayer(AttentionLayer(_attention(attn, True, factor, dropout), d_model, n_heads, mix=mix), cross(),
                          d_model, d_ff, dropout, activation) for _ in range(d_layers)], d_model, c_out)

    def cross_memory(self, memory: Tensor) -> Tensor:
        """The encoder output (B, n, d_model) as the decoder's cross-attention reads it (``memory_pos``)."""
        if self.memory_pos == 'rotary':
            n = memory.shape[1]
            index = torch.arange(n, device=memory.device, dtype=torch.float64)[:, None]  # exact under autocast
            memory = rotate_by_coords(memory, index, min_freq=math.pi / (4 * n))
        return memory

    def forward(self, x_enc: Tensor, x_mark_enc: Tensor, x_dec: Tensor, x_mark_dec: Tensor) -> Tensor:
        memory = self.cross_memory(self.encoder(self.enc_embedding(x_enc, x_mark_enc)))
        out = self.decoder(self.dec_embedding(x_dec, x_mark_dec), memory)
        return out[:, -self.pred_len:]


class LinearForecaster(nn.Module):
    """One linear map over time, ``seq_len -> pred_len``, shared by every channel (DLinear-style baseline).

    Takes Informer's data arguments so the same factory call builds either; the time features and the
    decoder input are ignored. With ``c_out < enc_in`` (``MS``) the last ``c_out`` channels are returned.
    """

    def __init__(self, enc_in: int, c_out: int, seq_len: int, pred_len: int, dec_in: Optional[int] = None,
                 label_len: int = 0, mark_dim: int = 0) -> None:
        super().__init__()
        self.c_out, self.pred_len = c_out, pred_len
        self.linear = nn.Linear(seq_len, pred_len)

    def forward(self, x_enc: Tensor, x_mark_enc: Optional[Tensor] = None, x_dec: Optional[Tensor] = None,
                x_mark_dec: Optional[Tensor] = None) -> Tensor:
        return self.linear(x_enc.transpose(1, 2)).transpose(1, 2)[..., -self.c_out:]


# ------------------------------------------------------------------------------------------ registry

FORECAST_MODELS: Dict[str, Dict[str, Any]] = {
    # Informer2020's defaults (main_informer.py), its head-mixing decoder self-attention (mix=True) included
    'informer': dict(cls=Informer, d_model=512, n_heads=8, e_layers=2, d_layers=1, d_ff=2048, factor=5,
                     dropout=0.05, mix=True),
    # a CPU-sized Informer: same structure, narrower, no dropout (a short run; dropout doubles its CPU time)
    'informer_cpu': dict(cls=Informer, d_model=64, n_heads=4, e_layers=2, d_layers=1, d_ff=128, factor=5,
                         dropout=0.0, lavo_slots=16),
    # a mid-size Informer for a CPU reproduction of the published ETTh1 figures: a quarter of the width,
    # Informer2020's dropout 0.05 and its head-mixing decoder self-attention (mix=True, as main_informer.py)
    'informer_mid': dict(cls=Informer, d_model=128, n_heads=8, e_layers=2, d_layers=1, d_ff=512, factor=5,
                         dropout=0.05, lavo_slots=16, mix=True),
    # Informer2020's `informerstack` (main_informer.py defaults: s_layers 3,2,1; d_layers 1; the rest as 'informer'),
    # which Informer2020's issue #212 reports needing for ETTh1's long horizons
    'informerstack': dict(cls=Informer, d_model=512, n_heads=8, e_layers=[3, 2, 1], d_layers=1, d_ff=2048, factor=5,
                          dropout=0.05, mix=True),
    'linear': dict(cls=LinearForecaster),
}


def forecast_model_names() -> List[str]:
    return sorted(FORECAST_MODELS)


def create_forecast_model(name: str, **overrides: Any) -> nn.Module:
    """Build a registered forecaster, e.g. ``create_forecast_model('informer_cpu', enc_in=7, dec_in=7, c_out=7,
    seq_len=96, label_len=48, pred_len=24, cross_attn='lavo')``.

    Raises:
        ValueError: Unknown name, or an override the model does not take (for ``linear``, the Informer-only
            arguments such as ``cross_attn`` are dropped, so one call builds every model of a comparison).
    """
    if name not in FORECAST_MODELS:
        raise ValueError(f'unknown forecast model {name!r}; choose from {forecast_model_names()}')
    config = dict(FORECAST_MODELS[name])
    cls = config.pop('cls')
    accepted = set(inspect.signature(cls.__init__).parameters) - {'self'}
    kwargs = {**config, **overrides}
    unknown = sorted(set(kwargs) - accepted)
    informer_only = set(inspect.signature(Informer.__init__).parameters)
    if cls is LinearForecaster:
        unknown = [k for k in unknown if k not in informer_only]
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    if unknown:
        raise ValueError(f'{name}: unknown argument(s) {unknown}; accepted: {sorted(accepted)}')
    return cls(**kwargs)
