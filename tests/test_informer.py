"""Informer: ProbSparse attention against explicit float64 references (Informer Eqs. 3-4), causality of the
decoder, distilling, LAVO / full cross-attention, the linear baseline and the factory."""
import math

import pytest
import torch

from vision_priors.layers.lavo import LavoCrossAttention
from vision_priors.models.informer import (AttentionLayer, EncoderStack, FullAttention, Informer, LinearForecaster,
                                           ProbAttention, create_forecast_model, decoder_input, sample_count)

TOL = dict(rtol=1e-10, atol=1e-12)  # float64 throughout


def reference_attention(q, k, v, causal, rows=None):
    """softmax(q k^T / sqrt(D)) v on (B, L, H, D), causal: key j <= query i; rows (B, H, u): only those queries
    attend, the others output mean(v) (unmasked) or cumsum(v) (masked) -- Informer's lazy queries."""
    b, l_q, h, d = q.shape
    out = torch.empty(b, l_q, h, v.shape[-1], dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            for i in range(l_q):
                if rows is not None and i not in rows[bi, hi].tolist():
                    out[bi, i, hi] = v[bi, :i + 1, hi].sum(0) if causal else v[bi, :, hi].mean(0)
                    continue
                keys = k[bi, :i + 1, hi] if causal else k[bi, :, hi]
                weights = torch.softmax(keys @ q[bi, i, hi] / math.sqrt(d), dim=0)
                out[bi, i, hi] = weights @ (v[bi, :i + 1, hi] if causal else v[bi, :, hi])
    return out


def qkv(b, l_q, l_k, h=2, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g, dtype=torch.float64, requires_grad=True) for n in (l_q, l_k, l_k)]


@pytest.mark.parametrize('causal, l_q, l_k', [(False, 7, 9), (True, 7, 7)])
def test_probsparse_equals_full_attention_when_all_queries_selected(one_thread, causal, l_q, l_k):
    q, k, v = qkv(2, l_q, l_k)
    attn = ProbAttention(mask_flag=causal, factor=10, attention_dropout=0.0)  # u = 10 * ceil(ln 7) >= 7
    assert sample_count(10, l_q) >= l_q
    out = attn(q, k, v)
    ref = reference_attention(q, k, v, causal)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(FullAttention(causal, attention_dropout=0.0)(q, k, v), ref, **TOL)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize('causal', [False, True])
def test_probsparse_top_u_queries_attend_and_lazy_queries_take_mean_or_cumsum(one_thread, causal):
    l = 23  # u = 1 * ceil(ln 23) = 4 < 23
    q, k, v = qkv(2, l, l, seed=1)
    attn = ProbAttention(mask_flag=causal, factor=1, attention_dropout=0.0)
    torch.manual_seed(5)
    rows = attn.select_queries(q.transpose(1, 2), k.transpose(1, 2), sample_count(1, l))
    assert rows.shape == (2, 2, 4)
    torch.manual_seed(5)
    out = attn(q, k, v)
    ref = reference_attention(q, k, v, causal, rows)
    torch.testing.assert_close(out, ref, **TOL)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, **TOL)


def test_probsparse_measure_selects_the_peaked_query(one_thread):
    """Eq. 4: a query whose scores have one high peak (max - mean large) is selected; flat ones are not."""
    l, d = 30, 4
    k = torch.randn(1, l, 1, d, dtype=torch.float64)
    q = torch.zeros(1, l, 1, d, dtype=torch.float64)
    q[0, 17, 0] = 50 * k[0, 3, 0] / k[0, 3, 0].norm()  # spiky scores for query 17
    attn = ProbAttention(mask_flag=False, factor=1, attention_dropout=0.0)
    torch.manual_seed(0)
    top = attn.select_queries(q.transpose(1, 2), k.transpose(1, 2), 1)
    assert top.flatten().tolist() == [17]


def tiny_informer(cross_attn='full', attn='prob', factor=10, c=3, seq_len=12, label_len=6, pred_len=5, e_layers=2,
                  **kw):
    torch.manual_seed(0)
    return Informer(enc_in=c, dec_in=c, c_out=c, seq_len=seq_len, label_len=label_len, pred_len=pred_len, mark_dim=4,
                    factor=factor, d_model=16, n_heads=2, e_layers=e_layers, d_layers=2, d_ff=24, dropout=0.0,
                    attn=attn, cross_attn=cross_attn, lavo_slots=8, **kw)


def batch(b=2, c=3, seq_len=12, label_len=6, pred_len=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, seq_len, c, generator=g), torch.randn(b, label_len + pred_len, c, generator=g)
    return (x, torch.rand(b, seq_len, 4, generator=g) - .5, decoder_input(y, label_len, pred_len),
            torch.rand(b, label_len + pred_len, 4, generator=g) - .5)


@pytest.mark.parametrize('cross_attn', ['full', 'lavo'])
def test_informer_with_all_queries_selected_equals_full_attention_model(one_thread, cross_attn):
    prob = tiny_informer(cross_attn, attn='prob').double().eval()
    full = tiny_informer(cross_attn, attn='full').double().eval()
    full.load_state_dict(prob.state_dict())
    inputs = [t.double().requires_grad_() for t in batch()]
    out_prob, out_full = prob(*inputs), full(*inputs)
    assert out_prob.shape == (2, 5, 3)
    torch.testing.assert_close(out_prob, out_full, **TOL)
    g_prob = torch.autograd.grad(out_prob.square().sum(), [*prob.parameters()])
    g_full = torch.autograd.grad(out_full.square().sum(), [*full.parameters()])
    for a, b in zip(g_prob, g_full):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize('cross_attn', ['full', 'lavo'])
def test_decoder_is_causal(one_thread, cross_attn):
    """Changing a later decoder position (a placeholder) never changes an earlier output of the decoder
    blocks (masked self-attention, per-position cross-attention, feed-forward and norms)."""
    model = tiny_informer(cross_attn, factor=10).double().eval()
    g = torch.Generator().manual_seed(1)
    x, memory = torch.randn(2, 11, 16, generator=g, dtype=torch.float64), torch.randn(2, 7, 16, generator=g,
                                                                                      dtype=torch.float64)
    before = model.decoder(x, memory)
    for t in (6, 9, 10):
        changed = x.clone()
        changed[:, t] += torch.randn(2, 16, generator=g, dtype=torch.float64)
        after = model.decoder(changed, memory)
        torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=0)
        assert (after[:, t] - before[:, t]).abs().max() > 1e-6
    mixed = tiny_informer(cross_attn, factor=10, mix=True).double().eval()
    changed = x.clone()
    changed[:, 10] += 1.0
    leak = (mixed.decoder(changed, memory)[:, :10] - mixed.decoder(x, memory)[:, :10]).abs().max()
    assert leak > 1e-6  # Informer2020's head-mixing reshape moves a later position's values to earlier ones


def test_probsparse_decoder_self_attention_causal_for_a_fixed_selection(one_thread, monkeypatch):
    """With u < L the top-u ranking is global (the paper's); for a given selection every output is causal."""
    q, k, v = qkv(1, 15, 15, seed=2)
    attn = ProbAttention(mask_flag=True, factor=1, attention_dropout=0.0)
    fixed = torch.tensor([[[2, 5, 11]]]).expand(1, 2, 3)
    monkeypatch.setattr(attn, 'select_queries', lambda *a: fixed)
    before = attn(q, k, v)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, 8:] += 1.0
    v2[:, 8:] -= 2.0
    after = attn(q, k2, v2)
    torch.testing.assert_close(after[:, :8], before[:, :8], rtol=0, atol=0)


def test_distilling_halves_the_encoder_length_and_lavo_is_the_package_layer(one_thread):
    model = tiny_informer('lavo', seq_len=13)
    model.encoder.layers.append(model.encoder.layers[0].__class__(
        AttentionLayer(ProbAttention(False, 10, attention_dropout=0.0), 16, 2), 16, 24, 0.0))
    model.encoder.distils.append(model.encoder.distils[0].__class__(16))
    x, x_mark, *_ = batch(seq_len=13)
    memory = model.encoder(model.enc_embedding(x, x_mark))
    assert memory.shape == (2, 4, 16)  # 13 -> 7 -> 4
    assert all(isinstance(layer.cross_attention.attn, LavoCrossAttention) for layer in model.decoder.layers)
    assert model.decoder.layers[0].cross_attention.attn.num_slots == 8


@pytest.mark.parametrize('name, overrides', [('informer_cpu', dict(cross_attn='full')),
                                             ('informer_cpu', dict(cross_attn='lavo')), ('linear', {})])
def test_a_few_steps_reduce_the_loss(one_thread, name, overrides):
    torch.manual_seed(0)
    t = torch.arange(40, dtype=torch.float32)
    series = torch.stack([torch.sin(2 * math.pi * (t + s) / 12) for s in range(16)])[:, :, None].repeat(1, 1, 2)
    x, y = series[:, :24], series[:, 18:]  # seq 24, label 6, pred 16
    marks = torch.zeros(16, 40, 4)
    model = create_forecast_model(name, enc_in=2, dec_in=2, c_out=2, seq_len=24, label_len=6, pred_len=16,
                                  mark_dim=4, d_model=16, n_heads=2, d_ff=16, **overrides) if name != 'linear' else \
        create_forecast_model(name, enc_in=2, dec_in=2, c_out=2, seq_len=24, label_len=6, pred_len=16, mark_dim=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        out = model(x, marks[:, :24], decoder_input(y, 6, 16), marks[:, 18:])
        loss = torch.nn.functional.mse_loss(out, y[:, -16:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_linear_baseline_is_one_map_shared_across_channels(one_thread):
    model = LinearForecaster(enc_in=3, c_out=3, seq_len=6, pred_len=4)
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    model = model.double()
    expected = torch.einsum('ps,bsc->bpc', model.linear.weight, x) + model.linear.bias[None, :, None]
    torch.testing.assert_close(model(x), expected, **TOL)
    ms = LinearForecaster(enc_in=3, c_out=1, seq_len=6, pred_len=4).double()
    ms.load_state_dict(model.state_dict())
    torch.testing.assert_close(ms(x), expected[..., -1:], **TOL)  # MS: the target (last channel)


def test_rotary_memory_lets_lavo_cross_attention_see_the_encoder_order(one_thread):
    """``memory_pos='rotary'``: LAVO's cross-attention reads the memory through its mean (Eq. 3), so shuffling the
    encoder output's tokens changes nothing without it and changes the decoder's output with it; the rotation keeps
    every token's norm, leaves token 0 as it is, and applies to full cross-attention alike."""
    g = torch.Generator().manual_seed(2)
    x, memory = torch.randn(2, 11, 16, generator=g, dtype=torch.float64), torch.randn(2, 7, 16, generator=g,
                                                                                      dtype=torch.float64)
    shuffled = memory[:, torch.randperm(7, generator=g)]
    for memory_pos in ('none', 'rotary'):
        model = tiny_informer('lavo', factor=10, memory_pos=memory_pos).double().eval()
        outs = [model.decoder(x, model.cross_memory(m)) for m in (memory, shuffled)]
        if memory_pos == 'none':
            torch.testing.assert_close(outs[0], outs[1], **TOL)
        else:
            assert (outs[0] - outs[1]).abs().max() > 1e-4
    rotated = tiny_informer('full', memory_pos='rotary').cross_memory(memory)
    torch.testing.assert_close(rotated.norm(dim=-1), memory.norm(dim=-1), **TOL)
    torch.testing.assert_close(rotated[:, 0], memory[:, 0], rtol=0, atol=0)
    assert (rotated[:, 1:] - memory[:, 1:]).abs().max() > 1e-3


def test_factory_errors():
    with pytest.raises(ValueError, match="unknown forecast model 'transformer'"):
        create_forecast_model('transformer')
    with pytest.raises(ValueError, match=r"informer_cpu: unknown argument\(s\) \['heads'\]"):
        create_forecast_model('informer_cpu', enc_in=1, dec_in=1, c_out=1, seq_len=8, label_len=4, pred_len=2, heads=3)
    with pytest.raises(ValueError, match="cross_attn must be one of"):
        create_forecast_model('informer_cpu', enc_in=1, dec_in=1, c_out=1, seq_len=8, label_len=4, pred_len=2,
                              cross_attn='sparse')
    with pytest.raises(ValueError, match="attn must be one of"):
        create_forecast_model('informer_cpu', enc_in=1, dec_in=1, c_out=1, seq_len=8, label_len=4, pred_len=2,
                              attn='local')
    with pytest.raises(ValueError, match="memory_pos must be one of"):
        create_forecast_model('informer_cpu', enc_in=1, dec_in=1, c_out=1, seq_len=8, label_len=4, pred_len=2,
                              memory_pos='sincos')
    linear = create_forecast_model('linear', enc_in=1, dec_in=1, c_out=1, seq_len=8, label_len=4, pred_len=2,
                                   cross_attn='lavo', attn='prob')  # Informer-only arguments are dropped
    assert isinstance(linear, LinearForecaster)


def informer2020_parameters(encoder_blocks, d=512, f=2048, c=7, marks=4):
    """Parameters of Informer2020's model with one decoder block, counted layer by layer from its model code (the
    value conv and the timeF linear carry biases): one encoder per entry of ``encoder_blocks`` (``Informer``: [2];
    ``InformerStack``: [3, 2, 1]), each with its blocks, a distilling conv between them and a final norm."""
    embedding = (c * d * 3 + d) + (marks * d + d)
    attention, ffn = 4 * (d * d + d), (d * f + f) + (f * d + d)
    distil = d * d * 3 + d + 2 * d  # conv with bias, BatchNorm affine
    encoders = sum(n * (attention + ffn + 2 * 2 * d) + (n - 1) * distil + 2 * d for n in encoder_blocks)
    decoder = (2 * attention + ffn + 3 * 2 * d) + 2 * d + (d * c + c)  # 1 block, norm, projection
    return 2 * embedding + encoders + decoder


def test_informer2020_parameter_layout_and_registered_sizes(one_thread):
    """The full-size model has Informer2020's parameters, counted layer by layer from its model code (the value
    conv and the timeF linear carry biases); ``informer_mid`` is the quarter-width CPU reproduction config."""
    c = 7
    model = create_forecast_model('informer', enc_in=c, dec_in=c, c_out=c, seq_len=48, label_len=48, pred_len=24)
    assert sum(p.numel() for p in model.parameters()) == informer2020_parameters([2]) == 11_330_055
    assert model.enc_embedding.value.conv.bias is not None and model.enc_embedding.time.bias is not None
    mid = create_forecast_model('informer_mid', enc_in=c, dec_in=c, c_out=c, seq_len=48, label_len=48, pred_len=24,
                                cross_attn='lavo')
    layer = mid.decoder.layers[0]
    assert mid.enc_embedding.value.conv.out_channels == 128 and layer.conv1.out_channels == 512
    assert layer.self_attention.mix and layer.self_attention.n_heads == 8 and mid.enc_embedding.dropout.p == 0.05
    assert layer.cross_attention.attn.num_slots == 16


def test_encoder_stack_reads_shrinking_suffixes_and_concatenates(one_thread):
    """Informer2020's EncoderStack: encoder i (e_layers[i] blocks, its own distils and norm) reads the last L // 2**i
    steps; outputs concatenated along time. Checked against the encoders run by hand, and by locality: a step
    before the last L // 2 reaches the first encoder's output only."""
    model = tiny_informer(seq_len=13, e_layers=[3, 2, 1]).double().eval()
    stack = model.encoder
    assert isinstance(stack, EncoderStack) and [len(e.layers) for e in stack.encoders] == [3, 2, 1]
    assert [len(e.distils) for e in stack.encoders] == [2, 1, 0] and stack.input_lengths(13) == [13, 6, 3]
    x, x_mark, *_ = (t.double() for t in batch(seq_len=13))
    h = model.enc_embedding(x, x_mark)
    memory = stack(h)
    by_hand = [stack.encoders[0](h), stack.encoders[1](h[:, -6:]), stack.encoders[2](h[:, -3:])]
    assert [m.shape[1] for m in by_hand] == [4, 3, 3]  # 13 -> 7 -> 4; 6 -> 3; 3
    torch.testing.assert_close(memory, torch.cat(by_hand, dim=1), rtol=0, atol=0)
    changed = h.clone()
    changed[:, 6] += 1.0  # step 6 of 13: outside the last 6 and the last 3
    after = stack(changed)
    torch.testing.assert_close(after[:, 4:], memory[:, 4:], rtol=0, atol=0)
    assert (after[:, :4] - memory[:, :4]).abs().max() > 1e-6
    out = model(x, x_mark, *(t.double() for t in batch(seq_len=13)[2:]))
    assert out.shape == (2, 5, 3) and torch.isfinite(out).all()
    single = tiny_informer(e_layers=[2]).eval()  # a stack of one is the plain encoder
    plain = tiny_informer().eval()
    plain.load_state_dict({k.replace('encoder.encoders.0.', 'encoder.'): v for k, v in single.state_dict().items()})
    inputs = batch()
    torch.testing.assert_close(single(*inputs), plain(*inputs), rtol=0, atol=0)
    for bad in ([], [2, 0], [1.5], [True]):
        with pytest.raises(ValueError, match='e_layers must be'):
            tiny_informer(e_layers=bad)
    with pytest.raises(ValueError, match='needs seq_len >= 4, got 3'):
        tiny_informer(seq_len=3, label_len=2, e_layers=[1, 1, 1])
    with pytest.raises(ValueError, match='an encoder stack of 3 needs at least 4 input steps, got 3'):
        stack(h[:, :3])


def test_informerstack_parameter_layout(one_thread):
    """``informerstack`` has Informer2020's InformerStack parameters with main_informer.py's defaults (s_layers 3, 2,
    1; d_layers 1; d_model 512, d_ff 2048), counted layer by layer from its model code."""
    c = 7
    model = create_forecast_model('informerstack', enc_in=c, dec_in=c, c_out=c, seq_len=168, label_len=168,
                                  pred_len=168)
    assert sum(p.numel() for p in model.parameters()) == informer2020_parameters([3, 2, 1]) == 25_517_575
    layer = model.decoder.layers[0]
    assert len(model.decoder.layers) == 1 and layer.self_attention.mix and model.enc_embedding.dropout.p == 0.05


def test_probsparse_applies_no_attention_dropout(one_thread):
    """Informer2020's ProbAttention builds a dropout but never applies it: training and eval outputs agree
    (same key samples)."""
    q, k, v = qkv(2, 23, 23, seed=3)
    attn = ProbAttention(mask_flag=False, factor=1, attention_dropout=0.5)
    torch.manual_seed(7)
    train_out = attn.train()(q, k, v)
    torch.manual_seed(7)
    torch.testing.assert_close(attn.eval()(q, k, v), train_out, rtol=0, atol=0)
