"""Multimodal blocks (``vision_priors.models.multimodal``): the content cross paths (softmax, LAVO; the positional
GOAT / PoPE ones: tests/test_prior_cross_attention.py) vs float64 references written from the equations, the
context mask, the all-masked sample, timm conventions, TorchScript and torch.fx.

Tolerances: float64 everywhere; the fast paths (SDPA, LAVO's factorised CODE ops) and the dense references
sum in different orders, so forward and gradients agree to rtol = atol = 1e-10.
"""
import importlib.util
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from timm.layers import LayerScale, RmsNorm
from timm.models._manipulate import checkpoint

from trace_check import assert_scripted_and_traced_match
from vision_priors.kernels.lavo_ref import lavo_global_reference
from vision_priors.models.multimodal import (CONTENT_CROSS_ATTENTIONS as CROSS_ATTENTIONS, SELF_ATTENTIONS,
                                             CrossAttentionBlock, create_cross_block)

TOL = dict(rtol=1e-10, atol=1e-10)
DIM, HEADS = 40, 2  # head dim 20: room for GOAT's d_p = 2 R D + 2 = 10 with R = 2 modes in 2D
B, N, CTX = 3, 7, 11  # odd shapes: 7 query tokens, 11 context tokens


def _block(self_attn: str, cross_attn: str, **kwargs) -> CrossAttentionBlock:
    torch.manual_seed(0)
    attn_kwargs = dict(num_modes=2, prior_init='random') if self_attn == 'goat' else None
    block = create_cross_block(self_attn, DIM, HEADS, cross_attn=cross_attn, attn_kwargs=attn_kwargs,
                               qkv_bias=True, init_values=0.5, **kwargs)
    with torch.no_grad():
        for p in block.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.3)  # non-trivial biases, norm weights and layer scales
    return block.double().eval()


def _inputs(seed: int = 0, n: int = N):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    context = torch.randn(B, CTX, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    coords = torch.randn(n, 2, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(B, CTX, generator=g) > 0.4
    mask[:, 0] = True  # every sample has a valid token here (the all-masked case has its own test)
    return x, context, coords, mask


def _heads(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], t.shape[1], HEADS, -1).transpose(1, 2)


def _merge(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


def _reference_cross(block: CrossAttentionBlock, y: torch.Tensor, context: torch.Tensor, mask: torch.Tensor):
    """The cross-attention of normed queries ``y``, dense, from the equations."""
    ca = block.cross_attn
    q = _heads(ca.q(y))
    if block.cross_attn_kind == 'lavo':
        # LAVO Eqs. 5-6 through the dense CODE reference: non-causal, so every row t reads the same masked mean
        # H of the whole source; the m queries ride in the first rows of a length-n query tensor
        z = _heads(ca.kv(context))
        q_rows = torch.zeros_like(z)
        q_rows[:, :, :q.shape[2]] = q
        out = lavo_global_reference(q_rows, z, ca.basis(), ca.scale, key_mask=mask, causal=False)[:, :, :q.shape[2]]
    else:
        k, v = ca.kv(context).split(DIM, dim=-1)
        k, v = _heads(k), _heads(v)
        logits = (q @ k.transpose(-1, -2)) * (DIM // HEADS) ** -0.5
        logits = logits.masked_fill(~mask[:, None, None, :], float('-inf'))
        out = logits.softmax(-1) @ v
    return ca.proj(_merge(out))


def _reference_block(block: CrossAttentionBlock, x, context, coords, mask):
    h = x + block.ls1(block.attn(block.norm1(x), coords))
    h = h + block.ls_cross(_reference_cross(block, block.norm_cross(h), context, mask))
    return h + block.ls2(block.mlp(block.norm2(h)))


def _grads(out: torch.Tensor, tensors):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), tensors, allow_unused=True)


@pytest.mark.parametrize('cross_attn', CROSS_ATTENTIONS)
def test_cross_path_matches_float64_reference(cross_attn, one_thread):
    """Forward and gradients (inputs and every parameter) of the block vs the dense reference."""
    block = _block('goat', cross_attn)
    x, context, coords, mask = _inputs()
    params = [p for p in block.parameters()]
    out = block(x, context, coords, context_mask=mask)
    ref = _reference_block(block, x, context, coords, mask)
    torch.testing.assert_close(out, ref, **TOL)
    for got, want in zip(_grads(out, [x, context] + params), _grads(ref, [x, context] + params)):
        if want is None:
            assert got is None or got.abs().max() == 0
        else:
            torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize('cross_attn', CROSS_ATTENTIONS)
def test_masked_context_has_no_effect(cross_attn, one_thread):
    """Garbage in masked context tokens changes nothing; their gradient is zero; each sample equals its run
    on its valid tokens alone."""
    block = _block('pope', cross_attn)
    x, context, coords, mask = _inputs(1)
    out = block(x, context, coords, context_mask=mask)
    garbage = torch.where(mask[..., None], context.detach(), 1e3 * torch.randn_like(context)).requires_grad_(True)
    out_garbage = block(x, garbage, coords, context_mask=mask)
    torch.testing.assert_close(out_garbage, out, rtol=0, atol=1e-12)
    (grad,) = _grads(out_garbage, [garbage])
    assert grad[~mask].abs().max() == 0 and grad[mask].abs().max() > 0
    for b in range(B):
        alone = block(x[b:b + 1], context[b:b + 1, mask[b]], coords)
        torch.testing.assert_close(out[b:b + 1], alone, **TOL)


@pytest.mark.parametrize('cross_attn', CROSS_ATTENTIONS)
def test_all_masked_sample_gets_the_projection_bias(cross_attn, one_thread):
    """Documented: no valid context token -> the cross sub-layer adds ls_cross(proj.bias), whatever the context
    (the same as an empty context, n = 0); gradients stay finite and zero through its context; the other
    samples are unaffected."""
    block = _block('plain', cross_attn)
    x, context, coords, mask = _inputs(2)
    mask[1] = False
    out = block(x, context, context_mask=mask)
    h = x + block.ls1(block.attn(block.norm1(x)))
    h = h + block.ls_cross(block.cross_attn.proj.bias.expand_as(h))
    expected = h + block.ls2(block.mlp(block.norm2(h)))
    torch.testing.assert_close(out[1], expected[1], **TOL)
    torch.testing.assert_close(block(x[1:2], context[1:2, :0]), expected[1:2], **TOL)
    torch.testing.assert_close(out[[0, 2]], block(x[[0, 2]], context[[0, 2]], context_mask=mask[[0, 2]]), **TOL)
    gx, gc = _grads(out, [x, context])
    assert torch.isfinite(gx).all() and torch.isfinite(gc).all()
    assert gc[1].abs().max() == 0


def test_lavo_cross_path_reads_only_the_masked_mean_of_the_context(one_thread):
    """Documented consequence of Eqs. 5-6 (non-causal CODE = masked mean after linear maps): replacing each
    sample's context by its masked mean token leaves the LAVO block unchanged; the softmax block changes."""
    x, context, coords, mask = _inputs(6)
    mean = (context * mask[..., None]).sum(1, keepdim=True) / mask.sum(1, keepdim=True)[..., None]
    lavo, softmax = _block('goat', 'lavo'), _block('goat', 'softmax')
    torch.testing.assert_close(lavo(x, mean, coords), lavo(x, context, coords, context_mask=mask), **TOL)
    assert (softmax(x, mean, coords) - softmax(x, context, coords, context_mask=mask)).abs().max() > 1e-3


@pytest.mark.parametrize('self_attn', SELF_ATTENTIONS)
def test_torchscript_and_fx_match_eager(self_attn, one_thread):
    """Every self-attention x both cross-attentions, as the ViT blocks: scripted and fx-traced (timm's leaf
    modules / functions) outputs equal eager. LAVO self-attention runs non-causal 2D over a 2 x 3 grid after one
    prefix token; the others get a causal 1D-in-2D call (``is_causal``) with coordinates."""
    x, context, coords, mask = _inputs(3)
    x = x.detach()
    lavo = self_attn == 'lavo'
    grid = [2, 3] if lavo else None
    for cross_attn in CROSS_ATTENTIONS:
        block = _block(self_attn, cross_attn, num_prefix_tokens=1 if lavo else 0)
        tokens = x[:, :7]
        args = (tokens, context.detach(), None if lavo else coords, grid, None, not lavo, mask)
        assert_scripted_and_traced_match(block, args, is_causal=not lavo)

def test_timm_conventions_layer_scale_norm_drop_path_checkpointing(one_thread):
    block = create_cross_block('goat', DIM, HEADS, cross_attn='lavo', attn_kwargs=dict(num_modes=2),
                               init_values=1e-3, drop_path=0.5, norm_layer=partial(RmsNorm, eps=1e-6),
                               dtype=torch.float64)
    assert isinstance(block.ls_cross, LayerScale) and torch.all(block.ls_cross.gamma == torch.tensor(1e-3).double())
    assert all(isinstance(m, RmsNorm) for m in (block.norm1, block.norm_cross, block.norm2))
    x, context, coords, mask = _inputs(4)
    block.eval()  # drop path off: deterministic, equal under grad checkpointing (values and gradients)
    out = block(x, context, coords, context_mask=mask)
    ckpt = checkpoint(block, x, context, coords, None, None, False, mask)
    torch.testing.assert_close(ckpt, out, rtol=0, atol=0)
    for a, b in zip(_grads(out, [x, context]), _grads(ckpt, [x, context])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    block.train()  # drop path on: some samples skip the residual branches entirely
    torch.manual_seed(0)
    outs = torch.stack([block(x, context, coords, context_mask=mask) for _ in range(8)])
    assert (outs - out).abs().amax(dim=(2, 3)).gt(1e-9).any()
    assert ((outs - x).abs().amax(dim=(2, 3)) < 1e-12).any()  # a sample dropped on all three branches


def test_errors_name_the_argument(one_thread):
    with pytest.raises(ValueError, match='cross_attn must be one of'):
        create_cross_block('plain', DIM, HEADS, cross_attn='linear')
    with pytest.raises(ValueError, match='self_attn must be one of'):
        create_cross_block('rope', DIM, HEADS)
    with pytest.raises(ValueError, match='causal LAVO self-attention is 1D'):
        create_cross_block('lavo', DIM, HEADS, causal=True)
    x, context, coords, mask = _inputs(5)
    for cross_attn in CROSS_ATTENTIONS:
        block = _block('plain', cross_attn)
        with pytest.raises(TypeError, match=r'mask must be a bool tensor of shape \(B, L\) = \(3, 11\)'):
            block(x, context, context_mask=mask.double())
        with pytest.raises(ValueError, match=r'mask must be a bool tensor of shape \(B, L\) = \(3, 11\)'):
            block(x, context, context_mask=mask[:, :5])
        with pytest.raises(ValueError, match=r'context must be \(B, n, (context_dim|40)\)'):
            block(x, context[:, :, :7])
    lavo = create_cross_block('lavo', DIM, HEADS, num_spatial_dims=1, causal=False)
    with pytest.raises(ValueError, match='accepts no attn_mask'):
        lavo(x.float(), context.float(), attn_mask=torch.ones(N, N, dtype=torch.bool))
    with pytest.raises(ValueError, match='built non-causal'):
        lavo(x.float(), context.float(), is_causal=True)



def test_fusion_cross_attention_benchmark_smoke_run(one_thread, capsys):
    """The benchmark runs both cross paths end to end and prints its table (timings are not asserted)."""
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / 'benchmarks'))
    try:
        spec = importlib.util.spec_from_file_location('bench_fusion',
                                                      root / 'benchmarks' / 'bench_fusion_cross_attention.py')
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(root / 'benchmarks'))
    rows = bench.main(['--tokens', '8', '1024', '--queries', '3', '--batch', '1', '--dim', '32', '--heads', '2',
                       '--repeats', '1'])
    assert [r['M'] for r in rows] == [8, 1024]
    assert all(r[f'{c}_{m}_s'] > 0 for r in rows for c in CROSS_ATTENTIONS for m in ('fwd', 'fwdbwd'))
    out = capsys.readouterr().out
    assert '| 1024 |' in out and 'from 1,024 image tokens on:' in out
