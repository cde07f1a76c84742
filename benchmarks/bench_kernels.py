"""GPU benchmark of the Triton attention kernels against ``F.scaled_dot_product_attention``.

Forward and forward+backward time of every kernel mode against its SDPA baseline on the same shapes
(same q / k / v, same dtype, same causality):

    * ViT-S shapes, bidirect.: B=64, H=6,  d=64, N = 197, 577, 1025 (224 / 384 / 512 px + class token)
    * LM shapes, causal:      B=4,  H=16, d=64, N = 1K, 2K, 4K, 8K, 16K

Rows (``ratio`` = baseline time / kernel time, so > 1 means the kernel is faster):

    ========  ===================================================  ================================
    row       kernel                                              baseline, goal
    ========  ===================================================  ================================
    goat      flash_prior_attention(mode='goat'): content logits  SDPA flash backend, plain q/k/v of
              + relative Fourier prior, fused                     width d, no prior; >= 0.9x
    pope      flash_prior_attention(mode='pope'): magnitudes and  SDPA on the materialized width-2d
              phases, fused                                       q / k (v zero-padded to 2d, as
                                                                  PopeAttention does); >= 1.3x
    plain     flash_prior_attention(mode='plain')                 SDPA (default dispatch); no goal
    lavo      vision_priors.layers.LavoAttention (causal, r = w  the same projections around causal
              = 64), the whole layer (on CUDA it runs             SDPA; >= 1.0x from N = 4K on
              vision_priors.kernels.lavo once the layer dispatches to it)
    lavo_     vision_priors.kernels.lavo: lavo_local (sliding + block) and      causal SDPA on the same q, k, v;
    kernel    lavo_global, combined as the layer does             >= 1.0x from N = 4K on
    goat_     GoatAttention / PopeAttention / LavoAttention, the  the same layer (same weights) with
    layer,    whole layer, kernel_backend='triton' (ViT rows: 2D  kernel_backend='torch': its SDPA /
    pope_     grid + class token; LM rows: 1D causal)             torch path; no goal: > 1 says
    layer,                                                        'auto' should pick the kernel
    lavo_                                                         (kernel_dispatch.AUTO_PICKS_KERNEL)
    layer
    ========  ===================================================  ================================

FLOP convention: a row's FLOPs are those of softmax attention at head width d = 64 on that shape,
``4 * B * H * N^2 * d`` for the forward (halved when causal) and 2.5x that for forward+backward,
whatever the kernel really executes (PoPE's 2d-wide logits, LAVO's linear-time read). TFLOP/s are
therefore "effective" and the kernel / baseline TFLOP/s ratio equals the time ratio.

Timing: CUDA events around each call, ``--warmup`` untimed calls (Triton's JIT compile lands there),
then the median of ``--repeats`` timed calls; forward+backward is one forward plus
``torch.autograd.grad`` of the output w.r.t. q, k, v (or x and the weights for the LAVO layer). The
"kernel host ms" column is the CPU time the kernel side's call took to issue its work (``Timer.last_host_ms``):
close to "kernel ms", the call is bound by the host (Python, launches), not by the GPU.
Every (row, shape) runs in its own try/except: a failure prints an ERROR row and the run goes on;
a kernel module that is absent gives SKIP rows that say why. After ``--budget-s`` seconds the
remaining rows are SKIPped, so the whole run stays inside the GPU check's time limit.

    python benchmarks/bench_kernels.py --json bench_kernels.json          # on a CUDA machine
    python benchmarks/bench_kernels.py --dry-run                          # CPU smoke run: tiny
        shapes, TRITON_INTERPRET=1, time.perf_counter; checks the plumbing, not the speed
"""
import os
import sys

if '--dry-run' in sys.argv:  # the Triton interpreter must be chosen before triton is imported
    os.environ.setdefault('TRITON_INTERPRET', '1')

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lavo import SdpaAttention  # noqa: E402  (causal SDPA with LavoAttention's projections)

SECTIONS = ('goat', 'pope', 'plain', 'lavo', 'lavo_kernel', 'goat_layer', 'pope_layer', 'lavo_layer')
PASSES = ('fwd', 'fwd+bwd')
CAUSAL_ONLY = ('lavo', 'lavo_kernel')  # rows against causal SDPA
GOALS: Dict[str, Tuple[float, int]] = {  # row -> (minimum speed-up, from this N on)
    'goat': (0.9, 0), 'pope': (1.3, 0), 'lavo': (1.0, 4096), 'lavo_kernel': (1.0, 4096),
}
BASELINES = {
    'goat': 'SDPA flash, no prior', 'pope': 'SDPA, 2d-wide q/k', 'plain': 'SDPA', 'lavo': 'SDPA causal layer',
    'lavo_kernel': 'SDPA causal', 'goat_layer': 'the layer on SDPA', 'pope_layer': 'the layer on SDPA',
    'lavo_layer': 'the layer on torch ops',
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention problem: batch, heads, tokens, head width, causality."""

    family: str
    B: int
    H: int
    N: int
    d: int
    causal: bool

    @property
    def label(self) -> str:
        n = f'{self.N // 1024}K' if self.N % 1024 == 0 else str(self.N)
        return f'{self.family} B{self.B} H{self.H} N{n} d{self.d}{" causal" if self.causal else ""}'

    def flops(self, pass_: str) -> float:
        """FLOPs by the module docstring's convention."""
        fwd = 4.0 * self.B * self.H * self.N * self.N * self.d * (0.5 if self.causal else 1.0)
        return fwd * (2.5 if pass_ == 'fwd+bwd' else 1.0)


def gpu_shapes() -> List[Shape]:
    """The shapes of the issue, cheapest first: ViT-S (bidirectional), then LM (causal)."""
    vit = [Shape('vit', 64, 6, n, 64, False) for n in (197, 577, 1025)]
    lm = [Shape('lm', 4, 16, n, 64, True) for n in (1024, 2048, 4096, 8192, 16384)]
    return vit + lm


def dry_shapes() -> List[Shape]:
    """Tiny shapes for the CPU interpreter: a 4 x 4 grid with a class token, and a causal sequence."""
    return [Shape('vit', 1, 2, 17, 16, False), Shape('lm', 1, 2, 32, 16, True)]


@dataclasses.dataclass
class Row:
    """One line of the result table."""

    section: str
    shape: str
    pass_: str
    N: int
    kernel_ms: Optional[float] = None
    baseline_ms: Optional[float] = None
    flops: float = 0.0
    status: str = 'ok'  # ok | SKIP | ERROR
    note: str = ''
    dry_run: bool = False  # CPU smoke run: goals are not evaluated
    kernel_host_ms: Optional[float] = None  # CPU time to issue the kernel side's call (Timer.last_host_ms)

    @property
    def ratio(self) -> Optional[float]:
        if self.kernel_ms and self.baseline_ms:
            return self.baseline_ms / self.kernel_ms
        return None

    @property
    def goal(self) -> Optional[float]:
        goal = GOALS.get(self.section)
        if goal is None or self.N < goal[1]:
            return None
        return goal[0]

    @property
    def result(self) -> str:
        if self.status != 'ok':
            return self.status
        if self.dry_run:
            return 'dry-run'
        if self.goal is None:
            return '-'
        return 'PASS' if self.ratio is not None and self.ratio >= self.goal else 'MISS'

    def tflops(self, ms: Optional[float]) -> Optional[float]:
        return self.flops / (ms * 1e-3) / 1e12 if ms else None

    def as_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(pass_=self.pass_, ratio=self.ratio, goal=self.goal, result=self.result,
                 kernel_tflops=self.tflops(self.kernel_ms), baseline_tflops=self.tflops(self.baseline_ms),
                 baseline=BASELINES.get(self.section, ''))
        return d


# ------------------------------------------------------------------------------------------------
# timing

class Timer:
    """Median milliseconds of a call: CUDA events on a GPU, ``time.perf_counter`` otherwise.

    ``last_host_ms`` is the median CPU time the last timed call took to issue its work (``perf_counter`` from
    before the start event to after the end event, with no synchronisation in between): where it is close to
    the event time, the call is bound by the host (Python, argument checks, launches), not by the GPU.
    """

    def __init__(self, cuda: bool, warmup: int, repeats: int) -> None:
        self.cuda, self.warmup, self.repeats = cuda, warmup, repeats
        self.last_host_ms: Optional[float] = None

    def __call__(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        times, host = [], []
        if self.cuda:
            torch.cuda.synchronize()
            for _ in range(self.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                fn()
                end.record()
                host.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            host = times
        self.last_host_ms = statistics.median(host)
        return statistics.median(times)


def fwd_bwd(forward: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor]) -> Callable[[], None]:
    """A callable running ``forward`` then the gradient of its output w.r.t. ``inputs``."""
    grad_out: List[Optional[torch.Tensor]] = [None]

    def run() -> None:
        out = forward()
        if grad_out[0] is None:
            grad_out[0] = torch.randn_like(out)
        torch.autograd.grad(out, list(inputs), grad_out[0])

    return run


def no_grad(forward: Callable[[], Any]) -> Callable[[], None]:
    """``forward`` under ``torch.no_grad``."""
    def run() -> None:
        with torch.no_grad():
            forward()
    return run


# ------------------------------------------------------------------------------------------------
# the compared calls: each section builds (kernel forward, baseline forward, grad inputs of each)

class Skip(Exception):
    """A row that cannot run here (e.g. its kernel module is absent); the message says why."""


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name in (name, name.rsplit('.', 1)[0]) or (exc.name or '').startswith('vision_priors.kernels'):
            raise Skip(f'{name} is absent ({exc})') from exc
        raise


def _qkv(shape: Shape, device: torch.device, dtype: torch.dtype, width_qk: Optional[int] = None,
         width_v: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device='cpu').manual_seed(shape.N)
    def make(width: int) -> torch.Tensor:
        t = torch.randn(shape.B, shape.H, shape.N, width, generator=g, dtype=torch.float32)
        return t.to(device=device, dtype=dtype).requires_grad_(True)
    return make(width_qk or shape.d), make(width_qk or shape.d), make(width_v or shape.d)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float] = None,
          flash_only: bool = False) -> torch.Tensor:
    if flash_only and q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


Pair = Tuple[Callable[[], torch.Tensor], List[torch.Tensor], Callable[[], torch.Tensor], List[torch.Tensor]]


def _positions(shape: Shape, device: torch.device) -> Tuple[torch.Tensor, int]:
    """Token coordinates and prefix count: LM rows are 1D sequences; a ViT row of N = 1 + g^2 tokens is
    a class token and a g x g patch grid (else 1D)."""
    from vision_priors.layers import grid_coords, sequence_coords
    g = math.isqrt(max(shape.N - 1, 0))
    if shape.family == 'vit' and g * g == shape.N - 1:
        return grid_coords((g, g), device=device), 1
    return sequence_coords(shape.N, device=device), 0


def build_flash_prior(mode: str, shape: Shape, device: torch.device, dtype: torch.dtype) -> Pair:
    """Kernel ``flash_prior_attention(mode=...)`` and its SDPA baseline on one shape.

    GOAT: R = 4 Fourier modes per axis (2 if d < 32), so q / k carry d_c = d - (2 R D + 2) content
    channels and v all d; alpha, beta and the key default get gradients, as in ``GoatAttention``.
    PoPE: per-axis ladders 10000^(-c / (d / D)), phase bias with gradient. The PoPE baseline is SDPA
    on q / k features of width 2d and v zero-padded to 2d, materialized beforehand (their cost is
    not timed), scale 1 as in ``PopeAttention``.
    """
    fp = _import('vision_priors.kernels.flash_prior')
    if not hasattr(fp, 'flash_prior_attention'):
        raise Skip('vision_priors.kernels.flash_prior has no flash_prior_attention')
    op = fp.flash_prior_attention
    f32 = dict(device=device, dtype=torch.float32)
    g = torch.Generator(device='cpu').manual_seed(1)

    def param(*size: int, std: float = 0.1) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * std).to(**f32).requires_grad_(True)

    if mode == 'plain':
        q, k, v = _qkv(shape, device, dtype)
        return (lambda: op(q, k, v, mode='plain', causal=shape.causal), [q, k, v],
                lambda: _sdpa(q, k, v, shape.causal), [q, k, v])

    coords, prefix = _positions(shape, device)
    D = coords.shape[-1]
    if mode == 'goat':
        R = 4 if shape.d >= 32 else 2
        d_c = shape.d - (2 * R * D + 2)
        q, k, _ = _qkv(shape, device, dtype, width_qk=d_c)
        _, _, v = _qkv(shape, device, dtype)
        freqs = (100.0 if D == 2 else 10000.0) ** (-torch.arange(R, **f32) / R)
        freqs = freqs.expand(D, R).contiguous()
        alpha, beta, u = param(shape.H, D, R), param(shape.H, D, R), param(shape.H, shape.N)
        q0, k0, v0 = _qkv(shape, device, dtype)  # the baseline: plain width-d heads, no prior

        def kernel() -> torch.Tensor:
            return op(q, k, v, mode='goat', causal=shape.causal, coords=coords, freqs=freqs,
                      num_prefix_tokens=prefix, alpha=alpha, beta=beta, key_default=u)
        return (kernel, [q, k, v, alpha, beta, u],
                lambda: _sdpa(q0, k0, v0, shape.causal, flash_only=True), [q0, k0, v0])

    if mode == 'pope':
        per_axis = shape.d // D
        freqs = (10000.0 ** (-torch.arange(per_axis, **f32) / per_axis)).expand(D, per_axis).contiguous()
        delta = param(shape.H, shape.d, std=1.0)
        q, k, v = _qkv(shape, device, dtype)
        with torch.no_grad():  # the layer's materialized features (PopeAttention's SDPA path)
            phase = (coords.unsqueeze(-1) * freqs).flatten(-2)  # (M, d)
            phase = torch.cat([phase.new_zeros(prefix, shape.d), phase])  # prefix tokens: phase 0
            k_phase = (phase + delta.detach()[:, None, :])  # (H, N, d)
            k_phase[:, :prefix] = 0
            mq, mk = F.softplus(q.float()), F.softplus(k.float())
            qf = torch.cat([mq * phase.cos(), mq * phase.sin()], -1) * shape.d ** -0.5
            kf = torch.cat([mk * k_phase.cos(), mk * k_phase.sin()], -1)
            vp = F.pad(v, (0, shape.d))
        qf, kf, vp = (t.to(dtype).requires_grad_(True) for t in (qf, kf, vp))

        def kernel() -> torch.Tensor:
            return op(q, k, v, mode='pope', causal=shape.causal, coords=coords, freqs=freqs,
                      num_prefix_tokens=prefix, phase_bias=delta)

        def baseline() -> torch.Tensor:
            return _sdpa(qf, kf, vp, shape.causal, scale=1.0)[..., :shape.d]
        return kernel, [q, k, v, delta], baseline, [qf, kf, vp]
    raise ValueError(f'unknown flash_prior mode {mode!r}')


def build_lavo_kernel(shape: Shape, device: torch.device, dtype: torch.dtype) -> Pair:
    """The LAVO attention core on Triton (``vision_priors.kernels.lavo``: sliding local window + block dissection +
    CODE read, combined as the layer does) against causal SDPA on the same q, k, v."""
    if not shape.causal:
        raise Skip('LAVO rows use the causal LM shapes')
    lk = _import('vision_priors.kernels.lavo')
    for name in ('lavo_local', 'lavo_global'):
        if not hasattr(lk, name):
            raise Skip(f'vision_priors.kernels.lavo has no {name}')
    q, k, v = _qkv(shape, device, dtype)
    w, r = min(64, shape.N), min(64, shape.d)
    bias = torch.zeros(2 * w - 1, device=device, dtype=torch.float32).normal_(0, 0.1).requires_grad_(True)
    basis = torch.linalg.qr(torch.randn(shape.H, shape.d, r, dtype=torch.float64))[0].transpose(-1, -2)
    basis = basis.to(device=device, dtype=torch.float32).contiguous()  # (H, r, d), orthonormal rows
    scale = shape.d ** -0.5

    def kernel() -> torch.Tensor:
        kw = dict(scale=scale, window=w, causal=True, backend='triton')
        f_local = lk.lavo_local(q, k, v, bias, mode='sliding', **kw)
        z = lk.lavo_local(q, k, v, bias, mode='block', **kw)
        return 0.5 * (f_local + lk.lavo_global(q, z, basis, scale, causal=True, backend='triton'))
    return kernel, [q, k, v, bias], lambda: _sdpa(q, k, v, True), [q, k, v]


def build_lavo(shape: Shape, device: torch.device, dtype: torch.dtype) -> Pair:
    """The causal LAVO layer and the same projections around causal SDPA."""
    if not shape.causal:
        raise Skip('LAVO rows use the causal LM shapes')
    from vision_priors.layers import LavoAttention
    dim = shape.H * shape.d
    torch.manual_seed(0)
    lavo = LavoAttention(dim, shape.H, num_slots=min(64, shape.d), window=min(64, shape.N), causal=True)
    lavo = lavo.to(device=device, dtype=dtype)
    sdpa = SdpaAttention(dim, shape.H).to(device=device, dtype=dtype)
    x = torch.randn(shape.B, shape.N, dim, device=device, dtype=dtype, requires_grad=True)
    return (lambda: lavo(x), [x, *lavo.parameters()], lambda: sdpa(x), [x, *sdpa.parameters()])


def build_prior_layer(family: str, shape: Shape, device: torch.device, dtype: torch.dtype) -> Pair:
    """``GoatAttention`` / ``PopeAttention`` / ``LavoAttention`` on its Triton kernels against the same layer
    on its SDPA / torch path: the measurement behind ``kernel_dispatch.AUTO_PICKS_KERNEL``. ViT rows: a g x g
    grid plus a class token (bidirectional); LM rows: a causal 1D sequence. Gradients: x and every weight."""
    from vision_priors.layers import GoatAttention, LavoAttention, PopeAttention
    g = math.isqrt(max(shape.N - 1, 0))
    grid = shape.family == 'vit' and g * g == shape.N - 1
    if family == 'lavo':
        kw: Dict[str, Any] = dict(num_slots=min(64, shape.d), window=min(64, shape.N), causal=shape.causal,
                                  num_spatial_dims=2 if grid else 1)
        call: Dict[str, Any] = dict(grid_size=[g, g], num_prefix_tokens=1) if grid else {}
    else:
        kw = dict(num_spatial_dims=2, num_prefix_tokens=1, grid_size=(g, g)) if grid else dict(num_spatial_dims=1)
        if family == 'goat':
            kw['num_modes'] = 4 if shape.d >= 32 else 2  # as the goat rows
        call = dict(is_causal=shape.causal)
    cls = {'goat': GoatAttention, 'pope': PopeAttention, 'lavo': LavoAttention}[family]
    torch.manual_seed(0)
    layers = [cls(shape.H * shape.d, shape.H, kernel_backend=backend, **kw) for backend in ('triton', 'torch')]
    layers[1].load_state_dict(layers[0].state_dict())
    kernel_layer, torch_layer = (m.to(device=device, dtype=dtype) for m in layers)
    x = torch.randn(shape.B, shape.N, shape.H * shape.d, device=device, dtype=dtype, requires_grad=True)

    def trained(m: torch.nn.Module) -> List[torch.Tensor]:
        return [x, *(p for p in m.parameters() if p.requires_grad)]
    return (lambda: kernel_layer(x, **call), trained(kernel_layer),
            lambda: torch_layer(x, **call), trained(torch_layer))


def build(section: str, shape: Shape, device: torch.device, dtype: torch.dtype) -> Pair:
    """The (kernel, baseline) pair of a row."""
    if section.endswith('_layer'):
        return build_prior_layer(section[:-len('_layer')], shape, device, dtype)
    if section == 'lavo':
        return build_lavo(shape, device, dtype)
    if section == 'lavo_kernel':
        return build_lavo_kernel(shape, device, dtype)
    return build_flash_prior(section, shape, device, dtype)


# ------------------------------------------------------------------------------------------------
# the run

def header(device: torch.device) -> str:
    """torch / triton / CUDA / GPU versions, one line each."""
    lines = [f'python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}']
    try:
        import triton
        lines.append(f'triton {triton.__version__}'
                     + (' (TRITON_INTERPRET=1: interpreter)' if os.environ.get('TRITON_INTERPRET') == '1' else ''))
    except ImportError:
        lines.append('triton: not importable')
    if device.type == 'cuda':
        props = torch.cuda.get_device_properties(device)
        lines.append(f'GPU {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, '
                     f'{props.multi_processor_count} SMs; flash SDPA '
                     f'{"enabled" if torch.backends.cuda.flash_sdp_enabled() else "disabled"}')
    else:
        lines.append(f'device: CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads')
    return '\n'.join(lines)


def _rows(section: str, shape: Shape, status: str, note: str,
          times: Dict[str, Tuple[float, float, Optional[float]]], dry_run: bool) -> List[Row]:
    """The fwd and fwd+bwd rows of one (section, shape): measured passes are 'ok', the others ``status``;
    ``times[pass]`` is (kernel ms, baseline ms, kernel host ms)."""
    rows = []
    for p in PASSES:
        km, bm, kh = times.get(p, (None, None, None))
        rows.append(Row(section, shape.label, p, shape.N, km, bm, shape.flops(p),
                        'ok' if p in times else status, note, dry_run, kh))
    return rows


def run(sections: Sequence[str], shapes: Sequence[Shape], device: torch.device, dtype: torch.dtype,
        timer: Callable[[Callable[[], Any]], float], budget_s: float, log: Callable[[str], None] = print,
        dry_run: bool = False) -> List[Row]:
    """Every (section, shape, pass) row; one row's failure gives ERROR rows, never an exception.

    Args:
        sections: row types (:data:`SECTIONS`); the rows against causal SDPA (``CAUSAL_ONLY``) only use the
            causal shapes.
        shapes: problems to time.
        device, dtype: where and in what precision.
        timer: milliseconds of a call (:class:`Timer`).
        budget_s: no (section, shape) starts after this many seconds; its rows are SKIPped. Shapes
            run in order, every row type per shape, so a cut-off leaves out the largest shapes.
        log: progress and tracebacks.
        dry_run: mark the rows as a smoke run (goals not evaluated).
    """
    rows: List[Row] = []
    deadline = time.monotonic() + budget_s
    stop = ''  # once set (budget used up, interrupted), the remaining rows are SKIPped with this note
    # shape-major order: if the budget runs out, every row type has its smaller shapes measured
    for shape in shapes:
        for section in sections:
            if section in CAUSAL_ONLY and not shape.causal:
                continue
            if time.monotonic() > deadline and not stop:
                stop = f'time budget of {budget_s:.0f} s used up'
            if stop:
                rows += _rows(section, shape, 'SKIP', stop, {}, dry_run)
                continue
            t0 = time.monotonic()
            times: Dict[str, Tuple[float, float, Optional[float]]] = {}
            try:
                kern, kern_in, base, base_in = build(section, shape, device, dtype)
                calls = {'fwd': (no_grad(kern), no_grad(base)),
                         'fwd+bwd': (fwd_bwd(kern, kern_in), fwd_bwd(base, base_in))}
                for p, (kern_call, base_call) in calls.items():
                    kern_ms = timer(kern_call)
                    kern_host = getattr(timer, 'last_host_ms', None)  # read before the baseline's timing
                    times[p] = (kern_ms, timer(base_call), kern_host)
                rows += _rows(section, shape, 'ok', '', times, dry_run)
            except Skip as exc:
                rows += _rows(section, shape, 'SKIP', str(exc), times, dry_run)
                log(f'SKIP {section} {shape.label}: {exc}')
            except Exception as exc:  # noqa: BLE001 - one row's failure must not stop the run
                first = str(exc).splitlines()[0] if str(exc) else ''
                rows += _rows(section, shape, 'ERROR', f'{type(exc).__name__}: {first}'[:200], times, dry_run)
                log(f'ERROR {section} {shape.label}:\n{traceback.format_exc(limit=-4)}')
            except KeyboardInterrupt:  # e.g. `timeout --signal=INT`: print what was measured
                stop = 'interrupted'
                rows += _rows(section, shape, 'ERROR', 'interrupted', times, dry_run)
            finally:
                kern = base = kern_in = base_in = calls = None  # free this shape's tensors before the next one
                if device.type == 'cuda':
                    torch.cuda.empty_cache()
            log(f'  {section:11s} {shape.label}: {time.monotonic() - t0:.1f} s')
    order = {name: i for i, name in enumerate(sections)}
    return sorted(rows, key=lambda r: order[r.section])  # stable: shapes stay in order within a row type


def _fmt(x: Optional[float], spec: str) -> str:
    return '-' if x is None else format(x, spec)


def table(rows: Sequence[Row]) -> str:
    """One markdown table of every row."""
    cols = ['row', 'shape', 'pass', 'kernel ms', 'kernel host ms', 'baseline ms', 'kernel TFLOP/s',
            'baseline TFLOP/s', 'baseline', 'speed-up', 'goal', 'result', 'note']
    out = ['| ' + ' | '.join(cols) + ' |', '|' + '---|' * len(cols)]
    for r in rows:
        goal = f'>= {r.goal:g}x' if r.goal is not None else '-'
        out.append('| ' + ' | '.join([
            r.section, r.shape, r.pass_, _fmt(r.kernel_ms, '.3f'), _fmt(r.kernel_host_ms, '.3f'),
            _fmt(r.baseline_ms, '.3f'),
            _fmt(r.tflops(r.kernel_ms), '.1f'), _fmt(r.tflops(r.baseline_ms), '.1f'), BASELINES.get(r.section, ''),
            _fmt(r.ratio, '.2f') + ('x' if r.ratio is not None else ''), goal, r.result,
            r.note.replace('|', '/')]) + ' |')
    return '\n'.join(out)


def build_parser() -> argparse.ArgumentParser:
    """The command line (checked by tests/test_readme.py against the README's commands)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--dry-run', action='store_true',
                        help='CPU: tiny shapes, TRITON_INTERPRET=1, time.perf_counter, 1 repeat')
    parser.add_argument('--sections', nargs='+', default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument('--family', nargs='+', default=['lm', 'vit'], choices=['lm', 'vit'])
    parser.add_argument('--max-n', type=int, default=None, help='leave out shapes with more tokens')
    parser.add_argument('--dtype', default='bf16', choices=['bf16', 'fp16', 'fp32'])
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--repeats', type=int, default=10)
    parser.add_argument('--budget-s', type=float, default=360.0, help='SKIP the rows left after this many seconds')
    parser.add_argument('--json', type=Path, default=None, help='also write the rows and the header here')
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        parser.error('no CUDA device: run on a GPU machine, or pass --dry-run for the CPU smoke run')
    device = torch.device('cuda' if cuda else 'cpu')
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}[args.dtype]
    if args.dry_run:
        dtype = torch.float32  # the interpreter runs numpy; keep the smoke run exact and fast
        args.warmup, args.repeats = min(args.warmup, 1), min(args.repeats, 1)  # plumbing, not speed
    shapes = [s for s in (dry_shapes() if args.dry_run else gpu_shapes())
              if s.family in args.family and (args.max_n is None or s.N <= args.max_n)]

    head = header(device)
    print(head)
    print(f'dtype {dtype}, warm-up {args.warmup}, median of {args.repeats}, budget {args.budget_s:.0f} s', flush=True)
    start = time.monotonic()
    rows = run(args.sections, shapes, device, dtype, Timer(cuda, args.warmup, args.repeats), args.budget_s,
               log=lambda s: print(s, file=sys.stderr, flush=True), dry_run=args.dry_run)
    print()
    print(table(rows))
    counts = {k: sum(r.result == k for r in rows) for k in ('PASS', 'MISS', 'ERROR', 'SKIP', 'dry-run')}
    print(f'\n{len(rows)} rows in {time.monotonic() - start:.0f} s: '
          + ', '.join(f'{v} {k}' for k, v in counts.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({'header': head, 'dtype': str(dtype), 'dry_run': args.dry_run,
                                         'rows': [r.as_dict() for r in rows]}, indent=1))
    return 1 if counts['ERROR'] else 0


if __name__ == '__main__':
    sys.exit(main())
