"""Attention layers with positional priors (GOAT, PoPE, LAVO) and coordinate helpers."""
from .coords import grid_coords, resolve_token_coords, sequence_coords
from .goat import GoatAttention, GoatPrior, goat_positional_dim
from .pope import PopeAttention, PopePhases, wrap_phase_bias
from .lavo import LavoAttention, LavoCrossAttention, LavoState
from .cross_prior import GoatCrossAttention, PopeCrossAttention
from .rotary import rotary_coordinate_table, rotate_by_coords

__all__ = [
    'grid_coords', 'resolve_token_coords', 'sequence_coords',
    'GoatAttention', 'GoatPrior', 'goat_positional_dim',
    'PopeAttention', 'PopePhases', 'wrap_phase_bias',
    'LavoAttention', 'LavoCrossAttention', 'LavoState',
    'GoatCrossAttention', 'PopeCrossAttention',
    'rotary_coordinate_table', 'rotate_by_coords',
]
