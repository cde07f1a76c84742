"""Tests of LAVO attention against explicit float64 references written from the paper's equations.

The references below use plain loops over positions and build the CODE slots ``diag(H) B`` explicitly
(Eqs. 3-6 of Zhang et al., arXiv:2312.11135). They share no code with the layer; they only read its
parameters (q/k/v weights in the standard ``(3, heads, head_dim)`` row layout).

Tolerances (float64): forward 1e-10 absolute, gradients 1e-9 absolute.
"""
import math

import pytest
import torch

from vision_priors.layers.lavo import LavoAttention, LavoCrossAttention

DT = torch.float64
FWD_TOL = 1e-10
GRAD_TOL = 1e-9
DIM, HEADS, SLOTS, WIN = 16, 2, 4, 8


pytestmark = pytest.mark.usefixtures('one_thread')


def _make(seed: int = 0, **kw) -> LavoAttention:
    torch.manual_seed(seed)
    kw.setdefault('num_slots', SLOTS)
    kw.setdefault('window', WIN)
    m = LavoAttention(DIM, HEADS, qkv_bias=True, **kw).to(DT).eval()
    with torch.no_grad():  # non-zero position biases so that EPE indexing is exercised
        for p in (m.rel_bias, m.rel_bias_2d):
            if p is not None:
                p.normal_()
    return m


def _qkv(m: LavoAttention, x: torch.Tensor):
    b, n, c = x.shape
    qkv = (x @ m.qkv.weight.T + m.qkv.bias).reshape(b, n, 3, m.num_heads, m.head_dim)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each (B, L, heads, hd)


def _softmax_read(q, keys, values, bias):
    """q (B, H, d); keys / values (B, n, H, d); bias (n,) -> softmax(q k^T * s + bias) v."""
    s = torch.einsum('bhd,bnhd->bhn', q, keys) / math.sqrt(q.shape[-1]) + bias
    return torch.einsum('bhn,bnhd->bhd', s.softmax(-1), values)


def _slots_read(q, h, basis):
    """Eq. 3 with explicit slots: X~ = diag(H) B, softmax(q X~^T * s) X~.  h (B, H, r), basis (H, r, d)."""
    slots = h[..., None] * basis  # (B, H, r, d), slot i = H_i b_i
    s = torch.einsum('bhd,bhrd->bhr', q, slots) / math.sqrt(q.shape[-1])
    return torch.einsum('bhr,bhrd->bhd', s.softmax(-1), slots)


def _out(m, f):
    return f @ m.proj.weight.T + m.proj.bias


def ref_causal(m: LavoAttention, x: torch.Tensor) -> torch.Tensor:
    """Causal LAVO (Eq. 4, Secs. 3.2-3.3), one position at a time."""
    q, k, v = _qkv(m, x)
    b, n, nh, d = q.shape
    w = m.window
    basis = m.basis()
    P = m.rel_bias if m.use_epe else None
    h = torch.zeros(b, nh, m.num_slots, dtype=x.dtype)
    outs = []
    for t in range(n):
        def attend(lo):  # keys lo..t, bias P[j - t + w - 1]
            bias = P[lo - t + w - 1: w] if P is not None else torch.zeros(t + 1 - lo, dtype=x.dtype)
            return _softmax_read(q[:, t], k[:, lo:t + 1], v[:, lo:t + 1], bias)

        f_local = attend(max(0, t - w + 1))
        if not m.context_dissection:
            z = v[:, t]
        elif m.dissection == 'sliding':
            z = f_local
        else:
            z = attend((t // w) * w)  # own dissection window, causally
        bz = torch.einsum('bhd,hrd->bhr', z, basis)
        h = h + (bz - h) / (t + 1)  # Eq. 4: H_t = H_{t-1} + (B z_t - H_{t-1}) / t
        f_global = _slots_read(q[:, t], h, basis)
        f = 0.5 * (f_local + f_global) if m.use_local else f_global
        outs.append(f.reshape(b, nh * d))
    return _out(m, torch.stack(outs, 1))


def ref_noncausal(m: LavoAttention, x, valid=None, grid=None, n_pre=0):
    """Non-causal LAVO: global mean over all valid tokens, two-sided 1D or 2D local windows."""
    q, k, v = _qkv(m, x)
    b, n, nh, d = q.shape
    w, w2 = m.window, m.window_2d
    kw = 2 * w2 - 1
    basis = m.basis()
    valid = torch.ones(b, n, dtype=torch.bool) if valid is None else valid

    def pos(j):
        return divmod(j - n_pre, grid[1])

    def neighbours(i, block):
        if grid is None:
            if block:
                return [j for j in range(n) if j // w == i // w], [j - i + w - 1 for j in range(n) if j // w == i // w]
            js = [j for j in range(n) if abs(j - i) <= w - 1]
            return js, [j - i + w - 1 for j in js]
        if i < n_pre:
            return list(range(n_pre)), None
        ri, ci = pos(i)
        js, idx = [], []
        for j in range(n_pre, n):
            rj, cj = pos(j)
            ok = (rj // w2 == ri // w2 and cj // w2 == ci // w2) if block else (
                abs(rj - ri) <= w2 - 1 and abs(cj - ci) <= w2 - 1)
            if ok:
                js.append(j)
                idx.append((rj - ri + w2 - 1) * kw + (cj - ci + w2 - 1))
        return js, idx

    def attend(bi, i, block):
        js, idx = neighbours(i, block)
        js_ok = [j for j in js if valid[bi, j]]
        if not js_ok:
            return torch.zeros(nh, d, dtype=x.dtype)
        table = m.rel_bias if grid is None else m.rel_bias_2d
        if m.use_epe and idx is not None:
            bias = torch.stack([table[ii] for j, ii in zip(js, idx) if valid[bi, j]])
        else:
            bias = torch.zeros(len(js_ok), dtype=x.dtype)
        return _softmax_read(q[bi:bi + 1, i], k[bi:bi + 1, js_ok], v[bi:bi + 1, js_ok], bias)[0]

    out = []
    for bi in range(b):
        f_local = [attend(bi, i, False) for i in range(n)]
        if not m.context_dissection:
            z = [v[bi, i] for i in range(n)]
        elif m.dissection == 'sliding':
            z = f_local
        else:
            z = [attend(bi, i, True) for i in range(n)]
        idx = [i for i in range(n) if valid[bi, i]]
        h = sum(torch.einsum('hd,hrd->hr', z[i], basis) for i in idx) / max(len(idx), 1)  # Eq. 3
        rows = []
        for i in range(n):
            f_global = _slots_read(q[bi:bi + 1, i], h[None], basis)[0]
            rows.append((0.5 * (f_local[i] + f_global)).reshape(-1))
        out.append(torch.stack(rows))
    return _out(m, torch.stack(out))


def _grads(fn, x, params, g):
    for p in params:
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    (y * g).sum().backward()
    return y.detach(), [x.grad] + [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def _assert_matches_reference(m, fn_layer, fn_ref, x):
    params = [p for p in m.parameters()]
    g = torch.randn(x.shape[0], x.shape[1], DIM, dtype=DT)
    y_ref, g_ref = _grads(fn_ref, x, params, g)
    y, g_lay = _grads(fn_layer, x, params, g)
    torch.testing.assert_close(y, y_ref, atol=FWD_TOL, rtol=0)
    for a, r in zip(g_lay, g_ref):
        torch.testing.assert_close(a, r, atol=GRAD_TOL, rtol=0)
    assert y.abs().max() > 1e-3 and g_ref[0].abs().max() > 1e-6  # non-trivial values were compared


# ----- causal -----

LENGTHS = [1, WIN - 1, WIN, WIN + 1, 333]


@pytest.mark.parametrize('length', LENGTHS)
def test_causal_parallel_matches_reference(length):
    m = _make()
    x = torch.randn(2, length, DIM, dtype=DT)
    _assert_matches_reference(m, m, lambda t: ref_causal(m, t), x)


@pytest.mark.parametrize('kw', [
    dict(dissection='sliding'),
    dict(use_epe=False),                               # ablation: without EPE
    dict(use_epe=False, context_dissection=False),     # ablation: without EPE and CD (local kept)
    dict(use_local=False, context_dissection=False),   # CODE only
    dict(num_slots=DIM // HEADS, basis='orthogonal'),  # r = head_dim, learned basis
])
def test_causal_variants_match_reference(kw):
    m = _make(**kw)
    x = torch.randn(2, 2 * WIN + 3, DIM, dtype=DT)
    _assert_matches_reference(m, m, lambda t: ref_causal(m, t), x)


@pytest.mark.parametrize('dissection', ['block', 'sliding'])
@pytest.mark.parametrize('length', LENGTHS)
def test_recurrent_matches_parallel(length, dissection):
    m = _make(dissection=dissection)
    x = torch.randn(2, length, DIM, dtype=DT)
    with torch.no_grad():
        y = m(x)
        state = m.init_state(2)
        ys = []
        for t in range(length):
            y_t, state = m.step(x[:, t:t + 1], state)
            ys.append(y_t)
        torch.testing.assert_close(torch.cat(ys, 1), y, atol=FWD_TOL, rtol=0)
        # prefill a prompt, then continue with the recurrent form
        split = length // 2 + 1
        y_p, state = m.prefill(x[:, :split])
        ys = [y_p]
        for t in range(split, length):
            y_t, state = m.step(x[:, t:t + 1], state)
            ys.append(y_t)
        torch.testing.assert_close(torch.cat(ys, 1), y, atol=FWD_TOL, rtol=0)


@pytest.mark.parametrize('kw', [dict(), dict(dissection='sliding'), dict(context_dissection=False)])
def test_causality_bit_exact(kw):
    m = _make(**kw)
    n = 3 * WIN + 5
    x = torch.randn(2, n, DIM, dtype=DT)
    with torch.no_grad():
        y = m(x)
        for t in [0, WIN - 2, WIN - 1, WIN, 2 * WIN + 1, n - 2]:
            x2 = x.clone()
            x2[:, t + 1:] = 100 * torch.randn_like(x2[:, t + 1:])
            y2 = m(x2)
            assert torch.equal(y2[:, :t + 1], y[:, :t + 1]), f'output at <= {t} changed'
            assert not torch.equal(y2[:, t + 1:], y[:, t + 1:])


def test_causal_key_padding_mask():
    """Invalid tokens are left out of windows and of the mean: equal to deleting them (right padding)."""
    m = _make()
    x = torch.randn(2, 21, DIM, dtype=DT)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, 13:] = False
    with torch.no_grad():
        y = m(x, key_mask=mask)
        torch.testing.assert_close(y[1, :13], m(x[1:, :13])[0], atol=FWD_TOL, rtol=0)
        torch.testing.assert_close(y[0], m(x[:1])[0], atol=FWD_TOL, rtol=0)


def test_state_size_constant():
    m = LavoAttention(8, 2, num_slots=2, window=4).eval()
    x = torch.randn(1, 10_000, 8)
    state = m.init_state(1)
    shapes = {}
    with torch.no_grad():
        for t in range(10_000):
            _, state = m.step(x[:, t:t + 1], state)
            if t + 1 in (10, 10_000):
                shapes[t + 1] = (state.numel(), [tuple(s.shape) for s in
                                                 (state.h, state.count, state.keys, state.values)])
    assert int(state.count) == 10_000
    assert shapes[10] == shapes[10_000]
    assert shapes[10][0] == 2 * 2 + 1 + 2 * (2 * 4 * 4)  # r*heads + count + 2 * heads*w*head_dim


# ----- non-causal -----

@pytest.mark.parametrize('kw', [dict(), dict(dissection='sliding'), dict(use_epe=False, context_dissection=False)])
def test_noncausal_1d_matches_reference(kw):
    m = _make(causal=False, **kw)
    x = torch.randn(2, 2 * WIN + 3, DIM, dtype=DT)
    mask = torch.ones(2, x.shape[1], dtype=torch.bool)
    mask[1, 4] = mask[1, 9:] = False  # query 18 (window 11..18) and block 2 have no valid key
    _assert_matches_reference(m, m, lambda t: ref_noncausal(m, t), x)
    with torch.no_grad():
        torch.testing.assert_close(m(x, key_mask=mask), ref_noncausal(m, x, valid=mask), atol=FWD_TOL, rtol=0)


@pytest.mark.parametrize('grid,n_pre', [((4, 5), 1), ((4, 6), 0), ((6, 4), 2)])
@pytest.mark.parametrize('dissection', ['block', 'sliding'])
def test_noncausal_2d_matches_reference(dissection, grid, n_pre):
    """Float64 forward and backward against the per-token reference, with and without a key mask: grids that
    are and are not whole 2 x 2 tiles, 0-2 prefix tokens ('block' forms H from the tiles' summed aggregates)."""
    m = _make(causal=False, window=3, window_2d=2, dissection=dissection)
    x = torch.randn(2, n_pre + grid[0] * grid[1], DIM, dtype=DT)
    mask = torch.ones(2, x.shape[1], dtype=torch.bool)
    gw = grid[1]
    # sample 1: patch tile (0, 0) and the 3x3 neighbourhood of patch (0, 0) all invalid; the last prefix too
    mask[1, [n_pre, n_pre + 1, n_pre + gw, n_pre + gw + 1]] = False
    if n_pre:
        mask[1, n_pre - 1] = False
    fn = lambda t: m(t, grid_size=grid, num_prefix_tokens=n_pre)
    _assert_matches_reference(m, fn, lambda t: ref_noncausal(m, t, grid=grid, n_pre=n_pre), x)
    fn_masked = lambda t: m(t, key_mask=mask, grid_size=grid, num_prefix_tokens=n_pre)
    _assert_matches_reference(m, fn_masked, lambda t: ref_noncausal(m, t, valid=mask, grid=grid, n_pre=n_pre), x)


def test_window_larger_than_sequence():
    for causal in (True, False):
        m = _make(causal=causal, window=50)
        x = torch.randn(2, 7, DIM, dtype=DT)
        ref = ref_causal if causal else ref_noncausal
        with torch.no_grad():
            torch.testing.assert_close(m(x), ref(m, x), atol=FWD_TOL, rtol=0)


# ----- cross-attention -----

def ref_cross(c: LavoCrossAttention, x, ctx, valid):
    """Eqs. 5-6: Q = Y W_q, X~ = diag(H) B with H the mean of B x_s over valid source tokens."""
    b, mq, _ = x.shape
    nh, d = c.num_heads, c.head_dim
    q = (x @ c.q.weight.T + c.q.bias).reshape(b, mq, nh, d)
    src = (ctx @ c.kv.weight.T + c.kv.bias).reshape(b, ctx.shape[1], nh, d)
    basis = c.basis()
    out = torch.zeros(b, mq, nh * d, dtype=x.dtype)
    for bi in range(b):
        idx = [s for s in range(ctx.shape[1]) if valid[bi, s]]
        h = sum(torch.einsum('hd,hrd->hr', src[bi, s], basis) for s in idx) / len(idx)
        for i in range(mq):
            out[bi, i] = _slots_read(q[bi:bi + 1, i], h[None], basis)[0].reshape(-1)
    return out @ c.proj.weight.T + c.proj.bias


def test_cross_matches_explicit_slots_and_ignores_masked():
    torch.manual_seed(0)
    c = LavoCrossAttention(DIM, HEADS, num_slots=SLOTS, context_dim=12, qkv_bias=True).to(DT).eval()
    x = torch.randn(2, 5, DIM, dtype=DT)
    ctx = torch.randn(2, 9, 12, dtype=DT)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, [1, 6]] = False
    mask[1, 4:] = False
    params = list(c.parameters())
    g = torch.randn(2, 5, DIM, dtype=DT)
    y_ref, g_ref = _grads(lambda t: ref_cross(c, t, ctx, mask), x, params, g)
    y, g_lay = _grads(lambda t: c(t, ctx, mask), x, params, g)
    torch.testing.assert_close(y, y_ref, atol=FWD_TOL, rtol=0)
    for a, r in zip(g_lay, g_ref):
        torch.testing.assert_close(a, r, atol=GRAD_TOL, rtol=0)
    with torch.no_grad():
        ctx2 = ctx.clone()
        ctx2[~mask] = 1e3 * torch.randn_like(ctx2[~mask])
        assert torch.equal(c(x, ctx2, mask), y)
        torch.testing.assert_close(c(x[1:], ctx[1:, :4])[0], y[1], atol=FWD_TOL, rtol=0)
        assert not torch.allclose(c(x, ctx), y)  # the mask matters


def test_cross_empty_context_is_the_all_masked_result():
    """An empty context (n = 0) and a sample whose context is all masked both have H = 0: zero attention
    output before the projection, so every query gets proj(0) = the projection bias; finite (zero) gradients
    through the queries and the source, exactly as the all-masked sample, and the same under TorchScript."""
    torch.manual_seed(0)
    c = LavoCrossAttention(DIM, HEADS, num_slots=SLOTS, context_dim=12, qkv_bias=True).to(DT).eval()
    x = torch.randn(2, 5, DIM, dtype=DT)
    ctx = torch.randn(2, 9, 12, dtype=DT)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1] = False  # sample 1: every source token masked
    params = list(c.parameters())
    g = torch.randn(2, 5, DIM, dtype=DT)
    bias = c.proj.bias.detach().expand(2, 5, DIM)
    results = {}
    for name, args in {'masked': (ctx, mask), 'empty': (ctx[:, :0], None),
                       'empty_masked': (ctx[:, :0], torch.ones(2, 0, dtype=torch.bool))}.items():
        y, grads = _grads(lambda t: c(t, *args), x, params, g)
        assert all(torch.isfinite(a).all() for a in grads), name
        results[name] = (y, grads)
    y, grads = results['empty']
    assert torch.equal(y, bias)
    assert grads[0].abs().max() == 0  # d out / d x: H = 0 makes the output independent of the queries
    names = [n for n, _ in c.named_parameters()]
    torch.testing.assert_close(grads[1 + names.index('proj.bias')], g.sum((0, 1)), rtol=0, atol=1e-12)
    y_m, grads_m = results['masked']
    assert torch.equal(y_m[1], y[1])
    assert grads_m[0][1].abs().max() == 0 and torch.equal(grads_m[0][1], grads[0][1])
    assert torch.equal(results['empty_masked'][0], y)
    with torch.no_grad():
        assert torch.equal(torch.jit.script(c)(x, ctx[:, :0]), bias)


def _compress_per_token(c: LavoCrossAttention, ctx, valid):
    """The per-token form of CODE compression (what ``compress`` computed before it took the mean first):
    project every source token ``x_s = W_x c_s + b_x``, apply the basis ``B x_s`` and average over the valid
    tokens; H = 0 for a sample without a valid token (n = 0 or all masked)."""
    b, n, _ = ctx.shape
    src = (ctx @ c.kv.weight.T + c.kv.bias).reshape(b, n, c.num_heads, c.head_dim).transpose(1, 2)
    proj = src @ c.basis().transpose(-1, -2)  # (B, heads, n, r)
    m = torch.ones(b, n, dtype=ctx.dtype) if valid is None else valid.to(ctx.dtype)
    proj = proj * m[:, None, :, None]
    return proj.sum(2, keepdim=True) / m.sum(1).clamp(min=1)[:, None, None, None]


def _cross_per_token(c: LavoCrossAttention, x, ctx, valid):
    b, mq, _ = x.shape
    h = _compress_per_token(c, ctx, valid)  # (B, heads, 1, r)
    q = (x @ c.q.weight.T + c.q.bias).reshape(b, mq, c.num_heads, c.head_dim).transpose(1, 2)
    slots = h[:, :, 0, :, None] * c.basis()  # (B, heads, r, d), slot i = H_i b_i
    logits = torch.einsum('bhmd,bhrd->bhmr', q, slots) * c.scale
    out = torch.einsum('bhmr,bhrd->bhmd', logits.softmax(-1), slots)
    return out.transpose(1, 2).reshape(b, mq, c.dim) @ c.proj.weight.T + c.proj.bias


@pytest.mark.parametrize('case', ['masked', 'no_mask', 'empty', 'empty_masked'])
def test_compress_mean_first_equals_per_token_form(case):
    """``compress`` averages the (masked) context and projects the mean once; in exact arithmetic that is
    the per-token form (project every token, then average). Float64, odd shapes (3 samples, 7 queries,
    13 source tokens of width 11, 3 heads of 5), projection biases on, masks with an all-masked sample:
    H, the output and the gradients of context, queries and every parameter agree to 1e-10."""
    torch.manual_seed(3)
    c = LavoCrossAttention(15, 3, num_slots=4, context_dim=11, qkv_bias=True).to(DT).eval()
    with torch.no_grad():
        c.kv.bias.normal_(0, 1.)  # a bias that would show if it leaked into an all-masked sample
    n = 0 if case.startswith('empty') else 13
    x = torch.randn(3, 7, 15, dtype=DT, requires_grad=True)
    ctx = torch.randn(3, n, 11, dtype=DT, requires_grad=True)
    valid = None
    if case == 'masked':
        valid = torch.rand(3, n) > 0.4
        valid[0, 0] = True
        valid[1] = False  # all masked
        valid[2] = True
    elif case == 'empty_masked':
        valid = torch.ones(3, 0, dtype=torch.bool)
    h, h_ref = c.compress(ctx, valid), _compress_per_token(c, ctx, valid)
    assert h.shape == h_ref.shape == (3, 3, 1, 4)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)
    if case != 'no_mask':
        absent = 1 if case == 'masked' else slice(None)
        assert h[absent].abs().max() == 0  # exactly H = 0, as before
    params = list(c.parameters())
    g = torch.randn(3, 7, 15, dtype=DT)
    y, y_ref = c(x, ctx, valid), _cross_per_token(c, x, ctx, valid)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    tensors = [x, ctx] + params
    got = torch.autograd.grad((y * g).sum(), tensors, allow_unused=True)
    want = torch.autograd.grad((y_ref * g).sum(), tensors, allow_unused=True)
    for a, r in zip(got, want):
        a = torch.zeros_like(r) if a is None else a
        r = torch.zeros_like(a) if r is None else r
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)
    if case == 'masked':
        assert got[1][1].abs().max() == 0 and got[1][~valid].abs().max() == 0  # masked tokens: zero gradient
        assert got[1][valid].abs().max() > 0


# ----- learned basis -----

def _train(module, steps, penalty_weight=0.):
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(2, 12, DIM)
        loss = module(x).pow(2).mean() + penalty_weight * module.orthogonality_penalty()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _max_dev(basis):
    b = basis.detach()
    return (b @ b.transpose(-1, -2) - torch.eye(b.shape[-2])).abs().max().item()


def test_orthogonality_preserved_when_learned():
    """'orthogonal' (parametrised): max |B B^T - I| < 1e-5 in float32 after 30 Adam steps, and B moved."""
    torch.manual_seed(0)
    m = LavoAttention(DIM, HEADS, num_slots=SLOTS, window=4, basis='orthogonal')
    b0 = m.basis().detach().clone()
    _train(m, 30)
    assert (m.basis().detach() - b0).abs().max() > 1e-3
    assert _max_dev(m.basis()) < 1e-5


def test_orthogonality_penalty_keeps_basis_near_orthogonal():
    """'penalty': with weight 10, max |B B^T - I| < 2e-2 after 30 Adam steps (soft constraint)."""
    torch.manual_seed(0)
    m = LavoAttention(DIM, HEADS, num_slots=SLOTS, window=4, basis='penalty')
    assert m.orthogonality_penalty().item() < 1e-10
    b0 = m.basis().detach().clone()
    _train(m, 30, penalty_weight=10.)
    assert (m.basis().detach() - b0).abs().max() > 1e-3
    assert _max_dev(m.basis()) < 2e-2


def test_fixed_basis_is_a_buffer():
    m = LavoAttention(DIM, HEADS, num_slots=SLOTS, window=4)
    assert 'basis.weight' not in dict(m.named_parameters())
    assert _max_dev(m.basis()) < 1e-6


# ----- bad input -----

def test_too_many_slots_is_an_error():
    with pytest.raises(ValueError, match=r'r=96.*head_dim=64'):
        LavoAttention(256, 4, num_slots=96)
    with pytest.raises(ValueError, match=r'r=9.*head_dim=8'):
        LavoCrossAttention(16, 2, num_slots=9)


def test_mismatched_dims_are_errors():
    c = LavoCrossAttention(DIM, HEADS, num_slots=SLOTS)
    with pytest.raises(ValueError, match=r'context must be \(B, n, 16\).*\(2, 5, 12\)'):
        c(torch.randn(2, 3, DIM), torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match=r'x must be \(B, m, 16\)'):
        c(torch.randn(2, 3, 8), torch.randn(2, 5, DIM))
    with pytest.raises(ValueError, match='batch sizes differ'):
        c(torch.randn(2, 3, DIM), torch.randn(3, 5, DIM))
    with pytest.raises(ValueError, match=r'key_mask must be a bool tensor of shape \(B, L\) = \(2, 5\) '
                                         r'with True = valid key, got torch.bool \(2, 4\)'):
        c(torch.randn(2, 3, DIM), torch.randn(2, 5, DIM), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match='bool'):
        c(torch.randn(2, 3, DIM), torch.randn(2, 5, DIM), torch.ones(2, 5))
    m = LavoAttention(DIM, HEADS, num_slots=SLOTS, window=4, causal=False)
    with pytest.raises(ValueError, match=r'expected input features 16'):
        m(torch.randn(1, 5, 8))
    with pytest.raises(ValueError, match=r'describes 21 tokens, but the sequence has L=20'):
        m(torch.randn(1, 20, DIM), grid_size=(4, 5), num_prefix_tokens=1)
    with pytest.raises(RuntimeError, match='causal=True'):
        m.init_state(1)
    with pytest.raises(ValueError, match='divisible'):
        LavoAttention(10, 3)


def test_dropout_only_in_training():
    m = LavoAttention(DIM, HEADS, num_slots=SLOTS, window=4, attn_drop=0.5)
    x = torch.randn(1, 9, DIM)
    m.train()
    assert not torch.equal(m(x), m(x))
    m.eval()
    assert torch.equal(m(x), m(x))


# ----- TorchScript -----

def _assert_script_equal(scripted, eager, *args):
    with torch.no_grad():
        y = eager(*args)
        for _ in range(3):  # the profiling executor optimises the graph after the first calls
            assert torch.equal(scripted(*args), y)


@pytest.mark.parametrize('kw', [
    dict(),
    dict(dissection='sliding'),
    dict(use_epe=False, context_dissection=False),
    dict(use_local=False, context_dissection=False),
    dict(basis='penalty'),
])
def test_script_noncausal_1d_matches_eager(kw):
    m = _make(causal=False, **kw)
    sm = torch.jit.script(m)
    x = torch.randn(2, 2 * WIN + 3, DIM, dtype=DT)
    mask = torch.ones(2, x.shape[1], dtype=torch.bool)
    mask[1, 4] = mask[1, 9:] = False
    _assert_script_equal(sm, m, x)
    _assert_script_equal(sm, m, x, mask)


@pytest.mark.parametrize('kw', [dict(), dict(dissection='sliding'), dict(use_epe=False, context_dissection=False)])
def test_script_noncausal_2d_matches_eager(kw):
    m = _make(causal=False, window=3, window_2d=2, **kw)
    sm = torch.jit.script(m)
    x = torch.randn(2, 1 + 20, DIM, dtype=DT)
    mask = torch.ones(2, x.shape[1], dtype=torch.bool)
    mask[1, [1, 2, 6, 7]] = False
    with torch.no_grad():
        y = m(x, None, (4, 5), 1)
        for _ in range(3):
            assert torch.equal(sm(x, None, [4, 5], 1), y)
            assert torch.equal(sm(x, mask, [4, 5], 1), m(x, mask, (4, 5), 1))
        with pytest.raises(Exception, match='grid_size'):
            sm(x, None, [4, 4], 1)


@pytest.mark.parametrize('kw', [dict(), dict(dissection='sliding'), dict(use_epe=False, context_dissection=False)])
def test_script_causal_matches_eager(kw):
    m = _make(**kw)
    sm = torch.jit.script(m)
    x = torch.randn(2, 2 * WIN + 3, DIM, dtype=DT)
    mask = torch.ones(2, x.shape[1], dtype=torch.bool)
    mask[1, 13:] = False
    _assert_script_equal(sm, m, x)
    _assert_script_equal(sm, m, x, mask)


def test_script_float32_and_dropout_train():
    torch.manual_seed(0)
    m = LavoAttention(DIM, HEADS, num_slots=SLOTS, window=4, causal=False, attn_drop=0.3).eval()
    sm = torch.jit.script(m)
    x = torch.randn(2, 9, DIM)
    _assert_script_equal(sm, m, x)
    m.train()
    sm.train()
    torch.manual_seed(3)
    y = m(x)
    torch.manual_seed(3)
    torch.testing.assert_close(sm(x), y, atol=1e-6, rtol=0)


@pytest.mark.parametrize('masked', [False, True])
def test_script_cross_matches_eager(masked):
    torch.manual_seed(0)
    c = LavoCrossAttention(DIM, HEADS, num_slots=SLOTS, context_dim=12, qkv_bias=True).to(DT).eval()
    sc = torch.jit.script(c)
    x = torch.randn(2, 5, DIM, dtype=DT)
    ctx = torch.randn(2, 9, 12, dtype=DT)
    mask = None
    if masked:
        mask = torch.ones(2, 9, dtype=torch.bool)
        mask[0, [1, 6]] = False
        mask[1, 4:] = False
    _assert_script_equal(sc, c, x, ctx, mask)
    with pytest.raises(Exception, match='context'):
        sc(x, torch.randn(2, 9, DIM, dtype=DT))


def test_scripted_finfo_min_matches_torch():
    from vision_priors.kernels.lavo_torch import finfo_min
    fn = torch.jit.script(finfo_min)
    for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        assert fn(dt) == finfo_min(dt) == torch.finfo(dt).min


def test_num_spatial_dims_keeps_only_the_used_bias_table():
    from vision_priors.layers.lavo import LavoAttention as _Lavo
    layer2d = _Lavo(32, 2, num_slots=8, window=4, causal=False, window_2d=2, num_spatial_dims=2)
    assert layer2d.rel_bias is None and layer2d.rel_bias_2d is not None
    out = layer2d(torch.randn(2, 1 + 12, 32), grid_size=(3, 4), num_prefix_tokens=1)
    out.square().sum().backward()
    assert all(p.grad is not None for p in layer2d.parameters())  # no parameter left without gradient
    with pytest.raises(ValueError, match='pass grid_size'):
        layer2d(torch.randn(1, 12, 32))
    layer1d = _Lavo(32, 2, num_slots=8, window=4, causal=False, num_spatial_dims=1)
    assert layer1d.rel_bias_2d is None
    with pytest.raises(ValueError, match='grid_size is not accepted'):
        layer1d(torch.randn(1, 12, 32), grid_size=(3, 4))
    with pytest.raises(ValueError, match='num_spatial_dims'):
        _Lavo(32, 2, num_slots=8, window=4, causal=True, num_spatial_dims=2)


# ----- blocked 2D local window (issue 16) against the unfold path it replaced and a dense reference -----

def _dense_window_2d(q, k, v, valid, gh, gw, w2, bias, scale):
    """Dense (N x N) 2D window straight from Secs. 3.2-3.3: logits ``scale q_i . k_j + P[dy, dx]`` for
    ``|dy|, |dx| <= w2 - 1``, invalid keys excluded, a query without a valid key gives 0."""
    n = gh * gw
    r, c = torch.arange(n) // gw, torch.arange(n) % gw
    dy, dx = r[None, :] - r[:, None], c[None, :] - c[:, None]
    allowed = (dy.abs() <= w2 - 1) & (dx.abs() <= w2 - 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias[((dy + w2 - 1) * (2 * w2 - 1) + dx + w2 - 1).clamp(0, (2 * w2 - 1) ** 2 - 1)]
    allowed = allowed[None, None] & (True if valid is None else valid[:, None, None, :])
    p = s.masked_fill(~allowed, float('-inf')).softmax(-1).nan_to_num(0.)
    return p @ v


def _unfold_window_2d(q, k, v, valid, gh, gw, w2, bias, scale):
    """The layer's 2D window before issue 16: ``F.unfold`` copies of every ``(2 w2 - 1)^2`` neighbourhood."""
    import torch.nn.functional as F
    b, nh, n, d = q.shape
    kw = 2 * w2 - 1

    def unfold(t):
        img = t.reshape(t.shape[0] * t.shape[1], gh, gw, t.shape[-1]).permute(0, 3, 1, 2)
        u = F.unfold(img, kernel_size=kw, padding=w2 - 1)
        return u.reshape(t.shape[0], t.shape[1], t.shape[-1], kw * kw, n).permute(0, 1, 4, 3, 2)

    pvalid = torch.ones(b, n, dtype=torch.bool) if valid is None else valid
    nvalid = unfold(pvalid[:, None, :, None].expand(b, nh, n, 1).to(q.dtype))[..., 0] > 0.5
    s = (q.unsqueeze(-2) @ unfold(k).transpose(-1, -2)).squeeze(-2) * scale
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~nvalid, torch.finfo(s.dtype).min)
    p = s.softmax(-1) * nvalid.any(-1, keepdim=True)
    return (p.unsqueeze(-2) @ unfold(v)).squeeze(-2)


@pytest.mark.parametrize('gh,gw,w2,tile', [(5, 7, 2, 0), (5, 7, 3, 2), (7, 3, 2, 3), (1, 6, 3, 0), (4, 5, 2, 9),
                                           (9, 5, 4, 1)])
@pytest.mark.parametrize('masked', [False, True])
def test_blocked_window_2d_matches_unfold_and_dense(gh, gw, w2, tile, masked):
    """Forward and backward (q, k, v, P) in float64 on odd grids, tiles that do and do not divide the grid."""
    from vision_priors.layers.lavo import local_window_2d
    torch.manual_seed(gh * 10 + gw)
    b, nh, d, n = 2, 2, 5, gh * gw
    q, k, v = (torch.randn(b, nh, n, d, dtype=DT, requires_grad=True) for _ in range(3))
    bias = torch.randn((2 * w2 - 1) ** 2, dtype=DT, requires_grad=True)
    valid = None
    if masked:
        valid = torch.rand(b, n) > 0.3
        valid[1, :] = False
        valid[1, n - 1] = True  # sample 1: one valid key, so queries far from it have an empty window
    g = torch.randn(b, nh, n, d, dtype=DT)
    results = []
    for fn in (lambda *a: local_window_2d(*a, tile=tile), _unfold_window_2d, _dense_window_2d):
        y = fn(q, k, v, valid, gh, gw, w2, bias, 0.37)
        grads = torch.autograd.grad((y * g).sum(), (q, k, v, bias))
        results.append((y, grads))
    (y, grads), (y_unfold, g_unfold), (y_dense, g_dense) = results
    for y_ref, g_ref in ((y_unfold, g_unfold), (y_dense, g_dense)):
        torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
        for a, r in zip(grads, g_ref):
            torch.testing.assert_close(a, r, atol=1e-11, rtol=0)
    assert y.abs().max() > 1e-2 and grads[3].abs().max() > 1e-3  # non-trivial values were compared
    if masked:  # empty windows give exactly 0
        assert bool((y_dense[1].abs().sum(-1) == 0).any()) and torch.equal(y[y_dense == 0], y_dense[y_dense == 0])


def test_window_tile_size_is_in_range():
    from vision_priors.layers.lavo import window_tile_size
    for grid, w2 in (((14, 14), 4), ((48, 48), 4), ((1, 1), 1), ((3, 100), 2)):
        assert w2 <= window_tile_size(*grid, w2) <= 3 * w2
    assert window_tile_size(14, 14, 4) == 7  # 2 x 2 tiles of 7 x 7, halo 3: 169 keys per tile, no padding
    import vision_priors.layers.lavo as lavo_mod
    assert not hasattr(lavo_mod, '_unfold_2d')  # the k x k neighbourhood copies are gone


def test_dense_window_path_matches_reference_with_prefix_tokens():
    """Small grids run the window as one masked (L x L) attention (prefix tokens included): float64 fwd + bwd."""
    from vision_priors.layers.lavo import dense_window_is_cheaper
    assert dense_window_is_cheaper(5, 3, 2) and dense_window_is_cheaper(14, 14, 4)
    assert not dense_window_is_cheaper(48, 48, 4) and not dense_window_is_cheaper(24, 24, 4)
    m = _make(causal=False, window=3, window_2d=2)
    gh, gw, n_pre = 5, 3, 2
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, HEADS, n_pre + gh * gw, DIM // HEADS, dtype=DT, requires_grad=True) for _ in range(3))
    g = torch.randn(2, HEADS, n_pre + gh * gw, DIM // HEADS, dtype=DT)
    params = (q, k, v, m.rel_bias_2d)

    def reference(q, k, v):
        pre = ((q[:, :, :n_pre] @ k[:, :, :n_pre].transpose(-1, -2)) * m.scale).softmax(-1) @ v[:, :, :n_pre]
        patches = _dense_window_2d(q[:, :, n_pre:], k[:, :, n_pre:], v[:, :, n_pre:], None, gh, gw, 2,
                                   m.rel_bias_2d, m.scale)
        return torch.cat([pre, patches], dim=2)

    y = m._local_2d(q, k, v, None, (gh, gw), n_pre)
    y_ref = reference(q, k, v)
    grads = torch.autograd.grad((y * g).sum(), params)
    grads_ref = torch.autograd.grad((y_ref * g).sum(), params)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, atol=1e-11, rtol=0)
    assert grads[3].abs().max() > 1e-3


# ----- exact rewrites of the non-causal fast path (kernels/lavo_torch.py) -----

def test_shared_memory_read_is_one_sdpa_call_equal_to_the_slot_form():
    """``code_read`` with one memory for every query (non-causal, cross-attention) runs SDPA over the r slots
    ``diag(H) B``; float64, odd shapes: equal to the explicit ``softmax((q B^T) H) (H B)`` form, values and
    gradients to 1e-12, including a zero memory (uniform weights over zero slots: output 0)."""
    from vision_priors.kernels.lavo_torch import code_read, code_slot_probs
    torch.manual_seed(5)
    q = torch.randn(3, 2, 7, 5, dtype=DT, requires_grad=True)
    h = torch.randn(3, 2, 1, 4, dtype=DT, requires_grad=True)
    basis = torch.linalg.qr(torch.randn(2, 5, 4, dtype=DT))[0].transpose(-1, -2).contiguous()
    with torch.no_grad():
        h[1] = 0.
    out = code_read(q, h, basis, 0.37)
    explicit = (code_slot_probs(q, h, basis, 0.37) * h) @ basis
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), (q, h))
    grads_ref = torch.autograd.grad((explicit * g).sum(), (q, h))
    torch.testing.assert_close(out, explicit, atol=1e-12, rtol=0)
    assert out[1].abs().max() == 0
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, atol=1e-12, rtol=0)


@pytest.mark.parametrize('grid,masked', [((5, 7), True), ((4, 6), False), ((1, 3), True)])
def test_tile_block_sum_equals_the_summed_aggregates(grid, masked):
    """``tile_block_2d_sum`` = sum over valid patches of ``tile_block_2d``'s outputs (never formed), float64,
    forward and gradients, grids with and without partial tiles, an all-masked tile included."""
    from vision_priors.kernels.lavo_torch import tile_block_2d, tile_block_2d_sum
    torch.manual_seed(6)
    gh, gw = grid
    n, w2 = gh * gw, 2
    q, k, v = (torch.randn(2, 3, n, 5, dtype=DT, requires_grad=True) for _ in range(3))
    bias = torch.randn((2 * w2 - 1) ** 2, dtype=DT, requires_grad=True)
    valid = None
    if masked:
        valid = torch.rand(2, n) > 0.3
        valid[1, :2] = False
        if gh > 1:
            valid[1, gw:gw + 2] = False  # tile (0, 0) of sample 1 has no valid patch
    total = tile_block_2d_sum(q, k, v, valid, gh, gw, w2, bias, 0.45)
    z = tile_block_2d(q, k, v, valid, gh, gw, w2, bias, 0.45)
    weight = torch.ones(2, n, dtype=DT) if valid is None else valid.to(DT)
    ref = (z * weight[:, None, :, None]).sum(dim=2, keepdim=True)
    g = torch.randn_like(total)
    grads = torch.autograd.grad((total * g).sum(), (q, k, v, bias))
    grads_ref = torch.autograd.grad((ref * g).sum(), (q, k, v, bias))
    torch.testing.assert_close(total, ref, atol=1e-12, rtol=0)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, atol=1e-12, rtol=0)
