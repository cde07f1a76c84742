"""PoPE attention: the real-valued single-SDPA path against a float64 complex-arithmetic reference.

Reference (PoPE paper, Eqs. 3-6): q~_tc = softplus(q_tc) e^{i t w_c}, k~_sc = softplus(k_sc)
e^{i (s w_c + delta_c)}, a_ts = Re sum_c q~_tc conj(k~_sc) / sqrt(d), computed with complex128
tensors. In 2D the first d/2 channels use x, the rest y; prefix tokens have phase 0 and no delta.

Tolerances: float64 forward 1e-10, gradients 1e-9; float32 fused vs dense 2e-5; float32 CPU inference
path (the compiled op, kernels/pope_cpu.cpp) vs SDPA path 2e-6 and vs the float64 reference 1e-5.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from vision_priors.layers import PopeAttention, grid_coords, sequence_coords, wrap_phase_bias
import vision_priors.layers.pope as pope_module
from grad_check import assert_grads_match


def pope_reference(layer: PopeAttention, x: torch.Tensor, coords: torch.Tensor, causal: bool) -> torch.Tensor:
    x = x.double()
    coords = coords.double()
    B, N, C = x.shape
    H, d = layer.num_heads, layer.head_dim
    P = layer.num_prefix_tokens
    D = coords.shape[1]
    qkv = F.linear(x, layer.qkv.weight.double(), None if layer.qkv.bias is None else layer.qkv.bias.double())
    q, k, v = qkv.reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4)
    theta = layer.phases.freq_base
    per_axis = d // D
    omega = torch.tensor([theta ** (-(c % per_axis) / per_axis) for c in range(d)], dtype=torch.float64)
    axis_of_channel = torch.tensor([c // per_axis for c in range(d)])
    # position phase of token t in channel c: p_t[axis(c)] * w_c; prefix tokens: 0
    pos = torch.zeros(N, d, dtype=torch.float64)
    pos[P:] = coords[:, axis_of_channel] * omega[None]
    delta = -torch.remainder(-layer.phases.phase_bias_raw.double(), 2 * math.pi)  # in (-2 pi, 0]
    key_phase = pos[None].expand(H, N, d).clone()
    key_phase[:, P:] = key_phase[:, P:] + delta[:, None, :]
    q_c = F.softplus(q) * torch.exp(1j * pos)[None, None]
    k_c = F.softplus(k) * torch.exp(1j * key_phase)[None]
    scores = torch.einsum('bhtc,bhsc->bhts', q_c, k_c.conj()).real / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float('-inf'))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, N, H * d)
    return F.linear(out, layer.proj.weight.double(), layer.proj.bias.double())


CASES = {
    '1d_bidirectional': (dict(dim=32, num_heads=2, num_spatial_dims=1), 13, lambda m: sequence_coords(m), False),
    '1d_causal': (dict(dim=24, num_heads=3, num_spatial_dims=1, freq_base=500.), 17,
                  lambda m: sequence_coords(m), True),
    '2d_class_token': (dict(dim=32, num_heads=2, num_spatial_dims=2, num_prefix_tokens=1), 16,
                       lambda m: grid_coords((3, 5)), False),
    '2d_arbitrary_coords': (dict(dim=40, num_heads=2, num_spatial_dims=2, num_prefix_tokens=2, qkv_bias=True), 11,
                            lambda m: torch.randn(m, 2, generator=torch.Generator().manual_seed(3)) * 4, False),
}


def _randomize(layer: PopeAttention, seed: int = 0) -> None:
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        # values outside [-2 pi, 0] too: the wrap must make them equivalent
        layer.phases.phase_bias_raw.copy_(torch.randn(layer.phases.phase_bias_raw.shape, generator=gen) * 5)


@pytest.fixture(params=['dense', 'sdpa'])
def cpu_training_path(request, monkeypatch):
    """CPU calls with autograd on take the explicit softmax path at short lengths (``use_dense_cpu_training``);
    'sdpa' turns it off so the same test checks the SDPA path (values widened to 2d) too."""
    if request.param == 'sdpa':
        monkeypatch.setattr(pope_module, 'CPU_DENSE_TRAIN_LOGITS_BYTES', 0)
    return request.param


@pytest.mark.parametrize('case', sorted(CASES))
def test_fast_path_matches_float64_reference(case, cpu_training_path):
    kwargs, num_tokens, make_coords, causal = CASES[case]
    torch.manual_seed(0)
    layer = PopeAttention(**kwargs).double()
    _randomize(layer)
    coords = make_coords(num_tokens - layer.num_prefix_tokens).double()
    x = torch.randn(2, num_tokens, kwargs['dim'], dtype=torch.float64, requires_grad=True)
    out = layer(x, coords=coords, is_causal=causal)
    ref = pope_reference(layer, x, coords, causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)

    assert 'phases.phase_bias_raw' in assert_grads_match(layer, x, out, ref)


@pytest.mark.parametrize('case', sorted(CASES))
def test_fused_matches_dense_float32(case, cpu_training_path):
    kwargs, num_tokens, make_coords, causal = CASES[case]
    torch.manual_seed(1)
    layer = PopeAttention(**kwargs)
    _randomize(layer, 1)
    coords = make_coords(num_tokens - layer.num_prefix_tokens)
    x = torch.randn(3, num_tokens, kwargs['dim'])
    fused = layer(x, coords=coords, is_causal=causal)
    dense, probs = layer(x, coords=coords, is_causal=causal, return_attn=True)
    torch.testing.assert_close(fused, dense, rtol=0, atol=2e-5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, layer.num_heads, num_tokens))


BATCHED_CASES = {
    '2d_scan_orders': (dict(dim=32, num_heads=2, num_spatial_dims=2), 12, False),
    '2d_prefix': (dict(dim=40, num_heads=2, num_spatial_dims=2, num_prefix_tokens=2, qkv_bias=True), 10, False),
    '1d_causal_prefix': (dict(dim=24, num_heads=3, num_spatial_dims=1, num_prefix_tokens=1), 8, True),
}


@pytest.mark.parametrize('case', sorted(BATCHED_CASES))
def test_per_sample_coords_match_float64_reference(case):
    """(B, N, D) coordinates: sample b equals the complex float64 reference with coords[b], forward and backward."""
    kwargs, num_tokens, causal = BATCHED_CASES[case]
    torch.manual_seed(6)
    layer = PopeAttention(**kwargs).double()
    _randomize(layer, 6)
    batch, dims, num = 3, kwargs['num_spatial_dims'], num_tokens - kwargs.get('num_prefix_tokens', 0)
    gen = torch.Generator().manual_seed(7)
    base = grid_coords((2, num // 2)).double() if dims == 2 and num % 2 == 0 else sequence_coords(num).double()
    base = base[:, :dims]
    coords = torch.stack([base[torch.randperm(num, generator=gen)] for _ in range(batch)])
    coords[1] = torch.randn(num, dims, generator=gen, dtype=torch.float64) * 3
    x = torch.randn(batch, num_tokens, kwargs['dim'], dtype=torch.float64, requires_grad=True)
    out = layer(x, coords=coords, is_causal=causal)
    ref = torch.cat([pope_reference(layer, x[b:b + 1], coords[b], causal) for b in range(batch)])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    dense = layer(x, coords=coords, is_causal=causal, return_attn=True)[0]
    torch.testing.assert_close(dense, ref, rtol=0, atol=1e-10)
    assert 'phases.phase_bias_raw' in assert_grads_match(layer, x, out, ref)
    same = coords[:1].expand(batch, -1, -1)
    torch.testing.assert_close(layer(x, coords=same, is_causal=causal), layer(x, coords=coords[0], is_causal=causal),
                               rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r'2 rows for a batch of 3 samples'):
        layer(x, coords=coords[:2])


def test_phase_bias_is_wrapped_and_never_frozen():
    raw = torch.tensor([-20.0, -2 * math.pi - 0.1, -1.0, 0.0, 0.5, 13.0], requires_grad=True)
    delta = wrap_phase_bias(raw)
    assert (delta <= 0).all() and (delta > -2 * math.pi).all()
    torch.testing.assert_close(torch.cos(delta), torch.cos(raw))
    torch.testing.assert_close(torch.sin(delta), torch.sin(raw))
    delta.sum().backward()
    torch.testing.assert_close(raw.grad, torch.ones_like(raw))  # derivative 1 at and beyond the bounds
    # zero init, and the zero-initialised bias receives gradient in a real layer
    layer = PopeAttention(32, 2, num_spatial_dims=1)
    assert layer.phases.phase_bias.abs().max() == 0
    layer(torch.randn(2, 9, 32)).square().sum().backward()
    assert layer.phases.phase_bias_raw.grad.abs().max() > 0


def test_scores_are_relative_without_prefix_tokens():
    torch.manual_seed(5)
    layer = PopeAttention(32, 2, num_spatial_dims=2).double()
    _randomize(layer)
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    coords = torch.rand(12, 2, dtype=torch.float64) * 6
    out_a = layer(x, coords=coords)
    out_b = layer(x, coords=coords + torch.tensor([2.0, -7.5], dtype=torch.float64))
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=1e-10)


def test_clear_errors():
    with pytest.raises(ValueError, match='odd'):
        PopeAttention(30, 2, num_spatial_dims=2)  # head dim 15
    layer = PopeAttention(32, 2, num_spatial_dims=2, num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r'coords has shape \(4,\), expected \(4, 2\)'):
        layer(torch.randn(1, 5, 32), coords=torch.zeros(4))


@pytest.mark.parametrize('grad', [True, False])  # autograd off: the CPU inference path, checked before it too
@pytest.mark.parametrize('bad', [float('nan'), float('inf')])
def test_non_finite_coords_are_errors(bad, grad):
    """A NaN / inf coordinate is a ValueError naming it (it would turn the whole sample's output NaN)."""
    layer = PopeAttention(32, 2, num_spatial_dims=2, num_prefix_tokens=1)
    x = torch.randn(2, 5, 32)
    shared = torch.rand(4, 2)
    shared[2, 0] = bad
    per_sample = torch.rand(2, 4, 2)
    per_sample[0, 3, 1] = bad
    with torch.set_grad_enabled(grad):
        with pytest.raises(ValueError, match=rf'^coords must be finite: coords\[2, 0\] = {bad}$'):
            layer(x, coords=shared)
        with pytest.raises(ValueError, match=rf'^coords must be finite: coords\[0, 3, 1\] = {bad}$'):
            layer(x, coords=per_sample)
        with pytest.raises(ValueError, match=rf'^coords must be finite: coords\[0, 3, 1\] = {bad}$'):
            layer(x, coords=per_sample, return_attn=True)
        layer1d = PopeAttention(32, 2, num_spatial_dims=1)
        with pytest.raises(ValueError, match=rf'^coords must be finite: coords\[1\] = {bad}$'):
            layer1d(torch.randn(1, 3, 32), coords=torch.tensor([0., bad, 2.]))
    # finite coordinates far from the grid are fine
    assert torch.isfinite(layer(x, coords=torch.rand(4, 2) * 1e4)).all()


# ---- CPU inference path (autograd off, no mask): per-sample features, head groups of cache-sized logits ----

INFERENCE_CASES = {
    '1d_bidirectional': (dict(dim=32, num_heads=2, num_spatial_dims=1), 13, 'shared'),
    '2d_class_token': (dict(dim=32, num_heads=2, num_spatial_dims=2, num_prefix_tokens=1), 16, 'shared'),
    '2d_arbitrary_coords': (dict(dim=40, num_heads=2, num_spatial_dims=2, num_prefix_tokens=2, qkv_bias=True), 11,
                            'shared'),
    '2d_per_sample_coords': (dict(dim=40, num_heads=2, num_spatial_dims=2, num_prefix_tokens=1), 10, 'per_sample'),
    # 301 tokens in float64: 2 MiB of logits holds 2 heads, so 3 heads run as a group of 2 and a group of 1
    '1d_head_groups_with_remainder': (dict(dim=24, num_heads=3, num_spatial_dims=1, num_prefix_tokens=1), 301,
                                      'shared'),
}


# path: (layer dtype, the function the layer must call, tolerance against the float64 reference)
INFERENCE_PATHS = {
    'torch_ops': (torch.float64, 'pope_cpu_inference_attention', 1e-10),
    'compiled': (torch.float32, 'pope_cpu_attention', 1e-5),  # kernels/pope_cpu.cpp, float32 only
}


@pytest.mark.parametrize('path', sorted(INFERENCE_PATHS))
@pytest.mark.parametrize('case', sorted(INFERENCE_CASES))
def test_cpu_inference_path_matches_float64_reference(case, path, monkeypatch):
    import shutil

    import vision_priors.layers.pope as pope_module
    dtype, function, atol = INFERENCE_PATHS[path]
    if path == 'compiled' and shutil.which('c++') is None and shutil.which('g++') is None:
        pytest.skip('no C++ compiler to build kernels/pope_cpu.cpp')
    if path == 'compiled':  # the op's numerics on any CPU, also where dispatch prefers the twin for speed
        monkeypatch.setattr(pope_module, 'compiled_op_is_faster_here', lambda: True)
    kwargs, num_tokens, coords_kind = INFERENCE_CASES[case]
    torch.manual_seed(8)
    layer = PopeAttention(**kwargs).to(dtype).eval()
    _randomize(layer, 8)
    batch, num = 3, num_tokens - layer.num_prefix_tokens
    gen = torch.Generator().manual_seed(9)
    shape = (num, layer.num_spatial_dims) if coords_kind == 'shared' else (batch, num, layer.num_spatial_dims)
    coords = torch.randn(*shape, generator=gen, dtype=dtype) * 4
    x = torch.randn(batch, num_tokens, kwargs['dim'], dtype=dtype, generator=gen) * 2
    calls = []
    real = getattr(pope_module, function)
    monkeypatch.setattr(pope_module, function, lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        out = layer(x, coords=coords)
    assert calls, f'{function} was not called'
    if coords_kind == 'shared':
        ref = pope_reference(layer, x, coords, False)
    else:
        ref = torch.cat([pope_reference(layer, x[b:b + 1], coords[b], False) for b in range(batch)])
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=atol)


def test_cpu_inference_path_matches_sdpa_path_float32(cpu_training_path):
    """A ViT-S-like layer (6 heads of 64, class token, 14 x 14 grid) in float32: inference path vs the autograd
    paths (explicit softmax at this length, SDPA when forced)."""
    torch.manual_seed(10)
    layer = PopeAttention(384, 6, num_prefix_tokens=1, grid_size=(14, 14), qkv_bias=True).eval()
    _randomize(layer, 10)
    x = torch.randn(2, 197, 384)
    with torch.inference_mode():
        fast = layer(x)
    sdpa = layer(x)  # autograd on: the dense path at 197 tokens, or SDPA when forced
    torch.testing.assert_close(fast, sdpa.detach(), rtol=0, atol=2e-6)


def test_cpu_inference_path_only_where_it_applies():
    from vision_priors.layers.pope import use_cpu_inference_attention
    x = torch.zeros(1, 4, 8)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    with torch.no_grad():
        assert use_cpu_inference_attention(x, None, False, False)
        assert not use_cpu_inference_attention(x, mask, False, False)
        assert not use_cpu_inference_attention(x, None, True, False)
        assert not use_cpu_inference_attention(x, None, False, True)
    assert not use_cpu_inference_attention(x, None, False, False)  # autograd on
    # masked / causal calls under no_grad still give the reference result (through SDPA)
    torch.manual_seed(11)
    layer = PopeAttention(24, 3, num_spatial_dims=1).double().eval()
    _randomize(layer, 11)
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    coords = sequence_coords(9).double()
    with torch.no_grad():
        torch.testing.assert_close(layer(x, coords=coords, is_causal=True), pope_reference(layer, x, coords, True),
                                   rtol=0, atol=1e-10)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_softplus_into_matches_softplus(dtype):
    """Against float64 softplus (no threshold): within 2 ulp relative and 1 ulp of 1 absolute."""
    from vision_priors.layers.pope import softplus_into
    x = torch.cat([torch.linspace(-120, 120, 4001, dtype=dtype), torch.randn(4000, dtype=dtype) * 3])
    out, scratch = torch.empty_like(x), torch.empty_like(x)
    result = softplus_into(x, out, scratch)
    assert result.data_ptr() == out.data_ptr()
    assert torch.isfinite(result).all()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(result, F.softplus(x.double(), threshold=1e9).to(dtype), rtol=2 * eps, atol=eps)


@pytest.mark.parametrize('isa, capability, compiled', [('x86-64-v4', 'AVX512', True), ('x86-64-v3', 'AVX2', False),
                                                       ('x86-64-v4', 'AVX2', False), ('x86-64', 'DEFAULT', False),
                                                       (None, 'AVX512', False)])
def test_dispatch_never_picks_the_compiled_op_where_it_is_slower(isa, capability, compiled, monkeypatch):
    """Issue 16: the compiled op runs only for (op ISA, ATen capability) pairs where it beat the torch-op twin;
    elsewhere (its AVX2 clone lost to ATen's AVX2 kernels) float32 CPU inference runs the twin."""
    import vision_priors.layers.pope as pope_module
    monkeypatch.setattr(pope_module, 'compiled_op_isa', lambda: isa)
    monkeypatch.setattr(torch.backends.cpu, 'get_cpu_capability', lambda: capability)
    assert pope_module.use_compiled_cpu_op(torch.float32) is compiled
    calls = []
    real_twin = pope_module.pope_cpu_inference_attention
    monkeypatch.setattr(pope_module, 'pope_cpu_inference_attention', lambda *a: calls.append('twin') or real_twin(*a))
    monkeypatch.setattr(pope_module, 'pope_cpu_attention', lambda *a: calls.append('compiled') or real_twin(*a[:5]))
    layer = PopeAttention(32, 2, num_prefix_tokens=1, grid_size=(3, 3)).eval()
    x = torch.randn(2, 10, 32)
    with torch.inference_mode():
        out = layer(x)
    assert calls == ['compiled' if compiled else 'twin']
    torch.testing.assert_close(out, layer(x).detach(), rtol=0, atol=2e-6)  # autograd on: the SDPA path


def test_compiled_op_isa_follows_the_cpu_flags():
    """The op reports the clone its resolver picks; it must agree with the kernel's view of the CPU."""
    import os
    from vision_priors.kernels.pope_cpu import compiled_op_isa
    isa = compiled_op_isa()
    if isa is None:
        pytest.skip('kernels/pope_cpu.cpp cannot be built here')
    assert isa in ('x86-64-v4', 'x86-64-v3', 'x86-64', 'native')
    if not os.path.exists('/proc/cpuinfo') or isa == 'native':
        return
    with open('/proc/cpuinfo') as f:
        flags = set(next(line for line in f if line.startswith('flags')).split(':', 1)[1].split())
    has_v4 = {'avx512f', 'avx512bw', 'avx512cd', 'avx512dq', 'avx512vl', 'avx2', 'fma'} <= flags
    has_v3 = {'avx2', 'fma', 'bmi1', 'bmi2', 'f16c', 'movbe'} <= flags
    assert (isa == 'x86-64-v4') == has_v4
    if not has_v4:
        assert (isa == 'x86-64-v3') == has_v3


def test_pinned_isa_setting_is_checked(monkeypatch):
    """A wrong VISION_PRIORS_POPE_CPU_ISA is named in the warning and the layers keep the torch-op twin."""
    from vision_priors.kernels import pope_cpu
    import vision_priors.layers.pope as pope_module
    monkeypatch.setattr(pope_cpu, '_op', None)
    monkeypatch.setattr(pope_cpu, '_build_error', None)
    monkeypatch.setenv('VISION_PRIORS_POPE_CPU_ISA', 'avx9')
    with pytest.warns(RuntimeWarning, match="VISION_PRIORS_POPE_CPU_ISA must be one of .*got 'avx9'"):
        assert pope_cpu.load_pope_cpu_op() is None
    assert pope_cpu.compiled_op_isa() is None and not pope_module.use_compiled_cpu_op(torch.float32)


@pytest.mark.parametrize('table_shape', [(3, 5, 2, 4), (1, 5, 2, 4), (2, 3, 5, 2, 4)])
def test_magnitude_features_equal_softplus_times_table(table_shape):
    """The training path's fused features (backward without the (..., 2, d) products) against
    ``pope_features(F.softplus(x), table)`` in float64: values to 1e-15, first derivatives in x and in a table
    shared by the batch, by the heads or per sample, second derivatives; large |x| included (F.softplus switches
    to x past 20, where its gradient is exactly 1)."""
    import torch.nn.functional as F
    from vision_priors.layers.pope import magnitude_features, pope_features
    torch.manual_seed(2)
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64) * 4
    x[0, 0, 0] = torch.tensor([-40., -20.5, 19.9, 45.], dtype=torch.float64)
    x.requires_grad_()
    table = torch.randn(*table_shape, dtype=torch.float64, requires_grad=True)
    y, ref = magnitude_features(x, table), pope_features(F.softplus(x), table)
    assert y.shape == ref.shape == (2, 3, 5, 8) and 'MagnitudeFeatures' in type(y.grad_fn).__name__
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, table), g)
    grads_ref = torch.autograd.grad(ref, (x, table), g)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-15)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-8)
    small = (x.detach()[:, :1, :2, :2].clone().requires_grad_(),
             table.detach()[..., :2, :, :2].clone().requires_grad_())
    assert torch.autograd.gradcheck(magnitude_features, small)
    assert torch.autograd.gradgradcheck(magnitude_features, small)
    with torch.no_grad():
        assert magnitude_features(x, table).grad_fn is None


def test_training_path_features_contiguous_from_qkv_views():
    """q / k / v arrive as permuted views of the qkv projection. The fused features come out contiguous in
    (B, H, N, 2d) (so the attention's matmuls read them without copies, forward and backward), and the features
    and the attention equal the plain composition on those views, values and gradients to 1e-12 (float64)."""
    import torch.nn.functional as F
    from vision_priors.layers.pope import dense_softmax_attention, magnitude_features, pope_features
    torch.manual_seed(5)
    B, N, H, d = 2, 7, 3, 5
    qkv = torch.randn(B, N, 3 * H * d, dtype=torch.float64, requires_grad=True)
    table = torch.randn(H, N, 2, d, dtype=torch.float64)
    q, k, v = qkv.reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)
    assert not q.is_contiguous() and not v.is_contiguous()
    fq, fk = magnitude_features(q, table), magnitude_features(k, table)
    assert fq.is_contiguous() and fk.is_contiguous() and fq.shape == (B, H, N, 2 * d)
    out = dense_softmax_attention(fq, fk, v)
    rq, rk = pope_features(F.softplus(q), table), pope_features(F.softplus(k), table)
    ref = torch.softmax(rq @ rk.transpose(-2, -1), dim=-1) @ v
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, qkv, g)[0], torch.autograd.grad(ref, qkv, g)[0],
                               rtol=0, atol=1e-12)
    # a table that broadcasts x to a larger shape: the buffer takes the broadcast shape (no resize of ``out``)
    wide = torch.randn(4, H, N, 2, d, dtype=torch.float64)[:, None]  # (4, 1, H, N, 2, d) against x (B, H, N, d)
    x = q.detach().clone().requires_grad_()
    y, r = magnitude_features(x, wide), pope_features(F.softplus(x), wide)
    assert y.shape == r.shape == (4, B, H, N, 2 * d) and y.is_contiguous()
    torch.testing.assert_close(y, r, rtol=0, atol=1e-15)
    gy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, gy)[0], torch.autograd.grad(r, x, gy)[0], rtol=0, atol=1e-12)


def test_dense_cpu_training_only_at_short_lengths(monkeypatch):
    """The explicit softmax path serves CPU autograd calls up to CPU_DENSE_TRAIN_LOGITS_BYTES of logits per head
    (ViT-S at 224 px: 197 tokens), SDPA the longer ones (384 px: 577 tokens), and never no-grad calls."""
    from vision_priors.layers.pope import use_dense_cpu_training
    x = torch.zeros(1, 4, 8)
    assert use_dense_cpu_training(x, 197) and not use_dense_cpu_training(x, 577)
    with torch.no_grad():
        assert not use_dense_cpu_training(x, 197)
    # both autograd paths give the same values and gradients on a ViT-S-like layer in float32
    torch.manual_seed(12)
    layer = PopeAttention(96, 3, num_prefix_tokens=1, grid_size=(7, 7), qkv_bias=True)
    _randomize(layer, 12)
    x = torch.randn(2, 50, 96, requires_grad=True)
    grads = []
    for limit in (pope_module.CPU_DENSE_TRAIN_LOGITS_BYTES, 0):  # the dense path, then SDPA
        monkeypatch.setattr(pope_module, 'CPU_DENSE_TRAIN_LOGITS_BYTES', limit)
        out = layer(x)
        grads.append((out.detach(),) + torch.autograd.grad(out.square().sum(), [x, *layer.parameters()]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_dense_softmax_attention_equals_autograd_composition():
    """The CPU training path's attention with its written-out backward against ``softmax(q k^T) v`` under autograd,
    float64, odd shapes (q / k width 2d = 10, v width 5): values and the gradients of q, k and v to 1e-12."""
    from vision_priors.layers.pope import dense_softmax_attention
    torch.manual_seed(4)
    q, k = (torch.randn(2, 3, 7, 10, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 7, 5, dtype=torch.float64, requires_grad=True)
    out = dense_softmax_attention(q, k, v)
    ref = torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(dense_softmax_attention, (q[:1, :1, :4, :4], k[:1, :1, :4, :4], v[:1, :1, :4]))
