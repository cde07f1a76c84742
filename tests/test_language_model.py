"""Decoder-only LM: exact attention against float64 references written from the papers' equations (forward and
backward), causality, cached / stateful generation == full forward, ablation switches, length limits."""
import math

import pytest
import torch
import torch.nn.functional as F

from vision_priors.layers.goat import GoatPrior, alibi_slopes
from vision_priors.models.language_model import (ATTENTIONS, SoftmaxCausalAttention, create_language_model,
                                                 rope_table)

TOL = dict(atol=1e-10, rtol=1e-9)  # float64 throughout


def randomize_positional(module: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial positional parameters (GOAT alpha / beta / slopes / MLP, PoPE delta, LAVO bias)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.requires_grad and ('prior' in name or 'phases' in name or 'rel_bias' in name):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)


def causal_softmax_attention(logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax over keys j <= i of explicit (B, H, N, N) logits, then the values."""
    n = logits.shape[-1]
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float('-inf'))
    return logits.softmax(-1) @ v


def reference_logits(attn: SoftmaxCausalAttention, x: torch.Tensor) -> tuple:
    """(logits (B, H, N, N), values) of each attention type straight from its paper's equations."""
    B, N, C = x.shape
    H, dh = attn.num_heads, attn.head_dim
    i = torch.arange(N, dtype=torch.float64)[:, None]  # query position
    j = torch.arange(N, dtype=torch.float64)[None, :]  # key position
    if attn.attn == 'goat':  # Eq. 11: q_c.k_c / sqrt(d_c) + sum_r alpha cos(w (i - j)) + beta sin(w (i - j)) + u_h(j)
        layer, prior = attn.layer, attn.layer.prior
        dc = layer.content_dim
        q, k, v = layer.qkv(x).split([H * dc, H * dc, H * dh], dim=-1)
        q, k = q.reshape(B, N, H, dc).transpose(1, 2), k.reshape(B, N, H, dc).transpose(1, 2)
        v = v.reshape(B, N, H, dh).transpose(1, 2)
        w = prior.freq_base ** (-torch.arange(prior.num_modes, dtype=torch.float64) / prior.num_modes)
        d = (i - j)[None, :, :, None] * w  # (1, N, N, R)
        rel = (prior.alpha[:, 0, None, None, :] * d.cos() + prior.beta[:, 0, None, None, :] * d.sin()).sum(-1)
        nu = 100.0 ** (-torch.arange(4, dtype=torch.float64) / 4)  # phi_abs(j) (Eq. 21): 4 sinusoid pairs and j / 2048
        phi = torch.cat([torch.sin(j.T * nu), torch.cos(j.T * nu), j.T / prior.abs_pos_scale], dim=-1)  # (N, 9)
        # lambda_h: the parameter itself, or softplus(rho_h) = log(1 + e^rho_h) (key_slope_param='softplus')
        slope = prior.key_slope if prior.key_slope is not None else torch.log1p(torch.exp(prior.key_slope_raw))
        mlp = prior.key_mlp(phi).T if prior.key_mlp is not None else 0.0  # g_h (off in the LM's default)
        u = (mlp + slope[:, None] * j  # g_h(phi_abs(j)) + lambda_h j
             + prior.first_key_bias[:, None] * (j == 0))  # + b_h 1{j = 0}     (Eqs. 21-22), (H, N)
        return q @ k.transpose(-1, -2) / math.sqrt(dc) + rel + u[:, None, :], v
    if attn.attn == 'pope':  # Eq. 6: sum_c f(q_tc) f(k_sc) cos((s - t) w_c + delta_c) / sqrt(d)
        layer = attn.layer
        q, k, v = layer.qkv(x).reshape(B, N, 3, H, dh).permute(2, 0, 3, 1, 4).unbind(0)
        f = {'softplus': F.softplus, 'relu': F.relu, 'identity': lambda t: t}[attn.pope_magnitude]
        w = 10000.0 ** (-torch.arange(dh, dtype=torch.float64) / dh)
        delta = layer.phases.phase_bias  # (H, d)
        angle = (j - i)[None, :, :, None] * w + delta[:, None, None, :]  # (H, N, N, d)
        logits = (f(q)[:, :, :, None, :] * f(k)[:, :, None, :, :] * angle.cos()).sum(-1) / math.sqrt(dh)
        return logits, v
    q, k, v = attn.qkv(x).reshape(B, N, 3, H, dh).permute(2, 0, 3, 1, 4).unbind(0)
    logits = q @ k.transpose(-1, -2) / math.sqrt(dh)
    if attn.attn == 'rope':  # Re sum_c q_c e^{i t w_c} conj(k_c e^{i s w_c}), pairs (2c, 2c + 1) as complex numbers
        w = attn.rope_theta ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
        qc = torch.complex(q[..., 0::2], q[..., 1::2]) * torch.polar(torch.ones_like(w), i * w)
        kc = torch.complex(k[..., 0::2], k[..., 1::2]) * torch.polar(torch.ones_like(w), i * w)
        logits = (qc @ kc.conj().transpose(-1, -2)).real / math.sqrt(dh)
    if attn.attn == 'alibi':  # - m_h (i - j), m_h = 2^(-8 (h + 1) / H)
        m = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float64)
        logits = logits - m[:, None, None] * (i - j)
    return logits, v


CASES = [('goat', {}), ('goat', dict(goat_relative='symmetric')),
         ('goat', dict(goat_kwargs=dict(key_slope_param='linear', prior_init='zero', key_mlp_hidden=32))),
         ('pope', {}), ('pope', dict(pope_magnitude='relu')),
         ('pope', dict(pope_magnitude='identity', pope_learn_delta=False)), ('rope', {}), ('alibi', {}), ('nope', {})]


@pytest.mark.parametrize('attn,options', CASES)
def test_softmax_attention_matches_paper_equations_forward_and_backward(attn, options, one_thread):
    torch.manual_seed(1)
    layer = SoftmaxCausalAttention(attn, dim=30, num_heads=3, goat_modes=2, **options).double()  # d_h = 10, odd N
    randomize_positional(layer)
    x = torch.randn(2, 11, 30, dtype=torch.float64, requires_grad=True)
    fast_out = layer(x)[0]
    logits, v = reference_logits(layer, x)
    out = causal_softmax_attention(logits, v)
    proj = layer.layer.proj if hasattr(layer, 'layer') else layer.proj
    ref_out = proj(out.transpose(1, 2).reshape(2, 11, 30))
    torch.testing.assert_close(fast_out, ref_out, **TOL)
    grad = torch.randn_like(ref_out)
    params = [x] + [p for p in layer.parameters() if p.requires_grad]
    fast_grads = torch.autograd.grad(fast_out, params, grad)
    ref_grads = torch.autograd.grad(ref_out, params, grad)
    for a, b in zip(fast_grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL)
    # the cached path (a prefix, then one token, then a chunk over the cached keys) gives the same outputs
    with torch.no_grad():
        head, past = layer(x[:, :4], use_cache=True)
        one, past = layer(x[:, 4:5], past, use_cache=True)
        rest, _ = layer(x[:, 5:], past, use_cache=True)
        torch.testing.assert_close(torch.cat([head, one, rest], 1), ref_out, **TOL)


@pytest.mark.parametrize('attn,options', CASES)
def test_attention_weights_are_the_ones_the_forward_applies(attn, options, one_thread):
    """The analysis weights equal the causal softmax of the paper-equation logits, and applied to the values they
    give the layer's forward output."""
    torch.manual_seed(2)
    layer = SoftmaxCausalAttention(attn, dim=30, num_heads=3, goat_modes=2, **options).double()
    randomize_positional(layer)
    x = torch.randn(2, 11, 30, dtype=torch.float64)
    with torch.no_grad():
        weights = layer.attention_weights(x)
        logits, v = reference_logits(layer, x)
        reference = logits.masked_fill(torch.ones(11, 11, dtype=torch.bool).triu(1), float('-inf')).softmax(-1)
        torch.testing.assert_close(weights, reference, **TOL)
        torch.testing.assert_close(layer.output(weights @ v), layer(x)[0], **TOL)


def tiny_model(attn: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_language_model(attn, dim=24, depth=2, num_heads=2, goat_modes=2, lavo_window=4, lavo_slots=6,
                                  **overrides).double().eval()
    randomize_positional(model)
    return model


@pytest.mark.parametrize('attn', ATTENTIONS)
def test_causality_and_generation_equal_full_forward(attn, one_thread):
    model = tiny_model(attn)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 13), generator=gen)
    with torch.no_grad():
        full = model(tokens)
        changed = tokens.clone()
        changed[:, 8:] = torch.randint(0, 256, (2, 5), generator=gen)
        assert torch.equal(model(changed)[:, :8], full[:, :8])  # a later token never changes an earlier logit
        assert not torch.allclose(model(changed)[:, 8:], full[:, 8:])
    for kwargs in (dict(temperature=0.0), dict(temperature=1.3, top_k=20, generator=torch.Generator().manual_seed(3))):
        out, logits = model.generate(tokens[:, :5], 9, return_logits=True, **kwargs)
        assert out.shape == (2, 14) and torch.equal(out[:, :5], tokens[:, :5])
        with torch.no_grad():
            reference = model(out)[:, 4:-1]  # the logits each new token was chosen from, by one full pass
        torch.testing.assert_close(logits, reference, **TOL)
        if kwargs['temperature'] == 0:
            assert torch.equal(out[:, 5:], reference.argmax(-1))
    if attn == 'lavo':  # O(1) decoding state: the same size after 5 and after 13 tokens
        _, short = model(tokens[:, :5], use_cache=True)
        _, long = model(tokens, use_cache=True)
        assert sum(s.numel() for s in short) == sum(s.numel() for s in long)


def test_goat_ablations_are_exact(one_thread):
    x = torch.randint(0, 256, (1, 9))
    for relative, frozen in (('symmetric', {'beta'}), ('none', {'alpha', 'beta'}), ('full', set())):
        model = create_language_model('goat', dim=32, depth=1, num_heads=2, goat_modes=3, goat_relative=relative)
        prior = model.blocks[0].attn.layer.prior
        assert prior.num_modes == 3 and prior.key_slopes() is not None  # R and the key-linear recency term (default)
        model(x).sum().backward()
        for name in ('alpha', 'beta'):
            p = getattr(prior, name)
            assert (name in frozen) == (not p.requires_grad)
            if name in frozen:
                assert p.grad is None and torch.count_nonzero(p) == 0
    no_slope = create_language_model('goat', goat_key_linear=False).blocks[0].attn.layer.prior
    assert no_slope.key_slopes() is None and no_slope.prior_init == 'zero'  # no 'alibi' cosine fit without slopes
    with pytest.raises(ValueError, match='goat_relative must be one of'):
        create_language_model('goat', goat_relative='half')


def test_pope_and_lavo_ablation_switches():
    model = create_language_model('pope', pope_learn_delta=False, pope_magnitude='relu')
    phases = model.blocks[0].attn.layer.phases
    assert 'phase_bias_raw' not in dict(phases.named_parameters()) and model.blocks[0].attn.pope_magnitude == 'relu'
    assert not model.blocks[0].attn.uses_layer_forward  # relu magnitudes never take the softplus-only fast path
    with pytest.raises(ValueError, match='pope_magnitude must be one of'):
        create_language_model('pope', pope_magnitude='tanh')
    lavo = create_language_model('lavo', lavo_epe=False, lavo_context_dissection=False).blocks[0].attn.layer
    assert lavo.rel_bias is None and not lavo.context_dissection


def test_rope_table_and_errors():
    table = rope_table(torch.arange(3), 4, theta=100.0)
    assert table.shape == (3, 8) and torch.allclose(table[:, 4:6], torch.cos(torch.arange(3.))[:, None].expand(3, 2))
    with pytest.raises(ValueError, match="attn must be one of|unknown attention"):
        create_language_model('flash')
    model = create_language_model('nope', dim=16, depth=1, num_heads=2, max_length=8)
    with pytest.raises(ValueError, match='max_length=8; this call reaches position 9'):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match='tokens must be'):
        model(torch.zeros(3, dtype=torch.long))
    unlimited = create_language_model('goat', dim=32, depth=1, num_heads=2, goat_modes=2)
    assert unlimited.max_length is None and unlimited(torch.zeros(1, 600, dtype=torch.long)).shape == (1, 600, 256)


def test_tied_embeddings_share_one_matrix():
    model = create_language_model('rope', dim=16, depth=1, num_heads=2, tie_embeddings=True)
    assert model.head is None and 'head.weight' not in model.state_dict()
    logits = model(torch.tensor([[1, 2]]))
    hidden = model.norm(model.blocks[0](model.embed(torch.tensor([[1, 2]])))[0])
    torch.testing.assert_close(logits, hidden @ model.embed.weight.T)


@pytest.mark.parametrize('attn', ATTENTIONS)
def test_bfloat16_autocast_cached_decoding_runs(attn, one_thread):
    model = create_language_model(attn, dim=24, depth=1, num_heads=2, goat_modes=2, lavo_window=4, lavo_slots=6).eval()
    tokens = torch.randint(0, 256, (1, 7))
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        logits, past = model(tokens[:, :5], use_cache=True)
        more, _ = model(tokens[:, 5:], past, use_cache=True)
        full = model(tokens)
    assert torch.isfinite(more).all() and (more.float() - full[:, 5:].float()).abs().max() < 0.1


def non_prior_linears(model: torch.nn.Module) -> list:
    """The model's Linear layers outside GOAT's priors (those keep the prior's own start)."""
    in_prior = {id(m) for prior in model.modules() if isinstance(prior, GoatPrior) for m in prior.modules()}
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m) not in in_prior]


@pytest.mark.parametrize('tied', [False, True])
def test_weight_init_scales(tied):
    """'fan_in': Linear ~ N(0, 1 / fan_in), embedding N(0, 1) (N(0, 1 / dim) tied); 'gpt2': 0.02 everywhere;
    biases zero; GOAT's prior keeps its own start."""
    torch.manual_seed(0)
    model = create_language_model('goat', dim=96, depth=2, num_heads=2, goat_modes=2, tie_embeddings=tied,
                                  qkv_bias=True)
    embed_std = 96 ** -0.5 if tied else 1.0
    assert abs(model.embed.weight.std().item() / embed_std - 1) < 0.03
    priors = [m for m in model.modules() if isinstance(m, GoatPrior)]
    linears = non_prior_linears(model)
    assert len(linears) >= 8
    for linear in linears:
        assert abs(linear.weight.std().item() * linear.in_features ** 0.5 - 1) < 0.1, linear
        assert linear.bias is None or not linear.bias.any()
    assert len(priors) == 2
    for prior in priors:  # the prior's own start (LM_GOAT_DEFAULTS): no relative term, ALiBi's slopes, no MLP
        assert not prior.alpha.any() and not prior.beta.any() and prior.key_mlp is None
        torch.testing.assert_close(prior.key_slopes(), alibi_slopes(2))
    with_mlp = create_language_model('goat', dim=96, depth=1, num_heads=2, goat_modes=2,
                                     goat_kwargs=dict(key_mlp_hidden=32)).blocks[0].attn.layer.prior
    assert abs(with_mlp.key_mlp[0].weight.std().item() / 0.02 - 1) < 0.2 and not with_mlp.key_mlp[2].weight.any()
    gpt2 = create_language_model('goat', dim=96, depth=2, num_heads=2, goat_modes=2, weight_init='gpt2')
    for module in [gpt2.embed, *non_prior_linears(gpt2)]:
        assert abs(module.weight.std().item() / 0.02 - 1) < 0.1
    with pytest.raises(ValueError, match='weight_init must be one of'):
        create_language_model('rope', weight_init='xavier')


def induction_batch(gen: torch.Generator, n: int, min_count: int = 8, max_count: int = 12) -> torch.Tensor:
    """(n, max_count + 3) rows '<8-12 distinct letters> | <anchor> <the letter after the anchor>', right-aligned
    (token 0 pads, 1 is the separator, letters are 2..53)."""
    rows = torch.zeros(n, max_count + 3, dtype=torch.long)
    for b in range(n):
        count = int(torch.randint(min_count, max_count + 1, (1,), generator=gen))
        letters = torch.randperm(52, generator=gen)[:count] + 2
        anchor = int(torch.randint(0, count - 1, (1,), generator=gen))
        row = torch.cat([letters, torch.tensor([1, int(letters[anchor]), int(letters[anchor + 1])])])
        rows[b, -row.numel():] = row
    return rows


def induction_accuracy(weight_init: str, updates: int = 1200) -> float:
    """Held-out accuracy of a 2-block RoPE model trained on the one-offset lookup (an induction head's job)."""
    torch.manual_seed(0)
    model = create_language_model('rope', vocab_size=64, dim=64, depth=2, num_heads=2, weight_init=weight_init)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    warm = updates // 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda u: min(1.0, (u + 1) / warm) * 0.5 * (1 + math.cos(math.pi * u / updates)))
    gen = torch.Generator().manual_seed(0)
    for _ in range(updates):
        rows = induction_batch(gen, 64)
        loss = F.cross_entropy(model(rows[:, :-1])[:, -1], rows[:, -1])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    test = induction_batch(torch.Generator().manual_seed(1000), 512)
    with torch.no_grad():
        return (model(test[:, :-1])[:, -1].argmax(-1) == test[:, -1]).float().mean().item()


def test_small_model_learns_an_induction_lookup_only_with_fan_in_init(one_thread):
    """Regression for the LM's old GPT-2 init: at width 64 its 0.02 weights keep a 2-block model on the
    'some letter of the string' plateau (about 10 %), while fan-in init forms the induction head."""
    fan_in, gpt2 = induction_accuracy('fan_in'), induction_accuracy('gpt2')
    print(f'one-offset lookup, 1,200 updates of 64: fan_in {fan_in:.3f}, gpt2 {gpt2:.3f}')
    assert fan_in > 0.95 and gpt2 < 0.3


@pytest.mark.parametrize('attn', ATTENTIONS)
def test_attention_maps_per_block(attn, one_thread):
    """One (B, H, N, N) map per block, each the block's own attention on its normed input; None for LAVO."""
    model = tiny_model(attn)
    tokens = torch.randint(0, 256, (2, 9))
    maps = model.attention_maps(tokens)
    assert len(maps) == len(model.blocks)
    if attn == 'lavo':
        assert maps == [None, None]
        return
    x = model.embed(tokens)
    for block, weights in zip(model.blocks, maps):
        with torch.no_grad():
            torch.testing.assert_close(weights, block.attn.attention_weights(block.norm1(x)), **TOL)
            x, _ = block(x)
        assert weights.shape == (2, 2, 9, 9) and torch.allclose(weights.sum(-1), torch.ones_like(weights[..., 0]))
        assert (weights.triu(1) == 0).all()
