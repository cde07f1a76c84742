"""Chamfer distance kernel (``kernels/chamfer.py``) against a float64 loop reference.

The reference scans, for every point, all valid points of the other cloud and keeps the first index
of the smallest squared distance; the Chamfer values follow the PCN benchmark convention (CD-L2 =
sum of the two mean squared NN distances, CD-L1 = average of the two mean NN distances). Without
CUDA the kernel runs in Triton's interpreter. Every kernel output starts as NaN / INT64_MIN.

Tolerances against float64: float32 distances 1e-5 (absolute; coordinates O(1)), gradients 1e-5;
float16 points 2e-3 relative to the distance (inputs rounded to float16 first, so only the kernel's
float32 arithmetic differs).
"""
import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA and os.environ.get('TRITON_INTERPRET') != '1':  # see test_kernels_lavo.py
    pytest.skip('no CUDA: runs in the Triton interpreter via tests/test_kernels_interpreter.py',
                allow_module_level=True)
triton = pytest.importorskip('triton')

from vision_priors.kernels import _backend  # noqa: E402
from vision_priors.kernels._backend import TORCH_TO_TRITON, kernel_function  # noqa: E402
from vision_priors.kernels import chamfer as C  # noqa: E402
from vision_priors.kernels.chamfer import chamfer_distance, chamfer_nn  # noqa: E402
from vision_priors.kernels.chamfer_ref import chamfer_nn_reference  # noqa: E402

DEV = 'cuda' if _CUDA else 'cpu'
F64 = torch.float64
TOL = 1e-5


@pytest.fixture(autouse=True)
def _kernel_env(monkeypatch):
    monkeypatch.delenv('VISION_PRIORS_KERNELS', raising=False)
    monkeypatch.setattr(_backend, 'POISON_OUTPUTS', True)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def nn_ref(x, y, x_valid, y_valid):
    """For each valid x_i: min_j over valid y_j of ||x_i - y_j||^2 and the first such j; else (0, -1)."""
    bsz, n, _ = x.shape
    dist = torch.zeros(bsz, n, dtype=F64)
    idx = torch.full((bsz, n), -1, dtype=torch.int64)
    for b in range(bsz):
        cand = [j for j in range(y.shape[1]) if y_valid[b, j]]
        for i in range(n):
            if not x_valid[b, i]:
                continue
            if not cand:
                dist[b, i] = float('inf')
                continue
            d = ((y[b, cand].double() - x[b, i].double()) ** 2).sum(-1)
            best = int(torch.argmin(d))
            first = min(k for k in range(len(cand)) if d[k] == d[best])
            dist[b, i], idx[b, i] = d[first], cand[first]
    return dist, idx


def _valid(bsz, n, lengths):
    return torch.ones(bsz, n, dtype=torch.bool) if lengths is None else torch.arange(n)[None] < lengths[:, None]


def _grad_ref(x, y, ix, iy, gx, gy, squared):
    """Gradients of sum g_x d(x_i, y_ix) + g_y d(y_j, x_iy) for the fixed neighbours (float64 autograd)."""
    x = x.double().detach().requires_grad_()
    y = y.double().detach().requires_grad_()
    total = 0.
    for src, dst, idx, g in ((x, y, ix, gx), (y, x, iy, gy)):
        for b in range(src.shape[0]):
            for i in range(src.shape[1]):
                if idx[b, i] < 0:
                    continue
                d2 = ((src[b, i] - dst[b, int(idx[b, i])]) ** 2).sum()
                d = d2 if squared else (d2.sqrt() if d2 > 0 else d2 * 0)
                total = total + g[b, i].double() * d
    return torch.autograd.grad(total, (x, y))


@pytest.mark.parametrize('n,m,dim,masked', [(37, 150, 3, False), (150, 37, 3, True), (64, 64, 2, False),
                                            (17, 200, 5, True)])
@pytest.mark.parametrize('squared', [True, False])
def test_nn_matches_reference(n, m, dim, masked, squared):
    gen = torch.Generator().manual_seed(n + m + dim)
    x = torch.randn(2, n, dim, generator=gen)
    y = torch.randn(2, m, dim, generator=gen)
    xl = torch.tensor([n, n - 5]) if masked else None
    yl = torch.tensor([m - 7, m]) if masked else None
    d_ref, i_ref = nn_ref(x, y, _valid(2, n, xl), _valid(2, m, yl))
    e_ref, j_ref = nn_ref(y, x, _valid(2, m, yl), _valid(2, n, xl))
    xd, yd = x.to(DEV).requires_grad_(), y.to(DEV).requires_grad_()
    res = chamfer_nn(xd, yd, xl, yl, squared=squared, backend='triton')
    assert torch.equal(res.idx_x.cpu(), i_ref) and torch.equal(res.idx_y.cpu(), j_ref)
    power = (lambda t: t) if squared else torch.sqrt
    torch.testing.assert_close(res.dist_x.detach().cpu().double(), power(d_ref), atol=TOL, rtol=0)
    torch.testing.assert_close(res.dist_y.detach().cpu().double(), power(e_ref), atol=TOL, rtol=0)
    gx, gy = torch.randn(2, n, generator=gen), torch.randn(2, m, generator=gen)
    got = torch.autograd.grad((res.dist_x * gx.to(DEV)).sum() + (res.dist_y * gy.to(DEV)).sum(), (xd, yd))
    ref = _grad_ref(x, y, i_ref, j_ref, gx, gy, squared)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a.cpu().double(), r, atol=TOL, rtol=0)
    assert ref[0].abs().max() > 1e-2
    # the dense PyTorch reference and backend agree, including gradients
    xr, yr = x.double().requires_grad_(), y.double().requires_grad_()
    tr = chamfer_nn_reference(xr, yr, xl, yl, squared=squared)
    assert torch.equal(tr.idx_x, i_ref) and torch.equal(tr.idx_y, j_ref)
    torch.testing.assert_close(tr.dist_x.detach(), power(d_ref), atol=1e-12, rtol=0)
    got_t = torch.autograd.grad((tr.dist_x * gx).sum() + (tr.dist_y * gy).sum(), (xr, yr))
    for a, r in zip(got_t, ref):
        torch.testing.assert_close(a, r, atol=1e-12, rtol=0)


def test_ties_and_duplicates():
    """Integer points (exact in float32): exact zeros, first index among equal distances, across tiles."""
    y = torch.zeros(1, 150, 3)
    y[0, :, 0] = torch.arange(150) * 10.  # far apart on a line
    y[0, 140] = y[0, 3]       # duplicate of point 3, in a later tile of BLOCK_M = 64 keys
    y[0, 7] = torch.tensor([0., 4., 0.])
    y[0, 8] = torch.tensor([0., -4., 0.])  # 7 and 8 are equidistant from the origin
    x = torch.stack([y[0, 3], y[0, 140], torch.zeros(3), torch.tensor([30., 3., 4.])])[None]  # |(0,3,4)| = 5
    for backend in ('triton', 'torch'):
        xd, yd = x.to(DEV).requires_grad_(), y.to(DEV).requires_grad_()
        res = chamfer_nn(xd, yd, squared=False, backend=backend)
        assert res.idx_x.cpu().tolist() == [[3, 3, 0, 3]]
        assert res.dist_x.detach().cpu().tolist() == [[0., 0., 0., 5.]]
        # y_140 and y_3 tie for x_0 and x_1 as nearest of each other; y 7 / 8 tie: first x index
        assert res.idx_y[0, 140].item() == 0 and res.idx_y[0, 3].item() == 0
        assert res.idx_y[0, 7].item() == 2 and res.idx_y[0, 8].item() == 2
        gx, gy = torch.autograd.grad(res.dist_x.sum() + res.dist_y.sum(), (xd, yd), retain_graph=True)
        assert torch.isfinite(gx).all() and torch.isfinite(gy).all()
        gx, = torch.autograd.grad(res.dist_x.sum(), xd)  # the x -> y term alone
        assert gx[0, :3].abs().max() == 0  # zero distance: zero (sub)gradient, not nan
        torch.testing.assert_close(gx[0, 3].cpu(), torch.tensor([0., 0.6, 0.8]), atol=1e-6, rtol=0)


def test_padding_lengths_and_masks():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 20, 3, generator=gen)
    y = torch.randn(3, 30, 3, generator=gen)
    y[0, 25] = x[0, 0]  # a padded y point exactly on x_0 must not be chosen
    xl, yl = torch.tensor([20, 12, 1]), torch.tensor([25, 30, 4])
    xm, ym = _valid(3, 20, xl), _valid(3, 30, yl)
    xd, yd = x.to(DEV).requires_grad_(), y.to(DEV).requires_grad_()
    a = chamfer_nn(xd, yd, x_lengths=xl, y_lengths=yl, backend='triton')
    b = chamfer_nn(xd, yd, x_mask=xm.to(DEV), y_mask=ym.to(DEV), backend='triton')
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert a.idx_x[0, 0].item() != 25 and a.dist_x[0, 0].item() > 0
    assert (a.idx_x[~xm.to(DEV)] == -1).all() and (a.dist_x[~xm.to(DEV)] == 0).all()
    assert (a.idx_y[~ym.to(DEV)] == -1).all() and (a.dist_y[~ym.to(DEV)] == 0).all()
    d_ref, i_ref = nn_ref(x, y, xm, ym)
    assert torch.equal(a.idx_x.cpu(), i_ref)
    gx, gy = torch.autograd.grad(a.dist_x.sum() + a.dist_y.sum(), (xd, yd))
    assert (gx[~xm.to(DEV)] == 0).all() and (gy[~ym.to(DEV)] == 0).all()
    # a cloud with no valid point: the other side's valid points get +inf and index -1
    c = chamfer_nn(xd, yd, x_lengths=xl, y_lengths=torch.tensor([25, 0, 4]), backend='triton')
    assert torch.isinf(c.dist_x[1, :12]).all() and (c.idx_x[1] == -1).all()


@pytest.mark.parametrize('squared', [True, False])
def test_chamfer_distance_convention(squared):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 40, 3, generator=gen)
    y = torch.randn(2, 70, 3, generator=gen)
    xl, yl = torch.tensor([40, 33]), torch.tensor([61, 70])
    per_cloud = []
    for b in range(2):
        d_x, _ = nn_ref(x[b:b + 1], y[b:b + 1], _valid(1, 40, xl[b:b + 1]), _valid(1, 70, yl[b:b + 1]))
        d_y, _ = nn_ref(y[b:b + 1], x[b:b + 1], _valid(1, 70, yl[b:b + 1]), _valid(1, 40, xl[b:b + 1]))
        d_x, d_y = d_x[0, :xl[b]], d_y[0, :yl[b]]
        per_cloud.append(d_x.mean() + d_y.mean() if squared else (d_x.sqrt().mean() + d_y.sqrt().mean()) / 2)
    per_cloud = torch.stack(per_cloud)
    for backend in ('triton', 'torch'):
        kw = dict(squared=squared, x_lengths=xl, y_lengths=yl, backend=backend)
        none = chamfer_distance(x.to(DEV), y.to(DEV), reduction='none', **kw)
        assert none.shape == (2,)
        torch.testing.assert_close(none.cpu().double(), per_cloud, atol=TOL, rtol=0)
        torch.testing.assert_close(chamfer_distance(x.to(DEV), y.to(DEV), reduction='mean', **kw).cpu().double(),
                                   per_cloud.mean(), atol=TOL, rtol=0)
        torch.testing.assert_close(chamfer_distance(x.to(DEV), y.to(DEV), reduction='sum', **kw).cpu().double(),
                                   per_cloud.sum(), atol=TOL, rtol=0)


def test_float16_points():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 50, 3, generator=gen).half()
    y = torch.randn(2, 90, 3, generator=gen).half()
    res = chamfer_nn(x.to(DEV), y.to(DEV), backend='triton')
    d_ref, i_ref = nn_ref(x.double(), y.double(), _valid(2, 50, None), _valid(2, 90, None))
    assert res.dist_x.dtype == torch.float16
    torch.testing.assert_close(res.dist_x.cpu().double(), d_ref, atol=1e-4, rtol=2e-3)
    # an index may differ only between neighbours at equal float32 distance
    same = res.idx_x.cpu() == i_ref
    assert same.float().mean() > 0.95
    alt = ((y.double()[torch.arange(2)[:, None], res.idx_x.cpu()] - x.double()) ** 2).sum(-1)
    torch.testing.assert_close(alt, d_ref, atol=1e-4, rtol=2e-3)


def test_env_var_routes_auto_to_the_kernel(monkeypatch):
    calls = []
    real = C._ChamferFn.apply
    monkeypatch.setattr(C._ChamferFn, 'apply', lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 10, 3, device=DEV)
    chamfer_distance(x, x + 1)
    assert calls == ([1] if _CUDA else [])
    monkeypatch.setenv('VISION_PRIORS_KERNELS', 'triton')
    assert chamfer_distance(x, x).item() == 0
    assert len(calls) == (2 if _CUDA else 1)


@pytest.mark.parametrize('kwargs,err,match', [
    (dict(y=torch.zeros(2, 5, 2)), ValueError, r'point dimensions differ: x has D=3, y has D=2'),
    (dict(y=torch.zeros(3, 5, 3)), ValueError, r'batch sizes differ: x has 2, y has 3'),
    (dict(x=torch.zeros(2, 4)), ValueError, r'x and y must be \(B, N, D\) and \(B, M, D\), got \(2, 4\)'),
    (dict(x_lengths=torch.tensor([4, 5])), ValueError, r'x_lengths must lie in \[0, 4\], got \[4, 5\]'),
    (dict(x_lengths=torch.tensor([4.0, 1.0])), ValueError, r'x_lengths must be an integer tensor of shape \(2,\)'),
    (dict(y_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError,
     r'y_mask must be a bool tensor of shape \(B, L\) = \(2, 5\) with True = valid point, got torch.bool \(2, 4\)'),
    (dict(x_mask=torch.ones(2, 4, dtype=torch.uint8)), TypeError,
     r'x_mask must be a bool tensor of shape \(B, L\) = \(2, 4\) with True = valid point, got torch.uint8'),
    (dict(x_lengths=torch.tensor([1, 1]), x_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError,
     'give x_lengths or x_mask, not both'),
    (dict(reduction='max'), ValueError, r"reduction must be one of \('mean', 'sum', 'none'\), got 'max'"),
])
def test_bad_inputs(kwargs, err, match):
    args = dict(x=torch.zeros(2, 4, 3), y=torch.zeros(2, 5, 3))
    args.update(kwargs)
    with pytest.raises(err, match=match):
        chamfer_distance(**args)


ENTRY_POINTS = {
    'chamfer_nn': lambda backend, **kw: chamfer_nn(backend=backend, **kw),
    'chamfer_distance': lambda backend, **kw: chamfer_distance(backend=backend, **kw),
    'chamfer_nn_reference': lambda backend, **kw: chamfer_nn_reference(**kw),
}


@pytest.mark.parametrize('entry', sorted(ENTRY_POINTS))
@pytest.mark.parametrize('backend', ['triton', 'torch'])
def test_non_finite_points_are_errors(entry, backend):
    """A NaN point would be every point's nearest neighbour: NaN / inf points (padded ones too) are a
    ValueError naming the cloud, sample, point and coordinate, on every entry point and backend."""
    fn = ENTRY_POINTS[entry]
    x = torch.randn(2, 6, 3, device=DEV)
    y = torch.randn(2, 8, 3, device=DEV)
    x_bad = x.clone()
    x_bad[1, 4, 2] = float('nan')
    with pytest.raises(ValueError, match=r'^x must be finite: x\[1, 4, 2\] = nan$'):
        fn(backend, x=x_bad, y=y)
    y_bad = y.clone()
    y_bad[0, 7, 0] = -float('inf')
    with pytest.raises(ValueError, match=r'^y must be finite: y\[0, 7, 0\] = -inf$'):
        fn(backend, x=x, y=y_bad)
    # a NaN in the padding still enters the arithmetic (and the gradients): padded points must be finite too
    padded = r'^y must be finite: y\[0, 7, 0\] = -inf \(padded points must be finite too\)$'
    with pytest.raises(ValueError, match=padded):
        fn(backend, x=x, y=y_bad, y_lengths=torch.tensor([7, 8]))


@pytest.mark.parametrize('backend', ['triton', 'torch'])
def test_empty_cloud_is_an_error_under_mean_and_sum_and_nan_under_none(backend):
    """A cloud without a valid point has no Chamfer distance: 'none' gives nan for that sample alone (the
    others keep their values); 'mean' / 'sum' raise, naming the cloud and the samples, instead of nan."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 10, 3, generator=gen).to(DEV)
    y = torch.randn(3, 12, 3, generator=gen).to(DEV)
    full = chamfer_distance(x, y, reduction='none', backend=backend)
    cases = {
        'x': dict(x_lengths=torch.tensor([10, 0, 10])),
        'y': dict(y_mask=torch.tensor([[True] * 12, [True] * 12, [False] * 12], device=DEV)),
    }
    for cloud, kw in cases.items():
        empty = 1 if cloud == 'x' else 2
        none = chamfer_distance(x, y, reduction='none', backend=backend, **kw)
        assert torch.isnan(none[empty]) and torch.isfinite(none).sum() == 2
        keep = [b for b in range(3) if b != empty]
        # the same values up to float rounding: with lengths / masks the kernel is another specialization, whose
        # compiled code may contract or order the sums differently (1 ulp, 2.4e-7 on an H200)
        torch.testing.assert_close(none[keep], full[keep], rtol=1e-6, atol=1e-6)
        for reduction in ('mean', 'sum'):
            with pytest.raises(ValueError, match=(
                    rf"^cloud {cloud} has no valid point in sample\(s\) \[{empty}\]: its Chamfer distance is "
                    rf"undefined and reduction='{reduction}' would make the whole result nan; drop those "
                    r"samples, or use reduction='none' \(nan for them\)$")):
                chamfer_distance(x, y, reduction=reduction, backend=backend, **kw)
    # every cloud empty by shape (N = 0): all samples named
    with pytest.raises(ValueError, match=r'^cloud x has no valid point in sample\(s\) \[0, 1, 2\]'):
        chamfer_distance(x[:, :0], y, backend=backend)
    assert torch.isnan(chamfer_distance(x[:, :0], y, reduction='none', backend=backend)).all()
    # chamfer_nn itself accepts empty clouds (the other side's points get +inf, index -1)
    res = chamfer_nn(x, y, x_lengths=torch.tensor([10, 0, 10]), backend=backend)
    assert torch.isinf(res.dist_y[1]).all() and (res.idx_y[1] == -1).all()


def test_aot_specs_follow_the_runtime_config():
    specs = C.aot_specs()
    assert [s['name'] for s in specs] == ['chamfer_nn_fp16_D3', 'chamfer_nn_bf16_D3', 'chamfer_nn_fp32_D3']
    for s, dtype in zip(specs, (torch.float16, torch.bfloat16, torch.float32)):
        assert s['fn'] is C._nn_kernel
        assert list(s['signature']) == list(kernel_function(s['fn']).arg_names)  # derived from the kernel
        assert s['signature']['X'] == s['signature']['Y'] == f'*{TORCH_TO_TRITON[dtype]}'
        assert s['constexprs']['YMASK'] is None and s['constexprs']['HAS_YMASK'] is False  # the heuristics' flag
        cfg = C.chamfer_config(dtype, 3)
        assert s['constexprs']['BLOCK_M'] == cfg['BLOCK_M'] and s['num_warps'] == cfg['num_warps']
