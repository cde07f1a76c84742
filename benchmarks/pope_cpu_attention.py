"""PoPE attention on CPU: the compiled inference op and its torch-op twin against the SDPA path and timm.

One ViT-S attention layer (384 wide, 6 heads, class token) on a square patch grid, batch 8, inference
mode, timed with ``vit_throughput``'s helpers: each round times one call of each variant back to back
(order rotating); printed are the median milliseconds and the median of the per-round time ratios.
The SDPA path is what PoPE runs with autograd on (q / k of width 2d, v widened to 2d for CPU SDPA's
fused kernel); the torch-op path is ``pope_cpu_inference_attention`` (``vision_priors/layers/pope.py``,
what CPU inference runs with ``kernel_backend='torch'``); the compiled path is the C++ op
``kernels/pope_cpu.cpp`` (the default for float32 CPU inference where it wins:
``COMPILED_OP_FASTER_ON`` in ``pope.py``; it is timed here on any CPU, and the header says which path
dispatch picks). ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` restricts ATen and MKL to AVX2
on an AVX-512 machine (the compiled op's clone follows the hardware).

    ./run.sh bench pope_cpu_attention                 # 14 x 14 and 24 x 24 grids (197 / 577 tokens)
    ./run.sh bench pope_cpu_attention --grids 32      # 1025 tokens
"""
import argparse
import statistics
from typing import Callable, List, Optional

import torch
from timm.layers import Attention

from vision_priors.kernels.pope_cpu import compiled_op_isa
from vision_priors.layers import PopeAttention
import vision_priors.layers.pope as pope_module
from vit_throughput import cpu_description, paired_ratios, time_rounds  # same directory: the shared timing helpers


def build_parser() -> argparse.ArgumentParser:
    """The command line (checked by tests/test_readme.py against the README's commands)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--grids', type=int, nargs='+', default=[14, 24], help='patch grid sides')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--rounds', type=int, default=25)
    parser.add_argument('--warmup', type=int, default=2)
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    torch.manual_seed(0)
    if compiled_op_isa() is None:
        raise SystemExit('pope_cpu_attention: kernels/pope_cpu.cpp could not be built (see the warning above)')
    if pope_module.requested_backend('auto') == 'torch':
        raise SystemExit('pope_cpu_attention: VISION_PRIORS_KERNELS=torch is set; unset it to time the compiled op')
    dispatch = 'compiled op' if pope_module.use_compiled_cpu_op(torch.float32) else 'torch-op twin'
    faster_here = pope_module.compiled_op_is_faster_here
    use_inference_path = pope_module.use_cpu_inference_attention

    print(f'\nPoPE attention, CPU, {torch.get_num_threads()} threads, batch {args.batch_size}, dim 384, 6 heads, '
          f'{args.rounds} rounds, torch {torch.__version__}, {cpu_description()}; compiled op code: '
          f'{compiled_op_isa()}, ATen kernels: {torch.backends.cpu.get_cpu_capability()}; float32 inference '
          f'dispatch here: {dispatch}\n')
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
                pope_module.compiled_op_is_faster_here = lambda: True  # time the op even where dispatch skips it
                pope.kernel_backend = backend
                try:
                    return pope(x)
                finally:
                    pope_module.use_cpu_inference_attention = use_inference_path
                    pope_module.compiled_op_is_faster_here = faster_here
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
