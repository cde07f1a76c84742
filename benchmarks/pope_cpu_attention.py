"""PoPE attention on CPU: the inference path against the SDPA path and timm's plain ``Attention``.

One ViT-S attention layer (384 wide, 6 heads, class token) on a square patch grid, batch 8, inference
mode, timed with ``vit_throughput``'s helpers: each round times one call of each variant back to back
(order rotating); printed are the median milliseconds and the median of the per-round time ratios.
The SDPA path is what PoPE runs with autograd on (q / k of width 2d, v widened to 2d for CPU SDPA's
fused kernel); the inference path is ``pope_cpu_inference_attention`` (``vision_priors/layers/pope.py``).

    ./run.sh bench pope_cpu_attention                 # 14 x 14 and 24 x 24 grids (197 / 577 tokens)
    ./run.sh bench pope_cpu_attention --grids 32      # 1025 tokens
"""
import argparse
import statistics
from typing import Callable

import torch
from timm.layers import Attention

from vision_priors.layers import PopeAttention
import vision_priors.layers.pope as pope_module
from vit_throughput import paired_ratios, time_rounds  # same directory: the shared timing helpers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--grids', type=int, nargs='+', default=[14, 24], help='patch grid sides')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--rounds', type=int, default=25)
    parser.add_argument('--warmup', type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    use_inference_path = pope_module.use_cpu_inference_attention

    print(f'\nPoPE attention, CPU, {torch.get_num_threads()} threads, batch {args.batch_size}, dim 384, 6 heads, '
          f'{args.rounds} rounds, torch {torch.__version__}\n')
    print('| tokens | timm Attention ms | PoPE SDPA path ms | PoPE inference path ms | '
          'SDPA path / inference path | timm / inference path |')
    print('|---|---|---|---|---|---|')
    for grid in args.grids:
        tokens = grid * grid + 1
        x = torch.randn(args.batch_size, tokens, 384)
        pope = PopeAttention(384, 6, num_prefix_tokens=1, grid_size=(grid, grid), qkv_bias=True).eval()
        plain = Attention(384, 6, qkv_bias=True).eval()

        def pope_with(inference_path: bool) -> Callable[[], object]:
            def run() -> object:
                pope_module.use_cpu_inference_attention = (
                    use_inference_path if inference_path else (lambda *a: False))
                try:
                    return pope(x)
                finally:
                    pope_module.use_cpu_inference_attention = use_inference_path
            return run

        with torch.inference_mode():
            torch.testing.assert_close(pope_with(True)(), pope_with(False)(), rtol=0, atol=1e-5)
            times, _ = time_rounds({'timm': lambda: plain(x), 'sdpa': pope_with(False), 'fast': pope_with(True)},
                                   args.rounds, args.warmup)
        med = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        sdpa_ratio = paired_ratios(times['sdpa'], times['fast'])[0]
        timm_ratio = paired_ratios(times['timm'], times['fast'])[0]
        print(f"| {tokens} | {med['timm']:.1f} | {med['sdpa']:.1f} | {med['fast']:.1f} | "
              f"{sdpa_ratio:.2f}x | {timm_ratio:.2f}x |")


if __name__ == '__main__':
    main()
