"""Positional flash attention (kernels/flash_prior.py) against its dense float64 reference.

Every case runs the Triton kernel (CPU: Triton's interpreter, TRITON_INTERPRET=1; GPU: compiled) on
small odd shapes and compares the forward output and EVERY gradient (q, k, v; GOAT: alpha, beta, the
key default u, the learned frequencies and coordinates; PoPE: the phase bias delta) with
``flash_prior_attention_ref`` evaluated in float64 on the same inputs. Kernel outputs and gradients
are allocated pre-filled with NaN, so an element the kernels forget to write fails the comparison.

Tolerances (max abs error <= tol * max(1, max |reference|)): fp32 inputs with IEEE fp32 dots 2e-5;
fp16 inputs 1e-2, bf16 (GPU only: the interpreter's bf16 tl.dot is wrong) 3e-2 (16-bit operands,
fp32 accumulation). The reference itself is checked against the layers' exact paths
(GoatAttention, PopeAttention) in float64 to 1e-10, so kernel, reference and layers share
conventions. On a GPU the same file also runs the dispatcher's default tiles for head dims 32, 64
and 128 in fp16 and bf16.
"""
import os
import re

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA and os.environ.get('TRITON_INTERPRET') != '1':
    # Triton picks interpreter or compiler for its whole library when first imported, so without CUDA
    # these tests run with TRITON_INTERPRET=1 set before Triton's import: in a child process by
    # tests/test_kernels_interpreter.py, or as ``TRITON_INTERPRET=1 pytest tests/test_kernels_flash_prior.py``.
    pytest.skip('no CUDA: runs in the Triton interpreter via tests/test_kernels_interpreter.py',
                allow_module_level=True)
pytest.importorskip('triton')

from vision_priors.kernels import _backend  # noqa: E402
from vision_priors.kernels.flash_prior import aot_specs, choose_config, flash_prior_attention  # noqa: E402
from vision_priors.kernels.flash_prior_ref import flash_prior_attention_ref  # noqa: E402
from vision_priors.layers import GoatAttention, PopeAttention, grid_coords, sequence_coords  # noqa: E402

DEVICE = torch.device('cuda' if _CUDA else 'cpu')
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def nan_filled_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, 'POISON_OUTPUTS', True)  # outputs and grads start as NaN


def _make_case(mode: str, B: int, H: int, N: int, d_qk: int, d_v: int, *, D: int = 1, R: int = 2, P: int = 0,
               padding: bool = False, per_sample: bool = False, learn_pos: bool = False,
               dtype: torch.dtype = torch.float32, seed: int = 0):
    """Random inputs; returns (q, k, v, kwargs, leaves: {name: tensor that needs a gradient})."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(DEVICE)

    q, k, v = rnd(B, H, N, d_qk).to(dtype), rnd(B, H, N, d_qk).to(dtype), rnd(B, H, N, d_v).to(dtype)
    leaves = {'q': q, 'k': k, 'v': v}
    kw = {}
    if padding:
        mask = torch.ones(B, N, dtype=torch.bool)  # key_mask: True = valid key
        mask[0, N - 5:] = False  # right padding (a shorter sequence)
        mask[-1, :3] = False  # left padding: under causal the first 3 queries see no key
        kw['key_mask'] = mask.to(DEVICE)
    M = N - P
    if mode != 'plain':
        coords = rnd(B, M, D, s=3.0) if per_sample else (
            sequence_coords(M, offset=2).to(DEVICE) if D == 1 else rnd(M, D, s=3.0))
        kw.update(coords=coords, num_prefix_tokens=P)
    if mode == 'goat':
        kw.update(freqs=(0.05 + torch.rand(D, R, generator=gen) * 0.6).to(DEVICE), alpha=rnd(H, D, R),
                  beta=rnd(H, D, R), key_default=rnd(B, H, N) if per_sample else rnd(H, N))
        leaves.update(alpha=kw['alpha'], beta=kw['beta'], key_default=kw['key_default'])
        if learn_pos:
            leaves.update(freqs=kw['freqs'], coords=kw['coords'])
    if mode == 'pope':
        per_axis = d_qk // D
        ladder = 100.0 ** (-torch.arange(per_axis, dtype=torch.float32) / per_axis)
        kw.update(freqs=ladder.expand(D, per_axis).to(DEVICE), phase_bias=rnd(H, d_qk, s=3.0))
        leaves['phase_bias'] = kw['phase_bias']
    for t in leaves.values():
        t.requires_grad_(True)
    return q, k, v, kw, leaves


def _check_against_reference(mode: str, causal: bool, q, k, v, kw, leaves) -> torch.Tensor:
    out = flash_prior_attention(q, k, v, mode=mode, causal=causal, **kw)
    as64 = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in kw.items()}
    ref = flash_prior_attention_ref(q.double(), k.double(), v.double(), mode=mode, causal=causal, **as64)
    tol = TOL[q.dtype]
    assert out.dtype == q.dtype and out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), f'{mode} forward: max error {err:.3e}'

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, out.dtype)
    names = list(leaves)
    grads = torch.autograd.grad(out, [leaves[n] for n in names], grad_out)
    ref_grads = torch.autograd.grad(ref, [leaves[n] for n in names], grad_out.double())
    for name, g, rg in zip(names, grads, ref_grads):
        assert g.shape == leaves[name].shape and g.dtype == leaves[name].dtype, name
        scale = max(1.0, rg.abs().max().item())
        err = (g.double() - rg).abs().max().item()
        assert err <= tol * scale, f'{mode} grad {name}: max error {err:.3e} (max |ref| {scale:.2f})'
    return out


# (mode, B, H, N, d_qk, d_v, causal, options)
FP32_CASES = {
    'plain_N17_d16': ('plain', 2, 2, 17, 16, 16, False, {}),
    'plain_N63_d32_causal_padded': ('plain', 2, 1, 63, 32, 32, True, dict(padding=True)),
    'goat_1d_N63_causal_learned_freqs': ('goat', 2, 1, 63, 16, 32, True, dict(D=1, R=3, learn_pos=True)),
    'goat_2d_N17_prefix_padded_per_sample': ('goat', 2, 2, 17, 30, 32, False,
                                             dict(D=2, R=2, P=1, padding=True, per_sample=True, learn_pos=True)),
    'goat_2d_N130_causal': ('goat', 1, 1, 130, 16, 16, True, dict(D=2, R=4, P=2)),
    'pope_1d_N63_causal_padded': ('pope', 2, 1, 63, 16, 16, True, dict(D=1, padding=True)),
    'pope_2d_N17_prefix': ('pope', 2, 2, 17, 32, 32, False, dict(D=2, P=2)),
}


@pytest.mark.parametrize('case', sorted(FP32_CASES))
def test_fp32_forward_and_every_gradient_match_float64_reference(case):
    mode, B, H, N, d_qk, d_v, causal, opts = FP32_CASES[case]
    q, k, v, kw, leaves = _make_case(mode, B, H, N, d_qk, d_v, **opts)
    out = _check_against_reference(mode, causal, q, k, v, kw, leaves)
    if opts.get('padding') and causal:
        # the last sample's first 3 queries have no valid key: zero output, by definition
        assert out[-1, :, :3].abs().max() == 0


@pytest.mark.parametrize('mode', ['plain', 'goat', 'pope'])
def test_fp16_matches_float64_reference(mode):
    opts = dict(D=2, R=2, P=1) if mode != 'plain' else {}
    q, k, v, kw, leaves = _make_case(mode, 2, 2, 33, 32, 32, padding=True, dtype=torch.float16, seed=3, **opts)
    _check_against_reference(mode, True, q, k, v, kw, leaves)


if _CUDA:  # GPU only (bf16 tl.dot is wrong in the interpreter); defined only there, so CPU runs skip nothing
    @pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
    @pytest.mark.parametrize('head_dim', [32, 64, 128])
    @pytest.mark.parametrize('mode', ['plain', 'goat', 'pope'])
    def test_gpu_default_configs_per_head_dim(mode, head_dim, dtype):
        """The GPU dispatcher's default tiles for every head dim, 16-bit, causal with padding."""
        opts = dict(D=2, R=4, P=1) if mode != 'plain' else {}
        d_qk = head_dim - 18 if mode == 'goat' else head_dim  # GOAT: d_c = d_h - (2 R D + 2)
        q, k, v, kw, leaves = _make_case(mode, 2, 3, 257, d_qk, head_dim, padding=True, dtype=dtype, seed=4, **opts)
        _check_against_reference(mode, True, q, k, v, kw, leaves)


def test_goat_prefix_tokens_get_only_their_key_default():
    """Prefix tokens carry no relative term: with zero content, a prefix query attends by u alone."""
    q, k, v, kw, _ = _make_case('goat', 1, 1, 20, 16, 16, D=2, R=3, P=2, seed=5)
    q, k = torch.zeros_like(q), torch.zeros_like(k)
    out = flash_prior_attention(q, k, v, mode='goat', **kw)
    probs = torch.softmax(kw['key_default'].detach()[0], dim=-1)  # (N,)
    expected = probs @ v.detach()[0, 0]
    torch.testing.assert_close(out.detach()[0, 0, :2], expected.expand(2, -1), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# the reference agrees with the layers' exact paths

def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)


@pytest.mark.parametrize('causal', [False, True])
def test_reference_matches_goat_attention_layer(causal):
    torch.manual_seed(0)
    layer = GoatAttention(64, num_heads=2, num_spatial_dims=2, num_modes=2, num_prefix_tokens=1,
                          learn_freqs=True).double()
    _randomize(layer, 1)
    coords = grid_coords((3, 4), dtype=torch.float64)
    B, N, H, dc, dh = 2, 13, 2, layer.content_dim, layer.head_dim
    x = torch.randn(B, N, 64, dtype=torch.float64)
    q, k, v = layer.qkv(x).split([H * dc, H * dc, H * dh], dim=-1)
    q, k = (t.reshape(B, N, H, dc).transpose(1, 2) for t in (q, k))
    v = v.reshape(B, N, H, dh).transpose(1, 2)
    prior = layer.prior
    u = torch.cat([prior.prefix_bias, prior.key_default(coords)], dim=-1)
    out = flash_prior_attention_ref(q, k, v, mode='goat', causal=causal, coords=coords,
                                    freqs=prior.frequencies(coords.dtype, coords.device), alpha=prior.alpha,
                                    beta=prior.beta, key_default=u, num_prefix_tokens=1, scale=layer.content_scale)
    ours = layer.proj(out.transpose(1, 2).reshape(B, N, H * dh))
    torch.testing.assert_close(ours, layer(x, coords=coords, is_causal=causal), rtol=0, atol=1e-10)
    # and the structural part alone equals the layer's dense prior_logits
    zero = torch.zeros(1, H, N, dc, dtype=torch.float64)
    eye = torch.eye(N, dtype=torch.float64).expand(1, H, N, N)
    probs = flash_prior_attention_ref(zero, zero, eye, mode='goat', coords=coords,
                                      freqs=prior.frequencies(coords.dtype, coords.device), alpha=prior.alpha,
                                      beta=prior.beta, key_default=u, num_prefix_tokens=1)
    torch.testing.assert_close(probs[0], layer.prior_logits(coords).softmax(-1), rtol=0, atol=1e-12)


def test_reference_matches_pope_attention_layer():
    torch.manual_seed(0)
    layer = PopeAttention(32, num_heads=2, num_spatial_dims=2, num_prefix_tokens=1).double()
    _randomize(layer, 2)
    coords = torch.randn(11, 2, dtype=torch.float64) * 3
    B, N, H, d = 2, 12, 2, 16
    x = torch.randn(B, N, 32, dtype=torch.float64)
    q, k, v = layer.qkv(x).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)
    phases = layer.phases
    ladder = phases.freq_base ** (-torch.arange(d // 2, dtype=torch.float64) / (d // 2))
    out = flash_prior_attention_ref(q, k, v, mode='pope', coords=coords, freqs=ladder.expand(2, -1),
                                    phase_bias=phases.phase_bias, num_prefix_tokens=1, scale=layer.scale)
    ours = layer.proj(out.transpose(1, 2).reshape(B, N, H * d))
    torch.testing.assert_close(ours, layer(x, coords=coords), rtol=0, atol=1e-10)


# ------------------------------------------------------------------------------------------------
# errors, configs, AOT specs

def test_errors_name_the_offending_value():
    q, k, v, kw, _ = _make_case('goat', 1, 2, 17, 16, 16, D=2, R=2)
    with pytest.raises(ValueError, match="mode must be one of"):
        flash_prior_attention(q, k, v, mode='rope')
    with pytest.raises(ValueError, match=r"q \(1, 2, 17, 16\) and k \(1, 2, 9, 16\)"):
        flash_prior_attention(q, k[:, :, :9], v)
    with pytest.raises(ValueError, match="share a dtype"):
        flash_prior_attention(q, k.half(), v)
    with pytest.raises(ValueError, match="float64"):
        flash_prior_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="mode='goat' needs alpha"):
        flash_prior_attention(q, k, v, mode='goat', **dict(kw, alpha=None))
    with pytest.raises(ValueError, match="alpha is not used by mode='plain'"):
        flash_prior_attention(q, k, v, alpha=kw['alpha'])
    with pytest.raises(ValueError, match=r"beta must be \(H, D, R\) = \(2, 2, 2\), got \(2, 2, 3\)"):
        flash_prior_attention(q, k, v, mode='goat', **dict(kw, beta=torch.zeros(2, 2, 3, device=q.device)))
    with pytest.raises(ValueError, match=r"key_mask must be a bool tensor of shape \(B, L\) = \(1, 17\) with "
                                         r"True = valid key, got torch.bool \(1, 16\)"):
        flash_prior_attention(q, k, v, key_mask=torch.zeros(1, 16, dtype=torch.bool, device=q.device))
    with pytest.raises(TypeError, match=r"key_mask must be a bool tensor .* True = valid key, got torch.uint8"):
        flash_prior_attention(q, k, v, key_mask=torch.zeros(1, 17, dtype=torch.uint8, device=q.device))
    with pytest.raises(TypeError, match="key_padding_mask"):  # the old name (True = padded) is gone
        flash_prior_attention(q, k, v, key_padding_mask=torch.zeros(1, 17, dtype=torch.bool, device=q.device))
    with pytest.raises(ValueError, match=r"coords must be \(N - P, D\) = \(16, D\)"):
        flash_prior_attention(q, k, v, mode='goat', **dict(kw, num_prefix_tokens=1))
    with pytest.raises(ValueError, match="exceed the supported maximum 128"):
        wide = torch.zeros(1, 1, 3, 160, device=q.device)
        flash_prior_attention(wide, wide, wide)
    pq, pk, pv, pkw, _ = _make_case('pope', 1, 2, 17, 16, 16, D=1)
    with pytest.raises(ValueError, match="treats coords and freqs as constants"):
        flash_prior_attention(pq, pk, pv, mode='pope', **dict(pkw, freqs=pkw['freqs'].clone().requires_grad_()))
    with pytest.raises(ValueError, match=r"D \* R = 8 != d = 16"):
        flash_prior_attention(pq, pk, pv, mode='pope', **dict(pkw, freqs=pkw['freqs'][:, :8]))


def test_aot_specs_agree_with_the_runtime_dispatcher():
    from triton.runtime.jit import JITFunction
    from vision_priors.kernels._backend import kernel_function
    specs = aot_specs()
    assert len(specs) == 3 * 3 * 3 * 2 * 2  # mode x kernel x head dim x dtype x causal
    assert len({s['name'] for s in specs}) == len(specs)
    for s in specs:
        fn = kernel_function(s['fn'])  # under @triton.heuristics
        assert isinstance(fn, JITFunction)  # compiler form even when the interpreter is on
        assert list(s['signature']) == list(fn.arg_names)
        assert set(s['constexprs']) == {n for n, t in s['signature'].items() if t == 'constexpr'}
        assert all(t in ('*fp16', '*bf16', '*fp32', '*u8', 'i32', 'fp32', 'constexpr') for t in s['signature'].values())
        mode, kname, d, dt = re.fullmatch(r'flash_prior_(\w+?)_(fwd|bwd_dkdv|bwd_dq)_d(\d+)_(fp16|bf16)(_causal)?',
                                          s['name']).groups()[:4]
        d, dtype = int(d), {'fp16': torch.float16, 'bf16': torch.bfloat16}[dt]
        assert s['constexprs']['CAUSAL'] == s['name'].endswith('_causal')
        kc = getattr(choose_config(d, dtype, mode, 'cuda'), kname)
        assert (s['constexprs']['BLOCK_M'], s['constexprs']['BLOCK_N'], s['num_warps'], s['num_stages']) == (
            kc.block_m, kc.block_n, kc.num_warps, kc.num_stages), s['name']
    assert choose_config(64, torch.float32, 'goat', 'cpu').input_precision == 'ieee'
