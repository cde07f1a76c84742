"""Optimizer parameter groups that give the positional priors their own learning rate.

GOAT's 2D prior starts at zero (a uniform prior: the model is permutation-equivariant over the patches
at the start, GOAT Sec. 4 / Table 5) and its O(1) coefficients move by about ``lr`` per Adam step, so a
short vision run can stay on the position-blind plateau for hundreds of updates. A larger learning
rate on the prior parameters only (``lr_scale``, applied by timm's schedulers at every step) is the
remedy the README's ablation table measures; use it with any timm optimizer:

    from functools import partial
    from timm.optim import create_optimizer_v2
    from vision_priors.optim import prior_param_groups

    optimizer = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05,
                                    param_group_fn=partial(prior_param_groups, weight_decay=0.05, lr_scale=10))

Positional-prior parameters are those of every :class:`~vision_priors.layers.GoatPrior` (alpha, beta, the
key default's MLP, slopes and biases), every :class:`~vision_priors.layers.PopePhases` (the phase bias
delta) and the embedded relative position bias P of every :class:`~vision_priors.layers.LavoAttention`
(``rel_bias``, ``rel_bias_2d``; LAVO Sec. 3.3, also zero at the start), found by module type, so any model
built from the package's layers qualifies.
"""
from typing import Any, Dict, Iterable, List, Set

from torch import nn

from timm.optim import param_groups_weight_decay

from .layers.goat import GoatPrior
from .layers.lavo import LavoAttention
from .layers.pope import PopePhases

__all__ = ['PRIOR_MODULES', 'VISION_PRIOR_LR_SCALE', 'prior_parameter_names', 'prior_param_groups']

PRIOR_MODULES = (GoatPrior, PopePhases)
# The 2D vision recipes' default lr_scale (README: GOAT leaves the position-blind start in both the resolution
# job and spatial VQA at 10; 1 and 3 stay on it, 30 is worse). Causal 1D language models keep 1 (GOAT Table 5).
VISION_PRIOR_LR_SCALE = 10.0
LAVO_PRIOR_PARAMETERS = ('rel_bias', 'rel_bias_2d')  # LavoAttention's embedded relative positions


def prior_parameter_names(model: nn.Module) -> Set[str]:
    """Names (as in ``model.named_parameters()``) of the trainable positional-prior parameters."""
    names: Set[str] = set()
    for module_name, module in model.named_modules():
        prefix = f'{module_name}.' if module_name else ''
        if isinstance(module, PRIOR_MODULES):
            names.update(prefix + n for n, p in module.named_parameters() if p.requires_grad)
        elif isinstance(module, LavoAttention):
            names.update(prefix + n for n in LAVO_PRIOR_PARAMETERS
                         if isinstance(getattr(module, n, None), nn.Parameter) and getattr(module, n).requires_grad)
    return names


def prior_param_groups(model: nn.Module, weight_decay: float = 0.0, lr_scale: float = 1.0,
                       no_weight_decay_list: Iterable[str] = ()) -> List[Dict[str, Any]]:
    """timm's weight-decay groups for every other parameter, plus one group of the positional priors with
    no weight decay and ``lr_scale`` (timm's schedulers multiply the group's learning rate by it).

    Args:
        model: Any module; the priors are found by type (:data:`PRIOR_MODULES`).
        weight_decay: Decay of the non-prior weights (timm's rule: none for biases, norms, 1-D parameters and
            ``model.no_weight_decay()``).
        lr_scale: Learning-rate multiplier of the prior group (> 0).
        no_weight_decay_list: Extra names without weight decay (added to ``model.no_weight_decay()``).
    """
    if not lr_scale > 0:
        raise ValueError(f'lr_scale must be > 0, got {lr_scale!r}')
    prior_names = prior_parameter_names(model)
    skip = set(no_weight_decay_list)
    if hasattr(model, 'no_weight_decay'):
        skip |= set(model.no_weight_decay())
    named = dict(model.named_parameters())
    prior = [named[n] for n in sorted(prior_names)]
    prior_ids = {id(p) for p in prior}
    groups = []
    for group in param_groups_weight_decay(model, weight_decay, no_weight_decay_list=skip):
        params = [p for p in group['params'] if id(p) not in prior_ids]
        if params:
            groups.append(dict(group, params=params))
    if prior:
        groups.append(dict(params=prior, weight_decay=0.0, lr_scale=float(lr_scale)))
    return groups
