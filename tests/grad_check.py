"""One helper for the float64 reference tests: every gradient of a fast path equals the reference's."""
from typing import Iterable, Sequence

import torch
from torch import Tensor, nn


def assert_grads_match(layer: nn.Module, x: Tensor, out: Tensor, ref: Tensor, atol: float = 1e-9) -> Sequence[str]:
    """Compare d(out)/d(x, trainable params) with d(ref)/d(same) for one random output gradient.

    A parameter the reference does not use must get no (or an all-zero) gradient from the fast path too.

    Returns:
        The names of the tensors whose gradients were compared.
    """
    grad_out = torch.randn_like(out)
    named = [('x', x)] + [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
    params: Iterable[Tensor] = [p for _, p in named]
    grads = torch.autograd.grad(out, params, grad_out, allow_unused=True, retain_graph=True)
    ref_grads = torch.autograd.grad(ref, params, grad_out, allow_unused=True, retain_graph=True)
    checked = []
    for (name, _), g, rg in zip(named, grads, ref_grads):
        if rg is None:
            assert g is None or g.abs().max() == 0, name
            continue
        torch.testing.assert_close(g, rg, rtol=0, atol=atol, msg=lambda m: f'{name}: {m}')
        checked.append(name)
    return checked
