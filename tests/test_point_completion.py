"""PoinTr-style completion model (``vision_priors/models/point_completion.py``), vanilla vs LAVO cross-attention.

Shapes (odd proxy / query counts), farthest point sampling against a brute-force check, input
validation, the registry, parameter counts, batch independence, gradients to every parameter, and a
few AdamW steps on a toy task (upper half of a sphere -> whole sphere) that must reduce PoinTr's loss.
"""

import pytest
import torch

from vision_priors.layers import LavoCrossAttention
from vision_priors.metrics import chamfer_l1
from vision_priors.models import (COMPLETION_MODELS, PointCompletionTransformer, VanillaCrossAttention,
                                  completion_loss, completion_model_names, create_completion_model,
                                  farthest_point_sample)
from vision_priors.models.point_completion import gather_points, knn_indices

CROSS = ('vanilla', 'lavo')
# small enough for quick CPU steps; odd proxy / query counts, non-square-friendly sizes
TINY = dict(embed_dim=32, num_heads=2, encoder_depth=1, decoder_depth=1, num_proxies=16, num_queries=16,
            fold_step=4, knn_k=8, geo_k=4, global_dim=64, fold_hidden=32)


pytestmark = pytest.mark.usefixtures('one_thread')


def _sphere(g, b, n, radius, upper=False):
    p = torch.randn(b, n, 3, generator=g)
    p = p / p.norm(dim=-1, keepdim=True)
    if upper:
        p[..., 2] = p[..., 2].abs()
    return p * radius[:, None, None]


# ----- farthest point sampling -----

def test_fps_brute_force_farthest_property():
    g = torch.Generator().manual_seed(0)
    pts = torch.rand(3, 40, 3, generator=g, dtype=torch.float64)
    idx = farthest_point_sample(pts, 12)
    assert idx.shape == (3, 12) and idx.dtype == torch.long
    for b in range(3):
        sel = idx[b].tolist()
        assert sel[0] == 0 and len(set(sel)) == 12 and all(0 <= i < 40 for i in sel)
        for s in range(1, 12):  # the s-th pick maximises the distance to the picks before it
            dist_to_set = torch.cdist(pts[b], pts[b, sel[:s]]).min(dim=1).values
            assert dist_to_set[sel[s]].item() == pytest.approx(dist_to_set.max().item(), abs=1e-12)
            assert sel[s] == int(dist_to_set.argmax())  # first index among ties, like argmax


def test_fps_batched_equals_per_sample_and_deterministic():
    g = torch.Generator().manual_seed(1)
    pts = torch.rand(4, 57, 3, generator=g)
    idx = farthest_point_sample(pts, 9)
    assert torch.equal(idx, farthest_point_sample(pts, 9))
    for b in range(4):
        assert torch.equal(idx[b:b + 1], farthest_point_sample(pts[b:b + 1], 9))
    sub = gather_points(pts, idx)  # a subset of the input
    assert torch.equal(sub[:, 0], pts[:, 0])
    with pytest.raises(ValueError, match='num_samples'):
        farthest_point_sample(pts, 58)


def test_knn_indices_nearest_first():
    g = torch.Generator().manual_seed(2)
    pts = torch.rand(2, 30, 3, generator=g, dtype=torch.float64)
    idx = knn_indices(pts, pts, 5)
    ref = torch.cdist(pts, pts).topk(5, dim=-1, largest=False).indices
    assert torch.equal(idx, ref) and torch.equal(idx[..., 0], torch.arange(30).expand(2, 30))


# ----- model -----

@pytest.mark.parametrize('cross_attn', CROSS)
@pytest.mark.parametrize('proxies,queries,step', [(13, 7, 3), (16, 16, 4), (5, 1, 1)])
def test_output_shapes(cross_attn, proxies, queries, step):
    torch.manual_seed(0)
    m = PointCompletionTransformer(**{**TINY, 'num_proxies': proxies, 'num_queries': queries, 'fold_step': step,
                                      'knn_k': 5}, cross_attn=cross_attn)
    x = torch.rand(3, 50, 3)
    coarse, fine = m(x)
    assert coarse.shape == (3, queries, 3) and fine.shape == (3, queries * step * step, 3)
    assert m.num_fine_points() == queries * step * step and torch.isfinite(fine).all()
    cls = LavoCrossAttention if cross_attn == 'lavo' else VanillaCrossAttention
    assert all(isinstance(blk.cross_attn, cls) for blk in m.decoder)


@pytest.mark.parametrize('cross_attn', CROSS)
def test_concat_input_layout(cross_attn):
    m = PointCompletionTransformer(**{**TINY, 'num_queries': 7, 'fold_step': 3}, cross_attn=cross_attn,
                                   concat_input=True)
    x = torch.rand(2, 41, 3)
    coarse, fine = m(x)
    assert coarse.shape == (2, 14, 3) and fine.shape == (2, 63 + 41, 3)
    assert torch.equal(fine[:, 63:], x)  # PoinTr appends the input
    assert torch.equal(coarse[:, 7:], gather_points(x, farthest_point_sample(x, 7)))


def test_lavo_model_uses_package_layer_with_head_dim_slots():
    m = create_completion_model('pointr_cpu', cross_attn='lavo')
    layers = [blk.cross_attn for blk in m.decoder]
    assert len(layers) == 2 and all(isinstance(a, LavoCrossAttention) for a in layers)
    assert all(a.num_slots == 32 and a.num_heads == 4 for a in layers)  # head_dim = 128 / 4
    assert create_completion_model('pointr_cpu', cross_attn='lavo', lavo_slots=8).decoder[0].cross_attn.num_slots == 8


@pytest.mark.parametrize('cross_attn', CROSS)
def test_batch_independent_and_all_parameters_get_gradients(cross_attn):
    torch.manual_seed(0)
    m = PointCompletionTransformer(**TINY, cross_attn=cross_attn)
    g = torch.Generator().manual_seed(3)
    x, gt = torch.rand(3, 40, 3, generator=g), torch.rand(3, 70, 3, generator=g)
    coarse, fine = m(x)
    c1, f1 = m(x[1:2])
    torch.testing.assert_close(c1, coarse[1:2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f1, fine[1:2], atol=1e-5, rtol=1e-5)
    loss = completion_loss(coarse, fine, gt)
    torch.testing.assert_close(loss, chamfer_l1(coarse, gt).mean() + chamfer_l1(fine, gt).mean())
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


def test_input_validation():
    m = PointCompletionTransformer(**TINY)
    with pytest.raises(ValueError, match=r'\(B, N, 3\)'):
        m(torch.rand(2, 40, 2))
    with pytest.raises(ValueError, match=r'\(B, N, 3\)'):
        m(torch.rand(40, 3))
    with pytest.raises(ValueError, match='at least 16'):
        m(torch.rand(2, 15, 3))
    with pytest.raises(TypeError, match='floating'):
        m(torch.ones(2, 40, 3, dtype=torch.long))
    x = torch.rand(2, 40, 3)
    x[1, 7, 2] = float('inf')
    with pytest.raises(ValueError, match=r'partial\[1, 7, 2\] = inf'):
        m(x)
    with pytest.raises(ValueError, match='divisible'):
        PointCompletionTransformer(embed_dim=30, num_heads=4)
    with pytest.raises(ValueError, match='lavo_slots'):
        PointCompletionTransformer(**TINY, cross_attn='lavo', lavo_slots=17)
    with pytest.raises(ValueError, match='num_queries'):
        PointCompletionTransformer(**{**TINY, 'num_queries': 0})


# ----- registry -----

def test_registry_names_and_errors():
    assert completion_model_names() == sorted(COMPLETION_MODELS)
    assert {'pointr_cpu', 'pointr_small', 'pointr_pcn'} <= set(completion_model_names())
    with pytest.raises(ValueError, match="unknown completion model 'pointr_xl'.*pointr_cpu"):
        create_completion_model('pointr_xl')
    with pytest.raises(ValueError, match=r"unknown override\(s\) \['width'\].*embed_dim"):
        create_completion_model('pointr_cpu', width=64)
    with pytest.raises(ValueError, match='cross_attn must be one of'):
        create_completion_model('pointr_cpu', cross_attn='linear')
    m = create_completion_model('pointr_cpu', num_queries=5)
    assert m.num_queries == 5 and m.embed_dim == COMPLETION_MODELS['pointr_cpu']['embed_dim']


def test_registry_fine_points_and_parameter_counts():
    # PoinTr's layout (the input is appended): Q x 64 generated + N input points
    expected_fine = {'pointr_cpu': 2048 + 512, 'pointr_small': 4096 + 512, 'pointr_pcn': 224 * 64 + 2048}
    inputs = {'pointr_cpu': 512, 'pointr_small': 512, 'pointr_pcn': 2048}
    for name in completion_model_names():
        counts = {}
        for ca in CROSS:
            m = create_completion_model(name, cross_attn=ca)
            counts[ca] = sum(p.numel() for p in m.parameters())
        cfg = COMPLETION_MODELS[name]
        assert m.concat_input and m.num_fine_points(inputs[name]) == expected_fine[name]
        # the only difference: LAVO's shared source map (C x C) vs vanilla's separate k, v (2 C x C)
        assert counts['vanilla'] - counts['lavo'] == cfg['decoder_depth'] * cfg['embed_dim'] ** 2
        assert 0.95 < counts['lavo'] / counts['vanilla'] < 1.0


# ----- training -----

@pytest.mark.parametrize('cross_attn', CROSS)
def test_training_reduces_loss(cross_attn):
    """30 AdamW steps: upper hemisphere (radius 0.3-0.5) -> whole sphere; PoinTr's loss falls by half (on the
    generated points alone: the appended input would start the loss lower)."""
    torch.manual_seed(0)
    m = create_completion_model('pointr_cpu', cross_attn=cross_attn, **TINY, concat_input=False)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(30):
        r = 0.3 + 0.2 * torch.rand(8, generator=g)
        partial, gt = _sphere(g, 8, 128, r, upper=True), _sphere(g, 8, 256, r)
        loss = completion_loss(*m(partial), gt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert last < 0.5 * first, (first, last, losses)


def test_initialisation_as_pointr_transformer_trunc_normal_rebuild_head_default():
    """PoinTr starts its transformer trunc-normal(0.02) and its rebuild head (increase_dim, reduce_map, the
    folding net) with PyTorch's default."""
    torch.manual_seed(0)
    model = create_completion_model('pointr_cpu', cross_attn='vanilla', concat_input=False)
    assert model.encoder[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.decoder[0].cross_attn.q.weight.std().item() == pytest.approx(0.02, rel=0.1)
    c = model.embed_dim
    fold = model.fold
    for feat, seed in ((fold.feat1, fold.seed1), (fold.feat2, fold.seed2)):
        bound = (c + seed.in_features) ** -0.5  # the concatenated layer's fan-in, as PoinTr's Conv1d
        for w in (feat.weight, feat.bias, seed.weight):
            assert w.abs().max().item() <= bound and w.abs().max().item() > 0.9 * bound
    uniform_std = (model.reduce_map.in_features * 3) ** -0.5  # U(+-1/sqrt(fan_in)) has std 1/sqrt(3 fan_in)
    assert model.reduce_map.weight.std().item() == pytest.approx(uniform_std, rel=0.1)
    # the grid seed reaches the offsets: their spread over a query's 64 fine points is ~1e-4 at this start,
    # against ~2e-7 when the head starts trunc-normal(0.02) too
    coarse, fine = model(torch.randn(2, 256, 3))
    offsets = fine.reshape(2, model.num_queries, model.points_per_query, 3) - coarse[:, :, None, :]
    assert offsets.std(dim=2).mean().item() > 1e-5
