"""Decoder-only byte-level language model whose attention is chosen by name.

Attention types (``ATTENTIONS``), all causal and all without a maximum length:

  ``goat``   GOAT 1D causal prior (paper 000, Eqs. 11-22): relative Fourier modes plus the key default
             u_h(j) = lambda_h j + b_h 1{j = 0}; the key-linear recency term lambda_h j (Sec. 4 / App. G.3)
             is on by default, as in the paper's Eq. 21, parametrised and started as in the authors' code
             (lambda_h = softplus(rho_h), ALiBi's slopes at the start); the absolute-position MLP g_h of
             Eq. 21 is off by default, as in the ViTs (``LM_GOAT_DEFAULTS``; README, Language).
  ``pope``   PoPE (paper 004, Eqs. 3-6): softplus magnitudes, phases carry position, learned delta.
  ``lavo``   LAVO causal (paper 002, Eq. 4): local window + orthogonal-memory global branch; decodes
             with a fixed-size ``LavoState``.
  ``rope``   rotary embedding (Su et al.) via timm's ``apply_rot_embed_cat``.
  ``alibi``  ALiBi (Press et al.): bias -m_h (i - j), geometric slopes.
  ``nope``   no positional signal (causal masking only).

Decoding state: the softmax types keep per layer the keys and values of every earlier token (GOAT's
keys carry their positional coordinates k_pos(p_j) with them, PoPE's their phase-rotated magnitudes);
LAVO keeps its O(1) ``LavoState``. ``LanguageModel.forward(tokens, past, use_cache)`` continues a
sequence from ``past``; ``generate`` is greedy or sampled, and its logits equal a full forward pass.

Ablation switches (papers' tables): GOAT ``goat_relative='full' | 'symmetric' | 'none'`` (cosine terms
only: beta fixed at 0; key default only: alpha = beta = 0), ``goat_modes`` (R), ``goat_key_linear``;
PoPE ``pope_magnitude='softplus' | 'relu' | 'identity'`` and ``pope_learn_delta`` (Table 5); LAVO
``lavo_epe`` and ``lavo_context_dissection``.
"""
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from timm.layers import Mlp, trunc_normal_
from timm.layers.pos_embed_sincos import apply_rot_embed_cat

from vision_priors.layers.coords import sequence_coords
from vision_priors.layers.goat import GoatAttention
from vision_priors.layers.lavo import LavoAttention, LavoState
from vision_priors.layers.pope import PopeAttention, phase_table, pope_features

__all__ = ['ATTENTIONS', 'LM_GOAT_DEFAULTS', 'LanguageModel', 'create_language_model', 'rope_table',
           'language_model_defaults', 'resolve_goat_kwargs']

ATTENTIONS = ('goat', 'pope', 'lavo', 'rope', 'alibi', 'nope')
GOAT_RELATIVE = ('full', 'symmetric', 'none')
POPE_MAGNITUDES = ('softplus', 'relu', 'identity')
WEIGHT_INITS = ('fan_in', 'gpt2')
# GoatPrior options of the LM's GOAT unless ``goat_kwargs`` sets them (README, Language: "GOAT's key default"):
# the authors' slope (elonlit/goat: lambda_h = softplus(rho_h), ALiBi's slopes at the start), and no MLP g_h on
# absolute positions: its inputs leave their trained range past the training length, as in the ViTs
LM_GOAT_DEFAULTS: Dict[str, Any] = dict(key_slope_param='softplus', prior_init='alibi', key_mlp_hidden=0)


def resolve_goat_kwargs(goat_kwargs: Optional[Dict[str, Any]], key_linear: bool = True) -> Dict[str, Any]:
    """The LM's GOAT options: ``LM_GOAT_DEFAULTS`` under the given ones. Without the key-linear term the start
    is 'zero' (a 1D 'alibi' start without slopes would be a cosine fit over 512 positions)."""
    defaults = dict(LM_GOAT_DEFAULTS) if key_linear else dict(LM_GOAT_DEFAULTS, prior_init='zero')
    return dict(defaults, **(goat_kwargs or {}))

KeyValues = Tuple[Tensor, Tensor]  # cached (keys, values) of one softmax layer: (B, H, T, d_k), (B, H, T, d_v)


def rope_table(positions: Tensor, head_dim: int, theta: float = 10000.0, dtype: torch.dtype = torch.float32) -> Tensor:
    """RoPE sin/cos table for ``apply_rot_embed_cat``: (N, 2 d_h) = [sin, cos], each pair of channels
    (2c, 2c + 1) rotated by positions * theta^(-2c / d_h); angles in float64, the table in ``dtype``."""
    if head_dim % 2:
        raise ValueError(f'RoPE needs an even head dim, got {head_dim}')
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angle = positions.to(torch.float64)[:, None] * freqs[None]
    angle = angle.repeat_interleave(2, dim=-1)
    return torch.cat([angle.sin(), angle.cos()], dim=-1).to(dtype)


class SoftmaxCausalAttention(nn.Module):
    """Causal softmax attention of one of goat / pope / rope / alibi / nope, with a key/value cache.

    Every type maps its tokens to widened queries / keys whose plain dot product is the full logit (scale
    and positional prior included), so one ``F.scaled_dot_product_attention`` call with ``scale=1`` serves
    the whole sequence and the cached continuation alike. GOAT and PoPE reuse their layers' projections,
    prior and phases (``GoatAttention``, ``PopeAttention``); a full sequence without a cache runs the
    layer's own forward (its fused kernels on GPU) where the configuration is the layer's.
    """

    def __init__(self, attn: str, dim: int, num_heads: int, qkv_bias: bool = False, goat_modes: int = 4,
                 goat_relative: str = 'full', goat_key_linear: bool = True,
                 goat_kwargs: Optional[Dict[str, Any]] = None, pope_magnitude: str = 'softplus',
                 pope_learn_delta: bool = True, rope_theta: float = 10000.0) -> None:
        super().__init__()
        if goat_relative not in GOAT_RELATIVE:
            raise ValueError(f'goat_relative must be one of {GOAT_RELATIVE}, got {goat_relative!r}')
        if pope_magnitude not in POPE_MAGNITUDES:
            raise ValueError(f'pope_magnitude must be one of {POPE_MAGNITUDES}, got {pope_magnitude!r}')
        self.attn = attn
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.goat_relative = goat_relative
        self.pope_magnitude = pope_magnitude
        self.rope_theta = rope_theta
        if attn == 'goat':
            self.layer = GoatAttention(dim, num_heads=num_heads, num_spatial_dims=1, num_modes=goat_modes,
                                       qkv_bias=qkv_bias, key_linear=goat_key_linear,
                                       **resolve_goat_kwargs(goat_kwargs, goat_key_linear))
            self.freeze_relative_terms()
        elif attn == 'pope':
            self.layer = PopeAttention(dim, num_heads=num_heads, num_spatial_dims=1, qkv_bias=qkv_bias,
                                       learn_bias=pope_learn_delta)
        elif attn in ('rope', 'alibi', 'nope'):
            if attn == 'rope' and self.head_dim % 2:
                raise ValueError(f'rope needs an even head dim, got {self.head_dim} (dim {dim} / {num_heads} heads)')
            self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
            self.proj = nn.Linear(dim, dim)
            if attn == 'alibi':
                # ALiBi's geometric slopes m_h = 2^(-8 (h + 1) / H), in float64 (goat.alibi_slopes is float32)
                slopes = torch.exp2(-8.0 * torch.arange(1, num_heads + 1, dtype=torch.float64) / num_heads)
                self.register_buffer('slopes', slopes, persistent=False)
        else:
            raise ValueError(f'unknown softmax attention {attn!r}')

    def freeze_relative_terms(self) -> None:
        """GOAT ablations: 'symmetric' fixes beta = 0 (cosine terms only), 'none' fixes alpha = beta = 0
        (key default only); the fixed coefficients are zeroed and get no gradient."""
        prior = self.layer.prior
        frozen = {'full': (), 'symmetric': (prior.beta,), 'none': (prior.alpha, prior.beta)}[self.goat_relative]
        for p in frozen:
            with torch.no_grad():
                p.zero_()
            p.requires_grad_(False)

    @property
    def uses_layer_forward(self) -> bool:
        """Whether a full sequence without cache runs the layer's own forward (same logits, fused kernels)."""
        return self.attn == 'goat' or (self.attn == 'pope' and self.pope_magnitude == 'softplus')

    def output(self, out: Tensor) -> Tensor:
        B, H, N, d = out.shape
        proj = self.layer.proj if hasattr(self, 'layer') else self.proj
        return proj(out.transpose(1, 2).reshape(B, N, H * d))

    def project(self, x: Tensor, start: int) -> Tuple[Tensor, Tensor, Tensor]:
        """(q', k', v) of the tokens at positions start.. start + N - 1; q'.k' is the full logit."""
        B, N, C = x.shape
        H, dh = self.num_heads, self.head_dim
        if self.attn == 'goat':
            layer = self.layer
            dc = layer.content_dim
            q, k, v = layer.qkv(x).split([H * dc, H * dc, H * dh], dim=-1)
            q = layer.q_norm(q.reshape(B, N, H, dc).transpose(1, 2))
            k = layer.k_norm(k.reshape(B, N, H, dc).transpose(1, 2))
            v = v.reshape(B, N, H, dh).transpose(1, 2)
            coords = sequence_coords(N, offset=start, device=x.device, dtype=layer.prior.alpha.dtype)
            q_pos, k_pos = layer.prior.qk_coordinates(coords)  # (H, N, d_p): the cached keys keep k_pos(p_j)
            q = torch.cat([q * layer.content_scale, q_pos.to(q.dtype).expand(B, -1, -1, -1)], dim=-1)
            k = torch.cat([k, k_pos.to(k.dtype).expand(B, -1, -1, -1)], dim=-1)
            return q, k, v
        if self.attn == 'pope':
            layer = self.layer
            q, k, v = layer.qkv(x).reshape(B, N, 3, H, dh).permute(2, 0, 3, 1, 4).unbind(0)
            q, k = layer.q_norm(q), layer.k_norm(k)
            coords = sequence_coords(N, offset=start, device=x.device, dtype=layer.phases.phase_bias_raw.dtype)
            q_phase, k_phase = layer.phases.phases(coords)
            magnitude = {'softplus': F.softplus, 'relu': F.relu, 'identity': lambda t: t}[self.pope_magnitude]
            q = pope_features(magnitude(q), phase_table(q_phase, layer.scale).to(q.dtype))
            k = pope_features(magnitude(k), phase_table(k_phase).to(k.dtype))
            return q, k, v
        q, k, v = self.qkv(x).reshape(B, N, 3, H, dh).permute(2, 0, 3, 1, 4).unbind(0)
        if self.attn == 'rope':
            table = rope_table(torch.arange(start, start + N, device=x.device), dh, self.rope_theta,
                               torch.promote_types(q.dtype, torch.float32))
            q, k = apply_rot_embed_cat(q, table), apply_rot_embed_cat(k, table)
        return q * dh ** -0.5, k, v

    def attention_weights(self, x: Tensor) -> Tensor:
        """(B, H, N, N) causal softmax probabilities (float32 or wider) that a full-sequence forward of the
        (B, N, C) tokens ``x`` applies to its values: the widened queries / keys of ``project`` (plus ALiBi's
        bias), for analysis; ``output(weights @ v)`` is this layer's forward."""
        q, k, _ = self.project(x, 0)
        logits = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32))
        positions = torch.arange(x.shape[1], device=x.device)
        if self.attn == 'alibi':
            logits = logits - self.slopes.to(logits.dtype)[:, None, None] * (positions[:, None] - positions[None])
        return logits.masked_fill(positions[None] > positions[:, None], float('-inf')).softmax(-1)

    def forward(self, x: Tensor, past: Optional[KeyValues] = None, use_cache: bool = False
                ) -> Tuple[Tensor, Optional[KeyValues]]:
        """Attend (B, N, C) tokens that follow the ``past`` tokens (keys / values of positions 0..T-1)."""
        N = x.shape[1]
        if past is None and not use_cache and self.uses_layer_forward:
            return self.layer(x, is_causal=True), None
        start = 0 if past is None else past[0].shape[2]
        q, k, v = self.project(x, start)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        total = start + N
        mask: Optional[Tensor] = None
        is_causal = False
        if self.attn == 'alibi':
            query_pos = torch.arange(start, total, device=x.device)[:, None]
            key_pos = torch.arange(total, device=x.device)[None]
            bias = -self.slopes.to(q.dtype)[:, None, None] * (query_pos - key_pos).to(q.dtype)  # (H, N, T)
            mask = bias.masked_fill(key_pos > query_pos, float('-inf'))
        elif start == 0:
            is_causal = N > 1
        elif N > 1:  # query i (absolute start + i) sees keys 0..start + i
            mask = torch.ones(N, total, dtype=torch.bool, device=x.device).tril(start)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=1.0)
        return self.output(out), ((k, v) if use_cache else None)


class LavoCausalAttention(nn.Module):
    """Causal ``LavoAttention`` with its fixed-size decoding state (``prefill`` then ``step``)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False, lavo_window: int = 32,
                 lavo_slots: int = 16, lavo_epe: bool = True, lavo_context_dissection: bool = True) -> None:
        super().__init__()
        self.layer = LavoAttention(dim, num_heads=num_heads, num_slots=lavo_slots, window=lavo_window, causal=True,
                                   num_spatial_dims=1, use_epe=lavo_epe, context_dissection=lavo_context_dissection,
                                   qkv_bias=qkv_bias)

    def forward(self, x: Tensor, past: Optional[LavoState] = None, use_cache: bool = False
                ) -> Tuple[Tensor, Optional[LavoState]]:
        if past is None:
            if not use_cache:
                return self.layer(x), None
            return self.layer.prefill(x)
        outs = []
        state = past
        for t in range(x.shape[1]):
            y, state = self.layer.step(x[:, t:t + 1], state)
            outs.append(y)
        return torch.cat(outs, dim=1), state


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=nn.GELU)

    def forward(self, x: Tensor, past: Any = None, use_cache: bool = False) -> Tuple[Tensor, Any]:
        y, present = self.attn(self.norm1(x), past, use_cache)
        x = x + y
        return x + self.mlp(self.norm2(x)), present


class LanguageModel(nn.Module):
    """Decoder-only transformer over byte tokens (pre-norm, optional tied embeddings, no position table).

    Args:
        attn: One of ``ATTENTIONS``.
        vocab_size: Token vocabulary (256 for bytes).
        dim, depth, num_heads, mlp_ratio: Width, blocks, heads, MLP width ratio.
        tie_embeddings: The output head reuses the token embedding matrix.
        max_length: Optional hard limit on the positions a forward may reach (None: no limit; none of
            the attention types has an inherent one). Going past it is an error naming the limit.
        qkv_bias: Bias in the q/k/v projections.
        goat_modes, goat_relative, goat_key_linear, goat_kwargs: GOAT's R, relative-term ablation, key-linear
            recency term (paper default on) and further ``GoatPrior`` options (prior_init, learn_freqs,
            key_slope_param, key_mlp_hidden, ...) over ``LM_GOAT_DEFAULTS``.
        pope_magnitude, pope_learn_delta: PoPE's magnitude function and learned phase bias (Table 5).
        lavo_window, lavo_slots, lavo_epe, lavo_context_dissection: LAVO's w, r, EPE and CD switches.
        rope_theta: RoPE frequency base.
        weight_init: ``'fan_in'`` (default): every Linear weight ~ N(0, 1 / fan_in) and the token embedding
            ~ N(0, 1) (N(0, 1 / dim) when tied, so the head keeps its fan-in scale); ``'gpt2'``: every weight
            N(0, 0.02^2), truncated. At small widths GPT-2's 0.02 leaves the attention logits near zero, and a
            2-block model at width 64 forms no induction head in thousands of updates (README, Language:
            "Initialisation").
    """

    def __init__(
            self,
            attn: str = 'goat',
            vocab_size: int = 256,
            dim: int = 128,
            depth: int = 4,
            num_heads: int = 4,
            mlp_ratio: float = 4.0,
            tie_embeddings: bool = False,
            max_length: Optional[int] = None,
            qkv_bias: bool = False,
            goat_modes: int = 4,
            goat_relative: str = 'full',
            goat_key_linear: bool = True,
            goat_kwargs: Optional[Dict[str, Any]] = None,
            pope_magnitude: str = 'softplus',
            pope_learn_delta: bool = True,
            lavo_window: int = 32,
            lavo_slots: int = 16,
            lavo_epe: bool = True,
            lavo_context_dissection: bool = True,
            rope_theta: float = 10000.0,
            weight_init: str = 'fan_in',
    ) -> None:
        super().__init__()
        if attn not in ATTENTIONS:
            raise ValueError(f'attn must be one of {ATTENTIONS}, got {attn!r}')
        if weight_init not in WEIGHT_INITS:
            raise ValueError(f'weight_init must be one of {WEIGHT_INITS}, got {weight_init!r}')
        if dim % num_heads:
            raise ValueError(f'dim ({dim}) must be divisible by num_heads ({num_heads})')
        if max_length is not None and max_length < 1:
            raise ValueError(f'max_length must be None or >= 1, got {max_length}')
        self.attn = attn
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.embed = nn.Embedding(vocab_size, dim)

        def make_attention() -> nn.Module:
            if attn == 'lavo':
                return LavoCausalAttention(dim, num_heads, qkv_bias, lavo_window, lavo_slots, lavo_epe,
                                           lavo_context_dissection)
            return SoftmaxCausalAttention(attn, dim, num_heads, qkv_bias, goat_modes, goat_relative, goat_key_linear,
                                          goat_kwargs, pope_magnitude, pope_learn_delta, rope_theta)

        self.blocks = nn.ModuleList([Block(dim, make_attention(), mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = None if tie_embeddings else nn.Linear(dim, vocab_size, bias=False)
        self.weight_init = weight_init
        self.init_weights()

    def init_weights(self) -> None:
        """Linear / Embedding weights as ``weight_init`` says, zero biases; positional parameters keep their
        layers' own init (GOAT prior, PoPE delta, LAVO bias)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if self.weight_init == 'gpt2':
                    trunc_normal_(module.weight, std=0.02)
                elif isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=module.in_features ** -0.5)
                else:
                    nn.init.normal_(module.weight, std=1.0 if self.head is not None else module.embedding_dim ** -0.5)
                if getattr(module, 'bias', None) is not None:
                    nn.init.zeros_(module.bias)
        for block in self.blocks:
            layer = getattr(block.attn, 'layer', None)
            if isinstance(layer, GoatAttention):
                layer.prior.reset_parameters()
                block.attn.freeze_relative_terms()

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Positional parameters (GOAT prior, PoPE delta, LAVO relative bias) get no weight decay."""
        return {n for n, _ in self.named_parameters() if '.prior.' in n or '.phases.' in n or n.endswith('rel_bias')}

    def past_length(self, past: Optional[List[Any]]) -> int:
        """Tokens already held by ``past`` (0 for None)."""
        if past is None:
            return 0
        first = past[0]
        return int(first.count[0]) if isinstance(first, LavoState) else first[0].shape[2]

    def forward(self, tokens: Tensor, past: Optional[List[Any]] = None, use_cache: bool = False):
        """Next-token logits (B, N, vocab) for ``tokens`` (B, N) that follow ``past``.

        Returns the logits, or ``(logits, present)`` with ``use_cache=True``: ``present`` (one entry per
        block: cached keys / values, or a ``LavoState``) continues the sequence in the next call.
        """
        if tokens.dim() != 2 or tokens.shape[1] < 1:
            raise ValueError(f'tokens must be (batch, length >= 1) integer ids, got shape {tuple(tokens.shape)}')
        end = self.past_length(past) + tokens.shape[1]
        if self.max_length is not None and end > self.max_length:
            raise ValueError(f'{self.attn} language model was built with max_length={self.max_length}; '
                             f'this call reaches position {end}')
        x = self.embed(tokens)
        present = []
        for i, block in enumerate(self.blocks):
            x, p = block(x, None if past is None else past[i], use_cache)
            present.append(p)
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight) if self.head is None else self.head(x)
        return (logits, present) if use_cache else logits

    @torch.no_grad()
    def attention_maps(self, tokens: Tensor) -> List[Optional[Tensor]]:
        """Per block, the (B, H, N, N) attention probabilities of a full forward of ``tokens`` (B, N)
        (``SoftmaxCausalAttention.attention_weights``); None for LAVO, whose global branch has no such matrix."""
        x, maps = self.embed(tokens), []
        for block in self.blocks:
            attn = block.attn
            maps.append(attn.attention_weights(block.norm1(x)) if isinstance(attn, SoftmaxCausalAttention) else None)
            x, _ = block(x)
        return maps

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, return_logits: bool = False):
        """Continue ``prompt`` (B, N) by ``max_new_tokens`` tokens, one forward of one token per step.

        ``temperature`` 0 is greedy; otherwise tokens are sampled from softmax(logits / temperature),
        restricted to the ``top_k`` best when given. Returns the (B, N + new) tokens, and with
        ``return_logits`` also the (B, new, vocab) logits each new token was chosen from.
        """
        if max_new_tokens < 0:
            raise ValueError(f'max_new_tokens must be >= 0, got {max_new_tokens}')
        if temperature < 0:
            raise ValueError(f'temperature must be >= 0, got {temperature}')
        tokens = prompt
        chosen_from = []
        logits, past = self(prompt, use_cache=True)
        for step in range(max_new_tokens):
            last = logits[:, -1]
            chosen_from.append(last)
            if temperature == 0:
                nxt = last.argmax(-1, keepdim=True)
            else:
                scaled = last.float() / temperature
                if top_k is not None:
                    kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
                    scaled = scaled.masked_fill(scaled < kth, float('-inf'))
                nxt = torch.multinomial(scaled.softmax(-1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
            if step + 1 < max_new_tokens:
                logits, past = self(nxt, past, use_cache=True)
        if return_logits:
            empty = logits.new_zeros(prompt.shape[0], 0, self.vocab_size)
            return tokens, torch.stack(chosen_from, dim=1) if chosen_from else empty
        return tokens


def language_model_defaults() -> Dict[str, Any]:
    """The factory's default configuration (a CPU-sized model; override any key)."""
    return dict(vocab_size=256, dim=128, depth=4, num_heads=4, mlp_ratio=4.0, tie_embeddings=False)


def create_language_model(attn: str, **overrides: Any) -> LanguageModel:
    """Build the language model with attention ``attn`` (one of ``ATTENTIONS``) and constructor overrides."""
    if attn not in ATTENTIONS:
        raise ValueError(f'unknown attention {attn!r}; choose one of {", ".join(ATTENTIONS)}')
    return LanguageModel(attn, **dict(language_model_defaults(), **overrides))
