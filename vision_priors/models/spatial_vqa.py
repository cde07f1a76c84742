"""Spatial VQA transformer: image patch tokens with canonical 2D coordinates, then 1D question tokens.

The model behind the GOAT paper's spatial VQA experiment (Litman & Guo, Sec. 6, Tables 9-10: four
CIFAR-10 images on a canonical 2x2 grid, test scan orders unseen in training). One transformer, one
budget; only the way position enters attention changes, chosen by name:

  ``nope``  no positional signal at all (timm ``AttentionRope`` called without ``rope``).
  ``rope``  1D RoPE over the *sequence index* (timm ``RotaryEmbeddingCat`` + ``AttentionRope``): image
            token k has position k (its place in the scan order), question token t has position M + t.
  ``goat``  :class:`~vision_priors.layers.GoatAttention`, 2D axis-wise prior (GOAT Eqs. 12 / 20-27) on
            the *canonical* (x, y) patch coordinates of the image tokens and on text coordinates
            (c + t, c + t) (below), given per sample as (B, N, 2).
  ``pope``  :class:`~vision_priors.layers.PopeAttention`, 2D phases (PoPE Eqs. 3-6: half the channels
            rotate with x, half with y) on the same coordinates as ``goat``.

Token layout (N = M + Q T tokens): M image patch tokens in the sample's scan order, then Q questions of
T tokens each. Each question is an independent segment: its tokens attend to every image token and,
causally, to the earlier tokens of the same question only, and its positions restart at t = 0, so the
Q answers of one scene are Q independent predictions (no answer can leak into another question) that
share one pass over the image. The answer is read at the last token of each question.

Image attention (``image_attention``): ``'prefix'`` (default, a prefix-LM) lets image tokens attend to
each other bidirectionally and never to text; ``'causal'`` makes them causal in scan order (then the
mask itself depends on the scan order).

Text coordinates for ``goat`` / ``pope``: question token t sits at (c + t, c + t), c = max(rows, cols)
of the patch grid, on the diagonal just outside the image. Every text-text offset is then (dt, dt), so
the text-text prior (GOAT: K_x(dt) + K_y(dt); PoPE: the x and y channel halves rotate alike) is a
function of the 1D offset dt only, as for a 1D sequence, while the text-image prior K(c + t - x,
c + t - y) still tells every image position apart (distinct offsets), so a head can route a question
token to any region of the scene by its prior.

Invariance that follows (tested): with ``'prefix'`` attention and canonical coordinates, ``goat`` and
``pope`` outputs at the question tokens do not depend on the scan order when the patch contents are
permuted consistently with their coordinates (attention is permutation-equivariant over the image
tokens and every positional term depends on coordinates, not on sequence indices). ``nope`` is
invariant too (it has no positional signal: image tokens form an unordered set), hence blind to where
anything is. ``rope`` is not invariant: its positions are sequence indices.
"""
from typing import Any, Dict, Optional, Set, Tuple, Type

import torch
from torch import Tensor, nn

from timm.layers import AttentionRope, DropPath, Mlp, RotaryEmbeddingCat, trunc_normal_

from ..layers import GoatAttention, PopeAttention

__all__ = ['SpatialVQATransformer', 'VQABlock', 'POS_METHODS', 'VQA_GOAT_DEFAULTS', 'IMAGE_ATTENTION',
           'vqa_attention_mask', 'vqa_text_coords', 'vqa_sequence_positions', 'count_parameters']

POS_METHODS = ('nope', 'rope', 'goat', 'pope')
# GOAT's start in this model (README, spatial VQA: the 'offsets' start against zero / random / alibi)
VQA_GOAT_DEFAULTS: Dict[str, Any] = dict(prior_init='offsets')
IMAGE_ATTENTION = ('prefix', 'causal')


def vqa_attention_mask(
        num_image_tokens: int,
        num_questions: int,
        question_len: int,
        image_attention: str = 'prefix',
        device: Optional[torch.device] = None,
) -> Tensor:
    """Boolean (N, N) mask, True = may attend, for M image tokens followed by Q questions of T tokens.

    Image tokens attend to all image tokens (``'prefix'``) or to the earlier ones in the sequence
    (``'causal'``), never to text; a question token attends to every image token and causally to its
    own question's tokens.
    """
    if image_attention not in IMAGE_ATTENTION:
        raise ValueError(f'image_attention must be one of {IMAGE_ATTENTION}, got {image_attention!r}')
    m, t = num_image_tokens, question_len
    n = m + num_questions * t
    mask = torch.zeros(n, n, dtype=torch.bool, device=device)
    image = torch.ones(m, m, dtype=torch.bool, device=device)
    mask[:m, :m] = image if image_attention == 'prefix' else image.tril()
    mask[m:, :m] = True
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    for q in range(num_questions):
        s = m + q * t
        mask[s:s + t, s:s + t] = causal
    return mask


def vqa_text_coords(
        num_questions: int,
        question_len: int,
        grid_size: Tuple[int, int],
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
) -> Tensor:
    """(Q T, 2) coordinates of the question tokens: token t of every question at (c + t, c + t).

    c = max(rows, cols) of the patch grid: the first diagonal point outside the image, so text-text
    offsets are (dt, dt) (a 1D prior) and text-image offsets are distinct for every patch.
    """
    c = float(max(grid_size[0], grid_size[1]))
    t = torch.arange(question_len, device=device, dtype=dtype) + c
    return torch.stack([t, t], dim=-1).repeat(num_questions, 1)


def vqa_sequence_positions(num_image_tokens: int, num_questions: int, question_len: int,
                           device: Optional[torch.device] = None) -> Tensor:
    """(N,) 1D sequence positions for ``rope``: image token k -> k, question token t -> M + t."""
    image = torch.arange(num_image_tokens, device=device)
    text = torch.arange(question_len, device=device).repeat(num_questions) + num_image_tokens
    return torch.cat([image, text])


class VQABlock(nn.Module):
    """Pre-norm transformer block; the attention is called as ``attn(x, pos, attn_mask)``.

    ``pos`` is what the attention layer takes as position: coordinates for GOAT / PoPE, the
    concatenated sin / cos table for timm's ``AttentionRope``, None for ``nope``.
    """

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: float = 4., drop_path: float = 0.,
                 norm_layer: Type[nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=nn.GELU)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: Tensor, pos: Optional[Tensor], attn_mask: Tensor) -> Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x), pos, attn_mask))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class SpatialVQATransformer(nn.Module):
    """Transformer over image patches (in any scan order) and question tokens; predicts one answer per question.

    Args:
        pos_method: 'nope', 'rope', 'goat' or 'pope' (module docstring).
        vocab_size: Text vocabulary (question and answer tokens); the head predicts over all of it.
        patch_dim: Features per image patch (e.g. 3 * 8 * 8 for 8x8 RGB patches).
        grid_size: (rows, cols) of the scene's patch grid; sets M = rows * cols and the text coordinates.
        question_len: T tokens per question (the answer is predicted at the last one).
        embed_dim: Width C.
        depth: Blocks.
        num_heads: Heads (the same for every method).
        mlp_ratio: MLP hidden width / C.
        image_attention: 'prefix' (bidirectional image tokens) or 'causal'.
        goat_modes: GOAT Fourier modes R per axis (d_p = 4 R + 2 of the head dim go to structure).
        goat_kwargs: Further ``GoatAttention`` / ``GoatPrior`` options (freq_base, prior_init, ...), over
            ``VQA_GOAT_DEFAULTS`` (the 'offsets' start: each head's 2D prior starts as a bump at its own key
            offset; with a zero start the diagonal text coordinates and the scenes' x <-> y symmetry leave the
            prior's x and y halves equal, and such a prior cannot tell top-right from bottom-left: README ablation).
        pope_kwargs: Further ``PopeAttention`` options (freq_base, learn_bias).
        rope_temperature: RoPE frequency base theta (frequencies theta^(-2k / d_h)).
        drop_path_rate: Stochastic depth, linearly increasing over blocks.
        qkv_bias: Bias in the q / k / v projection (all methods alike).
    """

    def __init__(
            self,
            pos_method: str,
            vocab_size: int,
            patch_dim: int,
            grid_size: Tuple[int, int] = (8, 8),
            question_len: int = 3,
            embed_dim: int = 128,
            depth: int = 4,
            num_heads: int = 4,
            mlp_ratio: float = 4.,
            image_attention: str = 'prefix',
            goat_modes: int = 2,
            goat_kwargs: Optional[Dict[str, Any]] = None,
            pope_kwargs: Optional[Dict[str, Any]] = None,
            rope_temperature: float = 10000.,
            drop_path_rate: float = 0.,
            qkv_bias: bool = True,
    ) -> None:
        super().__init__()
        if pos_method not in POS_METHODS:
            raise ValueError(f'pos_method must be one of {POS_METHODS}, got {pos_method!r}')
        if image_attention not in IMAGE_ATTENTION:
            raise ValueError(f'image_attention must be one of {IMAGE_ATTENTION}, got {image_attention!r}')
        if embed_dim % num_heads:
            raise ValueError(f'embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})')
        if question_len < 1 or vocab_size < 2 or patch_dim < 1:
            raise ValueError(f'need question_len >= 1, vocab_size >= 2, patch_dim >= 1; got {question_len}, '
                             f'{vocab_size}, {patch_dim}')
        self.pos_method = pos_method
        self.grid_size = (int(grid_size[0]), int(grid_size[1]))
        self.num_image_tokens = self.grid_size[0] * self.grid_size[1]
        self.question_len = question_len
        self.image_attention = image_attention
        self.vocab_size = vocab_size
        self.patch_dim = patch_dim
        head_dim = embed_dim // num_heads

        self.patch_embed = nn.Linear(patch_dim, embed_dim)
        self.text_embed = nn.Embedding(vocab_size, embed_dim)
        self.rope = (RotaryEmbeddingCat(2 * head_dim, in_pixels=False, temperature=rope_temperature)
                     if pos_method == 'rope' else None)
        rates = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.ModuleList([
            VQABlock(embed_dim, self._make_attention(embed_dim, num_heads, qkv_bias, goat_modes,
                                                     goat_kwargs or {}, pope_kwargs or {}),
                     mlp_ratio=mlp_ratio, drop_path=rates[i])
            for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, vocab_size)
        self.init_weights()

    def _make_attention(self, dim: int, num_heads: int, qkv_bias: bool, goat_modes: int,
                        goat_kwargs: Dict[str, Any], pope_kwargs: Dict[str, Any]) -> nn.Module:
        if self.pos_method == 'goat':
            return GoatAttention(dim, num_heads=num_heads, num_spatial_dims=2, num_modes=goat_modes,
                                 qkv_bias=qkv_bias, **dict(VQA_GOAT_DEFAULTS, **goat_kwargs))
        if self.pos_method == 'pope':
            return PopeAttention(dim, num_heads=num_heads, num_spatial_dims=2, qkv_bias=qkv_bias, **pope_kwargs)
        return AttentionRope(dim, num_heads=num_heads, qkv_bias=qkv_bias, num_prefix_tokens=0)

    def init_weights(self) -> None:
        """Truncated-normal (std 0.02) Linear / Embedding weights, zero biases; GOAT priors keep their own init."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                trunc_normal_(module.weight, std=.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                trunc_normal_(module.weight, std=.02)
        for block in self.blocks:
            prior = getattr(block.attn, 'prior', None)
            if prior is not None:
                prior.reset_parameters()

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Positional-prior parameters (GOAT alpha, beta, key defaults; PoPE delta) get no weight decay."""
        return {name for name, _ in self.named_parameters() if '.attn.prior.' in name or '.attn.phases.' in name}

    def token_positions(self, coords: Tensor, num_questions: int, dtype: torch.dtype) -> Optional[Tensor]:
        """What every block's attention receives as position for the full sequence (see ``VQABlock``)."""
        device = coords.device
        if self.pos_method == 'nope':
            return None
        if self.rope is not None:
            ids = vqa_sequence_positions(self.num_image_tokens, num_questions, self.question_len, device)
            table = self.rope.get_embed([self.num_image_tokens + self.question_len], dtype=torch.float32)
            return table.to(device)[ids].to(dtype)
        text = vqa_text_coords(num_questions, self.question_len, self.grid_size, device, coords.dtype)
        if coords.dim() == 3:
            text = text.unsqueeze(0).expand(coords.shape[0], -1, -1)
        return torch.cat([coords, text], dim=-2)

    def forward(self, patches: Tensor, coords: Tensor, text: Tensor) -> Tensor:
        """Answer logits for every question.

        Args:
            patches: (B, M, patch_dim) patch features in the sample's scan order.
            coords: (B, M, 2) canonical (x, y) patch coordinates in the same order (or (M, 2) shared by
                the batch); used by ``goat`` / ``pope`` only, validated for every method.
            text: (B, Q, T) question token ids.

        Returns:
            (B, Q, vocab_size) logits of the answer to each question.
        """
        B, M, P = patches.shape
        if M != self.num_image_tokens or P != self.patch_dim:
            raise ValueError(f'patches have shape {tuple(patches.shape)}, expected (B, {self.num_image_tokens}, '
                             f'{self.patch_dim}) for a {self.grid_size[0]}x{self.grid_size[1]} patch grid')
        if coords.shape[-2:] != (M, 2) or coords.dim() not in (2, 3) or (coords.dim() == 3 and coords.shape[0] != B):
            raise ValueError(f'coords have shape {tuple(coords.shape)}, expected ({B}, {M}, 2) or ({M}, 2)')
        if not coords.is_floating_point():
            raise ValueError(f'coords must be floating point, got dtype {coords.dtype}')
        if text.dim() != 3 or text.shape[0] != B or text.shape[2] != self.question_len:
            raise ValueError(f'text has shape {tuple(text.shape)}, expected ({B}, Q, {self.question_len})')
        num_questions = text.shape[1]
        x = torch.cat([self.patch_embed(patches), self.text_embed(text.flatten(1))], dim=1)
        pos = self.token_positions(coords, num_questions, x.dtype)
        mask = vqa_attention_mask(M, num_questions, self.question_len, self.image_attention, x.device)
        for block in self.blocks:
            x = block(x, pos, mask)
        answer_index = M + torch.arange(num_questions, device=x.device) * self.question_len + self.question_len - 1
        return self.head(self.norm(x[:, answer_index]))


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
