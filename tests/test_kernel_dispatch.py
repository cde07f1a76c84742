"""The attention layers hand their fused path to the Triton kernels: layer outputs and every parameter
gradient with ``kernel_backend='triton'`` match ``kernel_backend='torch'`` (one SDPA call).

Runs where Triton runs (CUDA, or TRITON_INTERPRET=1 set before Triton's import: in a child process via
tests/test_kernels_interpreter.py). Tolerance: max abs difference <= 1e-4 * max(1, max |torch path|) in
float32 (the kernel's IEEE fp32 dots against SDPA's math), at least 2e-4 for gradients. Key masks follow
the package convention (``key_mask`` (B, N), True = valid key) on both paths. The selection rule itself (no kernel for
dropout, general masks, 'torch', or the environment variable) is checked in every process.
"""
import os

import pytest
import torch

from vision_priors.layers import GoatAttention, LavoAttention, PopeAttention, grid_coords
from vision_priors.layers.kernel_dispatch import kernel_key_mask, use_flash_kernel

_TRITON_RUNS = torch.cuda.is_available() or os.environ.get('TRITON_INTERPRET') == '1'
DEVICE = torch.device('cuda' if torch.cuda.is_available() else 'cpu')


def _pair(cls, **kwargs):
    torch.manual_seed(0)
    fast = cls(**kwargs, kernel_backend='triton').to(DEVICE)
    exact = cls(**kwargs, kernel_backend='torch').to(DEVICE)
    with torch.no_grad():
        for p in fast.parameters():
            p.normal_(0, 0.3)
    exact.load_state_dict(fast.state_dict())
    return fast, exact


def _compare(fast, exact, x, **forward_kwargs):
    outs, grads = [], []
    for layer in (fast, exact):
        xi = x.clone().requires_grad_(True)
        out = layer(xi, **forward_kwargs)
        (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
        outs.append(out.detach())
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    scale = max(1.0, outs[1].abs().max().item())
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-4 * scale
    for g_fast, g_exact in zip(*grads):
        assert g_fast is not None and g_exact is not None
        # floor 2e-4: a gradient that cancels to 0 exactly (GOAT's key-default bias shifts every logit of a
        # row alike) is float32 rounding noise of large cancelling terms in both paths
        assert (g_fast - g_exact).abs().max().item() <= max(2e-4, 1e-4 * max(1.0, g_exact.abs().max().item()))


@pytest.mark.skipif(not _TRITON_RUNS, reason='needs CUDA or TRITON_INTERPRET=1 (tests/test_kernels_interpreter.py)')
@pytest.mark.parametrize('cls', [GoatAttention, PopeAttention])
def test_layer_kernel_path_matches_sdpa_path(cls):
    kwargs = dict(dim=64, num_heads=2, num_spatial_dims=2, num_prefix_tokens=1)
    if cls is GoatAttention:
        kwargs.update(num_modes=2, learn_freqs=True)
    fast, exact = _pair(cls, **kwargs)
    coords = grid_coords((3, 5))                             # 15 patches + 1 prefix token: N = 16
    x = torch.randn(2, 16, 64, device=DEVICE)
    _compare(fast, exact, x, coords=coords.to(DEVICE))
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool, device=DEVICE)
    mask[1, ..., 11:] = False                                 # second sample: last 5 keys padded
    _compare(fast, exact, x, coords=coords.to(DEVICE), attn_mask=mask)
    key_mask = mask[:, 0, 0].clone()                          # the package's convention: (B, N), True = valid key
    _compare(fast, exact, x, coords=coords.to(DEVICE), key_mask=key_mask)
    key_mask[0, 3] = False                                    # with a (B, 1, 1, N) attn_mask: both apply
    _compare(fast, exact, x, coords=coords.to(DEVICE), attn_mask=mask, key_mask=key_mask)
    per_sample = torch.stack([coords, coords.flip(0)]).to(DEVICE)
    _compare(fast, exact, x, coords=per_sample)


@pytest.mark.skipif(not _TRITON_RUNS, reason='needs CUDA or TRITON_INTERPRET=1 (tests/test_kernels_interpreter.py)')
@pytest.mark.parametrize('cls', [GoatAttention, PopeAttention])
def test_causal_1d_kernel_path_matches_sdpa_path(cls):
    kwargs = dict(num_modes=4) if cls is GoatAttention else {}
    fast, exact = _pair(cls, dim=64, num_heads=2, num_spatial_dims=1, **kwargs)
    x = torch.randn(2, 19, 64, device=DEVICE)
    _compare(fast, exact, x, is_causal=True)
    key_mask = torch.ones(2, 19, dtype=torch.bool, device=DEVICE)
    key_mask[1, :4] = False                                   # left padding: queries 0-3 see no key -> zeros
    key_mask[0, 15:] = False
    _compare(fast, exact, x, is_causal=True, key_mask=key_mask)
    with torch.no_grad():
        out = exact(x, is_causal=True, key_mask=key_mask)
    torch.testing.assert_close(out[1, :4], exact.proj.bias.expand(4, -1), rtol=0, atol=1e-6)


@pytest.mark.skipif(not _TRITON_RUNS, reason='needs CUDA or TRITON_INTERPRET=1 (tests/test_kernels_interpreter.py)')
@pytest.mark.parametrize('causal, dissection', [(True, 'block'), (False, 'sliding')])
def test_lavo_kernel_path_matches_torch_path(causal, dissection):
    fast, exact = _pair(LavoAttention, dim=64, num_heads=2, num_slots=16, window=5, causal=causal,
                        num_spatial_dims=1, dissection=dissection)
    x = torch.randn(2, 37, 64, device=DEVICE)
    _compare(fast, exact, x)
    valid = torch.ones(2, 37, dtype=torch.bool, device=DEVICE)
    valid[1, 30:] = False
    _compare(fast, exact, x, key_mask=valid)


def test_selection_rule(monkeypatch):
    x = torch.zeros(2, 5, 8)
    monkeypatch.delenv('VISION_PRIORS_KERNELS', raising=False)
    assert not use_flash_kernel('auto', x, None, False, 64, family='lavo')  # CPU tensors: 'auto' keeps SDPA
    assert not use_flash_kernel('torch', x, None, False, 64, family='lavo')
    assert not use_flash_kernel('triton', x, None, True, 64, family='lavo')  # attention dropout: SDPA
    assert not use_flash_kernel('triton', x, None, False, 256, family='lavo')  # head dim beyond the kernel's 128
    float_mask = torch.zeros(2, 1, 5, 5)
    assert not use_flash_kernel('triton', x, float_mask, False, 64, family='lavo')  # additive masks: SDPA
    monkeypatch.setenv('VISION_PRIORS_KERNELS', 'torch')
    assert not use_flash_kernel('auto', x, None, False, 64, family='lavo')
    monkeypatch.setenv('VISION_PRIORS_KERNELS', 'fast')
    with pytest.raises(ValueError, match="VISION_PRIORS_KERNELS must be 'triton', 'torch' or 'auto', got 'fast'"):
        use_flash_kernel('auto', x, None, False, 64, family='lavo')
    mask = torch.tensor([[True, True, False]]).view(1, 1, 1, 3)
    assert kernel_key_mask(None, mask).tolist() == [[True, True, False]]  # True = valid key, as key_mask
    assert kernel_key_mask(torch.tensor([[False, True, True]]), mask).tolist() == [[False, True, False]]
    with pytest.raises(ValueError, match="kernel_backend must be one of .*got 'cuda'"):
        GoatAttention(64, 2, kernel_backend='cuda')


def test_auto_keeps_the_torch_path_for_float64(monkeypatch):
    """The kernels take fp16 / bf16 / fp32: 'auto' on (what would be) CUDA float64 input stays on torch."""
    import vision_priors.layers.kernel_dispatch as dispatch
    monkeypatch.delenv('VISION_PRIORS_KERNELS', raising=False)
    monkeypatch.setattr(dispatch, 'resolve_backend', lambda backend, x: 'triton')  # as on a GPU
    assert use_flash_kernel('auto', torch.zeros(2, 5, 8), None, False, 64, family='lavo')
    assert use_flash_kernel('auto', torch.zeros(2, 5, 8, dtype=torch.float16), None, False, 64, family='lavo')
    assert not use_flash_kernel('auto', torch.zeros(2, 5, 8, dtype=torch.float64), None, False, 64, family='lavo')
    double = torch.zeros(2, 5, 8, dtype=torch.float64)
    assert use_flash_kernel('triton', double, None, False, 64, family='lavo')  # 'triton': the kernel refuses it


def test_auto_picks_sdpa_for_goat_and_pope_and_the_kernel_for_lavo_on_cuda(monkeypatch):
    """'auto' on (what would be) CUDA: GOAT and PoPE stay on SDPA, where an H200 ran them 3-9x faster than
    the flash-prior kernel; LAVO takes its kernels. 'triton' (argument or environment) forces every kernel."""
    import vision_priors.layers.kernel_dispatch as dispatch
    monkeypatch.delenv('VISION_PRIORS_KERNELS', raising=False)
    monkeypatch.setattr(dispatch, 'resolve_backend', lambda backend, x: 'triton')  # as on a GPU
    x = torch.zeros(2, 5, 8, dtype=torch.bfloat16)
    assert dispatch.AUTO_PICKS_KERNEL == {'goat': False, 'pope': False, 'lavo': True}
    assert not use_flash_kernel('auto', x, None, False, 64, family='goat')
    assert not use_flash_kernel('auto', x, None, False, 64, family='pope')
    assert use_flash_kernel('auto', x, None, False, 64, family='lavo')
    for family in ('goat', 'pope', 'lavo'):
        assert use_flash_kernel('triton', x, None, False, 64, family=family)
    monkeypatch.setenv('VISION_PRIORS_KERNELS', 'triton')
    assert use_flash_kernel('auto', x, None, False, 64, family='goat')
    assert use_flash_kernel('auto', x, None, False, 64, family='pope')
