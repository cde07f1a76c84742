"""LAVO's 2D local window kernel (``kernels/lavo.py: lavo_local_2d``) against float64 references (issue 16).

The window of Sec. 3.3 on a row-major (gh x gw) patch grid: patch i attends to patch j with logit
``scale q_i . k_j + P[(dy + w - 1) (2w - 1) + dx + w - 1]`` for ``|dy|, |dx| <= w - 1`` ('sliding', the local
branch) or for j in i's own w x w tile ('block', the context-dissection aggregate); invalid keys are dropped
and a query without a valid key gets 0. Checked here:

* the Triton kernels (forward, dq, dk, dv and the bias gradient) against the dense float64 reference
  ``lavo_local_2d_reference`` on odd grids (5 x 7, 3 x 11, 2 x 19: two row segments per row), w = 2, 3, 4,
  with and without a key mask (one sample keeps a single valid key, so some windows are fully masked and must
  give exactly 0), with a bias table with / without gradient and without one;
* the reference against a loop over the queries written here, and the op's PyTorch backend (the layer's own
  ``local_window_2d`` / ``tile_block_2d``) against the reference, in float64;
* ``LavoAttention`` with a ``grid_size`` (prefix tokens, key mask, block and sliding dissection): its Triton
  path (``kernel_backend='triton'``) equals its PyTorch path, forward and every gradient.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``; see the skip below and
tests/test_kernels_interpreter.py), float32 products with ``input_precision='ieee'``; every buffer a kernel
should write starts as NaN (``POISON_OUTPUTS``).

Tolerances against float64 (absolute; values O(1)), as tests/test_kernels_lavo.py: float32 inputs forward
5e-6, gradients 5e-5 (largest measured errors over CASES: 5.0e-7 forward, 1.7e-6 dq / dk / dv, 2.5e-6 for
the bias gradient, which sums dS over every pair with one offset); float16 inputs forward 5e-3, gradients
2e-2. Layer kernel path
against its torch path (float32 both): max abs difference <= 1e-4 * max(1, max |torch path|), at least 2e-4
for gradients (tests/test_kernel_dispatch.py's rule).
"""
import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA and os.environ.get('TRITON_INTERPRET') != '1':
    # as tests/test_kernels_lavo.py: without CUDA this file runs in a child process with TRITON_INTERPRET=1
    # (tests/test_kernels_interpreter.py), or directly as ``TRITON_INTERPRET=1 pytest tests/test_kernels_lavo_2d.py``
    pytest.skip('no CUDA: runs in the Triton interpreter via tests/test_kernels_interpreter.py',
                allow_module_level=True)
triton = pytest.importorskip('triton')

from vision_priors.kernels import lavo as K  # noqa: E402
from vision_priors.kernels.lavo import lavo_local_2d  # noqa: E402
from vision_priors.kernels.lavo_ref import lavo_local_2d_reference  # noqa: E402
from vision_priors.kernels.lavo_torch import local_window_2d, tile_block_2d  # noqa: E402
from vision_priors.layers import LavoAttention  # noqa: E402

# the 1D kernel tests' device, tolerances and kernel environment (NaN-poisoned outputs, 'ieee' products, 1 thread)
from test_kernels_lavo import DEV, F64, FWD_TOL, GRAD_TOL, HALF_FWD_TOL, HALF_GRAD_TOL, _kernel_env  # noqa: E402,F401


def loop_ref(q, k, v, bias, scale, grid, w, mode, mask):
    """Sec. 3.3 on a grid, one query at a time: the keys (y', x') of its window, logit scale q.k + P[dy, dx]."""
    gh, gw = grid
    b, nh, n, d = q.shape
    out = torch.zeros_like(q)
    for i in range(n):
        y, x = divmod(i, gw)
        for bb in range(b):
            js, idx = [], []
            for j in range(n):
                yj, xj = divmod(j, gw)
                if mode == 'sliding':
                    inside = abs(yj - y) <= w - 1 and abs(xj - x) <= w - 1
                else:
                    inside = yj // w == y // w and xj // w == x // w
                if inside and (mask is None or bool(mask[bb, j])):
                    js.append(j)
                    idx.append((yj - y + w - 1) * (2 * w - 1) + xj - x + w - 1)
            if not js:
                continue  # no valid key: 0
            s = scale * torch.einsum('hd,hnd->hn', q[bb, :, i], k[bb, :, js])
            if bias is not None:
                s = s + bias[idx]
            out[bb, :, i] = torch.einsum('hn,hnd->hd', s.softmax(-1), v[bb, :, js])
    return out


def _inputs(gh, gw, w, masked, gen, bsz=2, nh=1, d=16):
    n = gh * gw
    q, k, v = (torch.randn(bsz, nh, n, d, generator=gen, dtype=F64) for _ in range(3))
    table = torch.randn((2 * w - 1) ** 2, generator=gen, dtype=F64)
    mask = None
    if masked:
        mask = torch.rand(bsz, n, generator=gen) > 0.3
        mask[-1] = False
        mask[-1, n - 1] = True  # last sample: one valid key (the last patch), so far windows are fully masked
    g = torch.randn(bsz, nh, n, d, generator=gen, dtype=F64)
    return q, k, v, table, mask, g


def _run(fn, inputs, grad_out):
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
# the kernel against the float64 reference

CASES = [  # gh, gw, w, mode, masked, bias (None: no table; False: no bias gradient)
    (5, 7, 2, 'sliding', True, True),
    (3, 11, 3, 'sliding', False, True),
    (5, 7, 4, 'sliding', True, False),  # 7 x 7 neighbourhood on a 5 x 7 grid: windows clipped on every side
    (2, 19, 3, 'sliding', True, True),  # 19 columns: two 16-patch row segments, the window crosses them
    (3, 11, 2, 'block', True, True),    # 2 x 2 tiles, the last row and column of tiles partial
    (5, 7, 3, 'block', False, None),
]


@pytest.mark.parametrize('gh,gw,w,mode,masked,bias', CASES)
def test_local_2d_kernel_matches_reference(gh, gw, w, mode, masked, bias):
    gen = torch.Generator().manual_seed(gh * 100 + gw * 10 + w)
    q, k, v, table, mask, g = _inputs(gh, gw, w, masked, gen)
    scale = 0.3
    inputs = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_()]
    if bias is not None:
        inputs.append(table.requires_grad_(bool(bias)))

    def op(fn, m, **kw):
        if bias is None:
            return lambda a, b, c: fn(a, b, c, None, scale, (gh, gw), w, key_mask=m, mode=mode, **kw)
        return lambda a, b, c, p: fn(a, b, c, p, scale, (gh, gw), w, key_mask=m, mode=mode, **kw)

    ref = _run(op(lavo_local_2d_reference, mask), inputs, g)
    mask_d = mask.to(DEV) if mask is not None else None
    got = _run(op(lavo_local_2d, mask_d, backend='triton'),
               [t.to(DEV, torch.float32).requires_grad_(t.requires_grad) for t in inputs], g.to(DEV))
    _compare(got, ref, FWD_TOL, GRAD_TOL)
    if masked:  # fully masked windows give exactly 0 (and some exist)
        empty = ref[0][-1].abs().sum(-1) == 0
        assert bool(empty.any()) and bool((got[0][-1].cpu()[empty] == 0).all())
    # the op's PyTorch backend (local_window_2d / tile_block_2d: the layer's path) in float64
    _compare(_run(op(lavo_local_2d, mask, backend='torch'), inputs, g), ref, 1e-12, 1e-11)


def test_local_2d_kernel_float16():
    gen = torch.Generator().manual_seed(5)
    q, k, v, table, mask, g = _inputs(3, 11, 3, True, gen)
    q, k, v = (t.half().to(F64) for t in (q, k, v))  # the reference sees the same rounded inputs
    ref = _run(lambda a, b, c, p: lavo_local_2d_reference(a, b, c, p, 0.3, (3, 11), 3, key_mask=mask),
               [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), table.requires_grad_()], g)
    got = _run(lambda a, b, c, p: lavo_local_2d(a, b, c, p, 0.3, (3, 11), 3, key_mask=mask.to(DEV), backend='triton'),
               [q.to(DEV, torch.float16).requires_grad_(), k.to(DEV, torch.float16).requires_grad_(),
                v.to(DEV, torch.float16).requires_grad_(), table.to(DEV, torch.float32).requires_grad_()], g.to(DEV))
    assert got[0].dtype == torch.float16 and got[1][0].dtype == torch.float16 and got[1][3].dtype == torch.float32
    _compare(got, ref, HALF_FWD_TOL, HALF_GRAD_TOL)


# ------------------------------------------------------------------------------------------------
# the reference: written from the definition, and the layer's own torch functions agree with it

@pytest.mark.parametrize('gh,gw,w,mode', [(5, 7, 2, 'sliding'), (3, 11, 4, 'sliding'), (5, 7, 3, 'block')])
def test_reference_matches_loops_and_local_window_2d(gh, gw, w, mode):
    gen = torch.Generator().manual_seed(gh + gw + w)
    q, k, v, table, mask, _ = _inputs(gh, gw, w, True, gen, nh=2, d=5)
    y = lavo_local_2d_reference(q, k, v, table, 0.37, (gh, gw), w, key_mask=mask, mode=mode)
    torch.testing.assert_close(y, loop_ref(q, k, v, table, 0.37, (gh, gw), w, mode, mask), atol=1e-12, rtol=0)
    layer_fn = local_window_2d if mode == 'sliding' else tile_block_2d
    for m in (mask, None):
        torch.testing.assert_close(layer_fn(q, k, v, m, gh, gw, w, table, 0.37),
                                   lavo_local_2d_reference(q, k, v, table, 0.37, (gh, gw), w, key_mask=m, mode=mode),
                                   atol=1e-12, rtol=0)


# ------------------------------------------------------------------------------------------------
# LavoAttention on a grid: the Triton path equals the PyTorch path

def _pair(**kwargs):
    torch.manual_seed(0)
    fast = LavoAttention(**kwargs, kernel_backend='triton').to(DEV)
    exact = LavoAttention(**kwargs, kernel_backend='torch').to(DEV)
    with torch.no_grad():
        for p in fast.parameters():
            p.normal_(0, 0.3)
    exact.load_state_dict(fast.state_dict())
    return fast, exact


@pytest.mark.parametrize('dissection,n_pre,masked,ref', [
    ('block', 1, True, None), ('sliding', 0, False, None), ('sliding', 2, True, None),
    # a window rescaled from a 1 x 2 reference grid (scales 3 / 2.5: w2 3, the table read at fractional offsets)
    ('sliding', 0, False, (1, 2)), ('block', 1, True, (1, 2))])
def test_layer_grid_kernel_path_matches_torch_path(monkeypatch, dissection, n_pre, masked, ref):
    calls = []
    real = K._LavoLocal2dFn.apply
    monkeypatch.setattr(K._LavoLocal2dFn, 'apply', lambda *a: calls.append(a[-1]) or real(*a))
    fast, exact = _pair(dim=32, num_heads=2, num_slots=8, window=4, causal=False, window_2d=2, dissection=dissection)
    fast.set_ref_grid_size(ref)
    exact.set_ref_grid_size(ref)
    gh, gw = 3, 5
    length = n_pre + gh * gw
    x = torch.randn(2, length, 32, generator=torch.Generator().manual_seed(1)).to(DEV)
    mask = None
    if masked:
        mask = torch.ones(2, length, dtype=torch.bool)
        mask[1, n_pre + 5:] = False       # sample 1: only the prefix and the first row of patches are valid
        mask[0, 0] = False                # sample 0: the first token (a prefix token if any) is padding
        mask = mask.to(DEV)
    outs, grads = [], []
    for layer in (fast, exact):
        xi = x.clone().requires_grad_(True)
        out = layer(xi, key_mask=mask, grid_size=(gh, gw), num_prefix_tokens=n_pre)
        (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
        outs.append(out.detach())
        grads.append([xi.grad] + [p.grad for p in layer.parameters() if p.requires_grad])
    # the kernel ran: the local branch (block=False) and, for block dissection, the tile aggregate (block=True)
    assert calls == ([False, True] if dissection == 'block' else [False])
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-4 * max(1.0, outs[1].abs().max().item())
    for g_fast, g_exact in zip(*grads):
        if g_exact is None:  # the 1D table (num_spatial_dims=None keeps both): unused on a grid, on both paths
            assert g_fast is None
            continue
        assert g_fast is not None
        assert (g_fast - g_exact).abs().max().item() <= max(2e-4, 1e-4 * max(1.0, g_exact.abs().max().item()))
    assert fast.rel_bias_2d.grad.abs().max() > 1e-3  # the 2D bias gradient was compared, not two zeros


def test_layer_grid_auto_on_cpu_keeps_the_torch_path(monkeypatch):
    """'auto' picks Triton only on CUDA tensors: on the CPU the grid path does not call the kernel."""
    if _CUDA:
        pytest.skip('CPU dispatch rule')
    calls = []
    monkeypatch.setattr(K._LavoLocal2dFn, 'apply', lambda *a: calls.append(1))
    layer = LavoAttention(32, 2, num_slots=8, window=4, causal=False, window_2d=2)
    layer(torch.randn(1, 1 + 6, 32), grid_size=(2, 3), num_prefix_tokens=1)
    assert calls == []


# ------------------------------------------------------------------------------------------------
# errors, AOT specs

@pytest.mark.parametrize('kwargs,err,match', [
    (dict(grid_size=(3, 4)), ValueError, r'grid_size=\(3, 4\) describes 12 patches, but q has L=15'),
    (dict(grid_size=(15,)), ValueError, r'grid_size must be two ints \(rows, cols\) >= 1, got \(15,\)'),
    (dict(rel_bias=torch.zeros(5)), ValueError, r'rel_bias must have shape \(\(2 \* window - 1\) \*\* 2,\) = \(9,\)'),
    (dict(mode='dilated'), ValueError, r"mode must be one of \('sliding', 'block'\), got 'dilated'"),
    (dict(key_mask=torch.ones(1, 14, dtype=torch.bool)), ValueError,
     r'key_mask must be a bool tensor of shape \(B, L\) = \(1, 15\) with True = valid key'),
])
def test_local_2d_bad_inputs(kwargs, err, match):
    args = dict(q=torch.zeros(1, 2, 15, 16), k=torch.zeros(1, 2, 15, 16), v=torch.zeros(1, 2, 15, 16),
                rel_bias=torch.zeros(9), scale=1.0, grid_size=(3, 5), window=2)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        lavo_local_2d(**args)
    with pytest.raises(err, match=match):
        lavo_local_2d_reference(**args)


def test_reference_has_the_op_signature_and_is_exported():
    import inspect

    import vision_priors.kernels as kernels
    assert list(inspect.signature(lavo_local_2d).parameters) == list(
        inspect.signature(lavo_local_2d_reference).parameters)
    assert {'lavo_local_2d', 'lavo_local_2d_reference'} <= set(kernels.__all__)


def test_local_2d_aot_specs_follow_the_runtime_config():
    by_name = {s['name']: s for s in K.aot_specs()}
    for dtype, ty in ((torch.float16, 'fp16'), (torch.float32, 'fp32')):
        cfg = K.local_2d_config(dtype, 64, 4)
        for kernel in ('fwd', 'bwd_dkdv', 'bwd_dq'):
            spec = by_name[f'lavo_local2d_{kernel}_{ty}_d64']
            assert spec['constexprs']['BLOCK_M'] == cfg['BLOCK_M'] and spec['num_warps'] == cfg['num_warps']
        assert by_name[f'lavo_local2d_bwd_dq_{ty}_d64']['constexprs']['BLOCK_KW2'] == cfg['BLOCK_KW2'] == 64
