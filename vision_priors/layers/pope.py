"""PoPE attention: content in softplus magnitudes, position in phases, a learned phase bias.

Paper: Gopalakrishnan et al., "Decoupling the 'What' and 'Where' with Polar Coordinate Positional
Embedding" (PoPE), Sec. 3, Eqs. 3-6:

    q~_tc = softplus(q_tc) e^{i t w_c},   k~_sc = softplus(k_sc) e^{i (s w_c + delta_c)}
    a_ts  = Re sum_c q~_tc conj(k~_sc) = sum_c softplus(q_tc) softplus(k_sc) cos((s - t) w_c + delta_c)

with d frequencies w_c = theta^{-(c-1)/d} (the authors' code; the v3 PDF prints the exponent without
its minus sign) and delta_c learned per head and channel, zero-initialised, in [-2 pi, 0].

Real-valued fast path (Eq. 10): q_real = softplus(q) [cos(t w), sin(t w)] and
k_real = softplus(k) [cos(s w + delta), sin(s w + delta)] have width 2d and their dot product is
a_ts, so ONE ``F.scaled_dot_product_attention`` call (q/k width 2d, v width d) is exact.
"""
import math
from typing import Optional, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.jit import Final

from timm.layers.attention import resolve_self_attn_mask

from vision_priors.kernels._backend import check_key_mask, requested_backend
from vision_priors.kernels.pope_cpu import DEFAULT_LOGITS_BYTES, compiled_op_isa, pope_cpu_attention

from .coords import check_mask_args, resolve_token_coords
from .kernel_dispatch import (check_kernel_backend, kernel_key_mask, key_mask_to_attn_mask, tracing_or_compiling,
                              use_flash_kernel)

# leaf calls under torch.fx symbolic tracing: they run on concrete values, checks included
torch.fx.wrap('check_mask_args')
torch.fx.wrap('resolve_token_coords')

__all__ = ['PopePhases', 'PopeAttention', 'wrap_phase_bias', 'pope_cpu_inference_attention',
           'cpu_inference_attention', 'compiled_op_is_faster_here', 'use_compiled_cpu_op']


def wrap_phase_bias(raw: Tensor) -> Tensor:
    """Map the unconstrained phase bias into (-2 pi, 0] by wrapping, ``delta = -((-raw) mod 2 pi)``.

    cos is 2 pi periodic, so the wrapped value gives exactly the same scores as ``raw``; the map has
    derivative 1 everywhere, so (unlike a clamp) the gradient never freezes at the bounds.
    """
    return -torch.remainder(-raw, 2 * math.pi)


class PopePhases(nn.Module):
    """Fixed PoPE frequencies and the learned per-head phase bias delta (Eqs. 4-6).

    In 1D channel c rotates with phase t w_c over the d channels. In 2D the channels are split in
    two contiguous halves: the first half rotates with x, the second with y, each half with its own
    full ladder w_c = theta^{-c / (d/2)}. Prefix tokens (class, register) are not rotated: phase 0
    and no delta (like timm's RoPE ViTs leave prefix tokens unrotated), so a prefix token's score
    with a positioned token depends on that token's phase only, not on a relative offset.

    Args:
        num_heads: Heads H.
        head_dim: Real content channels d per head (complex width d, real width 2d).
        num_spatial_dims: 1 or 2 (2 needs an even head_dim).
        freq_base: theta; default 10000 (1D) or 100 (2D).
        learn_bias: Learn delta (the paper's full PoPE); False gives the 'No learned delta' ablation.
        num_prefix_tokens: Leading tokens without coordinates.
    """

    def __init__(
            self,
            num_heads: int,
            head_dim: int,
            num_spatial_dims: int = 1,
            freq_base: Optional[float] = None,
            learn_bias: bool = True,
            num_prefix_tokens: int = 0,
    ) -> None:
        super().__init__()
        if num_spatial_dims not in (1, 2):
            raise ValueError(f'num_spatial_dims must be 1 or 2, got {num_spatial_dims}')
        if num_spatial_dims == 2 and head_dim % 2:
            raise ValueError(f'2D PoPE splits the head dim between x and y; head dim {head_dim} is odd')
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_spatial_dims = num_spatial_dims
        self.num_prefix_tokens = num_prefix_tokens
        base = float(freq_base if freq_base is not None else (10000.0 if num_spatial_dims == 1 else 100.0))
        self.freq_base = base
        self.per_axis = head_dim // num_spatial_dims
        if learn_bias:
            self.phase_bias_raw = nn.Parameter(torch.zeros(num_heads, head_dim))
        else:
            self.register_buffer('phase_bias_raw', torch.zeros(num_heads, head_dim), persistent=False)

    @property
    def phase_bias(self) -> Tensor:
        """delta in (-2 pi, 0]: (H, d)."""
        return wrap_phase_bias(self.phase_bias_raw)

    def phases(self, coords: Tensor) -> Tuple[Tensor, Tensor]:
        """Query and key phases of all tokens, prefix tokens first.

        Args:
            coords: (M, D) coordinates of the non-prefix tokens shared by the batch, or (B, M, D) per sample.

        Returns:
            (q_phase (1, N, d), k_phase (H, N, d)): t w_c and s w_c + delta_c; with per-sample coords
            (B, 1, N, d) and (B, H, N, d).
        """
        # channel block a rotates with axis a; w_c = theta^(-c / per_axis) within each block
        exponents = torch.arange(self.per_axis, dtype=coords.dtype, device=coords.device) / self.per_axis
        ladder = torch.pow(self.freq_base, -exponents)  # (per_axis,)
        pos_phase = (coords.unsqueeze(-1) * ladder).flatten(-2)  # (..., M, D * per_axis) = (..., M, d)
        if self.num_prefix_tokens:
            # prefix phases 0, built by broadcasting (no Python branch on the rank: torch.fx safe)
            pre = torch.zeros_like(pos_phase[..., :1, :]).repeat_interleave(self.num_prefix_tokens, dim=-2)
            pos_phase = torch.cat([pre, pos_phase], dim=-2)
        pos_phase = pos_phase.unsqueeze(-3)  # (..., 1, N, d)
        delta = wrap_phase_bias(self.phase_bias_raw).to(coords.dtype)[:, None, :]  # (H, 1, d)
        k_phase = pos_phase + delta  # (..., H, N, d)
        if self.num_prefix_tokens:
            k_phase = torch.cat([
                torch.zeros_like(k_phase[..., :self.num_prefix_tokens, :]),
                k_phase[..., self.num_prefix_tokens:, :],
            ], dim=-2)
        return pos_phase, k_phase


def phase_table(phase: Tensor, scale: float = 1.0) -> Tensor:
    """[cos(phase), sin(phase)] * scale stacked as (..., 2, d), computed once per forward for the batch."""
    return torch.stack([phase.cos(), phase.sin()], dim=-2) * scale


def pope_features(magnitude: Tensor, table: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """Real-valued PoPE features [m cos(phase), m sin(phase)] of width 2d (Eq. 10), in one pass.

    ``out``: optional (..., N, 2, d) buffer to write into (the CPU inference path reuses one).
    """
    if out is None:
        return (magnitude.unsqueeze(-2) * table).flatten(-2)
    return torch.mul(magnitude.unsqueeze(-2), table, out=out).flatten(-2)


# logits kept per matmul on the CPU inference paths (torch ops and the compiled op): about one core's L2
CPU_LOGITS_BYTES = DEFAULT_LOGITS_BYTES
# CPU training: up to this many bytes of float32 (N, N) logits per head the explicit softmax path (values of width d)
# beats SDPA's flash kernel, which needs the values widened to 2d. Measured forward + backward of one ViT-S layer's
# attention (batch 8, 6 heads, 1 thread): 197 tokens 36 vs 54 ms; 577 tokens level (448-462 vs 415-437 ms); 2,305
# tokens flash ahead (1.23 vs 1.58 s). 512 KiB = up to 362 tokens.
CPU_DENSE_TRAIN_LOGITS_BYTES = 2 ** 19


@torch.jit.unused
def use_cpu_inference_attention(x: Tensor, attn_mask: Optional[Tensor], is_causal: bool, dropout_active: bool) -> bool:
    """Whether ``cpu_inference_attention`` (compiled op or its torch-op twin) serves this call: CPU tensors,
    autograd off, no mask, no causal masking, no attention dropout, outside fx tracing and torch.compile."""
    if tracing_or_compiling():
        return False
    return (x.device.type == 'cpu' and attn_mask is None and not is_causal and not dropout_active
            and not torch.is_grad_enabled())


@torch.jit.unused
def use_dense_cpu_training(x: Tensor, num_tokens: int) -> bool:
    """Whether a CPU call with autograd on takes the explicit softmax path instead of SDPA: short sequences
    only (``CPU_DENSE_TRAIN_LOGITS_BYTES``), outside fx tracing and torch.compile."""
    if tracing_or_compiling():
        return False
    return (x.device.type == 'cpu' and torch.is_grad_enabled()
            and num_tokens * num_tokens * 4 <= CPU_DENSE_TRAIN_LOGITS_BYTES)


@torch.jit.unused
def softplus_into(x: Tensor, out: Tensor, scratch: Tensor) -> Tensor:
    """softplus(x) = max(x, 0) + log(1 + exp(-|x|)) written into ``out`` (``scratch``: same shape).

    Overflow-free and within one unit in the last place of 1 of ``F.softplus`` (absolute), and about
    three times faster on CPU, where ATen's ``log1p`` (behind ``F.softplus``) is not vectorised.
    """
    torch.abs(x, out=scratch)
    scratch.neg_().exp_().add_(1.0).log_()
    torch.clamp_min(x, 0.0, out=out)
    return out.add_(scratch)


class _MagnitudeFeatures(torch.autograd.Function):
    """``softplus(x)[..., None, :] * table`` flattened to width 2d (Eqs. 3-4, 10), with a backward that never forms
    the (..., 2, d) products: ``d/dx = (g_cos table_cos + g_sin table_sin) sigmoid(x)`` (sigmoid is softplus's exact
    derivative) and ``d/dtable = g * softplus(x)`` summed to the table's shape. Twice differentiable (the backward
    is written in differentiable torch ops)."""

    @staticmethod
    def forward(ctx, x: Tensor, table: Tensor) -> Tensor:  # type: ignore[override]
        magnitude = F.softplus(x)
        ctx.save_for_backward(x, magnitude, table)
        # written into a contiguous (..., N, 2, d) buffer: x is usually a permuted view of the qkv projection, and
        # features in that layout would be copied by every matmul that reads them (forward and backward)
        shape = torch.broadcast_shapes(magnitude.unsqueeze(-2).shape, table.shape)
        out = torch.empty(shape, dtype=torch.result_type(magnitude, table), device=x.device)
        return pope_features(magnitude, table, out=out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor]]:  # type: ignore[override]
        x, magnitude, table = ctx.saved_tensors
        grad = grad.unflatten(-1, (2, x.shape[-1]))
        grad_x = grad_table = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.addcmul(grad[..., 0, :] * table[..., 0, :], grad[..., 1, :], table[..., 1, :])
            grad_x = grad_x * torch.sigmoid(x)
        if ctx.needs_input_grad[1]:
            weight = magnitude.unsqueeze(-2)
            if torch.is_grad_enabled():  # double backward: the saved magnitude is not connected to x, recompute it
                grad_table = (grad * F.softplus(x).unsqueeze(-2)).sum_to_size(table.shape)
            elif tuple(table.shape) == tuple(grad.shape[1:]):  # one table for the batch: sum sample by sample
                grad_table = grad[0] * weight[0]
                for b in range(1, grad.shape[0]):
                    grad_table.addcmul_(grad[b], weight[b])
            else:
                grad_table = (grad * weight).sum_to_size(table.shape)
        return grad_x, grad_table


class _DenseSoftmaxAttention(torch.autograd.Function):
    """``softmax(q k^T) v`` (the logit scale folded into q) with its backward written out in the layouts the next
    ops read: ``dv = P^T g``, ``dS = P (dP - rowsum(P dP))`` for ``dP = g v^T`` (one fused softmax backward), then
    ``dq = dS k`` and ``dk = dS^T q`` directly (autograd forms d(k^T) and copies its transpose). Once differentiable."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # type: ignore[override]
        v = v.contiguous()  # once, for the forward's and the backward's matmuls (v is often a view of qkv)
        probs = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        ctx.save_for_backward(q, k, v, probs)
        return probs @ v

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> Tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        q, k, v, probs = ctx.saved_tensors
        grad_v = probs.transpose(-2, -1) @ grad
        grad_s = torch._softmax_backward_data(grad @ v.transpose(-2, -1), probs, -1, probs.dtype)
        return grad_s @ k, grad_s.transpose(-2, -1) @ q, grad_v


@torch.jit.unused
def dense_softmax_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``softmax(q k^T) v`` for the CPU training path (no mask, no dropout): :class:`_DenseSoftmaxAttention`."""
    return _DenseSoftmaxAttention.apply(q, k, v)


@torch.jit.unused
def magnitude_features(x: Tensor, table: Tensor) -> Tensor:
    """PoPE's real features ``softplus(x) [cos, sin]`` of width 2d (Eqs. 3-4, 10) from the raw q or k (B, H, N, d) and
    a phase table (..., N, 2, d) (:func:`phase_table`); the fused autograd form when a gradient is needed (outside
    fx tracing and torch.compile), ``pope_features(F.softplus(x), table)`` otherwise."""
    if tracing_or_compiling() or not (torch.is_grad_enabled() and (x.requires_grad or table.requires_grad)):
        return pope_features(F.softplus(x), table)
    return _MagnitudeFeatures.apply(x, table)


@torch.jit.unused
def pope_cpu_inference_attention(q: Tensor, k: Tensor, v: Tensor, q_table: Tensor, k_table: Tensor) -> Tensor:
    """PoPE attention for CPU inference in torch ops, one sample's features and one head's logits at a time.

    The twin and reference of the compiled op ``kernels/pope_cpu.cpp`` (same signature), and what
    ``cpu_inference_attention`` runs where that op is not used (non-float32, backend 'torch', no build, or a
    CPU where the op's code is slower than this twin: ``COMPILED_OP_FASTER_ON``).

    CPU SDPA's fused kernel needs equal q / k / v widths, so the SDPA path pads v from d to 2d (and
    pays for it in the second matmul) and materialises the width-2d features of the whole batch. Here
    each sample's features (H, N, 2d) and each head's (N, N) logits are small enough to stay in cache,
    v keeps width d, and no batch-sized temporaries are allocated. Same result as the SDPA path.

    Args:
        q, k: (B, H, N, d) pre-softplus queries and keys.
        v: (B, H, N, d) values.
        q_table, k_table: ``phase_table`` outputs, (1 or H, N, 2, d) shared or (B, 1 or H, N, 2, d) per
            sample; the attention scale is folded into ``q_table``.

    Returns:
        (B, H, N, d), a view of a (B, N, H, d) tensor (so the output projection's reshape is free).
    """
    B, H, N, d = v.shape
    out = v.new_empty(B, N, H, d).transpose(1, 2)
    # as many heads per matmul as keep their (N, N) logits within CPU_LOGITS_BYTES (one head at least)
    step = max(1, min(H, CPU_LOGITS_BYTES // (N * N * q.element_size())))
    # scratch reused by every sample / head group: the loop allocates nothing
    magnitude, scratch = q.new_empty(H, N, d), q.new_empty(H, N, d)
    q_feat, k_feat = q.new_empty(H, N, 2, d), k.new_empty(H, N, 2, d)
    logits, probs = q.new_empty(step, N, N), q.new_empty(step, N, N)
    per_sample = q_table.dim() == 5
    for b in range(B):
        # softplus magnitudes written into the scratch, then the width-2d features (Eq. 10)
        q_rows = pope_features(softplus_into(q[b], magnitude, scratch), q_table[b] if per_sample else q_table,
                               out=q_feat)
        k_rows = pope_features(softplus_into(k[b], magnitude, scratch), k_table[b] if per_sample else k_table,
                               out=k_feat)
        for h in range(0, H, step):
            n = min(step, H - h)
            torch.bmm(q_rows[h:h + n], k_rows[h:h + n].transpose(1, 2), out=logits[:n])
            torch.softmax(logits[:n], dim=-1, out=probs[:n])
            torch.bmm(probs[:n], v[b, h:h + n], out=out[b, h:h + n])
    return out


# (compiled op's ISA, ATen's CPU capability) pairs where the compiled op beats its torch-op twin, measured per
# ISA on one ViT-S layer's shapes (197 / 577 / 2,305 tokens, issue 16): AVX-512 clone vs ATen AVX-512 1.27-1.36x
# faster; AVX2 + FMA clone vs ATen AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2) 0.70-0.91x, i.e. slower, so not listed.
COMPILED_OP_FASTER_ON = frozenset({('x86-64-v4', 'AVX512')})


@torch.jit.unused
def compiled_op_is_faster_here() -> bool:
    """Whether this CPU runs the compiled op's code for an ISA where it was measured faster than the torch-op
    twin (``COMPILED_OP_FASTER_ON``): False where the op cannot be built or its ISA lost to ATen's kernels."""
    isa = compiled_op_isa()
    return isa is not None and (isa, torch.backends.cpu.get_cpu_capability()) in COMPILED_OP_FASTER_ON


@torch.jit.unused
def use_compiled_cpu_op(dtype: torch.dtype, kernel_backend: str = 'auto') -> bool:
    """Whether CPU inference runs the compiled op (``kernels/pope_cpu.cpp``): float32, a backend other than
    'torch' (argument or ``VISION_PRIORS_KERNELS``), an op that builds here and a CPU where it beats its
    torch-op twin (:func:`compiled_op_is_faster_here`; elsewhere the twin runs)."""
    return dtype == torch.float32 and requested_backend(kernel_backend) != 'torch' and compiled_op_is_faster_here()


@torch.jit.unused
def cpu_inference_attention(q: Tensor, k: Tensor, v: Tensor, q_table: Tensor, k_table: Tensor,
                            kernel_backend: str = 'auto') -> Tensor:
    """CPU inference attention: the compiled op where ``use_compiled_cpu_op``, else
    ``pope_cpu_inference_attention`` (the same computation in torch ops, and the op's reference).
    Arguments as there."""
    if use_compiled_cpu_op(q.dtype, kernel_backend):
        return pope_cpu_attention(q, k, v, q_table, k_table, CPU_LOGITS_BYTES)
    return pope_cpu_inference_attention(q, k, v, q_table, k_table)


class PopeAttention(nn.Module):
    """Multi-head self-attention with PoPE (polar) positions, computed by one SDPA call.

    Same API as ``GoatAttention``: ``forward(x, coords=None, attn_mask=None, is_causal=False,
    return_attn=False, key_mask=None)``. Scores are scaled by 1 / sqrt(d_h) as in standard attention.

    Args:
        dim: Embedding width C.
        num_heads: Heads H (d_h = C / H real channels per head).
        num_spatial_dims: 1 or 2.
        num_prefix_tokens: Leading tokens without coordinates (see ``PopePhases``).
        grid_size: (rows, cols) used when ``coords`` is None in 2D.
        freq_base: theta (see ``PopePhases``).
        learn_bias: Learn the phase bias delta.
        qkv_bias, qk_norm, attn_drop, proj_drop, norm_layer: As timm's ``Attention``; qk_norm acts
            on the pre-softplus q, k.
        fused_attn: Use the fused path rather than the dense one: the Triton kernel (CUDA, 'triton'), one SDPA
            call, or, for CPU inference without a mask, ``cpu_inference_attention`` (same result, v kept
            at width d, cache-sized logits; the compiled C++ op for float32 where it is the faster one).
        kernel_backend: 'auto' (SDPA on CUDA tensors: on an H200 it ran 3-9x faster than the Triton kernel,
            ``kernel_dispatch.AUTO_PICKS_KERNEL``; the compiled op for CPU inference where
            :func:`compiled_op_is_faster_here`), 'triton' (the kernel on CUDA tensors)
            or 'torch' (SDPA, and torch ops for CPU inference); the ``VISION_PRIORS_KERNELS``
            environment variable overrides 'auto'.
    """
    fused_attn: Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            num_spatial_dims: int = 2,
            num_prefix_tokens: int = 0,
            grid_size: Optional[Tuple[int, int]] = None,
            freq_base: Optional[float] = None,
            learn_bias: bool = True,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Type[nn.Module] = nn.LayerNorm,
            fused_attn: bool = True,
            kernel_backend: str = 'auto',
    ) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f'dim ({dim}) must be divisible by num_heads ({num_heads})')
        head_dim = dim // num_heads
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_spatial_dims = num_spatial_dims
        self.num_prefix_tokens = num_prefix_tokens
        self.grid_size: Optional[Tuple[int, int]] = (None if grid_size is None
                                                     else (int(grid_size[0]), int(grid_size[1])))
        self.scale = head_dim ** -0.5
        self.fused_attn = fused_attn
        self.kernel_backend = check_kernel_backend(kernel_backend)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.phases = PopePhases(
            num_heads, head_dim, num_spatial_dims=num_spatial_dims, freq_base=freq_base,
            learn_bias=learn_bias, num_prefix_tokens=num_prefix_tokens)

    def set_grid_size(self, grid_size: Optional[Tuple[int, int]]) -> None:
        """Default patch grid used when ``coords`` is None (2D)."""
        self.grid_size = None if grid_size is None else (int(grid_size[0]), int(grid_size[1]))

    @torch.jit.unused
    def _flash_attention(self, q: Tensor, k: Tensor, v: Tensor, coords: Tensor, key_mask: Optional[Tensor],
                         is_causal: bool) -> Tensor:
        """The fused Triton kernel (``vision_priors.kernels.flash_prior``, PoPE mode): softplus magnitudes and phases
        are applied per tile in-kernel, so the width-2d q/k features are never materialised."""
        from vision_priors.kernels.flash_prior import flash_prior_attention
        phases = self.phases
        exponents = torch.arange(phases.per_axis, dtype=coords.dtype, device=coords.device) / phases.per_axis
        ladder = torch.pow(phases.freq_base, -exponents).expand(phases.num_spatial_dims, -1)
        return flash_prior_attention(
            q, k, v, mode='pope', coords=coords, freqs=ladder, phase_bias=phases.phase_bias,
            num_prefix_tokens=self.num_prefix_tokens, causal=is_causal,
            key_mask=key_mask, scale=self.scale)

    def forward(
            self,
            x: Tensor,
            coords: Optional[Tensor] = None,
            attn_mask: Optional[Tensor] = None,
            is_causal: bool = False,
            return_attn: bool = False,
            key_mask: Optional[Tensor] = None,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Attention over (B, N, C) tokens whose last N - P have coordinates ``coords``.

        ``coords`` is (N - P, D) shared by the batch or (B, N - P, D) per sample (see
        ``resolve_token_coords``). ``attn_mask`` is the general SDPA mask (boolean, True = attend, or
        additive; not with ``is_causal``); ``key_mask`` (B, N) bool, True = valid key, is the package's
        key-padding convention (it combines with either); a query without any valid key outputs zeros.
        Returns ``out`` (B, N, C), or ``(out, probs)`` with ``return_attn=True``, both from the explicit
        dense path (probs: (B, H, N, N)).
        """
        B, N, C = x.shape
        check_mask_args(attn_mask, is_causal)
        check_key_mask(key_mask, B, N, device=x.device)
        coords = resolve_token_coords(
            coords, N - self.num_prefix_tokens, self.num_spatial_dims, self.num_prefix_tokens, self.grid_size,
            x.device, self.phases.phase_bias_raw.dtype, B)
        H, dh = self.num_heads, self.head_dim
        q, k, v = self.qkv(x).reshape(B, N, 3, H, dh).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if not torch.jit.is_scripting() and not return_attn and self.fused_attn and use_flash_kernel(
                self.kernel_backend, x, attn_mask, self.training and self.attn_drop.p > 0, dh, family='pope'):
            out = self._flash_attention(q, k, v, coords, kernel_key_mask(key_mask, attn_mask), is_causal)
            return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))

        q_phase, k_phase = self.phases.phases(coords)
        q_table = phase_table(q_phase, self.scale).to(q.dtype)
        k_table = phase_table(k_phase).to(k.dtype)
        if (not torch.jit.is_scripting() and not return_attn and self.fused_attn and key_mask is None
                and use_cpu_inference_attention(x, attn_mask, is_causal, self.training and self.attn_drop.p > 0)):
            out = cpu_inference_attention(q, k, v, q_table, k_table, self.kernel_backend)
            return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))
        if torch.jit.is_scripting():
            q, k = pope_features(F.softplus(q), q_table), pope_features(F.softplus(k), k_table)
        else:
            q, k = magnitude_features(q, q_table), magnitude_features(k, k_table)
        attn_mask, is_causal, has_key = key_mask_to_attn_mask(key_mask, attn_mask, is_causal, N)

        dense_cpu_training = not torch.jit.is_scripting() and use_dense_cpu_training(x, N)
        plain = attn_mask is None and has_key is None and not is_causal and not (self.training and self.attn_drop.p > 0)
        if dense_cpu_training and plain and not return_attn and self.fused_attn:
            out = dense_softmax_attention(q, k, v)
            return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))
        if return_attn or not self.fused_attn or dense_cpu_training:
            logits = q @ k.transpose(-2, -1)
            bias = resolve_self_attn_mask(N, logits, attn_mask, is_causal)
            if bias is not None:
                logits = logits + bias
            probs = logits.softmax(dim=-1)
            if has_key is not None:
                probs = probs * has_key
            out = self.attn_drop(probs) @ v
            out = self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))
            if return_attn:
                return out, probs
            return out

        # fused SDPA kernels (CPU flash, CUDA flash) need equal q/k/v widths: widen v to 2d by repeating it
        # (cheaper than zero padding: one write, no fill) and keep the first d outputs. The repeat's outputs
        # are dropped, so it gets zero gradient and the gradients of q, k, v are unchanged.
        v = torch.cat([v, v], dim=-1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=1.0,
            dropout_p=self.attn_drop.p if self.training else 0.)
        out = out[..., :dh]
        if has_key is not None:
            out = out * has_key
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))
