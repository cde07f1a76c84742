"""``vision_priors.optim.prior_param_groups``: the positional priors get their own learning rate, nothing else
changes."""
import functools

import pytest
import timm
import torch
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2

import vision_priors  # noqa: F401
from vision_priors.optim import prior_param_groups, prior_parameter_names

SMALL = dict(embed_dim=64, depth=1, num_heads=2, patch_size=8, img_size=32, num_classes=3)


@pytest.mark.parametrize('name, expected', [
    ('vit_tiny_patch16_goat_224', ('alpha', 'beta', 'prefix_bias')),
    ('vit_tiny_patch16_goat_224', ('alpha', 'beta', 'key_mlp.0.weight', 'key_mlp.2.bias', 'prefix_bias')),
    ('vit_tiny_patch16_pope_224', ('phase_bias_raw',)),
    ('vit_tiny_patch16_lavo_224', ('attn.rel_bias_2d',)),
    ('vit_tiny_patch16_224', ()),
])
def test_groups_partition_the_parameters_and_scale_only_the_priors(name, expected):
    # the second goat case turns the key-default MLP back on (the ViTs' GOAT default has none)
    extra = dict(attn_kwargs=dict(key_mlp_hidden=8)) if any('key_mlp' in e for e in expected) else {}
    model = timm.create_model(name, **SMALL, **extra)
    names = prior_parameter_names(model)
    assert all(any(n.endswith(e) for n in names) for e in expected)
    assert bool(names) == bool(expected)
    groups = prior_param_groups(model, weight_decay=0.05, lr_scale=10.0)
    seen = [id(p) for g in groups for p in g['params']]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # every parameter exactly once
    by_id = {id(p): n for n, p in model.named_parameters()}
    for g in groups:
        group_names = {by_id[id(p)] for p in g['params']}
        if 'lr_scale' in g:
            assert group_names == names and g['lr_scale'] == 10.0 and g['weight_decay'] == 0.0
        else:
            assert not group_names & names
    decayed = {by_id[id(p)] for g in groups if g.get('weight_decay') for p in g['params']}
    assert decayed and all(torch.is_tensor(model.get_parameter(n)) and model.get_parameter(n).ndim > 1 for n in decayed)


def test_timm_scheduler_applies_the_scale():
    model = timm.create_model('vit_tiny_patch16_goat_224', **SMALL)
    opt = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05,
                              param_group_fn=functools.partial(prior_param_groups, weight_decay=0.05, lr_scale=10.0))
    sched, _ = create_scheduler_v2(opt, 'cosine', num_epochs=10, warmup_epochs=0)
    sched.step(1)
    lrs = {g.get('lr_scale', 1.0): g['lr'] for g in opt.param_groups}
    assert lrs[10.0] == pytest.approx(10 * lrs[1.0])


def test_bad_scale_is_rejected():
    model = timm.create_model('vit_tiny_patch16_goat_224', **SMALL)
    with pytest.raises(ValueError, match='lr_scale must be > 0, got 0'):
        prior_param_groups(model, lr_scale=0)


@pytest.mark.parametrize('attn', ['goat', 'pope', 'lavo', 'rope', 'alibi', 'nope'])
def test_language_models_keep_weight_decay_off_their_positional_parameters(attn):
    # the LM recipe builds its optimizer with timm's create_optimizer_v2 and weight decay (recipes/language.py);
    # the model's no_weight_decay() must cover every positional parameter the package's layers hold (found by
    # module type), as the GOAT authors' C4 training leaves their prior's coefficients undecayed
    from vision_priors.models.language_model import create_language_model
    model = create_language_model(attn, dim=32, depth=2, num_heads=2, vocab_size=16)
    names = prior_parameter_names(model)
    assert bool(names) == (attn in ('goat', 'pope', 'lavo'))
    opt = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05)
    by_id = {id(p): n for n, p in model.named_parameters()}
    decayed = {by_id[id(p)] for g in opt.param_groups if g['weight_decay'] > 0 for p in g['params']}
    assert decayed, 'the weight matrices must still be decayed'
    assert not decayed & names, f'positional parameters decayed: {sorted(decayed & names)}'
    assert all(model.get_parameter(n).ndim > 1 for n in decayed)
