"""GOAT attention: content logits plus a learned relative Fourier log-prior and a key-only default.

Paper: Litman & Guo, "You Need Better Attention Priors" (GOAT), Sec. 4, Eqs. 12-27, Algorithm 1.

    z_ij = q_c,i . k_c,j / sqrt(d_c) + K_rel(p_i - p_j) + u_h(j)                  (Eq. 11)
    K_rel(d) = sum_a sum_r alpha_{a,r} cos(w_{a,r} d_a) + beta_{a,r} sin(w_{a,r} d_a)  (Eqs. 12, 20)
    u_h(j) = lambda_h p_j + g_h(phi_abs(p_j)) + b_h 1{p_j = 0}                     (Eqs. 21-22)

Each Fourier mode is two key coordinates (cos w p_j, sin w p_j) and two query coordinates
(alpha cos w p_i + beta sin w p_i, alpha sin w p_i - beta cos w p_i) whose dot product is exactly
that mode's relative term (Eqs. 13-19); the key default is a constant-1 query coordinate against a
key coordinate u_h(j); one zero pad coordinate keeps the head width (Eqs. 23-27). So d_p = 2 R D + 2
(R modes per axis, D axes) positional coordinates come out of the head dimension, d_c = d_h - d_p
content coordinates remain, values keep all d_h, and ONE ``F.scaled_dot_product_attention`` call on
the widened q', k' computes the logits exactly, with no dense bias matrix.
"""
import math
from typing import Optional, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.jit import Final

from timm.layers.attention import resolve_self_attn_mask

from vision_priors.kernels._backend import check_key_mask

from .coords import check_mask_args, resolve_token_coords
from .kernel_dispatch import check_kernel_backend, kernel_key_mask, key_mask_to_attn_mask, use_flash_kernel

# leaf calls under torch.fx symbolic tracing: they run on concrete values, checks included
torch.fx.wrap('check_mask_args')
torch.fx.wrap('resolve_token_coords')

__all__ = ['GoatPrior', 'GoatAttention', 'goat_positional_dim', 'goat_head_dims']

PRIOR_INITS = ('zero', 'random', 'alibi', 'offsets')
KEY_SLOPE_PARAMS = ('linear', 'softplus')
# the 'softplus' slope's zero start: softplus(-30) ~ 1e-13, the authors' neutral start (elonlit/goat, 'uniform')
SOFTPLUS_ZERO_RAW = -30.0
# the 'alibi' cosine fit must stay within this share of m * extent of the ALiBi line and be monotone
ALIBI_FIT_TOLERANCE = 0.25


def goat_positional_dim(num_modes: int, num_spatial_dims: int) -> int:
    """Number of head coordinates GOAT reserves for structure: 2 R D + 2 (Sec. 4, Alg. 1)."""
    return 2 * num_modes * num_spatial_dims + 2


def alibi_slopes(num_heads: int) -> Tensor:
    """Geometric ALiBi slopes m_h = 2^(-8 (h + 1) / H) (Press et al.), used by the 'alibi' init."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)], device="cpu")


def goat_head_dims(dim: int, num_heads: int, num_modes: int, num_spatial_dims: int) -> Tuple[int, int]:
    """(d_h, d_c): head width and the content coordinates left after d_p = 2 R D + 2 go to structure; raises
    ValueError when ``dim`` does not split into ``num_heads`` heads or no content coordinate is left."""
    if dim % num_heads != 0:
        raise ValueError(f'dim ({dim}) must be divisible by num_heads ({num_heads})')
    head_dim = dim // num_heads
    positional_dim = goat_positional_dim(num_modes, num_spatial_dims)
    content_dim = head_dim - positional_dim
    if content_dim < 1:
        raise ValueError(
            f'head dim {head_dim} (dim {dim} / {num_heads} heads) is too small for GOAT: '
            f'{num_modes} modes x {num_spatial_dims} axes need d_p = 2*{num_modes}*{num_spatial_dims}+2 '
            f'= {positional_dim} positional coordinates, leaving {content_dim} content coordinates; '
            f'use fewer modes or heads (need head dim > {positional_dim})')
    return head_dim, content_dim


class GoatPrior(nn.Module):
    """The structural part of GOAT: learned per-head relative Fourier prior and key-only default.

    Produces the positional query / key coordinates of every token; their dot product is the
    log-prior ``K_rel(p_i - p_j) + u_h(j)`` (Eqs. 12-22). Prefix tokens (class, register) carry no
    relative features: their relative coordinates are zero, so no pair that involves a prefix token
    gets a relative term, and as keys they get a learned per-head, per-prefix-token default logit
    (a generalisation of the paper's first-token bump b_h, zero at init) in place of u_h.

    Args:
        num_heads: Attention heads H; every head has its own alpha, beta and key default.
        num_spatial_dims: 1 (sequences) or 2 (images, axis-wise prior of Eq. 12 / 20).
        num_modes: Fourier modes R per axis; each axis has its own full ladder.
        freq_base: Ladder w_r = max_freq * freq_base^(-r / R), r = 0..R-1 (radians per coordinate unit).
            Default 10000 in 1D and 100 in 2D (patch grids are short).
        max_freq: w_0, the top of the ladder (default 1, the paper's ladder). A mode turns max_freq * d radians
            over an offset d, so offsets past pi / max_freq alias onto shorter ones; the 2D ViTs set it from
            their patch grid (``vit_goat_max_freq``: 0.4 on 4 x 4; README, main-job ablation).
        learn_freqs: Learn the frequencies (log-parametrised, Table 4 'Learned') instead of fixing them.
        prior_init: 'zero' (uniform prior at init), 'random' (alpha, beta ~ N(0, init_std^2) from a
            seeded generator) or 'alibi' (recency start: key-linear slopes in the causal 1D case,
            else cosine modes least-squares fitted to -m_h |d| per axis over |d| <= alibi_extent);
            the paper's Table 5; or 'offsets' (2D only, this package's vision start): head h starts as a bump
            at its own key offset delta_h = offset_radius * (cos t_h, sin t_h), t_h = pi / 4 + 2 pi h / H (four
            heads: the four diagonal neighbours), every mode of axis a getting amplitude offset_amplitude:
            K_h(p_j - p_i) = A sum_a sum_r cos(w_{a,r} (p_j - p_i - delta_h)_a), i.e. alpha = A cos(w delta),
            beta = -A sin(w delta) in Eq. 12's K(p_i - p_j). The convolution-like start of Cordonnier et al.
            (2020) and ConViT (d'Ascoli et al., 2021) written in GOAT's Fourier coordinates: unlike 'zero' the
            model is not permutation-equivariant at the start, and unlike 'random' no two heads (and no two
            axes) start alike (README, spatial VQA ablation).
        init_std: Standard deviation of the 'random' init.
        init_seed: Seed of the 'random' init.
        offset_radius: Distance of the 'offsets' start's bump centres from the query (coordinate units).
        offset_amplitude: Amplitude A of every mode in the 'offsets' start.
        alibi_extent: Offset range of the 'alibi' fit; default 16 (2D) or 512 (1D).
        key_linear: Include the key-linear trend lambda_h p_j (the causal recency term).
        key_slope_param: How lambda_h is parametrised: 'linear' (lambda_h itself is the parameter, any sign) or
            'softplus' (lambda_h = softplus(rho_h) >= 0, the GOAT authors' code, elonlit/goat). Under Adam a
            softplus slope changes by a roughly constant *factor* per step near zero, so a slow head started
            at ALiBi's 1/256 per position stays slow, and the zero start (rho = -30) stays practically at 0.
        first_key_bias: Include b_h 1{p_j = 0}; default True in 1D, False in 2D.
        key_mlp_hidden: Width of the SiLU MLP g_h; 0 disables it.
        abs_num_freqs: Sinusoid pairs per axis in phi_abs.
        abs_pos_scale: phi_abs also holds p / abs_pos_scale (a fixed constant, so the default is
            causal-safe and defined at any length); default 14 (2D) or 2048 (1D).
        num_prefix_tokens: Leading prefix tokens handled as described above.
    """

    def __init__(
            self,
            num_heads: int,
            num_spatial_dims: int = 2,
            num_modes: int = 4,
            freq_base: Optional[float] = None,
            max_freq: float = 1.0,
            learn_freqs: bool = False,
            prior_init: str = 'zero',
            init_std: float = 0.5,
            init_seed: int = 0,
            offset_radius: float = math.sqrt(2.0),
            offset_amplitude: float = 3.0,
            alibi_extent: Optional[float] = None,
            key_linear: bool = False,
            key_slope_param: str = 'linear',
            first_key_bias: Optional[bool] = None,
            key_mlp_hidden: int = 32,
            abs_num_freqs: int = 4,
            abs_pos_scale: Optional[float] = None,
            num_prefix_tokens: int = 0,
    ) -> None:
        super().__init__()
        if num_spatial_dims not in (1, 2):
            raise ValueError(f'num_spatial_dims must be 1 or 2, got {num_spatial_dims}')
        if num_modes < 1:
            raise ValueError(f'num_modes must be >= 1, got {num_modes}')
        if not 0 < max_freq < float('inf'):
            raise ValueError(f'max_freq must be a finite number > 0, got {max_freq!r}')
        if prior_init not in PRIOR_INITS:
            raise ValueError(f'prior_init must be one of {PRIOR_INITS}, got {prior_init!r}')
        if key_slope_param not in KEY_SLOPE_PARAMS:
            raise ValueError(f'key_slope_param must be one of {KEY_SLOPE_PARAMS}, got {key_slope_param!r}')
        if num_prefix_tokens < 0:
            raise ValueError(f'num_prefix_tokens must be >= 0, got {num_prefix_tokens}')
        if prior_init == 'offsets' and num_spatial_dims != 2:
            raise ValueError("prior_init='offsets' is a start for 2D priors (a bump per head at its own 2D key "
                             f'offset); got num_spatial_dims={num_spatial_dims}: use zero, random or alibi')
        if not (0 <= offset_radius < float('inf') and 0 < offset_amplitude < float('inf')):
            raise ValueError(f'need a finite offset_radius >= 0 and offset_amplitude > 0, got {offset_radius!r}, '
                             f'{offset_amplitude!r}')
        self.num_heads = num_heads
        self.num_spatial_dims = num_spatial_dims
        self.num_modes = num_modes
        self.num_prefix_tokens = num_prefix_tokens
        self.positional_dim = goat_positional_dim(num_modes, num_spatial_dims)
        self.prior_init = prior_init
        self.init_std = init_std
        self.init_seed = init_seed
        self.offset_radius = float(offset_radius)
        self.offset_amplitude = float(offset_amplitude)
        is_2d = num_spatial_dims == 2
        self.freq_base = float(freq_base if freq_base is not None else (100.0 if is_2d else 10000.0))
        self.max_freq = float(max_freq)
        self.alibi_extent = float(alibi_extent if alibi_extent is not None else (16.0 if is_2d else 512.0))
        self.abs_pos_scale = float(abs_pos_scale if abs_pos_scale is not None else (14.0 if is_2d else 2048.0))

        if learn_freqs:
            ladder = self.max_freq * self.freq_base ** (-torch.arange(num_modes, dtype=torch.float64) / num_modes)
            self.log_freqs = nn.Parameter(ladder.log().float().expand(num_spatial_dims, num_modes).clone())
        else:
            self.log_freqs = None  # fixed ladder, computed in the positions' dtype (no rounded buffer)

        self.alpha = nn.Parameter(torch.zeros(num_heads, num_spatial_dims, num_modes))
        self.beta = nn.Parameter(torch.zeros(num_heads, num_spatial_dims, num_modes))

        self.abs_num_freqs = abs_num_freqs
        abs_features = num_spatial_dims * (2 * abs_num_freqs + 1)
        if key_mlp_hidden > 0:
            self.key_mlp = nn.Sequential(
                nn.Linear(abs_features, key_mlp_hidden), nn.SiLU(), nn.Linear(key_mlp_hidden, num_heads))
        else:
            self.key_mlp = None
        softplus_slope = key_linear and key_slope_param == 'softplus'
        # 'linear': key_slope is lambda_h; 'softplus': key_slope_raw is rho_h, lambda_h = softplus(rho_h)
        self.key_slope = nn.Parameter(torch.zeros(num_heads)) if key_linear and not softplus_slope else None
        self.key_slope_raw = nn.Parameter(torch.zeros(num_heads)) if softplus_slope else None
        use_first = (not is_2d) if first_key_bias is None else first_key_bias
        self.first_key_bias = nn.Parameter(torch.zeros(num_heads)) if use_first else None
        self.prefix_bias = nn.Parameter(torch.zeros(num_heads, num_prefix_tokens)) if num_prefix_tokens else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Apply the configured prior initialisation (Table 5) and zero the key default."""
        with torch.no_grad():
            self.alpha.zero_()
            self.beta.zero_()
            if self.key_mlp is not None:
                nn.init.trunc_normal_(self.key_mlp[0].weight, std=0.02)
                nn.init.zeros_(self.key_mlp[0].bias)
                nn.init.zeros_(self.key_mlp[2].weight)
                nn.init.zeros_(self.key_mlp[2].bias)
            for p in (self.key_slope, self.first_key_bias, self.prefix_bias):
                if p is not None:
                    p.zero_()
            if self.key_slope_raw is not None:
                self.key_slope_raw.fill_(SOFTPLUS_ZERO_RAW)
            if self.prior_init == 'random':
                gen = torch.Generator().manual_seed(self.init_seed)
                self.alpha.copy_(torch.randn(self.alpha.shape, generator=gen, device='cpu') * self.init_std)
                self.beta.copy_(torch.randn(self.beta.shape, generator=gen, device='cpu') * self.init_std)
            elif self.prior_init == 'offsets':
                alpha, beta = self._offset_bumps()
                self.alpha.copy_(alpha.float())
                self.beta.copy_(beta.float())
            elif self.prior_init == 'alibi':
                slopes = alibi_slopes(self.num_heads).double().cpu()
                if self.key_slope is not None:
                    # causal: -m (i - j) = m j - m i, and -m i is a row constant (Appendix G.3)
                    self.key_slope.copy_(slopes.float())
                elif self.key_slope_raw is not None:
                    self.key_slope_raw.copy_(torch.log(torch.expm1(slopes)).float())  # softplus^-1(m_h)
                else:
                    alpha = self._fit_symmetric_decay(slopes)
                    self._check_alibi_fit(alpha, slopes)
                    self.alpha.copy_(alpha.float())

    def offset_centres(self) -> Tensor:
        """delta_h of the 'offsets' start, the key offset p_j - p_i each head's bump is centred on: (H, 2) float64."""
        angles = math.pi / 4 + 2 * math.pi * torch.arange(self.num_heads, dtype=torch.float64) / self.num_heads
        return self.offset_radius * torch.stack([angles.cos(), angles.sin()], dim=-1)

    def _offset_bumps(self) -> Tuple[Tensor, Tensor]:
        """alpha, beta (H, 2, R) with alpha cos(w d) + beta sin(w d) = A cos(w (d + delta)) for d = p_i - p_j."""
        cpu = torch.device('cpu')
        phase = self.offset_centres()[:, :, None] * self.frequencies(torch.float64, cpu).detach().to(cpu)[None]
        return self.offset_amplitude * phase.cos(), -self.offset_amplitude * phase.sin()

    def init_weights(self) -> None:
        """timm's ViT init hook: re-apply our init after timm re-initialises the MLP's Linear layers."""
        self.reset_parameters()

    def _fit_symmetric_decay(self, slopes: Tensor) -> Tensor:
        """Ridge fit of cosine coefficients: sum_r a_r cos(w_r d) + c ~= -m |d| on |d| <= extent.

        The constant c (a row constant, which softmax ignores) is fitted but dropped; the small ridge
        term keeps the near-collinear low frequencies from blowing up.
        """
        cpu = torch.device('cpu')
        offsets = torch.arange(-self.alibi_extent, self.alibi_extent + 1, dtype=torch.float64, device=cpu)
        freqs = self.frequencies(torch.float64, cpu).detach().to(cpu)  # (D, R)
        alpha = torch.zeros(self.num_heads, self.num_spatial_dims, self.num_modes, dtype=torch.float64, device=cpu)
        targets = -slopes[None, :] * offsets.abs()[:, None]  # (n, H)
        ridge = torch.eye(self.num_modes + 1, dtype=torch.float64, device=cpu) * 1e-3 * len(offsets)
        ridge[-1, -1] = 0.0
        for axis in range(self.num_spatial_dims):
            basis = torch.cat([torch.cos(offsets[:, None] * freqs[axis][None]),
                               torch.ones(len(offsets), 1, dtype=torch.float64, device=cpu)], dim=1)
            solution = torch.linalg.solve(basis.T @ basis + ridge, basis.T @ targets)  # (R + 1, H)
            alpha[:, axis] = solution[:-1].T / self.num_spatial_dims
        return alpha

    def alibi_fit_curves(self, alpha: Tensor) -> Tuple[Tensor, Tensor]:
        """(lags 0..extent, per-axis prior sum_r alpha_{h,a,r} cos(w_{a,r} d) - its value at d = 0: (H, D, n))."""
        cpu = torch.device('cpu')
        lags = torch.arange(0, self.alibi_extent + 1, dtype=torch.float64, device=cpu)
        freqs = self.frequencies(torch.float64, cpu).detach().to(cpu)  # (D, R)
        curves = (alpha.to(torch.float64)[..., None] * torch.cos(freqs[None, :, :, None] * lags)).sum(2)
        return lags, curves - curves[..., :1]

    def _check_alibi_fit(self, alpha: Tensor, slopes: Tensor) -> None:
        """Refuse an 'alibi' fit that is not ALiBi-shaped (not monotone, or off the line by too much)."""
        lags, curves = self.alibi_fit_curves(alpha)
        target = -slopes[:, None, None] * lags / self.num_spatial_dims
        scale = slopes[:, None] * self.alibi_extent / self.num_spatial_dims
        error = ((curves - target).abs().amax(-1) / scale).max().item()
        monotone = bool((curves[..., 1:] <= curves[..., :-1] + 1e-12).all())
        if not monotone or error > ALIBI_FIT_TOLERANCE:
            raise ValueError(
                f"prior_init='alibi': {self.num_modes} cosine modes (freq_base {self.freq_base:g}) cannot fit the "
                f'ALiBi line -m |d| over |d| <= {self.alibi_extent:g} (max error {error:.0%} of m * extent, '
                f'{"monotone" if monotone else "not monotone"}); use key_linear=True for causal sequences '
                f'(exact), a smaller alibi_extent or more num_modes')

    def frequencies(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Mode frequencies w_{a,r}: (D, R); learned (log-parametrised) or the fixed ladder."""
        if self.log_freqs is not None:
            return self.log_freqs.to(dtype).exp()
        exponents = torch.arange(self.num_modes, dtype=dtype, device=device) / self.num_modes
        return torch.pow(self.freq_base, -exponents).expand(self.num_spatial_dims, self.num_modes) * self.max_freq

    def abs_features(self, coords: Tensor) -> Tensor:
        """phi_abs(p): per axis, sinusoids of p and p / abs_pos_scale (input of g_h, Eq. 21): (..., M, F)."""
        exponents = torch.arange(self.abs_num_freqs, dtype=coords.dtype, device=coords.device)
        abs_freqs = torch.pow(100.0, -exponents / max(self.abs_num_freqs, 1))  # nu_m = 100^(-m / F)
        phase = coords.unsqueeze(-1) * abs_freqs  # (..., M, D, F)
        feats = torch.cat([phase.sin(), phase.cos(), coords.unsqueeze(-1) / self.abs_pos_scale], dim=-1)
        return feats.flatten(-2)

    def key_slopes(self) -> Optional[Tensor]:
        """lambda_h of the key-linear trend (H,), whichever its parametrisation; None without the term."""
        if self.key_slope_raw is not None:
            return F.softplus(self.key_slope_raw)
        return self.key_slope

    def key_default(self, coords: Tensor) -> Tensor:
        """u_h(j) for the non-prefix tokens (Eqs. 21-22): (H, M) for (M, D) coords, (B, H, M) for (B, M, D)."""
        # zeros of shape (..., H, M) built by broadcasting (no Python branch on the rank: torch.fx safe)
        u = torch.zeros_like(coords[..., 0]).unsqueeze(-2) + coords.new_zeros(self.num_heads, 1)
        if self.key_mlp is not None:
            u = u + self.key_mlp(self.abs_features(coords)).transpose(-1, -2)
        slopes = self.key_slopes()
        if slopes is not None:
            u = u + slopes.to(coords.dtype)[:, None] * coords[..., 0].unsqueeze(-2)
        if self.first_key_bias is not None:
            is_first = (coords == 0).all(dim=-1).to(coords.dtype)
            u = u + self.first_key_bias.to(coords.dtype)[:, None] * is_first.unsqueeze(-2)
        return u

    def qk_coordinates(self, coords: Tensor) -> Tuple[Tensor, Tensor]:
        """Positional query and key coordinates of all tokens, prefix tokens first.

        Args:
            coords: (M, D) coordinates of the non-prefix tokens shared by the batch, or (B, M, D) per
                sample (already validated).

        Returns:
            (q_pos, k_pos), each (H, P + M, d_p), or (B, H, P + M, d_p) for per-sample coords:
            ``q_pos[..., h, i, :] . k_pos[..., h, j, :]`` is the log-prior.
        """
        freqs = self.frequencies(coords.dtype, coords.device)  # (D, R)
        phase = coords.unsqueeze(-1) * freqs  # (..., M, D, R)
        cos, sin = phase.cos().unsqueeze(-4), phase.sin().unsqueeze(-4)  # (..., 1, M, D, R)
        alpha = self.alpha.to(coords.dtype)[:, None]  # (H, 1, D, R)
        beta = self.beta.to(coords.dtype)[:, None]
        # (..., H, M, 2DR)
        q_rel = torch.stack([alpha * cos + beta * sin, alpha * sin - beta * cos], dim=-1).flatten(-3)
        k_rel = torch.stack([cos, sin], dim=-1).flatten(-3).expand_as(q_rel)
        u = self.key_default(coords)  # (..., H, M)
        ones = torch.ones_like(u)
        zeros = torch.zeros_like(u)
        q_pos = torch.cat([q_rel, ones.unsqueeze(-1), zeros.unsqueeze(-1)], dim=-1)
        k_pos = torch.cat([k_rel, u.unsqueeze(-1), zeros.unsqueeze(-1)], dim=-1)
        if self.prefix_bias is not None:
            num_prefix = self.num_prefix_tokens
            pre_zeros = torch.zeros_like(q_pos[..., :1, :]).repeat_interleave(num_prefix, dim=-2)  # (..., H, P, d_p)
            q_pre = torch.cat([pre_zeros[..., :-2], torch.ones_like(pre_zeros[..., :1]), pre_zeros[..., :1]], dim=-1)
            k_pre = torch.cat([
                pre_zeros[..., :-2],
                pre_zeros[..., :1] + self.prefix_bias.to(coords.dtype).unsqueeze(-1),
                pre_zeros[..., :1],
            ], dim=-1)
            q_pos = torch.cat([q_pre, q_pos], dim=-2)
            k_pos = torch.cat([k_pre, k_pos], dim=-2)
        return q_pos, k_pos

    def prior_logits(self, coords: Tensor) -> Tensor:
        """The structural log-prior K_rel(p_i - p_j) + u_h(j) over all tokens: (H, N, N) or (B, H, N, N)."""
        q_pos, k_pos = self.qk_coordinates(coords)
        return q_pos @ k_pos.transpose(-1, -2)


class GoatAttention(nn.Module):
    """Multi-head self-attention with the GOAT positional log-prior, computed by one SDPA call.

    The block-facing API matches timm's ``Attention`` plus token coordinates and the package's key mask:
    ``forward(x, coords=None, attn_mask=None, is_causal=False, return_attn=False, key_mask=None)``.

    Args:
        dim: Embedding width C.
        num_heads: Heads H; head width d_h = C / H must exceed the d_p = 2 R D + 2 positional
            coordinates (the rest, d_c = d_h - d_p, is content).
        num_spatial_dims: 1 or 2.
        num_modes: Fourier modes R per axis.
        num_prefix_tokens: Leading tokens without coordinates (see ``GoatPrior``).
        grid_size: (rows, cols) used when ``coords`` is None in 2D.
        qkv_bias: Bias in the q/k/v projection.
        qk_norm: LayerNorm on the content part of q and k.
        attn_drop: Attention-probability dropout.
        proj_drop: Output dropout.
        norm_layer: Normalisation used by ``qk_norm``.
        fused_attn: Use the fused path (Triton kernel or one SDPA call) rather than the dense one.
        kernel_backend: 'auto' (SDPA: on an H200 it ran 3-4x faster than the Triton kernel,
            ``kernel_dispatch.AUTO_PICKS_KERNEL``), 'triton' (the kernel on CUDA tensors) or 'torch' (SDPA); the
            ``VISION_PRIORS_KERNELS`` environment variable overrides 'auto'.
        **prior_kwargs: Options of ``GoatPrior`` (freq_base, learn_freqs, prior_init, ...).
    """
    fused_attn: Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            num_spatial_dims: int = 2,
            num_modes: int = 4,
            num_prefix_tokens: int = 0,
            grid_size: Optional[Tuple[int, int]] = None,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Type[nn.Module] = nn.LayerNorm,
            fused_attn: bool = True,
            kernel_backend: str = 'auto',
            **prior_kwargs,
    ) -> None:
        super().__init__()
        head_dim, content_dim = goat_head_dims(dim, num_heads, num_modes, num_spatial_dims)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.content_dim = content_dim
        self.num_spatial_dims = num_spatial_dims
        self.num_prefix_tokens = num_prefix_tokens
        self.grid_size: Optional[Tuple[int, int]] = (None if grid_size is None
                                                     else (int(grid_size[0]), int(grid_size[1])))
        self.content_scale = content_dim ** -0.5
        self.fused_attn = fused_attn
        self.kernel_backend = check_kernel_backend(kernel_backend)

        self.qkv = nn.Linear(dim, num_heads * (2 * content_dim + head_dim), bias=qkv_bias)
        self.q_norm = norm_layer(content_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(content_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.prior = GoatPrior(
            num_heads, num_spatial_dims=num_spatial_dims, num_modes=num_modes,
            num_prefix_tokens=num_prefix_tokens, **prior_kwargs)

    def set_grid_size(self, grid_size: Optional[Tuple[int, int]]) -> None:
        """Default patch grid used when ``coords`` is None (2D)."""
        self.grid_size = None if grid_size is None else (int(grid_size[0]), int(grid_size[1]))

    def prior_logits(self, coords: Optional[Tensor] = None, num_tokens: Optional[int] = None) -> Tensor:
        """Structural log-prior (relative + key default, no content): (H, N, N) over all N tokens.

        Args:
            coords: Coordinates of the non-prefix tokens, (M, D) or per sample (B, M, D) (then the
                result is (B, H, N, N)); None for the default grid / sequence.
            num_tokens: Number of non-prefix tokens when ``coords`` is None (default: the grid's).
        """
        if num_tokens is None:
            if coords is not None:
                num_tokens = coords.shape[-2] if coords.dim() > 1 else coords.shape[0]
            elif self.grid_size is not None:
                num_tokens = self.grid_size[0] * self.grid_size[1]
            else:
                raise ValueError('prior_logits() needs coords, num_tokens or a configured grid_size')
        coords = resolve_token_coords(
            coords, num_tokens, self.num_spatial_dims, self.num_prefix_tokens, self.grid_size,
            self.prior.alpha.device, self.prior.alpha.dtype)
        return self.prior.prior_logits(coords)

    @torch.jit.unused
    def _flash_attention(self, q: Tensor, k: Tensor, v: Tensor, coords: Tensor, key_mask: Optional[Tensor],
                         is_causal: bool) -> Tensor:
        """The fused Triton kernel (``vision_priors.kernels.flash_prior``, GOAT mode): the prior is built in-kernel from
        per-position cos/sin tables, so the d_p extra q/k coordinates are never materialised."""
        from vision_priors.kernels.flash_prior import flash_prior_attention
        P = self.num_prefix_tokens
        u = self.prior.key_default(coords)  # (H, N - P) or (B, H, N - P)
        if self.prior.prefix_bias is not None:
            u = torch.cat([self.prior.prefix_bias.to(u.dtype).expand(*u.shape[:-1], P), u], dim=-1)
        return flash_prior_attention(
            q, k, v, mode='goat', coords=coords, freqs=self.prior.frequencies(coords.dtype, coords.device),
            alpha=self.prior.alpha, beta=self.prior.beta, key_default=u, num_prefix_tokens=P,
            causal=is_causal, key_mask=key_mask, scale=self.content_scale)

    def forward(
            self,
            x: Tensor,
            coords: Optional[Tensor] = None,
            attn_mask: Optional[Tensor] = None,
            is_causal: bool = False,
            return_attn: bool = False,
            key_mask: Optional[Tensor] = None,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Attention over (B, N, C) tokens whose last N - P have coordinates ``coords``.

        ``coords`` is (N - P, D) shared by the batch or (B, N - P, D) per sample (see
        ``resolve_token_coords``). ``attn_mask`` is the general SDPA mask (boolean, True = attend, or
        additive; not with ``is_causal``); ``key_mask`` (B, N) bool, True = valid key, is the package's
        key-padding convention (it combines with either); a query without any valid key outputs zeros.
        Returns ``out`` (B, N, C), or ``(out, probs)`` with ``return_attn=True``, both from the explicit
        dense path (probs: (B, H, N, N)). The fused path runs the Triton kernel where ``kernel_backend`` /
        ``VISION_PRIORS_KERNELS`` select it ('triton'; 'auto' keeps SDPA, see ``kernel_dispatch``) and one
        SDPA call otherwise.
        """
        B, N, C = x.shape
        check_mask_args(attn_mask, is_causal)
        check_key_mask(key_mask, B, N, device=x.device)
        coords = resolve_token_coords(
            coords, N - self.num_prefix_tokens, self.num_spatial_dims, self.num_prefix_tokens, self.grid_size,
            x.device, self.prior.alpha.dtype, B)
        H, dc, dh = self.num_heads, self.content_dim, self.head_dim
        q, k, v = self.qkv(x).split([H * dc, H * dc, H * dh], dim=-1)
        q = self.q_norm(q.reshape(B, N, H, dc).transpose(1, 2))
        k = self.k_norm(k.reshape(B, N, H, dc).transpose(1, 2))
        v = v.reshape(B, N, H, dh).transpose(1, 2)

        if not torch.jit.is_scripting() and not return_attn and self.fused_attn and use_flash_kernel(
                self.kernel_backend, x, attn_mask, self.training and self.attn_drop.p > 0, dh, family='goat'):
            out = self._flash_attention(q, k, v, coords, kernel_key_mask(key_mask, attn_mask), is_causal)
            return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))

        attn_mask, is_causal, has_key = key_mask_to_attn_mask(key_mask, attn_mask, is_causal, N)
        q_pos, k_pos = self.prior.qk_coordinates(coords)  # (H, N, d_p) or (B, H, N, d_p)
        q_pos = q_pos.to(x.dtype)
        k_pos = k_pos.to(x.dtype)

        if return_attn or not self.fused_attn:
            logits = (q @ k.transpose(-2, -1)) * self.content_scale + q_pos @ k_pos.transpose(-2, -1)
            bias = resolve_self_attn_mask(N, logits, attn_mask, is_causal)
            if bias is not None:
                logits = logits + bias
            probs = logits.softmax(dim=-1)
            if has_key is not None:
                probs = probs * has_key
            out = self.attn_drop(probs) @ v
            out = self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))
            if return_attn:
                return out, probs
            return out

        # SDPA's scale applies 1 / sqrt(d_c) to the content part; the positional query coordinates
        # are pre-divided by it, so q'.k' * scale = content / sqrt(d_c) + prior exactly (Eqs. 23-27)
        q_pos = q_pos / self.content_scale
        q = torch.cat([q, q_pos.expand(B, -1, -1, -1)], dim=-1)  # adds the batch dim to shared coords
        k = torch.cat([k, k_pos.expand(B, -1, -1, -1)], dim=-1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.content_scale,
            dropout_p=self.attn_drop.p if self.training else 0.)
        if has_key is not None:
            out = out * has_key
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))
