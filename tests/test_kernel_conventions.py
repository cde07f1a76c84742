"""One kernel convention (issue 13), checked on the CPU without Triton's interpreter.

* One key mask: ``key_mask`` (B, L_keys) bool, True = valid key, for every public op and layer; wrong
  dtypes / shapes are errors that state the convention (Chamfer's ``x_mask`` / ``y_mask``: True = valid
  point, same check). The old names (``key_padding_mask`` True = padded, ``context_mask``, LAVO's
  validity ``attn_mask``) are gone. GOAT / PoPE fold ``key_mask`` into their SDPA masking exactly as the
  ops do: a query without a valid key outputs zeros.
* Each op's PyTorch backend is its fastest exact path and the layer runs the same function: LAVO's
  blocked local window and cumulative-sum CODE, Chamfer's tiled neighbour search; each matches the dense
  reference beside the op (``lavo_ref.py``, ``chamfer_ref.py``) forward and backward in float64.
* One backend module: the fp32 dot-precision rule, tile widths, the dtype table, AOT signatures derived
  from a kernel's parameter list.
"""
import pytest
import torch

import vision_priors.kernels as K
from vision_priors.kernels import _backend, chamfer, lavo_torch
from vision_priors.kernels.chamfer_ref import chamfer_nn_reference
from vision_priors.kernels.flash_prior_ref import flash_prior_attention_ref
from vision_priors.kernels.lavo import lavo_global, lavo_local
from vision_priors.kernels.lavo_ref import lavo_global_reference, lavo_local_reference
from vision_priors.layers import GoatAttention, LavoAttention, LavoCrossAttention, PopeAttention, grid_coords

F64 = torch.float64
B, L = 2, 7


def _qkv(d=8, heads=2, length=L, dtype=torch.float32):
    return tuple(torch.randn(B, heads, length, d, dtype=dtype) for _ in range(3))


def _call(entry):
    """One call per public op / layer with ``key_mask`` (or Chamfer's ``x_mask``) for keys of length L."""
    q, k, v = _qkv()
    basis = torch.linalg.qr(torch.randn(2, 8, 4))[0].transpose(-1, -2).contiguous()
    x = torch.randn(B, L, 32)
    calls = {
        'flash_prior_attention_ref': lambda m: flash_prior_attention_ref(q, k, v, key_mask=m),
        'flash_prior_attention': lambda m: K.flash_prior_attention(q, k, v, key_mask=m),
        'lavo_global': lambda m: lavo_global(q, v, basis, 0.3, key_mask=m, backend='torch'),
        'lavo_local': lambda m: lavo_local(q, k, v, None, 0.3, 3, key_mask=m, backend='torch'),
        'lavo_global_reference': lambda m: lavo_global_reference(q, v, basis, 0.3, key_mask=m),
        'lavo_local_reference': lambda m: lavo_local_reference(q, k, v, None, 0.3, 3, key_mask=m),
        'LavoAttention': lambda m: LavoAttention(32, 2, num_slots=4, window=3)(x, key_mask=m),
        'LavoCrossAttention': lambda m: LavoCrossAttention(32, 2, num_slots=4)(torch.randn(B, 3, 32), x,
                                                                                 key_mask=m),
        'GoatAttention': lambda m: GoatAttention(32, 2, num_spatial_dims=1, num_modes=2)(x, key_mask=m),
        'PopeAttention': lambda m: PopeAttention(32, 2, num_spatial_dims=1)(x, key_mask=m),
    }
    return calls[entry]


ENTRIES = ['flash_prior_attention_ref', 'flash_prior_attention', 'lavo_global', 'lavo_local',
           'lavo_global_reference', 'lavo_local_reference', 'LavoAttention', 'LavoCrossAttention',
           'GoatAttention', 'PopeAttention']


# ------------------------------------------------------------------------------------------------
# (1) one key-mask convention, one check

@pytest.mark.parametrize('entry', ENTRIES)
def test_key_mask_errors_state_the_convention(entry):
    if entry == 'flash_prior_attention' and not hasattr(K, 'flash_prior_attention'):
        pytest.skip('no Triton')
    call = _call(entry)
    convention = rf'key_mask must be a bool tensor of shape \(B, L\) = \({B}, {L}\) with True = valid key, got '
    with pytest.raises(TypeError, match=convention + r'torch\.float32 \(2, 7\)$'):
        call(torch.ones(B, L))
    with pytest.raises(TypeError, match=convention + r'torch\.uint8 \(2, 7\)$'):
        call(torch.ones(B, L, dtype=torch.uint8))
    with pytest.raises(ValueError, match=convention + r'torch\.bool \(2, 6\)$'):
        call(torch.ones(B, L - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=convention + r'torch\.bool \(2, 1, 1, 7\)$'):
        call(torch.ones(B, 1, 1, L, dtype=torch.bool))
    with pytest.raises(TypeError, match=convention + 'list$'):
        call([[True] * L] * B)
    if entry != 'flash_prior_attention' or _backend.interpreting():  # (the op itself needs CUDA / the interpreter)
        call(torch.ones(B, L, dtype=torch.bool))  # the convention itself is accepted


def test_chamfer_masks_use_the_same_check():
    x, y = torch.randn(B, 5, 3), torch.randn(B, 6, 3)
    for fn in (chamfer.chamfer_nn, chamfer_nn_reference, chamfer.chamfer_distance):
        with pytest.raises(TypeError, match=r'x_mask must be a bool tensor of shape \(B, L\) = \(2, 5\) with '
                                            r'True = valid point, got torch.int64 \(2, 5\)'):
            fn(x, y, x_mask=torch.ones(B, 5, dtype=torch.long))
        with pytest.raises(ValueError, match=r'y_mask must be a bool tensor of shape \(B, L\) = \(2, 6\) with '
                                             r'True = valid point, got torch.bool \(2, 5\)'):
            fn(x, y, y_mask=torch.ones(B, 5, dtype=torch.bool))


def test_check_key_mask_device_and_script():
    mask = torch.ones(B, L, dtype=torch.bool)
    assert _backend.check_key_mask(None, B, L) is None
    assert _backend.check_key_mask(mask, B, L, device=torch.device('cpu')) is mask
    with pytest.raises(ValueError, match='key_mask is on cpu but the inputs are on meta'):
        _backend.check_key_mask(mask, B, L, device=torch.device('meta'))
    scripted = torch.jit.script(_backend.check_key_mask)
    assert scripted(mask, B, L) is not None
    with pytest.raises(Exception, match=r'key_mask must be a bool tensor of shape \(B, L\) with True = valid key'):
        scripted(mask.float(), B, L)


def test_old_mask_names_are_gone():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match='key_padding_mask'):
        flash_prior_attention_ref(q, k, v, key_padding_mask=torch.zeros(B, L, dtype=torch.bool))
    x = torch.randn(B, L, 32)
    with pytest.raises(TypeError, match='attn_mask'):
        LavoAttention(32, 2, num_slots=4, window=3)(x, attn_mask=torch.ones(B, L, dtype=torch.bool))
    with pytest.raises(TypeError, match='context_mask'):
        LavoCrossAttention(32, 2, num_slots=4)(x, x, context_mask=torch.ones(B, L, dtype=torch.bool))


def _randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return module


@pytest.mark.parametrize('cls', [GoatAttention, PopeAttention])
@pytest.mark.parametrize('causal', [False, True])
def test_goat_pope_key_mask_matches_the_ops_reference(cls, causal):
    """The layers' SDPA path, dense path and the ops' dense reference agree on ``key_mask`` (float64),
    including queries without any valid key (zeros before the projection, no NaN)."""
    kwargs = dict(num_modes=2) if cls is GoatAttention else {}
    layer = _randomize(cls(32, num_heads=2, num_spatial_dims=2, num_prefix_tokens=1, **kwargs).double(), 1)
    coords = grid_coords((2, 4), dtype=F64)
    n = 9
    x = torch.randn(3, n, 32, dtype=F64)
    key_mask = torch.ones(3, n, dtype=torch.bool)
    key_mask[0, 6:] = False       # right padding
    key_mask[1, :3] = False       # left padding: causal queries 0-2 have no valid key
    key_mask[2] = False           # no valid key at all
    fused = layer(x, coords=coords, is_causal=causal, key_mask=key_mask)
    dense, probs = layer(x, coords=coords, is_causal=causal, key_mask=key_mask, return_attn=True)
    torch.testing.assert_close(fused, dense, rtol=0, atol=1e-10)
    assert torch.isfinite(fused).all() and (probs.masked_select(~key_mask[:, None, None, :]) == 0).all()
    torch.testing.assert_close(fused[2], layer.proj.bias.expand(n, -1), rtol=0, atol=1e-12)
    # the ops' dense reference with the same key_mask
    H = 2
    if cls is GoatAttention:
        dc, dh = layer.content_dim, layer.head_dim
        q, k, v = layer.qkv(x).split([H * dc, H * dc, H * dh], dim=-1)
        q, k = (t.reshape(3, n, H, dc).transpose(1, 2) for t in (q, k))
        v = v.reshape(3, n, H, dh).transpose(1, 2)
        prior = layer.prior
        u = torch.cat([prior.prefix_bias, prior.key_default(coords)], dim=-1)
        out = flash_prior_attention_ref(q, k, v, mode='goat', causal=causal, key_mask=key_mask, coords=coords,
                                        freqs=prior.frequencies(F64, coords.device), alpha=prior.alpha,
                                        beta=prior.beta, key_default=u, num_prefix_tokens=1,
                                        scale=layer.content_scale)
    else:
        d = layer.head_dim
        q, k, v = layer.qkv(x).reshape(3, n, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)
        phases = layer.phases
        ladder = phases.freq_base ** (-torch.arange(d // 2, dtype=F64) / (d // 2))
        out = flash_prior_attention_ref(q, k, v, mode='pope', causal=causal, key_mask=key_mask, coords=coords,
                                        freqs=ladder.expand(2, -1), phase_bias=phases.phase_bias,
                                        num_prefix_tokens=1, scale=layer.scale)
    ours = layer.proj(out.transpose(1, 2).reshape(3, n, -1))
    torch.testing.assert_close(ours, fused, rtol=0, atol=1e-10)
    # gradients are finite, also through the all-masked sample
    xg = x.clone().requires_grad_()
    layer(xg, coords=coords, is_causal=causal, key_mask=key_mask).sum().backward()
    assert torch.isfinite(xg.grad).all()


@pytest.mark.parametrize('cls', [GoatAttention, PopeAttention])
def test_goat_pope_key_mask_equals_dropping_the_padded_keys(cls):
    kwargs = dict(num_modes=2) if cls is GoatAttention else {}
    layer = _randomize(cls(32, num_heads=2, num_spatial_dims=1, **kwargs).double(), 2).eval()
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(3), dtype=F64)
    key_mask = torch.ones(2, 10, dtype=torch.bool)
    key_mask[1, 6:] = False
    tol = dict(rtol=0, atol=1e-10)
    with torch.no_grad():
        y = layer(x, key_mask=key_mask)
        torch.testing.assert_close(y[1, :6], layer(x[1:, :6])[0], **tol)
        torch.testing.assert_close(y[0], layer(x[:1])[0], **tol)
        # with a general SDPA mask as well: both apply
        bool_attn = torch.ones(2, 1, 10, 10, dtype=torch.bool).tril()
        both = layer(x, attn_mask=bool_attn, key_mask=key_mask)
        additive = torch.zeros(2, 1, 10, 10, dtype=F64).masked_fill(~bool_attn, float('-inf'))
        torch.testing.assert_close(layer(x, attn_mask=additive, key_mask=key_mask), both, **tol)
        torch.testing.assert_close(both, layer(x, is_causal=True, key_mask=key_mask), **tol)
        scripted = torch.jit.script(layer)
        torch.testing.assert_close(scripted(x, None, None, False, False, key_mask), y, **tol)


# ------------------------------------------------------------------------------------------------
# (2) references beside the ops; the torch backends are the layers' exact fast paths

LOCAL_CASES = [  # L, d, w, causal, mode, masked, bias
    (13, 8, 4, True, 'sliding', True, True),
    (13, 8, 4, False, 'sliding', False, True),
    (11, 6, 3, True, 'block', True, False),
    (17, 8, 5, False, 'block', True, True),
    (5, 8, 9, False, 'sliding', True, True),  # window longer than the sequence
    (9, 4, 1, True, 'sliding', False, True),  # w = 1
]


@pytest.mark.parametrize('length,d,w,causal,mode,masked,bias', LOCAL_CASES)
def test_lavo_local_torch_backend_matches_dense_reference(length, d, w, causal, mode, masked, bias):
    gen = torch.Generator().manual_seed(length + d + w)
    q, k, v = (torch.randn(2, 3, length, d, generator=gen, dtype=F64, requires_grad=True) for _ in range(3))
    table = torch.randn(2 * w - 1, generator=gen, dtype=F64, requires_grad=True) if bias else None
    mask = None
    if masked:
        mask = torch.rand(2, length, generator=gen) > 0.3
        mask[1, :3] = False
    leaves = [t for t in (q, k, v, table) if t is not None]
    y = lavo_local(q, k, v, table, 0.4, w, causal, mode, mask, backend='torch')
    y_ref = lavo_local_reference(q, k, v, table, 0.4, w, causal, mode, mask)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    g = torch.randn(y.shape, generator=gen, dtype=F64)
    for a, b in zip(torch.autograd.grad(y, leaves, g), torch.autograd.grad(y_ref, leaves, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize('causal,masked', [(True, True), (False, True), (True, False), (False, False)])
def test_lavo_global_torch_backend_matches_dense_reference(causal, masked):
    gen = torch.Generator().manual_seed(7)
    q, z = (torch.randn(2, 3, 11, 8, generator=gen, dtype=F64, requires_grad=True) for _ in range(2))
    basis = torch.linalg.qr(torch.randn(3, 8, 5, generator=gen, dtype=F64))[0].transpose(-1, -2).contiguous()
    basis.requires_grad_()
    mask = (torch.rand(2, 11, generator=gen) > 0.3) if masked else None
    if masked:
        mask[0, :2] = False
    y = lavo_global(q, z, basis, 0.5, mask, causal, backend='torch')
    y_ref = lavo_global_reference(q, z, basis, 0.5, mask, causal)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    g = torch.randn(y.shape, generator=gen, dtype=F64)
    for a, b in zip(torch.autograd.grad(y, [q, z, basis], g), torch.autograd.grad(y_ref, [q, z, basis], g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_layer_and_op_share_one_torch_implementation(monkeypatch):
    """LavoAttention's 1D local windows and CODE memory are the ops' PyTorch backend (no second copy)."""
    import vision_priors.layers.lavo as layer_module
    assert layer_module.lavo_local_windows is lavo_torch.lavo_local_windows
    assert layer_module.code_memory is lavo_torch.code_memory
    calls = []
    real = lavo_torch.lavo_local_windows
    monkeypatch.setattr(lavo_torch, 'lavo_local_windows', lambda *a: calls.append('op') or real(*a))
    monkeypatch.setattr(layer_module, 'lavo_local_windows', lambda *a: calls.append('layer') or real(*a))
    q, k, v = _qkv()
    lavo_local(q, k, v, None, 0.3, 3, backend='torch')
    LavoAttention(32, 2, num_slots=4, window=3, kernel_backend='torch')(torch.randn(B, L, 32))
    assert calls == ['op', 'layer']
    assert not hasattr(K.lavo, 'lavo_local_reference') or K.lavo.lavo_local_reference is lavo_local_reference


@pytest.mark.parametrize('squared', [True, False])
def test_chamfer_torch_backend_is_tiled_and_exact(monkeypatch, squared):
    """Tiles of a few points (many tiles per cloud) give the dense reference's neighbours (first index
    among ties), distances and gradients."""
    monkeypatch.setattr(chamfer, 'TORCH_TILE_PAIRS', 2 * 8 * 5)
    monkeypatch.setattr(chamfer, '_TORCH_TILE_M', 5)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 23, 3, generator=gen, dtype=F64)
    y = torch.randn(2, 17, 3, generator=gen, dtype=F64)
    y[:, 11] = y[:, 4]  # duplicate points: ties
    x[:, 2] = y[:, 4]
    x.requires_grad_()
    y.requires_grad_()
    x_mask = torch.rand(2, 23, generator=gen) > 0.2
    y_mask = torch.rand(2, 17, generator=gen) > 0.2
    y_mask[:, 4] = y_mask[:, 11] = True
    for kw in (dict(), dict(x_mask=x_mask, y_mask=y_mask)):
        got = chamfer.chamfer_nn(x, y, squared=squared, backend='torch', **kw)
        ref = chamfer_nn_reference(x, y, squared=squared, **kw)
        assert torch.equal(got.idx_x, ref.idx_x) and torch.equal(got.idx_y, ref.idx_y)
        assert (got.idx_x[:, 2] == 4).all()
        torch.testing.assert_close(got.dist_x, ref.dist_x, rtol=0, atol=1e-12)
        torch.testing.assert_close(got.dist_y, ref.dist_y, rtol=0, atol=1e-12)
        loss_got = got.dist_x.sum() + 2 * got.dist_y.sum()
        loss_ref = ref.dist_x.sum() + 2 * ref.dist_y.sum()
        for a, b in zip(torch.autograd.grad(loss_got, [x, y]), torch.autograd.grad(loss_ref, [x, y])):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_references_live_beside_the_ops_with_the_same_signatures():
    import inspect
    from vision_priors.kernels import chamfer_ref, flash_prior_ref, lavo_ref
    pairs = [(lavo_global, lavo_ref.lavo_global_reference), (lavo_local, lavo_ref.lavo_local_reference),
             (chamfer.chamfer_nn, chamfer_ref.chamfer_nn_reference)]
    if hasattr(K, 'flash_prior_attention'):
        pairs.append((K.flash_prior_attention, flash_prior_ref.flash_prior_attention_ref))
    for op, ref in pairs:
        assert list(inspect.signature(op).parameters) == list(inspect.signature(ref).parameters), op.__name__
    for name in ('chamfer_nn_reference', 'lavo_global_reference', 'lavo_local_reference',
                 'flash_prior_attention_ref'):
        assert name in K.__all__ and hasattr(K, name)


# ------------------------------------------------------------------------------------------------
# (3) one backend module

def test_fp32_dot_precision_rule(monkeypatch):
    assert _backend.gpu_dot_precision(torch.float32, allow_tf32=False) == 'ieee'
    assert _backend.gpu_dot_precision(torch.float32, allow_tf32=True) == 'tf32'
    for dtype in (torch.float16, torch.bfloat16):
        assert _backend.gpu_dot_precision(dtype, allow_tf32=False) == 'tf32'
    monkeypatch.setattr(_backend, 'FORCE_DOT_PRECISION', 'tf32x3')
    assert _backend.dot_precision(torch.float32) == 'tf32x3'
    monkeypatch.setattr(_backend, 'FORCE_DOT_PRECISION', None)
    allow = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        if not _backend.interpreting():
            assert _backend.dot_precision(torch.float32) == 'ieee'
        if _backend.HAS_TRITON:  # flash_prior's dispatcher follows the same rule
            from vision_priors.kernels.flash_prior import choose_config
            assert choose_config(64, torch.float32, 'goat', 'cuda').input_precision == 'ieee'
            assert choose_config(64, torch.float16, 'pope', 'cuda').input_precision == 'tf32'
            torch.backends.cuda.matmul.allow_tf32 = True
            assert choose_config(64, torch.float32, 'plain', 'cuda').input_precision == 'tf32'
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow


def test_tile_widths_dtype_table_and_poison(monkeypatch):
    assert [_backend.next_power_of_2(n) for n in (1, 16, 17, 33, 128)] == [16, 16, 32, 64, 128]
    assert _backend.next_power_of_2(3, floor=1) == 4
    assert _backend.TORCH_TO_TRITON == {torch.float16: 'fp16', torch.bfloat16: 'bf16', torch.float32: 'fp32'}
    monkeypatch.setattr(_backend, 'POISON_OUTPUTS', True)
    assert torch.isnan(_backend.empty(2, 3, dtype=torch.float32, device='cpu')).all()
    assert (_backend.empty((4,), dtype=torch.int64, device='cpu') == torch.iinfo(torch.int64).min).all()


def test_aot_signature_is_derived_from_the_kernel():
    triton = pytest.importorskip('triton')
    tl = pytest.importorskip('triton.language')

    @triton.heuristics({'HAS_M': lambda args: args['M'] is not None})
    @triton.jit
    def kernel(X, M, OUT, stride_x, scale, n, HAS_M: tl.constexpr, BLOCK: tl.constexpr):
        pass

    sig, consts = _backend.aot_signature(kernel, {'X': '*fp16', 'M': '*u8'}, constexprs={'BLOCK': 64})
    assert sig == {'X': '*fp16', 'M': '*u8', 'OUT': '*fp32', 'stride_x': 'i32', 'scale': 'fp32', 'n': 'i32',
                   'HAS_M': 'constexpr', 'BLOCK': 'constexpr'}
    assert consts == {'BLOCK': 64, 'HAS_M': True}
    sig, consts = _backend.aot_signature(kernel, {'X': '*fp16'}, absent={'M'}, constexprs={'BLOCK': 64})
    assert sig['M'] == 'constexpr' and consts == {'BLOCK': 64, 'M': None, 'HAS_M': False}
    with pytest.raises(ValueError, match=r"\['n'\] are not pointer parameters"):
        _backend.aot_signature(kernel, {'n': '*fp16'}, constexprs={'BLOCK': 64})
    with pytest.raises(ValueError, match=r"no value for the constexpr\(s\) \['BLOCK'\]"):
        _backend.aot_signature(kernel, {})
