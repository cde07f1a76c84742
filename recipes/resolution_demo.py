"""Resolution demo (the README's main command, until the extrapolation recipe lands).

Builds every registered GOAT / PoPE ViT and timm's positional baselines at one size, then evaluates
each at several resolutions, square and not, on a built-in input: a scene defined in continuous
coordinates (soft discs, a bar and a ring on a gradient), so every resolution shows the same content
with more patches. No weights are downloaded; models are randomly initialised from ``--seed``.

For each model and resolution it prints the patch grid, the forward time per image, whether the
output is finite, and the cosine similarity of the pooled features to those at the model's native
224 (how much the representation moves when only the sampling density changes). timm's learned
absolute embedding is resampled bicubically by timm (``dynamic_img_size=True``); our models
resample nothing. Results (and the config) are saved as JSON next to the printed table.

    ./run.sh demo                       # tiny models, 160 224 288 384 512 and 224x320
    ./run.sh demo --size small --out outputs/demo
"""
import argparse
import json
import math
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
import timm

import vision_priors  # noqa: F401  (registers our models)

BASELINES = {
    'tiny': ['vit_tiny_patch16_224'],
    'small': ['vit_small_patch16_224', 'vit_small_patch16_rope_224', 'vit_small_patch16_rope_mixed_224'],
    'base': ['vit_base_patch16_224', 'vit_base_patch16_rope_224', 'vit_base_patch16_rope_mixed_224'],
}


def render_scene(height: int, width: int) -> torch.Tensor:
    """A fixed RGB scene sampled at (height, width) pixel centres of the unit square: (3, H, W) in [0, 1]."""
    ys = (torch.arange(height, dtype=torch.float64) + 0.5) / height
    xs = (torch.arange(width, dtype=torch.float64) + 0.5) / width
    y, x = torch.meshgrid(ys, xs, indexing='ij')

    def soft(signed_distance: torch.Tensor, edge: float = 0.01) -> torch.Tensor:
        return torch.sigmoid(-signed_distance / edge)

    disc = soft(torch.hypot(x - 0.3, y - 0.35) - 0.15)
    ring = soft((torch.hypot(x - 0.7, y - 0.65) - 0.16).abs() - 0.03)
    bar = soft(torch.maximum((x - 0.55).abs() - 0.3, (y - 0.15).abs() - 0.04))
    red = 0.2 + 0.6 * disc + 0.2 * x
    green = 0.1 + 0.7 * ring + 0.2 * y
    blue = 0.15 + 0.7 * bar + 0.1 * (1 - x)
    return torch.stack([red, green, blue]).clamp(0, 1).float()


def parse_resolutions(values: Sequence[str]) -> List[Tuple[int, int]]:
    """'384' -> (384, 384); '224x320' -> (224, 320) as (height, width)."""
    sizes = []
    for value in values:
        parts = value.lower().split('x')
        try:
            dims = [int(p) for p in parts]
        except ValueError:
            raise SystemExit(f'--resolutions: {value!r} is not N or HxW with integers')
        if len(dims) not in (1, 2) or min(dims) <= 0:
            raise SystemExit(f'--resolutions: {value!r} is not N or HxW with positive integers')
        sizes.append((dims[0], dims[-1]))
    return sizes


def evaluate(name: str, resolutions: List[Tuple[int, int]], seed: int) -> List[Dict]:
    torch.manual_seed(seed)
    model = timm.create_model(name, dynamic_img_size=True).eval()
    cfg = model.pretrained_cfg
    mean = torch.tensor(cfg['mean']).view(3, 1, 1)
    std = torch.tensor(cfg['std']).view(3, 1, 1)
    patch = model.patch_embed.patch_size[0]
    rows, reference = [], None
    with torch.inference_mode():
        for height, width in [(224, 224)] + [r for r in resolutions if r != (224, 224)]:
            if height % patch or width % patch:
                raise SystemExit(f'resolution {height}x{width} is not divisible by the patch size {patch} of {name}')
            image = ((render_scene(height, width) - mean) / std).unsqueeze(0)
            start = time.perf_counter()
            features = model.forward_head(model.forward_features(image), pre_logits=True)
            seconds = time.perf_counter() - start
            if reference is None:
                reference = features
            cosine = F.cosine_similarity(features, reference).item()
            rows.append(dict(model=name, height=height, width=width, grid=f'{height // patch}x{width // patch}',
                             ms=1000 * seconds, finite=bool(torch.isfinite(features).all()), cos_vs_224=cosine))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--size', choices=sorted(BASELINES), default='tiny', help='model size to build')
    parser.add_argument('--resolutions', nargs='+', default=['160', '224', '288', '384', '512', '224x320'],
                        help='evaluation resolutions, N or HxW')
    parser.add_argument('--seed', type=int, default=0, help='initialisation seed of every model')
    parser.add_argument('--out', type=Path, default=Path('outputs/resolution_demo'), help='folder for results.json')
    args = parser.parse_args()
    resolutions = parse_resolutions(args.resolutions)

    names = BASELINES[args.size] + [f'vit_{args.size}_patch16_{kind}_224' for kind in ('goat', 'pope')]
    results = []
    for name in names:
        results += evaluate(name, resolutions, args.seed)

    print(f'\nResolution demo: {args.size} models, random init (seed {args.seed}), built-in scene\n')
    print('| model | input | grid | ms/img | finite | cos(features, 224) |')
    print('|---|---|---|---|---|---|')
    for row in results:
        print(f"| {row['model']} | {row['height']}x{row['width']} | {row['grid']} | {row['ms']:.1f} | "
              f"{'yes' if row['finite'] else 'NO'} | {row['cos_vs_224']:.4f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / 'results.json'
    path.write_text(json.dumps(dict(config={k: str(v) for k, v in vars(args).items()}, results=results), indent=2))
    print(f'\nsaved {path}')
    if not all(row['finite'] for row in results):
        raise SystemExit('some outputs were not finite')


if __name__ == '__main__':
    main()
