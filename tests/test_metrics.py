"""PCN completion metrics (``vision_priors/metrics.py``) against PoinTr's definitions.

PoinTr (``extensions/chamfer_dist``, ``utils/metrics.py``), with d1 / d2 the squared nearest-neighbour
distances pred -> gt / gt -> pred: CD-L1 = (mean sqrt d1 + mean sqrt d2) / 2, CD-L2 = mean d1 + mean d2
(both reported x 1000), F-score@0.01 from the unsquared distances with a strict ``<``.

The references here are hand-computed values and a brute-force float64 ``torch.cdist`` (no kernel
op). Tolerances: float64 inputs 1e-12, float32 inputs 1e-6 (coordinates O(1)).
"""
import pytest
import torch

from vision_priors.metrics import chamfer_l1, chamfer_l2, completion_metrics, f_score, nearest_sq_distances

F64 = torch.float64


pytestmark = pytest.mark.usefixtures('one_thread')


def _reference(pred, gt, th=0.01):
    """Brute-force float64 CD-L1, CD-L2, F-score per sample (PoinTr's formulas)."""
    d = torch.cdist(pred.to(F64), gt.to(F64), compute_mode='donot_use_mm_for_euclid_dist')  # (B, N, M)
    d1, d2 = d.min(dim=2).values, d.min(dim=1).values  # unsquared
    cd_l1 = (d1.mean(1) + d2.mean(1)) / 2
    cd_l2 = (d1 ** 2).mean(1) + (d2 ** 2).mean(1)
    p, r = (d1 < th).to(F64).mean(1), (d2 < th).to(F64).mean(1)
    f = torch.where(p + r > 0, 2 * p * r / (p + r).clamp(min=1e-300), 0.)
    return cd_l1, cd_l2, f


def _grid(step=0.1, n=5):
    ax = torch.arange(n, dtype=F64) * step
    return torch.stack(torch.meshgrid(ax, ax, ax, indexing='ij'), -1).reshape(1, -1, 3)


# ----- hand-computed values -----

def test_hand_computed_tiny_clouds():
    pred = torch.tensor([[[0., 0, 0], [1, 0, 0]]], dtype=F64)
    gt = torch.tensor([[[0., 0, 0]]], dtype=F64)
    # d1 = [0, 1], d2 = [0]
    assert chamfer_l1(pred, gt).item() == pytest.approx(0.25, abs=1e-15)  # ((0 + 1) / 2 + 0) / 2
    assert chamfer_l2(pred, gt).item() == pytest.approx(0.5, abs=1e-15)  # (0 + 1) / 2 + 0
    assert f_score(pred, gt).item() == pytest.approx(2 / 3, abs=1e-15)  # P = 1/2, R = 1

    pred = torch.tensor([[[0., 0, 0]]], dtype=F64)
    gt = torch.tensor([[[3., 4, 0], [0, 0, 1]]], dtype=F64)
    # d1 = [1], d2 = [25, 1] (squared)
    assert chamfer_l1(pred, gt).item() == pytest.approx((1 + (5 + 1) / 2) / 2, abs=1e-15)
    assert chamfer_l2(pred, gt).item() == pytest.approx(1 + (25 + 1) / 2, abs=1e-15)
    assert f_score(pred, gt, threshold=1.5).item() == pytest.approx(2 * 1 * 0.5 / 1.5, abs=1e-15)
    assert f_score(pred, gt).item() == 0.  # P = R = 0 -> 0, not nan


def test_f_score_threshold_is_strict():
    pred = torch.tensor([[[0., 0, 0]]], dtype=F64)
    gt = torch.tensor([[[0.5, 0, 0]]], dtype=F64)  # distance exactly 0.5
    assert f_score(pred, gt, threshold=0.5).item() == 0.
    assert f_score(pred, gt, threshold=0.5 + 1e-9).item() == 1.


def test_identical_clouds():
    x = torch.rand(3, 41, 3, generator=torch.Generator().manual_seed(0))
    for fn in (chamfer_l1, chamfer_l2):
        assert torch.equal(fn(x, x), torch.zeros(3))
    assert torch.equal(f_score(x, x), torch.ones(3))
    m = completion_metrics(x, x)
    assert set(m) == {'cd_l1', 'cd_l2', 'f_score'}
    assert torch.equal(m['cd_l1'], torch.zeros(3)) and torch.equal(m['f_score'], torch.ones(3))


@pytest.mark.parametrize('dtype', [torch.float32, F64])
def test_known_shift(dtype):
    """A grid (spacing 0.1) and its copy shifted by 0.02 along x: every NN distance is 0.02."""
    x = _grid().to(dtype)
    y = x + torch.tensor([0.02, 0., 0.], dtype=dtype)
    tol = 1e-12 if dtype == F64 else 1e-6
    assert chamfer_l1(x, y).item() == pytest.approx(0.02, abs=tol)
    assert chamfer_l2(x, y).item() == pytest.approx(2 * 0.0004, abs=tol)
    assert f_score(x, y, 0.01).item() == 0.
    assert f_score(x, y, 0.03).item() == 1.
    m = completion_metrics(x, y)
    assert m['cd_l1'].item() == pytest.approx(20., abs=tol * 1e3)
    assert m['cd_l2'].item() == pytest.approx(0.8, abs=tol * 1e3)
    assert m['f_score'].item() == 0.


# ----- brute force on random clouds -----

@pytest.mark.parametrize('dtype,tol', [(F64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize('n,m', [(37, 53), (1, 17), (101, 3)])
def test_random_clouds_against_brute_force(dtype, tol, n, m):
    g = torch.Generator().manual_seed(n * 1000 + m)
    pred = (torch.rand(3, n, 3, generator=g, dtype=F64) * 0.1).to(dtype)  # dense enough for F-scores in (0, 1)
    gt = (torch.rand(3, m, 3, generator=g, dtype=F64) * 0.1).to(dtype)
    cd1, cd2, f = _reference(pred, gt)
    assert chamfer_l1(pred, gt).dtype == dtype
    torch.testing.assert_close(chamfer_l1(pred, gt).to(F64), cd1, atol=tol, rtol=0)
    torch.testing.assert_close(chamfer_l2(pred, gt).to(F64), cd2, atol=tol, rtol=0)
    if dtype == F64:  # a float32 distance may round across the threshold
        torch.testing.assert_close(f_score(pred, gt).to(F64), f, atol=1e-12, rtol=0)
        mets = completion_metrics(pred, gt)
        torch.testing.assert_close(mets['cd_l1'], cd1 * 1000, atol=1e-9, rtol=0)
        torch.testing.assert_close(mets['cd_l2'], cd2 * 1000, atol=1e-9, rtol=0)
        torch.testing.assert_close(mets['f_score'], f, atol=1e-12, rtol=0)


def test_many_exact_ties_match_the_reference():
    """Integer grids make many equidistant neighbours: the op's first-index tie-break gives the reference values
    (the op's own tiling is tested in tests/test_kernel_conventions.py)."""
    g = torch.Generator().manual_seed(3)
    pred = torch.randint(0, 4, (2, 301, 3), generator=g).to(F64)
    gt = torch.randint(0, 4, (2, 157, 3), generator=g).to(F64)
    cd1, cd2, f = _reference(pred, gt, th=1.5)
    torch.testing.assert_close(chamfer_l1(pred, gt), cd1, atol=1e-12, rtol=0)
    torch.testing.assert_close(chamfer_l2(pred, gt), cd2, atol=1e-12, rtol=0)
    torch.testing.assert_close(f_score(pred, gt, 1.5), f, atol=1e-12, rtol=0)


# ----- gradients -----

def test_gradients_match_brute_force():
    g = torch.Generator().manual_seed(5)
    pred = torch.rand(2, 19, 3, generator=g, dtype=F64, requires_grad=True)
    gt = torch.rand(2, 23, 3, generator=g, dtype=F64, requires_grad=True)
    w = torch.tensor([0.3, 1.7], dtype=F64)
    for ours, idx in ((chamfer_l1, 0), (chamfer_l2, 1)):
        ga = torch.autograd.grad((ours(pred, gt) * w).sum(), (pred, gt))
        gb = torch.autograd.grad((_reference(pred, gt)[idx] * w).sum(), (pred, gt))
        for a, b in zip(ga, gb):
            assert a.abs().sum() > 0
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda p, q: chamfer_l1(p, q), (pred, gt))
    assert torch.autograd.gradcheck(lambda p, q: chamfer_l2(p, q), (pred, gt))


def test_gradient_finite_at_duplicates():
    x = torch.rand(1, 9, 3, dtype=F64, generator=torch.Generator().manual_seed(6))
    pred = x.clone().requires_grad_(True)
    chamfer_l1(pred, x).sum().backward()  # sqrt at distance 0: gradient 0 (PoinTr's would be nan)
    assert torch.equal(pred.grad, torch.zeros_like(pred))


def test_f_score_has_no_gradient():
    pred = torch.rand(1, 5, 3, requires_grad=True)
    assert not f_score(pred, pred.detach()).requires_grad


# ----- errors -----

def test_errors():
    x = torch.rand(2, 5, 3)
    with pytest.raises(ValueError, match='batch sizes differ'):
        chamfer_l1(x, torch.rand(3, 5, 3))
    with pytest.raises(ValueError, match='point dimensions differ'):
        chamfer_l2(x, torch.rand(2, 5, 2))
    with pytest.raises(ValueError, match='empty cloud'):
        chamfer_l1(x, torch.rand(2, 0, 3))
    with pytest.raises(ValueError, match=r'\(B, N, D\)'):
        chamfer_l1(x[0], x[0])
    with pytest.raises(TypeError, match='dtype'):
        chamfer_l1(x, x.double())
    bad = x.clone()
    bad[1, 2, 0] = float('nan')
    with pytest.raises(ValueError, match='finite'):
        completion_metrics(bad, x)
    with pytest.raises(ValueError, match='threshold'):
        f_score(x, x, threshold=0.)


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA (Triton path of chamfer_nn)')
def test_cuda_matches_cpu():
    g = torch.Generator().manual_seed(7)
    pred, gt = torch.rand(4, 1001, 3, generator=g), torch.rand(4, 777, 3, generator=g)
    cpu = completion_metrics(pred, gt, threshold=0.05)
    gpu = completion_metrics(pred.cuda(), gt.cuda(), threshold=0.05)
    for k in cpu:
        torch.testing.assert_close(gpu[k].cpu(), cpu[k], atol=1e-4, rtol=1e-5)
    d1, d2 = nearest_sq_distances(pred.cuda().requires_grad_(), gt.cuda())
    assert d1.shape == (4, 1001) and d2.shape == (4, 777)
