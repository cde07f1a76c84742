"""Token coordinates: made once where the layout is known, passed down unchanged.

Layers never guess a grid from a sequence length; a model (or recipe) builds coordinates with these
helpers and hands them to every attention layer.
"""
import operator
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from vision_priors.kernels._backend import nonfinite_message

from .kernel_dispatch import tracing_or_compiling

__all__ = ['grid_coords', 'grid_extents', 'sequence_coords', 'resolve_token_coords', 'check_mask_args']


def grid_extents(grid_size: Any, name: str = 'grid_size') -> Tuple[int, int]:
    """(rows, cols) as positive ints; Python, numpy and torch integers pass, floats, bools and values < 1 do not
    (a ValueError naming ``name`` and the value)."""
    try:
        extents = tuple(grid_size)
    except TypeError:
        extents = ()
    if len(extents) != 2:
        raise ValueError(f'{name} must be (rows, cols), two positive integers, got {grid_size!r}')
    out = []
    for axis, value in zip(('rows', 'cols'), extents):
        is_bool = isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool)
        try:
            size = -1 if is_bool else operator.index(value)
        except TypeError:
            size = -1
        if size < 1:
            raise ValueError(f'{name} must be (rows, cols), two positive integers, got {grid_size!r}: '
                             f'{axis} = {value!r} ({type(value).__name__})')
        out.append(size)
    return out[0], out[1]


def grid_coords(
        grid_size: Tuple[int, int],
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
        ref_grid_size: Optional[Tuple[int, int]] = None,
) -> Tensor:
    """Row-major (x, y) coordinates of a patch grid, in patch units (or in units of a reference grid).

    Args:
        grid_size: (rows, cols) of the patch grid, positive integers (numpy / torch integers accepted).
        device: Device of the result.
        dtype: Floating dtype of the result.
        ref_grid_size: (rows, cols) of a reference grid (e.g. the training grid): coordinates are rescaled so
            that the grid spans it, column ``c`` at ``c * ref_cols / cols`` and row ``r`` at ``r * ref_rows /
            rows`` (position interpolation; timm's EVA ``ref_feat_shape``). None: patch units.

    Returns:
        (rows * cols, 2) tensor; token ``r * cols + c`` has coordinate ``(c, r)`` (rescaled with a reference).

    Raises:
        ValueError: a grid_size or ref_grid_size that is not two positive integers (e.g. a float, a bool, 0),
            naming the value.
    """
    if not torch.jit.is_scripting():
        rows, cols = grid_extents(grid_size)
    else:
        rows, cols = grid_size[0], grid_size[1]
        if rows < 1 or cols < 1:
            raise ValueError('grid_size must be two positive integers')
    ys, xs = torch.meshgrid(
        torch.arange(rows, device=device, dtype=dtype),
        torch.arange(cols, device=device, dtype=dtype),
        indexing='ij',
    )
    if ref_grid_size is not None:
        if not torch.jit.is_scripting():
            ref_rows, ref_cols = grid_extents(ref_grid_size, 'ref_grid_size')
        else:
            ref_rows, ref_cols = ref_grid_size[0], ref_grid_size[1]
            if ref_rows < 1 or ref_cols < 1:
                raise ValueError('ref_grid_size must be two positive integers')
        xs = xs * (ref_cols / cols)
        ys = ys * (ref_rows / rows)
    return torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)


def sequence_coords(
        length: int,
        offset: int = 0,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
) -> Tensor:
    """1D positions ``offset, ..., offset + length - 1`` as an (length, 1) tensor."""
    return torch.arange(offset, offset + length, device=device, dtype=dtype).unsqueeze(-1)


def resolve_token_coords(
        coords: Optional[Tensor],
        num_tokens: int,
        num_spatial_dims: int,
        num_prefix_tokens: int,
        grid_size: Optional[Tuple[int, int]],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        batch_size: Optional[int] = None,
) -> Tensor:
    """Validate per-token coordinates, or build the default ones, as (N, D) or (B, N, D) in ``dtype``.

    Args:
        coords: Coordinates of the non-prefix tokens, floating point: (N, D) shared by the whole batch
            (in 1D also (N,)), or (B, N, D) with one row per sample (e.g. a different scan order per
            sample); D = 1 in 1D, D = 2 as (x, y) in 2D. None for the default sequence positions
            0..N-1 (1D) or the configured ``grid_size`` (2D).
        num_tokens: N, the non-prefix tokens.
        num_spatial_dims: D, 1 or 2.
        num_prefix_tokens: Only used in the error message.
        grid_size: (rows, cols) default grid in 2D.
        device: Device of the result.
        dtype: Floating dtype of the result (the positional parameters' dtype, so that positions
            stay in full precision under autocast).
        batch_size: B of the tokens; per-sample coordinates must have this many rows (checked when given).

    Callers register it with ``torch.fx.wrap`` in their module: under torch.fx it is one leaf call,
    run on concrete values, so every check still happens. Non-finite coordinates (NaN / inf would make
    every output and gradient of the sample NaN) are rejected in eager mode at the cost of one
    ``torch.isfinite(coords).all()`` (a host sync on CUDA); the check stands aside under TorchScript,
    ``torch.jit.trace`` and ``torch.compile``, which cannot hold its data-dependent branch, and for meta
    tensors, which have no values.

    Raises:
        ValueError: naming the offending shape / dtype / grid and what is expected, or the first
            non-finite coordinate and its position (e.g. 'coords must be finite: coords[0, 3, 1] = nan').
    """
    if coords is None:
        if num_spatial_dims == 1:
            return sequence_coords(num_tokens, device=device, dtype=dtype)
        if grid_size is None or grid_size[0] * grid_size[1] != num_tokens:
            raise ValueError(
                f'coords=None needs the default grid, but grid_size={grid_size} does not hold the '
                f'{num_tokens} non-prefix tokens; pass coords of shape ({num_tokens}, 2) or call set_grid_size()')
        return grid_coords(grid_size, device=device, dtype=dtype)
    given = coords  # positions in error messages refer to the caller's layout
    if coords.dim() == 1 and num_spatial_dims == 1:
        coords = coords.unsqueeze(-1)
    if not torch.jit.is_scripting():
        if not coords.is_floating_point():
            raise ValueError(f'coords must be a floating-point tensor, got dtype {coords.dtype}')
        if coords.dim() not in (2, 3) or coords.shape[-2] != num_tokens or coords.shape[-1] != num_spatial_dims:
            raise ValueError(
                f'coords has shape {tuple(coords.shape)}, expected ({num_tokens}, {num_spatial_dims}) shared by '
                f'the batch or (B, {num_tokens}, {num_spatial_dims}) per sample: one row per non-prefix token '
                f'({num_tokens + num_prefix_tokens} tokens - {num_prefix_tokens} prefix) with '
                f'{num_spatial_dims} coordinate(s)')
        if coords.dim() == 3 and batch_size is not None and coords.shape[0] != batch_size:
            raise ValueError(
                f'per-sample coords have shape {tuple(coords.shape)}: {coords.shape[0]} rows for a batch of '
                f'{batch_size} samples; expected ({batch_size}, {num_tokens}, {num_spatial_dims})')
        skip = tracing_or_compiling() or torch.jit.is_tracing() or given.is_meta  # no values to read
        if not (skip or bool(torch.isfinite(given).all())):
            raise ValueError(nonfinite_message(given, 'coords'))
    return coords.to(device=device, dtype=dtype)


def check_mask_args(attn_mask: Optional[Tensor], is_causal: bool) -> None:
    """Reject an explicit mask together with ``is_causal`` (SDPA semantics).

    Callers register it with ``torch.fx.wrap('check_mask_args')`` in their own module, so torch.fx
    records a call (the arguments are graph inputs there) instead of tracing into the check.
    """
    if attn_mask is not None and is_causal:
        raise ValueError('pass either attn_mask or is_causal=True, not both (SDPA semantics)')
