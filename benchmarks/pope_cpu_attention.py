"""PoPE attention on CPU: the compiled inference op and its torch-op twin against the SDPA path and timm.

One ViT-S attention layer (384 wide, 6 heads, class token) on a square patch grid, batch 8, inference
mode, timed with ``vit_throughput``'s helpers: each round times one call of each variant back to back
(order rotating); printed are the median milliseconds and the median of the per-round time ratios.
The SDPA path is what PoPE runs with autograd on (q / k of width 2d, v widened to 2d for CPU SDPA's
fused kernel); the torch-op path is ``pope_cpu_inference_attention`` (``vision_priors/layers/pope.py``,
what CPU inference runs with ``kernel_backend='torch'``); the compiled path is the C++ op
``kernels/pope_cpu.cpp`` (the default for float32 CPU inference).

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
    if not pope_module.use_compiled_cpu_op(torch.float32):
        raise SystemExit('pope_cpu_attention: the compiled op is not in use (VISION_PRIORS_KERNELS=torch, or '
                         'kernels/pope_cpu.cpp could not be built: see the warning above)')
    use_inference_path = pope_module.use_cpu_inference_attention

    print(f'\nPoPE attention, CPU, {torch.get_num_threads()} threads, batch {args.batch_size}, dim 384, 6 heads, '
          f'{args.rounds} rounds, torch {torch.__version__}\n')
    print('| tokens | timm Attention ms | PoPE SDPA path ms | PoPE torch-op path ms | PoPE compiled path ms | '
          'SDPA path / compiled | torch-op path / compiled | timm / compiled |')
    print('|---|---|---|---|---|---|---|---|')
    for grid in args.grids:
        tokens = grid * grid + 1
        x = torch.randn(args.batch_size, tokens, 384)
        pope = PopeAttention(384, 6, num_prefix_tokens=1, grid_size=(grid, grid), qkv_bias=True).eval()
        plain = Attention(384, 6, qkv_bias=True).eval()

        def pope_with(inference_path: bool, backend: str = 'auto') -> Callable[[], object]:
            def run() -> object:
                pope_module.use_cpu_inference_attention = (
                    use_inference_path if inference_path else (lambda *a: False))
                pope.kernel_backend = backend
                try:
                    return pope(x)
                finally:
                    pope_module.use_cpu_inference_attention = use_inference_path
                    pope.kernel_backend = 'auto'
            return run

        variants = {'timm': lambda: plain(x), 'sdpa': pope_with(False), 'torch_ops': pope_with(True, 'torch'),
                    'compiled': pope_with(True)}
        with torch.inference_mode():
            reference = variants['sdpa']()
            for name in ('torch_ops', 'compiled'):
                torch.testing.assert_close(variants[name](), reference, rtol=0, atol=1e-5)
            times, _ = time_rounds(variants, args.rounds, args.warmup)
        med = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        ratios = {name: paired_ratios(times[name], times['compiled'])[0] for name in ('sdpa', 'torch_ops', 'timm')}
        print(f"| {tokens} | {med['timm']:.1f} | {med['sdpa']:.1f} | {med['torch_ops']:.1f} | {med['compiled']:.1f} | "
              f"{ratios['sdpa']:.2f}x | {ratios['torch_ops']:.2f}x | {ratios['timm']:.2f}x |")

if __name__ == '__main__':
    main()
