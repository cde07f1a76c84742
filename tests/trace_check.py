"""Shared check for the multimodal block tests: a block scripted with TorchScript and one fx-traced with timm's
leaf modules / functions both equal the eager block."""
import torch
from timm.models import get_notrace_functions, get_notrace_modules


class TimmLeafTracer(torch.fx.Tracer):
    """fx tracer that keeps timm's registered no-trace modules and functions as leaf calls."""

    def __init__(self):
        super().__init__(autowrap_functions=tuple(get_notrace_functions()))

    def is_leaf_module(self, m, name):
        return isinstance(m, tuple(get_notrace_modules())) or super().is_leaf_module(m, name)


def assert_scripted_and_traced_match(block: torch.nn.Module, args: tuple, is_causal: bool) -> None:
    """``block(*args)`` equals its TorchScript and its fx-traced (attn_mask=None, ``is_causal`` fixed) copies."""
    with torch.no_grad():
        ref = block(*args)
        torch.testing.assert_close(torch.jit.script(block)(*args), ref, rtol=0, atol=1e-12)
    graph = TimmLeafTracer().trace(block, concrete_args=dict(attn_mask=None, is_causal=is_causal))
    traced = torch.fx.GraphModule(block, graph)
    with torch.no_grad():
        torch.testing.assert_close(traced(*args), ref, rtol=0, atol=1e-12)
