"""The compiled PoPE CPU attention op (kernels/pope_cpu.cpp) against a float64 reference from the equations.

Reference (PoPE paper, Eqs. 3-6, real form Eq. 10): scores_ts = scale * Re sum_c softplus(q_tc) e^{i phi_q,tc}
conj(softplus(k_sc) e^{i phi_k,sc}), out = softmax(scores) v, in complex128 from the phases themselves (not
from the op's cos / sin tables). The op is float32; tolerances: 1e-5 absolute against the float64 reference
(outputs are convex combinations of v with |v| ~ 1), 2e-6 against its float32 torch-op twin
``pope_cpu_inference_attention``.

The op is built on first use; these tests skip only where no C++ compiler is on PATH (a build failure with
a compiler present fails them).
"""
import shutil

import pytest
import torch
import torch.nn.functional as F

import vision_priors.kernels.pope_cpu as pope_cpu
from vision_priors.layers.pope import phase_table, pope_cpu_inference_attention

pytestmark = pytest.mark.skipif(shutil.which('c++') is None and shutil.which('g++') is None,
                                reason='no C++ compiler to build kernels/pope_cpu.cpp')


@pytest.fixture(scope='module')
def op():
    built = pope_cpu.load_pope_cpu_op()
    assert built is not None, f'kernels/pope_cpu.cpp did not build: {pope_cpu._build_error}'
    return pope_cpu.pope_cpu_attention


def reference(q, k, v, q_phase, k_phase, scale):
    """float64 complex PoPE attention; phases broadcast against (B, H, N, d)."""
    q, k, v = q.double(), k.double(), v.double()
    q_c = F.softplus(q) * torch.exp(1j * q_phase.double())
    k_c = F.softplus(k) * torch.exp(1j * k_phase.double())
    scores = torch.einsum('bhtc,bhsc->bhts', q_c, k_c.conj()).real * scale
    return scores.softmax(-1) @ v


def make_inputs(B, H, N, d, per_sample, magnitude=2.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # q, k, v as strided views of one (B, N, 3, H, d) projection, as the layer produces them
    qkv = torch.randn(B, N, 3, H, d, generator=gen) * magnitude
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    v = v / magnitude
    lead = (B,) if per_sample else ()
    q_phase = torch.rand(*lead, 1, N, d, generator=gen, dtype=torch.float64) * 40 - 20
    k_phase = torch.rand(*lead, H, N, d, generator=gen, dtype=torch.float64) * 40 - 20
    return q, k, v, q_phase, k_phase


SHAPES = {
    # (B, H, N, d, per-sample tables)
    'vit_s_like_197': (2, 6, 197, 64, False),
    'odd_sizes': (3, 3, 37, 7, False),
    'per_sample_tables': (3, 2, 29, 10, True),
    'single_token': (2, 2, 1, 16, False),
    'odd_head_dim_long': (1, 3, 301, 33, False),
}


@pytest.mark.parametrize('case', sorted(SHAPES))
def test_op_matches_float64_reference(op, case):
    B, H, N, d, per_sample = SHAPES[case]
    q, k, v, q_phase, k_phase = make_inputs(B, H, N, d, per_sample, seed=len(case))
    scale = d ** -0.5
    q_table = phase_table(q_phase, scale).float()
    k_table = phase_table(k_phase).float()
    with torch.inference_mode():
        out = op(q, k, v, q_table, k_table)
        twin = pope_cpu_inference_attention(q, k, v, q_table, k_table)
    assert out.shape == (B, H, N, d) and out.dtype == torch.float32
    # laid out (B, N, H, d): the output projection's reshape after transpose(1, 2) is a view
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out.double(), reference(q, k, v, q_phase, k_phase, scale), rtol=0, atol=1e-5)
    torch.testing.assert_close(out, twin, rtol=0, atol=2e-6)


def test_head_groups_with_remainder(op):
    """A logits budget of two heads' (N, N) logits: 5 heads run as groups of 2, 2 and 1."""
    B, H, N, d = 2, 5, 23, 12
    q, k, v, q_phase, k_phase = make_inputs(B, H, N, d, False, seed=3)
    q_table, k_table = phase_table(q_phase, d ** -0.5).float(), phase_table(k_phase).float()
    with torch.inference_mode():
        grouped = op(q, k, v, q_table, k_table, logits_bytes=2 * N * N * 4)
        one_group = op(q, k, v, q_table, k_table, logits_bytes=H * N * N * 4)
    ref = reference(q, k, v, q_phase, k_phase, d ** -0.5)
    torch.testing.assert_close(grouped.double(), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(grouped, one_group, rtol=0, atol=1e-6)


def test_softplus_and_exp_over_extreme_inputs(op):
    """q, k up to |60| (softplus from ~1e-26 to 60): the op's own exp / log1p polynomials, checked through
    the output with a small scale that keeps the logits moderate."""
    B, H, N, d = 2, 2, 40, 16
    q, k, v, q_phase, k_phase = make_inputs(B, H, N, d, False, magnitude=25.0, seed=4)
    q, k = q.clamp(-60, 60), k.clamp(-60, 60)
    assert q.abs().max() > 50 and q.min() < -50
    scale = 2e-4
    q_table, k_table = phase_table(q_phase, scale).float(), phase_table(k_phase).float()
    with torch.inference_mode():
        out = op(q, k, v, q_table, k_table)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k, v, q_phase, k_phase, scale), rtol=0, atol=1e-5)


def test_softmax_of_large_logits(op):
    """Logits in the thousands (a nearly one-hot softmax) stay finite and match the reference."""
    B, H, N, d = 1, 2, 50, 8
    q, k, v, q_phase, k_phase = make_inputs(B, H, N, d, False, magnitude=30.0, seed=5)
    q_table, k_table = phase_table(q_phase, 1.0).float(), phase_table(k_phase).float()
    with torch.inference_mode():
        out = op(q, k, v, q_table, k_table)
        twin = pope_cpu_inference_attention(q, k, v, q_table, k_table)
    assert torch.isfinite(out).all()
    # float32 logits of this size carry absolute errors ~1e-4, so compare with the float32 twin
    torch.testing.assert_close(out, twin, rtol=0, atol=1e-4)


def test_process_floating_point_state_unchanged(op):
    """Loading the op must not switch the process to flush-to-zero / denormals-are-zero (what linking
    -ffast-math objects can do): a denormal product and a denormal input survive."""
    tiny = torch.tensor([1e-30]) * torch.tensor([1e-10])
    assert tiny.item() != 0.0
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0


def test_clear_errors(op):
    """The wrapper checks device, dtype and shapes in Python (ValueError naming them) before the op runs."""
    q, k, v, q_phase, k_phase = make_inputs(1, 2, 5, 4, False)
    q_table, k_table = phase_table(q_phase).float(), phase_table(k_phase).float()
    with torch.inference_mode():
        with pytest.raises(ValueError, match=r'^pope_cpu_attention: float32 tensors expected, got q torch.float64'):
            op(q.double(), k.double(), v.double(), q_table.double(), k_table.double())
        with pytest.raises(ValueError, match=r'k_table of shape \(2, 5, 2, 3\) does not match B=1, H=2, N=5, d=4'):
            op(q, k, v, q_table, k_table[..., :3])
        with pytest.raises(ValueError, match=r'q_table of shape \(3, 5, 2, 4\) does not match B=1, H=2'):
            op(q, k, v, q_table.expand(3, 5, 2, 4), k_table)  # 3 heads in the table, 2 in q
        with pytest.raises(ValueError, match=r'q, k, v must all be \(B, H, N, d\), got \(1, 2, 5, 4\), \(1, 2, 4, 4\)'):
            op(q, k[:, :, :4], v, q_table, k_table)
        with pytest.raises(ValueError, match=r'^pope_cpu_attention: CPU tensors expected, got meta / cpu / cpu$'):
            op(q.to('meta'), k, v, q_table, k_table)
    with pytest.raises(RuntimeError, match='no backward'):
        op(q.requires_grad_(), k, v, q_table, k_table)


def test_compiled_op_checks_its_inputs_too(op):
    """The op's own TORCH_CHECKs (its second line, for direct torch.ops callers) raise RuntimeError."""
    q, k, v, q_phase, k_phase = make_inputs(1, 2, 5, 4, False)
    q_table, k_table = phase_table(q_phase).float(), phase_table(k_phase).float()
    raw = torch.ops.vision_priors_cpu.pope_attention
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match='float32 tensors expected'):
            raw(q.double(), k.double(), v.double(), q_table.double(), k_table.double(), 1 << 20)
        with pytest.raises(RuntimeError, match=r'k_table of shape .* does not match B=1, H=2, N=5, d=4'):
            raw(q, k, v, q_table, k_table[..., :3], 1 << 20)


def test_build_failure_falls_back_with_a_warning(monkeypatch):
    """No compiler / ninja: one RuntimeWarning naming the cause, and the layer keeps the torch-op path."""
    from torch.utils import cpp_extension

    import vision_priors.layers.pope as pope_module
    from vision_priors.layers import PopeAttention

    def failing_load(*args, **kwargs):
        raise RuntimeError('Ninja is required to load C++ extensions')

    monkeypatch.setattr(pope_cpu, '_op', None)
    monkeypatch.setattr(pope_cpu, '_build_error', None)
    monkeypatch.setattr(cpp_extension, 'load', failing_load)
    with pytest.warns(RuntimeWarning, match='Ninja is required'):
        assert pope_cpu.load_pope_cpu_op() is None
    calls = []
    real = pope_module.pope_cpu_inference_attention
    monkeypatch.setattr(pope_module, 'pope_cpu_inference_attention', lambda *a: calls.append(1) or real(*a))
    layer = PopeAttention(32, 2, num_prefix_tokens=1, grid_size=(3, 3)).eval()
    with torch.inference_mode():
        out = layer(torch.randn(2, 10, 32))
    assert calls and torch.isfinite(out).all()
    with pytest.raises(RuntimeError, match='unavailable'):
        with torch.inference_mode():
            pope_cpu.pope_cpu_attention(*make_inputs(1, 1, 3, 4, False)[:3], torch.ones(1, 3, 2, 4),
                                        torch.ones(1, 3, 2, 4))


@pytest.mark.parametrize('setting', ['auto', 'argument_torch', 'env_torch', 'float64'])
def test_layer_dispatch(op, setting, monkeypatch):
    """PopeAttention's CPU inference path takes the compiled op for float32 unless told 'torch' (on a CPU where the
    op was measured faster: pinned here, so the test means the same on AVX2-only and AVX-512 machines)."""
    import vision_priors.layers.pope as pope_module
    from vision_priors.layers import PopeAttention

    monkeypatch.setattr(pope_module, 'compiled_op_is_faster_here', lambda: True)
    compiled, torch_ops = [], []
    real_op, real_twin = pope_module.pope_cpu_attention, pope_module.pope_cpu_inference_attention
    monkeypatch.setattr(pope_module, 'pope_cpu_attention', lambda *a: compiled.append(1) or real_op(*a))
    monkeypatch.setattr(pope_module, 'pope_cpu_inference_attention', lambda *a: torch_ops.append(1) or real_twin(*a))
    if setting == 'env_torch':
        monkeypatch.setenv('VISION_PRIORS_KERNELS', 'torch')
    layer = PopeAttention(32, 2, num_prefix_tokens=1, grid_size=(3, 3),
                          kernel_backend='torch' if setting == 'argument_torch' else 'auto').eval()
    x = torch.randn(2, 10, 32)
    if setting == 'float64':
        layer, x = layer.double(), x.double()
    with torch.inference_mode():
        layer(x)
    assert (bool(compiled), bool(torch_ops)) == ((True, False) if setting == 'auto' else (False, True))


@pytest.mark.parametrize('threads', [1, 3])
def test_thread_counts(op, threads):
    """Rows split over 1 or 3 threads (the suite otherwise runs with 2) give the reference result."""
    B, H, N, d = 2, 3, 131, 24
    q, k, v, q_phase, k_phase = make_inputs(B, H, N, d, False, seed=6)
    q_table, k_table = phase_table(q_phase, d ** -0.5).float(), phase_table(k_phase).float()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            out = op(q, k, v, q_table, k_table)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), reference(q, k, v, q_phase, k_phase, d ** -0.5), rtol=0, atol=1e-5)
