"""LAVO Triton kernels (``kernels/lavo.py``) against float64 references written from the paper.

The references below follow Zhang et al. (arXiv:2312.11135) literally and share no code with the
kernels, their PyTorch backend (``lavo_torch.py``) or their dense references (``lavo_ref.py``): the CODE
branch builds the slots ``X~_t = diag(H_t) B`` of the running mean ``H_t = (1/n_t) sum_{valid s <= t}
B z_s`` (Eqs. 3-4) and reads them with ``softmax(scale q_t X~_t^T) X~_t``; the local branch loops over
queries and their window with the bias ``P[j - i + w - 1]`` (Sec. 3.3). Every case also checks the ops'
PyTorch backend (forward and gradients) and the dense references. One test ties the ops to
``LavoAttention``'s own forward.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``; see the skip below),
float32 products with ``input_precision='ieee'`` (also forced on a GPU). Every buffer a kernel
should write starts as NaN (``POISON_OUTPUTS``), so an unwritten element fails.

Tolerances against float64 (absolute; values O(1)): float32 inputs forward 5e-6, gradients 5e-5
(largest measured errors 4.9e-7 and 4.7e-6); float16 inputs (rounded to float16 before the
reference too) forward 5e-3, gradients 2e-2 (measured 6.6e-4 and 3.0e-3, local branch).
"""
import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA and os.environ.get('TRITON_INTERPRET') != '1':
    # Triton picks interpreter or compiler for its whole library when first imported, so these tests
    # cannot share a process with the compile tests (test_kernels_compile.py). Without CUDA they run
    # with TRITON_INTERPRET=1 set before Triton's import: by test_kernels_interpreter.py in a child
    # process, or directly as ``TRITON_INTERPRET=1 pytest tests/test_kernels_lavo.py``.
    pytest.skip('no CUDA: runs in the Triton interpreter via tests/test_kernels_interpreter.py',
                allow_module_level=True)
triton = pytest.importorskip('triton')

from vision_priors.kernels import _backend  # noqa: E402
from vision_priors.kernels import lavo as K  # noqa: E402
from vision_priors.kernels._backend import kernel_function  # noqa: E402
from vision_priors.kernels.lavo import lavo_global, lavo_local  # noqa: E402
from vision_priors.kernels.lavo_ref import lavo_global_reference, lavo_local_reference  # noqa: E402

from vision_priors.layers import LavoAttention  # noqa: E402

DEV = 'cuda' if _CUDA else 'cpu'
F64 = torch.float64
FWD_TOL, GRAD_TOL = 5e-6, 5e-5  # float32 inputs, 'ieee' products
HALF_FWD_TOL, HALF_GRAD_TOL = 5e-3, 2e-2  # float16 inputs


@pytest.fixture(autouse=True)
def _kernel_env(monkeypatch):
    monkeypatch.delenv('VISION_PRIORS_KERNELS', raising=False)
    monkeypatch.setattr(_backend, 'POISON_OUTPUTS', True)
    monkeypatch.setattr(_backend, 'FORCE_DOT_PRECISION', 'ieee')
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------------
# float64 references from the paper's equations

def code_ref(q, z, basis, scale, mask, causal):
    """Eqs. 3-4: slots diag(H_t) B of the mean of B z over the valid tokens s <= t (or all s)."""
    bsz, nh, length, _ = q.shape
    valid = torch.ones(bsz, length, dtype=torch.bool) if mask is None else mask.cpu()
    outs = []
    for t in range(length):
        ctx = list(range(t + 1)) if causal else list(range(length))
        w = valid[:, ctx].to(q.dtype).to(q.device)  # (B, n)
        n = w.sum(1).clamp(min=1)
        zbar = torch.einsum('bn,bhnd->bhd', w, z[:, :, ctx]) / n[:, None, None]
        h = torch.einsum('hrd,bhd->bhr', basis, zbar)  # H = (1/n) sum_s B z_s
        slots = h[..., None] * basis  # X~ = diag(H) B, (B, heads, r, d)
        a = torch.softmax(scale * torch.einsum('bhd,bhrd->bhr', q[:, :, t], slots), dim=-1)
        outs.append(torch.einsum('bhr,bhrd->bhd', a, slots))
    return torch.stack(outs, dim=2)


def local_ref(q, k, v, bias, scale, w, causal, mode, mask):
    """Sec. 3.3: query i attends to its window with logit scale q_i.k_j + P[j - i + w - 1]."""
    bsz, nh, length, d = q.shape
    rows = []
    for i in range(length):
        if mode == 'sliding':
            js = [j for j in range(length) if -(w - 1) <= j - i <= (0 if causal else w - 1)]
        else:
            js = [j for j in range(length) if j // w == i // w and (j <= i or not causal)]
        per_b = []
        for b in range(bsz):
            jb = [j for j in js if mask is None or bool(mask[b, j])]
            if not jb:
                per_b.append(torch.zeros(nh, d, dtype=q.dtype, device=q.device))
                continue
            s = scale * torch.einsum('hd,hnd->hn', q[b, :, i], k[b, :, jb])
            if bias is not None:
                s = s + bias[[j - i + w - 1 for j in jb]]
            per_b.append(torch.einsum('hn,hnd->hd', s.softmax(-1), v[b, :, jb]))
        rows.append(torch.stack(per_b))
    return torch.stack(rows, dim=2)


# ------------------------------------------------------------------------------------------------
# helpers

def _basis(nh, r, d, gen):
    return torch.linalg.qr(torch.randn(nh, d, r, generator=gen, dtype=F64))[0].transpose(-1, -2).contiguous()


def _mask(bsz, length, gen, leading_invalid=0):
    m = torch.rand(bsz, length, generator=gen) > 0.3
    m[0, :leading_invalid] = False
    m[-1, length // 3: length // 3 + 12] = False  # a run of invalid keys: some windows have none
    return m


def _run(fn, inputs, grad_out):
    """Forward and gradients w.r.t. every input that requires grad."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    y = fn(*leaves)
    grads = torch.autograd.grad(y, [t for t in leaves if t.requires_grad], grad_out.to(y.dtype))
    return y.detach(), grads


def _compare(got, ref, fwd_tol, grad_tol):
    (y, gs), (y_ref, gs_ref) = got, ref
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y.to(F64).cpu(), y_ref.cpu(), atol=fwd_tol, rtol=0)
    assert len(gs) == len(gs_ref)
    for g, g_ref in zip(gs, gs_ref):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g.to(F64).cpu(), g_ref.cpu(), atol=grad_tol, rtol=0)
    assert y_ref.abs().max() > 1e-2 and max(float(g.abs().max()) for g in gs_ref) > 1e-2  # non-trivial


# ------------------------------------------------------------------------------------------------
# CODE (global) branch

GLOBAL_CASES = [  # L, d, r, causal, masked, basis requires grad
    (17, 16, 5, True, False, True),
    (63, 32, 32, True, True, True),
    (130, 16, 16, False, True, True),
    (130, 48, 7, True, True, False),   # d = 48: two head-dim slices; fixed basis (no dB)
    (63, 32, 3, False, False, True),
]


@pytest.mark.parametrize('length,d,r,causal,masked,basis_grad', GLOBAL_CASES)
def test_global_matches_paper_reference(length, d, r, causal, masked, basis_grad):
    gen = torch.Generator().manual_seed(length * 7 + d + r)
    bsz, nh, scale = 2, 2, d ** -0.5
    q = torch.randn(bsz, nh, length, d, generator=gen, dtype=F64) * 2
    z = torch.randn(bsz, nh, length, d, generator=gen, dtype=F64) + 0.5  # non-zero mean: H matters
    basis = _basis(nh, r, d, gen)
    mask = _mask(bsz, length, gen, leading_invalid=3) if masked else None
    g = torch.randn(bsz, nh, length, d, generator=gen, dtype=F64)
    ref = _run(lambda a, b, c: code_ref(a, b, c, scale, mask, causal),
               [q.requires_grad_(), z.requires_grad_(), basis.requires_grad_(basis_grad)], g)
    mask_d = mask.to(DEV) if mask is not None else None
    got = _run(lambda a, b, c: lavo_global(a, b, c, scale, mask_d, causal, backend='triton'),
               [t.to(DEV, torch.float32).requires_grad_(t.requires_grad) for t in (q, z, basis)], g.to(DEV))
    _compare(got, ref, FWD_TOL, GRAD_TOL)
    # the op's PyTorch backend (the layer's path) in float64, forward and gradients
    torch_backend = _run(lambda a, b, c: lavo_global(a, b, c, scale, mask, causal, backend='torch'),
                         [q, z, basis], g)
    _compare(torch_backend, ref, 1e-12, 1e-11)
    # the dense reference implements the same equations
    torch.testing.assert_close(lavo_global_reference(q, z, basis, scale, mask, causal).detach(), ref[0],
                               atol=1e-12, rtol=0)


def test_global_float16():
    gen = torch.Generator().manual_seed(1)
    bsz, nh, length, d, r = 1, 2, 63, 32, 16
    q, z = (torch.randn(bsz, nh, length, d, generator=gen, dtype=F64) for _ in range(2))
    basis = _basis(nh, r, d, gen)
    mask = _mask(bsz, length, gen)
    g = torch.randn(bsz, nh, length, d, generator=gen, dtype=F64)
    q16, z16 = q.half().to(F64), z.half().to(F64)  # the reference sees the same rounded inputs
    ref = _run(lambda a, b, c: code_ref(a, b, c, 0.25, mask, True),
               [q16.requires_grad_(), z16.requires_grad_(), basis.requires_grad_()], g)
    got = _run(lambda a, b, c: lavo_global(a, b, c, 0.25, mask.to(DEV), True, backend='triton'),
               [q16.to(DEV, torch.float16).requires_grad_(), z16.to(DEV, torch.float16).requires_grad_(),
                basis.to(DEV, torch.float32).requires_grad_()], g.to(DEV))
    assert got[0].dtype == torch.float16 and got[1][0].dtype == torch.float16
    _compare(got, ref, HALF_FWD_TOL, HALF_GRAD_TOL)


# ------------------------------------------------------------------------------------------------
# local window branch

LOCAL_CASES = [  # L, d, w, causal, mode, masked, bias (None: no EPE; False: no bias gradient)
    (17, 16, 5, True, 'sliding', False, True),
    (63, 32, 16, False, 'sliding', True, True),
    (130, 16, 40, True, 'sliding', True, True),    # the window spans several key tiles
    (130, 32, 7, False, 'block', False, True),
    (63, 16, 9, True, 'block', True, False),       # bias without gradient
    (130, 16, 33, False, 'sliding', False, None),  # no bias (use_epe=False)
    (17, 48, 1, False, 'sliding', False, True),    # w = 1: each token alone; d = 48 padded to 64
    (20, 16, 64, False, 'block', True, True),      # window longer than the sequence
]


@pytest.mark.parametrize('length,d,w,causal,mode,masked,bias', LOCAL_CASES)
def test_local_matches_paper_reference(length, d, w, causal, mode, masked, bias):
    gen = torch.Generator().manual_seed(length * 3 + d + w)
    bsz, nh, scale = 2, 2, d ** -0.5
    q, k, v = (torch.randn(bsz, nh, length, d, generator=gen, dtype=F64) for _ in range(3))
    table = torch.randn(2 * w - 1, generator=gen, dtype=F64) if bias is not None else None
    mask = _mask(bsz, length, gen) if masked else None
    g = torch.randn(bsz, nh, length, d, generator=gen, dtype=F64)
    inputs = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_()]
    if table is not None:
        inputs.append(table.requires_grad_(bool(bias)))

    def with_table(fn):
        return (lambda a, b, c, p: fn(a, b, c, p)) if table is not None else (lambda a, b, c: fn(a, b, c, None))

    ref = _run(with_table(lambda a, b, c, p: local_ref(a, b, c, p, scale, w, causal, mode, mask)), inputs, g)
    mask_d = mask.to(DEV) if mask is not None else None
    got = _run(with_table(lambda a, b, c, p: lavo_local(a, b, c, p, scale, w, causal, mode, mask_d, backend='triton')),
               [t.to(DEV, torch.float32).requires_grad_(t.requires_grad) for t in inputs], g.to(DEV))
    _compare(got, ref, FWD_TOL, GRAD_TOL)
    if masked:  # queries whose window holds no valid key give exactly 0
        empty_rows = [i for i in range(length) if not any(
            bool(mask[-1, j]) for j in range(length)
            if (mode == 'sliding' and -(w - 1) <= j - i <= (0 if causal else w - 1))
            or (mode == 'block' and j // w == i // w and (j <= i or not causal)))]
        if empty_rows:
            assert (got[0][-1, :, empty_rows] == 0).all()
    # the op's PyTorch backend (the layer's blocked O(L w) path) in float64, forward and gradients
    torch_backend = _run(with_table(lambda a, b, c, p: lavo_local(a, b, c, p, scale, w, causal, mode, mask,
                                                                  backend='torch')), inputs, g)
    _compare(torch_backend, ref, 1e-12, 1e-11)
    torch.testing.assert_close(lavo_local_reference(q, k, v, table, scale, w, causal, mode, mask).detach(),
                               ref[0], atol=1e-12, rtol=0)


def test_local_float16():
    gen = torch.Generator().manual_seed(2)
    bsz, nh, length, d, w = 1, 2, 130, 32, 24
    q, k, v = (torch.randn(bsz, nh, length, d, generator=gen, dtype=F64).half().to(F64) for _ in range(3))
    table = torch.randn(2 * w - 1, generator=gen, dtype=F64)
    g = torch.randn(bsz, nh, length, d, generator=gen, dtype=F64)
    ref = _run(lambda a, b, c, p: local_ref(a, b, c, p, 0.2, w, True, 'sliding', None),
               [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), table.requires_grad_()], g)
    got = _run(lambda a, b, c, p: lavo_local(a, b, c, p, 0.2, w, True, 'sliding', backend='triton'),
               [q.to(DEV, torch.float16).requires_grad_(), k.to(DEV, torch.float16).requires_grad_(),
                v.to(DEV, torch.float16).requires_grad_(), table.to(DEV, torch.float32).requires_grad_()], g.to(DEV))
    assert got[0].dtype == torch.float16
    _compare(got, ref, HALF_FWD_TOL, HALF_GRAD_TOL)


def test_local_strided_views_like_the_layer():
    """q, k, v as the layer makes them: non-contiguous views of one (B, L, 3, heads, d) projection."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 37, 3, 2, 16, generator=gen).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    assert not q.is_contiguous()
    table = torch.randn(2 * 6 - 1, generator=gen)
    y = lavo_local(q.to(DEV), k.to(DEV), v.to(DEV), table.to(DEV), 0.25, 6, False, 'sliding', backend='triton')
    torch.testing.assert_close(y.cpu().double(), local_ref(q.double(), k.double(), v.double(), table.double(),
                                                           0.25, 6, False, 'sliding', None), atol=FWD_TOL, rtol=0)


# ------------------------------------------------------------------------------------------------
# the ops reproduce LavoAttention

@pytest.mark.parametrize('causal,dissection,use_epe', [(True, 'block', True), (False, 'sliding', True),
                                                       (True, 'sliding', False)])
def test_ops_reproduce_lavo_attention(causal, dissection, use_epe):
    torch.manual_seed(4)
    m = LavoAttention(32, num_heads=2, num_slots=8, window=6, causal=causal, dissection=dissection,
                      use_epe=use_epe, qkv_bias=True).to(F64).eval()
    if m.rel_bias is not None:
        with torch.no_grad():
            m.rel_bias.normal_()
    x = torch.randn(2, 23, 32, dtype=F64)
    mask = torch.ones(2, 23, dtype=torch.bool)
    mask[1, [0, 1, 9, 10, 11, 12, 13, 14]] = False

    def via_ops(layer, xx, backend):
        q, k, v = layer._qkv(xx)
        kw = dict(scale=layer.scale, window=layer.window, causal=layer.causal, key_mask=mask.to(xx.device),
                  backend=backend)
        bias = layer.rel_bias if layer.use_epe else None
        f_local = lavo_local(q, k, v, bias, mode='sliding', **kw)
        z = f_local if layer.dissection == 'sliding' else lavo_local(q, k, v, bias, mode='block', **kw)
        f_global = lavo_global(q, z, layer.basis(), layer.scale, key_mask=mask.to(xx.device), causal=layer.causal,
                               backend=backend)
        return layer._out(0.5 * (f_local + f_global))

    y_layer = m(x, key_mask=mask)
    torch.testing.assert_close(via_ops(m, x, 'torch'), y_layer, atol=1e-12, rtol=0)
    m32 = m.to(DEV, torch.float32)
    y_kernels = via_ops(m32, x.to(DEV, torch.float32), 'triton')
    torch.testing.assert_close(y_kernels.cpu().double(), y_layer, atol=FWD_TOL, rtol=0)


# ------------------------------------------------------------------------------------------------
# dispatch, errors, AOT specs

def test_backend_resolution(monkeypatch):
    t = torch.zeros(1, device=DEV)
    assert _backend.resolve_backend('torch', t) == 'torch'
    assert _backend.resolve_backend('triton', t) == 'triton'
    assert _backend.resolve_backend('auto', t) == ('triton' if _CUDA else 'torch')
    monkeypatch.setenv('VISION_PRIORS_KERNELS', 'torch')
    assert _backend.resolve_backend('auto', t) == 'torch'
    assert _backend.resolve_backend('triton', t) == 'triton'  # an explicit argument wins
    monkeypatch.setenv('VISION_PRIORS_KERNELS', 'triton')
    assert _backend.resolve_backend('auto', t) == 'triton'
    monkeypatch.setenv('VISION_PRIORS_KERNELS', 'cuda')
    with pytest.raises(ValueError, match='VISION_PRIORS_KERNELS'):
        _backend.resolve_backend('auto', t)
    with pytest.raises(ValueError, match="backend must be one of"):
        _backend.resolve_backend('gpu', t)
    monkeypatch.delenv('VISION_PRIORS_KERNELS')
    monkeypatch.setattr(_backend, 'interpreting', lambda: False)  # as if Triton were imported compiled
    with pytest.raises(RuntimeError, match='needs CUDA tensors'):
        _backend.resolve_backend('triton', torch.zeros(1))


def test_env_var_routes_auto_to_the_kernel(monkeypatch):
    calls = []
    real = K._LavoLocalFn.apply
    monkeypatch.setattr(K._LavoLocalFn, 'apply', lambda *a: calls.append(1) or real(*a))
    q = torch.randn(1, 1, 20, 16, device=DEV)
    y_auto = lavo_local(q, q, q, None, 0.3, 4, True)
    assert calls == ([1] if _CUDA else [])
    monkeypatch.setenv('VISION_PRIORS_KERNELS', 'triton')
    y_env = lavo_local(q, q, q, None, 0.3, 4, True)
    assert len(calls) == (2 if _CUDA else 1)
    torch.testing.assert_close(y_env, y_auto, atol=FWD_TOL, rtol=0)


@pytest.mark.parametrize('kwargs,err,match', [
    (dict(q=torch.zeros(2, 3, 4)), ValueError, r'q must be \(B, heads, L, head_dim\), got shape \(2, 3, 4\)'),
    (dict(k=torch.zeros(1, 2, 9, 16)), ValueError, r'k must have the shape of q \(1, 2, 8, 16\), got \(1, 2, 9, 16\)'),
    (dict(window=0), ValueError, r'window must be an int >= 1, got 0'),
    (dict(rel_bias=torch.zeros(6)), ValueError, r'rel_bias must have shape \(2 \* window - 1,\) = \(5,\), got \(6,\)'),
    (dict(mode='dilated'), ValueError, r"mode must be one of \('sliding', 'block'\), got 'dilated'"),
    (dict(key_mask=torch.ones(1, 9, dtype=torch.bool)), ValueError,
     r'key_mask must be a bool tensor of shape \(B, L\) = \(1, 8\) with True = valid key, got torch.bool \(1, 9\)'),
    (dict(key_mask=torch.ones(1, 8)), TypeError,
     r'key_mask must be a bool tensor of shape \(B, L\) = \(1, 8\) with True = valid key, got torch.float32'),
])
def test_local_bad_inputs(kwargs, err, match):
    args = dict(q=torch.zeros(1, 2, 8, 16), k=torch.zeros(1, 2, 8, 16), v=torch.zeros(1, 2, 8, 16),
                rel_bias=torch.zeros(5), scale=1.0, window=3)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        lavo_local(**args)


@pytest.mark.parametrize('kwargs,match', [
    (dict(basis=torch.zeros(3, 4, 16)),
     r'basis must be \(heads, r, head_dim\) = \(2, r, 16\) with r >= 1, got \(3, 4, 16\)'),
    (dict(z=torch.zeros(1, 2, 8, 8)), r'z must have the shape of q'),
])
def test_global_bad_inputs(kwargs, match):
    args = dict(q=torch.zeros(1, 2, 8, 16), z=torch.zeros(1, 2, 8, 16), basis=torch.zeros(2, 4, 16), scale=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        lavo_global(**args)


def test_triton_rejects_float64():
    q = torch.zeros(1, 1, 8, 16, dtype=F64, device=DEV)
    with pytest.raises(TypeError, match='float16, bfloat16 and float32; q has dtype torch.float64'):
        lavo_local(q, q, q, None, 1.0, 2, backend='triton')


def test_aot_specs_follow_the_runtime_configs():
    specs = K.aot_specs()
    names = [s['name'] for s in specs]
    assert len(names) == len(set(names)) and all(n.startswith('lavo_') for n in names)
    by_name = {s['name']: s for s in specs}
    for s in specs:
        params = kernel_function(s['fn']).arg_names  # under @triton.heuristics (interpreted with TRITON_INTERPRET=1)
        assert list(s['signature']) == list(params), s['name']  # derived from the kernel's parameter list
        assert {n for n, t in s['signature'].items() if t == 'constexpr'} == set(s['constexprs']), s['name']
        assert all(isinstance(t, str) for t in s['signature'].values())
    for dtype, ty in ((torch.float16, 'fp16'), (torch.bfloat16, 'bf16'), (torch.float32, 'fp32')):
        for d in (32, 64, 128):
            gc = K.global_config(dtype, d, min(64, d))
            spec = by_name[f'lavo_code_fwd_{ty}_d{d}']
            assert spec['constexprs']['BLOCK_T'] == gc['BLOCK_T'] and spec['num_warps'] == gc['num_warps']
            lc = K.local_config(dtype, d, 64)
            spec = by_name[f'lavo_local_bwd_dq_{ty}_d{d}']
            assert spec['constexprs']['BLOCK_M'] == lc['BLOCK_M'] and spec['constexprs']['BLOCK_W'] == lc['BLOCK_W']
