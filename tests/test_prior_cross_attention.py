"""Positional cross-attention (``vision_priors.layers.GoatCrossAttention`` / ``PopeCrossAttention``) and the
multimodal block's 'goat' / 'pope' cross paths.

The layers run one SDPA call on widened q / k; the references below are written straight from the equations
(GOAT Eqs. 11-22: dense logits = content / sqrt(d_c) + sum_a,r alpha cos(w (p_i - p'_j)) + beta sin(w (p_i - p'_j))
+ u_h(p'_j); PoPE Eqs. 3-6: sum_c softplus(q) softplus(k) cos((s - t) w_c + delta_c) / sqrt(d)), a softmax over each
sample's valid context tokens only (a loop over samples), then @ v and the projection. Float64, odd shapes
(B = 2 samples, N = 5 queries, n = 7 context tokens, 3 heads, context width != query width); forward and gradients
(queries, context and every parameter) agree to rtol = atol = 1e-10 (the paths sum in different orders).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from trace_check import assert_scripted_and_traced_match
from vision_priors.layers import GoatCrossAttention, PopeCrossAttention
from vision_priors.models.multimodal import (POSITIONAL_CROSS_ATTENTIONS, SELF_ATTENTIONS, CrossAttentionBlock,
                                             create_cross_block)

TOL = dict(rtol=1e-10, atol=1e-10)
B, N, CTX, HEADS, DIM, CTX_DIM = 2, 5, 7, 3, 48, 20  # head dim 16: GOAT 2D with R = 2 keeps d_c = 6


def _layer(method: str, dims: int, prefix: int = 0, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    if method == 'goat':
        layer = GoatCrossAttention(DIM, HEADS, context_dim=CTX_DIM, num_spatial_dims=dims, num_modes=2,
                                   num_prefix_tokens=prefix, qkv_bias=True, **kwargs)
    else:
        layer = PopeCrossAttention(DIM, HEADS, context_dim=CTX_DIM, num_spatial_dims=dims, num_prefix_tokens=prefix,
                                   qkv_bias=True, **kwargs)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in layer.parameters():  # every parameter non-trivial (GOAT's key MLP output starts at zero)
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() < 2 or p.shape[0] <= HEADS else 0.2))
    return layer.double().eval()


def _inputs(dims: int, prefix: int = 0, seed: int = 0, per_sample: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    context = torch.randn(B, CTX, CTX_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    lead = (B,) if per_sample else ()
    coords = torch.randn(*lead, N - prefix, dims, generator=g, dtype=torch.float64) * 3
    context_coords = torch.randn(*lead, CTX, dims, generator=g, dtype=torch.float64) * 3
    context_coords[..., 0, :] = 0.  # a context token at the origin (GOAT 1D's first-key bias)
    mask = torch.rand(B, CTX, generator=g) > 0.4
    mask[:, 1] = True
    return x, context, coords, context_coords, mask


def _per_sample(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[b] if t.dim() == 3 else t


def _goat_logits(layer: GoatCrossAttention, q, k, p_q, p_k):
    """One sample: q (H, N, d_c), k (H, n, d_c), p_q (N - P, D), p_k (n, D) -> (H, N, n), GOAT Eqs. 11-22."""
    prior = layer.prior
    H, R, D = layer.num_heads, prior.num_modes, layer.num_spatial_dims
    if prior.log_freqs is not None:
        w = prior.log_freqs.exp()
    else:
        w = (prior.max_freq * prior.freq_base ** (-torch.arange(R, dtype=torch.float64) / R)).expand(D, R)
    content = q @ k.transpose(-1, -2) / math.sqrt(layer.content_dim)
    d = p_q[:, None, :, None] - p_k[None, :, :, None]  # (N - P, n, D, 1): p_i - p'_j per axis
    rel = (prior.alpha[:, None, None] * torch.cos(w * d) + prior.beta[:, None, None] * torch.sin(w * d)).sum((-1, -2))
    # key default u_h(p') = g_h(phi_abs(p')) + b_h 1{p' = 0} (+ lambda_h p'_0 when key_linear), Eqs. 21-22
    nu = 100. ** (-torch.arange(prior.abs_num_freqs, dtype=torch.float64) / prior.abs_num_freqs)
    phi = torch.cat([torch.cat([torch.sin(p_k[:, a:a + 1] * nu), torch.cos(p_k[:, a:a + 1] * nu),
                                p_k[:, a:a + 1] / prior.abs_pos_scale], dim=-1) for a in range(D)], dim=-1)
    mlp = prior.key_mlp
    u = mlp[2](F.silu(mlp[0](phi))).T  # (H, n)
    if prior.first_key_bias is not None:
        u = u + prior.first_key_bias[:, None] * (p_k == 0).all(-1).double()
    if prior.key_slope is not None:
        u = u + prior.key_slope[:, None] * p_k[:, 0]
    P = layer.num_prefix_tokens
    rel = torch.cat([rel.new_zeros(H, P, rel.shape[-1]), rel], dim=1)  # prefix queries: no relative term
    return content + rel + u[:, None, :]


def _pope_logits(layer: PopeCrossAttention, q, k, p_q, p_k):
    """One sample, pre-softplus q (H, N, d), k (H, n, d) -> (H, N, n), PoPE Eqs. 3-6 (2D: channel half a
    rotates with axis a, ladder w = theta^(-c / (d / D)) within each half)."""
    ph = layer.phases
    d, D = layer.head_dim, layer.num_spatial_dims
    per_axis = d // D
    c = torch.arange(d)
    w = ph.freq_base ** (-(c % per_axis).double() / per_axis)
    axis = c // per_axis
    t = p_q[:, axis] * w  # (N - P, d)
    t = torch.cat([t.new_zeros(layer.num_prefix_tokens, d), t])  # prefix queries: phase 0
    s = p_k[:, axis] * w  # (n, d)
    delta = ph.phase_bias_raw  # cos is 2 pi periodic: the raw parameter and its wrapped value score alike
    angle = s[None, None] - t[None, :, None] + delta[:, None, None]  # (H, N, n, d)
    mag = F.softplus(q)[:, :, None] * F.softplus(k)[:, None]
    return (mag * torch.cos(angle)).sum(-1) / math.sqrt(d)


def reference(layer, x, context, coords, context_coords, mask=None):
    """Dense forward from the equations; per sample, softmax over its valid context tokens only."""
    H = layer.num_heads
    outs = []
    for b in range(x.shape[0]):
        valid = torch.ones(context.shape[1], dtype=torch.bool) if mask is None else mask[b]
        ctx, p_k = context[b, valid], _per_sample(context_coords, b)[valid]
        p_q = _per_sample(coords, b)
        if not valid.any():
            outs.append(x.new_zeros(x.shape[1], x.shape[2]))  # documented: zero before the projection
            continue
        if isinstance(layer, GoatCrossAttention):
            dc, dh = layer.content_dim, layer.head_dim
            q = layer.q(x[b]).reshape(-1, H, dc).transpose(0, 1)
            k, v = layer.kv(ctx).split([H * dc, H * dh], dim=-1)
            k, v = k.reshape(-1, H, dc).transpose(0, 1), v.reshape(-1, H, dh).transpose(0, 1)
            logits = _goat_logits(layer, q, k, p_q, p_k)
        else:
            dh = layer.head_dim
            q = layer.q(x[b]).reshape(-1, H, dh).transpose(0, 1)
            k, v = layer.kv(ctx).split(layer.dim, dim=-1)
            k, v = k.reshape(-1, H, dh).transpose(0, 1), v.reshape(-1, H, dh).transpose(0, 1)
            logits = _pope_logits(layer, q, k, p_q, p_k)
        outs.append((logits.softmax(-1) @ v).transpose(0, 1).reshape(x.shape[1], -1))
    return layer.proj(torch.stack(outs))


def _grads(out, tensors):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), tensors, allow_unused=True)


def _assert_same_grads(out, ref, tensors):
    for got, want in zip(_grads(out, tensors), _grads(ref, tensors)):
        assert want is not None
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize('method', POSITIONAL_CROSS_ATTENTIONS)
@pytest.mark.parametrize('dims', (1, 2))
@pytest.mark.parametrize('prefix', (0, 1))
def test_forward_and_gradients_match_the_equations(method, dims, prefix, one_thread):
    """Shared coordinates, a context mask, 1D / 2D, with and without a query prefix token; GOAT with learned
    frequencies and the key-linear term in 1D (every prior parameter in play)."""
    kwargs = dict(learn_freqs=True, key_linear=dims == 1) if method == 'goat' else {}
    layer = _layer(method, dims, prefix, **kwargs)
    x, context, coords, context_coords, mask = _inputs(dims, prefix)
    out = layer(x, context, mask, coords, context_coords)
    ref = reference(layer, x, context, coords, context_coords, mask)
    torch.testing.assert_close(out, ref, **TOL)
    _assert_same_grads(out, ref, [x, context] + list(layer.parameters()))
    # without a mask: every context token
    torch.testing.assert_close(layer(x, context, None, coords, context_coords),
                               reference(layer, x, context, coords, context_coords), **TOL)


@pytest.mark.parametrize('method', POSITIONAL_CROSS_ATTENTIONS)
@pytest.mark.parametrize('dims', (1, 2))
def test_per_sample_coordinates_equal_a_loop_over_samples(method, dims, one_thread):
    """(B, N, D) query and (B, n, D) context coordinates (and either one shared) equal the per-sample runs
    with shared coordinates; forward and gradients equal the reference."""
    layer = _layer(method, dims, seed=1)
    x, context, coords, context_coords, mask = _inputs(dims, seed=1, per_sample=True)
    out = layer(x, context, mask, coords, context_coords)
    for b in range(B):
        alone = layer(x[b:b + 1], context[b:b + 1], mask[b:b + 1], coords[b], context_coords[b])
        torch.testing.assert_close(out[b:b + 1], alone, **TOL)
    ref = reference(layer, x, context, coords, context_coords, mask)
    torch.testing.assert_close(out, ref, **TOL)
    _assert_same_grads(out, ref, [x, context] + list(layer.parameters()))
    for q_coords, k_coords in ((coords[0], context_coords), (coords, context_coords[1])):
        torch.testing.assert_close(layer(x, context, mask, q_coords, k_coords),
                                   reference(layer, x, context, q_coords, k_coords, mask), **TOL)


@pytest.mark.parametrize('method', POSITIONAL_CROSS_ATTENTIONS)
def test_masked_context_tokens_have_no_effect(method, one_thread):
    """Garbage in the masked context tokens (features and coordinates) changes nothing, gets zero gradient;
    each sample equals its run on its valid tokens alone."""
    layer = _layer(method, 2, seed=2)
    x, context, coords, context_coords, mask = _inputs(2, seed=2, per_sample=True)
    out = layer(x, context, mask, coords, context_coords)
    garbage = torch.where(mask[..., None], context.detach(), 1e3 * torch.randn_like(context)).requires_grad_(True)
    far = torch.where(mask[..., None], context_coords, 1e3 * torch.randn_like(context_coords))
    out_garbage = layer(x, garbage, mask, coords, far)
    torch.testing.assert_close(out_garbage, out, rtol=0, atol=1e-12)
    (grad,) = _grads(out_garbage, [garbage])
    assert grad[~mask].abs().max() == 0 and grad[mask].abs().max() > 0
    for b in range(B):
        alone = layer(x[b:b + 1], context[b:b + 1, mask[b]], None, coords[b], context_coords[b, mask[b]])
        torch.testing.assert_close(out[b:b + 1], alone, **TOL)


@pytest.mark.parametrize('method', POSITIONAL_CROSS_ATTENTIONS)
def test_all_masked_sample_gets_the_projection_bias(method, one_thread):
    """Documented: a sample without a valid context token gives proj(0) = proj.bias for every query, the same
    as an empty context (n = 0); finite gradients, zero through its context; the other sample is unaffected."""
    layer = _layer(method, 2, seed=3)
    x, context, coords, context_coords, mask = _inputs(2, seed=3)
    mask[1] = False
    out = layer(x, context, mask, coords, context_coords)
    torch.testing.assert_close(out[1], layer.proj.bias.expand(N, DIM), **TOL)
    torch.testing.assert_close(layer(x[1:2], context[1:2, :0], None, coords, context_coords[:0]), out[1:2], **TOL)
    torch.testing.assert_close(out[:1], layer(x[:1], context[:1], mask[:1], coords, context_coords), **TOL)
    ref = reference(layer, x, context, coords, context_coords, mask)
    torch.testing.assert_close(out, ref, **TOL)
    gx, gc = _grads(out, [x, context])
    assert torch.isfinite(gx).all() and torch.isfinite(gc).all()
    assert gc[1].abs().max() == 0 and gx[1].abs().max() == 0


@pytest.mark.parametrize('method', POSITIONAL_CROSS_ATTENTIONS)
def test_layer_errors(method, one_thread):
    layer = _layer(method, 2)
    x, context, coords, context_coords, mask = _inputs(2)
    with pytest.raises(ValueError, match='is positional: it needs coords'):
        layer(x, context, mask, None, context_coords)
    with pytest.raises(ValueError, match='is positional: it needs coords'):
        layer(x, context, mask, coords)
    with pytest.raises(ValueError, match=r'context_coords has shape \(6, 2\), expected \(7, 2\)'):
        layer(x, context, mask, coords, context_coords[:6])
    with pytest.raises(ValueError, match=r'coords has shape \(5, 1\), expected \(5, 2\)'):
        layer(x, context, mask, coords[:, :1], context_coords)
    with pytest.raises(TypeError, match=r'context_mask must be a bool tensor of shape \(B, L\) = \(2, 7\)'):
        layer(x, context, mask.double(), coords, context_coords)
    with pytest.raises(ValueError, match=r'context must be \(B, n, context_dim\) = \(2, n, 20\)'):
        layer(x, context[..., :5], mask, coords, context_coords)
    if method == 'goat':
        with pytest.raises(ValueError, match='too small for GOAT'):
            GoatCrossAttention(24, 3, num_modes=2)


# ------------------------------------------------------------------------------------ the multimodal block

def _block(self_attn: str, cross_attn: str, **kwargs) -> CrossAttentionBlock:
    torch.manual_seed(0)
    attn_kwargs = dict(num_modes=2) if self_attn == 'goat' else None
    cross_kwargs = dict(num_modes=2, prior_init='random') if cross_attn == 'goat' else None
    block = create_cross_block(self_attn, DIM, HEADS, cross_attn=cross_attn, attn_kwargs=attn_kwargs,
                               cross_kwargs=cross_kwargs, context_dim=CTX_DIM, qkv_bias=True, init_values=0.5,
                               **kwargs)
    with torch.no_grad():
        for p in block.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.3)
    return block.double().eval()


@pytest.mark.parametrize('cross_attn', POSITIONAL_CROSS_ATTENTIONS)
def test_block_cross_path_uses_query_and_context_coordinates(cross_attn, one_thread):
    """The block's cross sub-layer is the layer on (cross_coords or coords, context_coords); 1D self-attention
    positions with 2D cross coordinates (the fusion decoder's layout); forward and gradients vs the reference."""
    block = _block('goat', cross_attn, num_spatial_dims=1, cross_spatial_dims=2)
    assert block.cross_attn.num_spatial_dims == 2 and block.attn.num_spatial_dims == 1
    x, context, cross_coords, context_coords, mask = _inputs(2, seed=4, per_sample=True)
    positions = torch.arange(N, dtype=torch.float64)[:, None]
    out = block(x, context, positions, context_mask=mask, context_coords=context_coords, cross_coords=cross_coords)
    h = x + block.ls1(block.attn(block.norm1(x), positions))
    h = h + block.ls_cross(reference(block.cross_attn, block.norm_cross(h), context, cross_coords, context_coords,
                                     mask))
    ref = h + block.ls2(block.mlp(block.norm2(h)))
    torch.testing.assert_close(out, ref, **TOL)
    _assert_same_grads(out, ref, [x, context] + list(block.cross_attn.parameters()))
    # same frame for both: coords serve the self- and the cross-attention
    block2 = _block('pope', cross_attn)
    out2 = block2(x, context, cross_coords, context_mask=mask, context_coords=context_coords)
    torch.testing.assert_close(out2, block2(x, context, cross_coords, None, None, False, mask, context_coords,
                                            cross_coords), rtol=0, atol=0)


def test_block_errors(one_thread):
    x, context, coords, context_coords, mask = _inputs(2)
    for cross_attn in POSITIONAL_CROSS_ATTENTIONS:
        block = _block('plain', cross_attn)
        with pytest.raises(ValueError, match=f"cross_attn='{cross_attn}' is positional: pass context_coords"):
            block(x, context, coords, context_mask=mask)
        with pytest.raises(ValueError, match=f"cross_attn='{cross_attn}' is positional: pass the queries' coord"):
            block(x, context, context_mask=mask, context_coords=context_coords)
    with pytest.raises(ValueError, match='cross_kwargs are options of the positional cross-attentions'):
        create_cross_block('plain', DIM, HEADS, cross_attn='softmax', cross_kwargs=dict(num_modes=2))


@pytest.mark.parametrize('self_attn', SELF_ATTENTIONS)
def test_block_torchscript_and_fx_match_eager(self_attn, one_thread):
    """Every self-attention x both positional cross-attentions: scripted and fx-traced (timm's leaf modules /
    functions) blocks equal eager; as tests/test_multimodal_blocks.py does for the content cross paths."""
    x, context, coords, context_coords, mask = _inputs(2, seed=5, per_sample=True)
    x, context = x.detach(), context.detach()
    lavo = self_attn == 'lavo'
    for cross_attn in POSITIONAL_CROSS_ATTENTIONS:
        block = _block(self_attn, cross_attn, num_prefix_tokens=0)
        grid = [1, 5] if lavo else None
        args = (x, context, None if lavo else coords, grid, None, not lavo, mask, context_coords, coords)
        assert_scripted_and_traced_match(block, args, is_causal=not lavo)
