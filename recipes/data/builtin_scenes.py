"""Built-in dataset for resolution extrapolation: spatial-relation scenes rendered at any resolution.

``SpatialScenes`` generates, on the fly, scenes of flat-coloured parts (disc, square or pentagon) on a
background. A scene is a set of float parameters on the unit square (centres, sizes, rotations, colours,
background gradient and waves), so the same scene can be rasterised at any (H, W): a 64 px image shows
the content of the 32 px image with four times the pixels (GOAT paper, Fig. 5 protocol: train at a low
resolution, evaluate at 1x, 1.5x, 2x without fine-tuning).

Two tasks, twelve classes each; the label is a spatial relation between parts, and colours, shape kinds,
rotations, absolute position, spacing and the background are drawn independently of it:

- ``'clock'``: a white disc and a red disc about half its size on black; the class is the clock
  direction (12, 1, ..., 11 o'clock) in which the red disc lies from the white one; position, sizes
  and spacing are random. Colour only tells the two parts apart. Kept this plain on purpose: a tiny
  ViT learns it in a few hundred CPU updates (the README's main command), whereas with the random
  colours, kinds and textured backgrounds of ``'layouts'`` it stayed at chance for 300 updates.
- ``'layouts'``: three parts of random kind and colour on a textured background in one of twelve
  configurations (row, column, tower, nested, ...; see ``SpatialScenes``): needs far more training.

Coordinates: x grows to the right, y grows DOWN (image rows), so "above" means a smaller y. An image of
(H, W) pixels has ``S = min(H, W)`` pixels per unit: the unit square fills the shorter side and is
centred, and the longer side shows more of the (continuous, infinite) background. Shapes keep their
aspect ratio and every part stays in view at any (H, W).

Augmentation: every ``'layouts'`` class is invariant under horizontal flips (all rules are left/right
symmetric), so timm's default ``hflip=0.5`` is safe there; a flip maps k o'clock to (12 - k) o'clock, so
``'clock'`` must not be flipped. Vertical flips or rotations change the label (``triangle_up`` <->
``triangle_down``, ``row`` <-> ``column``), and aggressive random-resized crops can cut parts out; ``zoom``
(``SpatialScenes``, :func:`zoom_scene`) is the random-resized crop made for these scenes: it magnifies the parts
by a random factor, never more than keeps every part whole in view, and so never changes the label.

    python -m vision_priors.recipes.data.builtin_scenes --out grid.png --resolution 32 64 --task clock
"""
import argparse
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils.data import Dataset

from ..cli import parse_checked

__all__ = ['CLASSES', 'CLOCK_CLASSES', 'TASKS', 'Part', 'Background', 'Scene', 'SpatialScenes', 'RenderedScenes',
           'make_scene', 'render_scene', 'scene_seed', 'zoom_scene']

CLASSES = [
    'row', 'column', 'diagonal', 'row_big_middle', 'tower', 'inverted_tower',
    'triangle_up', 'triangle_down', 'l_shape', 'nested', 'touching', 'chain',
]
CLOCK_CLASSES = [f'{hour}_oclock' for hour in (12, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)]
TASKS = {'clock': CLOCK_CLASSES, 'layouts': CLASSES}
CLOCK_SPREAD = 7.5  # degrees: a 'clock' direction is its hour's angle +- this (classes 15 degrees apart)
SPLITS = ('train', 'val')
DEFAULT_NUM_SAMPLES = {'train': 12000, 'val': 2400}
KINDS = ('disc', 'square', 'pentagon')
SIDES = {'square': 4, 'pentagon': 5}
# Circumradius and inradius per unit of size (the radius of the disc of equal area, so equal sizes look
# equally big): a regular n-gon of circumradius R has area (n / 2) R^2 sin(2 pi / n) and inradius R cos(pi / n).
# (No triangles: their circumradius is twice their inradius, too loose a bound for the contact rules.)
CIRCUMRADIUS = {'disc': 1.0, **{k: math.sqrt(2 * math.pi / (n * math.sin(2 * math.pi / n))) for k, n in SIDES.items()}}
INRADIUS = {'disc': 1.0, **{k: CIRCUMRADIUS[k] * math.cos(math.pi / n) for k, n in SIDES.items()}}

GAP = 0.05        # "separated": circumscribed circles more than this far apart (1.6 px at 32 px)
MARGIN = 0.02     # every part's circumscribed circle stays this far inside the unit square
JITTER = 0.006    # alignment jitter of "aligned" centres (0.2 px at 32 px)


@dataclass(frozen=True)
class Part:
    """One flat-coloured shape.

    Attributes:
        kind: 'disc', 'square' or 'pentagon' (regular polygons, edge normals at ``angle + 2 pi k / n``).
        x: Centre x on the unit square (right is +).
        y: Centre y on the unit square (down is +).
        size: Radius of the disc of equal area (what "bigger" means in the class rules).
        angle: Rotation in radians (ignored for discs).
        color: RGB in [0, 1].
    """
    kind: str
    x: float
    y: float
    size: float
    angle: float
    color: Tuple[float, float, float]

    @property
    def radius(self) -> float:
        """Circumradius: the part lies inside the circle of this radius around its centre."""
        return self.size * CIRCUMRADIUS[self.kind]

    @property
    def inradius(self) -> float:
        """Radius of the largest circle around the centre that lies inside the part."""
        return self.size * INRADIUS[self.kind]


@dataclass(frozen=True)
class Background:
    """Linear two-colour gradient plus low-frequency luminance waves, defined on the whole plane.

    Attributes:
        color0: RGB at gradient position t = 0.
        color1: RGB at t = 1; t = clamp(0.5 + (p - 0.5) . (cos a, sin a), 0, 1).
        angle: Gradient direction a in radians.
        waves: (fx, fy, phase, amplitude) tuples; each adds amplitude * sin(2 pi (fx x + fy y) + phase)
            to all channels (frequencies in cycles per unit, at most 3).
    """
    color0: Tuple[float, float, float]
    color1: Tuple[float, float, float]
    angle: float
    waves: Tuple[Tuple[float, float, float, float], ...]


@dataclass(frozen=True)
class Scene:
    """All parameters of one scene; ``render_scene`` rasterises it at any resolution.

    Attributes:
        label: Class index into the task's classes (``TASKS[task]``).
        class_name: ``TASKS[task][label]``.
        parts: The three parts, painted in this order (largest first, so smaller parts lie on top).
        background: The background.
    """
    label: int
    class_name: str
    parts: Tuple[Part, ...]
    background: Background


# ----------------------------------------------------------------------------------------------- sampling

class _Uniforms:
    """Uniform draws from a seeded ``torch.Generator``, fetched in blocks (one RNG call per 128 draws)."""

    def __init__(self, seed: int) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._buffer: List[float] = []

    def __call__(self, low: float = 0.0, high: float = 1.0) -> float:
        if not self._buffer:
            self._buffer = torch.rand(128, generator=self._gen, dtype=torch.float64).tolist()[::-1]
        return low + (high - low) * self._buffer.pop()

    def choice(self, options: Sequence):
        return options[min(int(self() * len(options)), len(options) - 1)]

    def sign(self) -> float:
        return 1.0 if self() < 0.5 else -1.0


def scene_seed(seed: int, split: str, index: int) -> int:
    """63-bit generator seed from a hash of (seed, split, index); train and val use disjoint streams."""
    digest = hashlib.blake2b(f'vision_priors.spatial_scenes|{seed}|{split}|{index}'.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), 'little') & ((1 << 63) - 1)


# A layout part before colouring: [x, y, size, kind].
_Layout = List[list]


def _circ(part: list) -> float:
    return part[2] * CIRCUMRADIUS[part[3]]


def _inr(part: list) -> float:
    return part[2] * INRADIUS[part[3]]


def _distance(a: list, b: list) -> float:
    return math.hypot(a[0] - b[0], a[1] - b[1])


def _separated(a: list, b: list) -> bool:
    return _distance(a, b) > _circ(a) + _circ(b) + GAP


def _extent(layout: _Layout, axis: int) -> Tuple[float, float]:
    return min(p[axis] - _circ(p) for p in layout), max(p[axis] + _circ(p) for p in layout)


def _place(layout: _Layout, u: _Uniforms) -> _Layout:
    """Translate a layout (local coordinates) uniformly at random so every part fits in the unit square."""
    (lo_x, hi_x), (lo_y, hi_y) = _extent(layout, 0), _extent(layout, 1)
    if max(hi_x - lo_x, hi_y - lo_y) > 1 - 2 * MARGIN:
        raise AssertionError(f'layout {layout} does not fit in the unit square')  # the ranges below prevent it
    dx, dy = u(MARGIN - lo_x, 1 - MARGIN - hi_x), u(MARGIN - lo_y, 1 - MARGIN - hi_y)
    return [[x + dx, y + dy, s, k] for x, y, s, k in layout]


def _line(sizes: Sequence[float], kinds: Sequence[str], angle: float, u: _Uniforms) -> _Layout:
    """Parts along a line at ``angle`` (radians, y down) in the given order, consecutive circumscribed
    circles GAP + [0.02, 0.06] apart before the centres are jittered by at most JITTER per coordinate."""
    cos, sin = math.cos(angle), math.sin(angle)
    s, layout, previous = 0.0, [], None
    for size, kind in zip(sizes, kinds):
        part = [0.0, 0.0, size, kind]
        if previous is not None:
            s += _circ(previous) + _circ(part) + GAP + u(0.02, 0.06)
        part[0], part[1] = s * cos + u(-JITTER, JITTER), s * sin + u(-JITTER, JITTER)
        layout.append(part)
        previous = part
    return layout


def _overlapping(b: list, part: list, u: _Uniforms) -> Optional[list]:
    """Move ``part`` next to ``b`` so they overlap: inscribed circles overlap (d <= 0.85 (r_b + r)) and each
    part's inscribed circle pokes out of the other's circumscribed circle (d >= R_other - r_own + 0.015),
    so neither looks nested. None if the two sizes allow no such distance."""
    rin_sum = _inr(b) + _inr(part)
    low = max(0.5 * rin_sum, _circ(b) - _inr(part) + 0.015, _circ(part) - _inr(b) + 0.015)
    high = 0.85 * rin_sum
    if low >= high:
        return None
    d, phi = u(low, high), u(0, 2 * math.pi)
    return [b[0] + d * math.cos(phi), b[1] + d * math.sin(phi), part[2], part[3]]


def _add_separated(layout: _Layout, kind: str, u: _Uniforms, tries: int = 200) -> Optional[_Layout]:
    """Add a part at a uniformly random position, separated from every part of ``layout`` (None if none fits)."""
    part = [0.0, 0.0, u(0.06, 0.09), kind]
    r = _circ(part)
    for _ in range(tries):
        part[0], part[1] = u(MARGIN + r, 1 - MARGIN - r), u(MARGIN + r, 1 - MARGIN - r)
        if all(_separated(part, other) for other in layout):
            return layout + [part]
    return None


def _layout_for(name: str, kinds: Sequence[str], u: _Uniforms) -> _Layout:
    """Geometry (centres, sizes, kinds) of one scene of class ``name`` on the unit square."""
    if name in ('row', 'column', 'diagonal'):
        angle = {'row': 0.0, 'column': math.pi / 2}.get(name)
        if angle is None:
            angle = u.choice((math.pi / 4, 3 * math.pi / 4)) + math.radians(u(-8, 8))
        base = u(0.06, 0.09)
        return _place(_line([base * u(0.97, 1.03) for _ in range(3)], kinds, angle, u), u)
    if name == 'row_big_middle':
        ends = [u(0.055, 0.072)] * 2
        ends = [ends[0] * u(0.97, 1.03), ends[1] * u(0.97, 1.03)]
        return _place(_line([ends[0], max(ends) * u(1.4, 1.6), ends[1]], kinds, 0.0, u), u)
    if name in ('tower', 'inverted_tower'):
        top = u(0.05, 0.062)
        sizes = [top, top * u(1.28, 1.36)]
        sizes.append(sizes[1] * u(1.28, 1.36))            # top, middle, bottom: grows downward
        if name == 'inverted_tower':
            sizes = sizes[::-1]
        return _place(_line(sizes, kinds, math.pi / 2, u), u)  # angle pi/2 (y down): first part on top
    if name in ('triangle_up', 'triangle_down'):
        width, height = u(0.33, 0.5), u(0.3, 0.4)
        up = -1.0 if name == 'triangle_up' else 1.0
        layout = [[0.0, u(-JITTER, JITTER), u(0.06, 0.09), kinds[0]],
                  [width, u(-JITTER, JITTER), u(0.06, 0.09), kinds[1]],
                  [width * (0.5 + u(-0.08, 0.08)), up * height, u(0.06, 0.09), kinds[2]]]
        return _place(layout, u)
    if name == 'l_shape':
        vertical, horizontal = u.sign() * u(0.31, 0.5), u.sign() * u(0.31, 0.5)
        layout = [[0.0, 0.0, u(0.06, 0.09), kinds[0]],                        # corner
                  [u(-JITTER, JITTER), vertical, u(0.06, 0.09), kinds[1]],    # above or below it
                  [horizontal, u(-JITTER, JITTER), u(0.06, 0.09), kinds[2]]]  # left or right of it
        return _place(layout, u)
    while True:  # contact classes: build the touching parts, then add the separated one (retry if none fits)
        if name == 'nested':
            outer = [0.0, 0.0, u(0.14, 0.18), kinds[0]]
            inner = [0.0, 0.0, _inr(outer) * u(0.35, 0.48), kinds[1]]
            d, phi = u(0, _inr(outer) - _circ(inner) - 0.015), u(0, 2 * math.pi)
            inner[0], inner[1] = d * math.cos(phi), d * math.sin(phi)
            layout = [outer, inner]
        elif name == 'touching':
            first = [0.0, 0.0, u(0.065, 0.125), kinds[0]]
            second = _overlapping(first, [0.0, 0.0, u(0.065, 0.125), kinds[1]], u)
            if second is None:
                continue
            layout = [first, second]
        elif name == 'chain':
            middle = [0.0, 0.0, u(0.075, 0.13), kinds[1]]
            first = _overlapping(middle, [0.0, 0.0, u(0.06, 0.11), kinds[0]], u)
            last = _overlapping(middle, [0.0, 0.0, u(0.06, 0.11), kinds[2]], u)
            if first is None or last is None or not _separated(first, last):
                continue
            layout = [first, middle, last]
        else:
            raise KeyError(name)
        if max(hi - lo for lo, hi in (_extent(layout, 0), _extent(layout, 1))) > 0.8:
            continue
        layout = _place(layout, u)
        if len(layout) == 3:
            return layout
        full = _add_separated(layout, kinds[2], u)
        if full is not None:
            return full


def _color_distance(a: Sequence[float], b: Sequence[float]) -> float:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))


def _colors(u: _Uniforms, background: Sequence[Sequence[float]], count: int) -> List[Tuple[float, float, float]]:
    """Random RGB colours, >= 0.4 from both background colours and >= 0.35 from each other (relaxed if stuck)."""
    to_background, to_each_other, colors = 0.4, 0.35, []
    while len(colors) < count:
        for _ in range(100):
            c = (u(), u(), u())
            if all(_color_distance(c, b) >= to_background for b in background) and \
                    all(_color_distance(c, o) >= to_each_other for o in colors):
                colors.append(c)
                break
        else:
            to_background, to_each_other = 0.9 * to_background, 0.9 * to_each_other
    return colors


CLOCK_BIG_COLOR = (1.0, 1.0, 1.0)
CLOCK_SMALL_COLOR = (1.0, 0.0, 0.0)


def _clock_scene(label: int, u: _Uniforms) -> Scene:
    """A white disc and a red disc 1.7-2.2x smaller at ``label`` o'clock from it (0 = 12 o'clock) on black."""
    big = [0.0, 0.0, u(0.13, 0.18), 'disc']
    small = [0.0, 0.0, big[2] / u(1.7, 2.2), 'disc']
    angle = math.radians(30.0 * label + u(-CLOCK_SPREAD, CLOCK_SPREAD))  # clockwise from "up"
    distance = u(big[2] + small[2] + 0.08, 0.55)
    small[0], small[1] = distance * math.sin(angle), -distance * math.cos(angle)  # y grows downward
    (bx, by, bs, bk), (sx, sy, ss, sk) = _place([big, small], u)
    black = (0.0, 0.0, 0.0)
    return Scene(label, CLOCK_CLASSES[label],
                 (Part(bk, bx, by, bs, 0.0, CLOCK_BIG_COLOR), Part(sk, sx, sy, ss, 0.0, CLOCK_SMALL_COLOR)),
                 Background(black, black, 0.0, ()))


def zoom_scene(scene: Scene, zoom: float, u: Union[_Uniforms, int]) -> Tuple[Scene, float]:
    """Magnify a scene's parts by ``zoom`` and translate them uniformly at random inside the unit square.

    The scene version of a random-resized crop that keeps every part whole: the zoom is capped at the largest
    factor at which the parts' circumscribed circles still fit ``MARGIN`` inside the unit square (so a scene
    may be magnified less than asked; ``zoom < 1`` shrinks it). Centres, sizes and every offset between parts
    scale by the factor, so a relation the label names (direction, order, contact, nesting) is unchanged, and the
    absolute distances of the class rules (``SpatialScenes``) scale with it; rotations, colours and the background
    (which carries no label) are kept. Returns (scene, factor used)."""
    if not zoom > 0 or math.isinf(zoom):
        raise ValueError(f'zoom must be a positive finite number, got {zoom!r}')
    if not isinstance(u, _Uniforms):
        u = _Uniforms(int(u))
    layout = [[p.x, p.y, p.size, p.kind] for p in scene.parts]
    width = max(hi - lo for lo, hi in (_extent(layout, 0), _extent(layout, 1)))
    factor = min(zoom, (1 - 2 * MARGIN) / width * (1 - 1e-9))  # (rounding must not overflow the square)
    placed = _place([[x * factor, y * factor, s * factor, k] for x, y, s, k in layout], u)
    parts = tuple(Part(p.kind, x, y, s, p.angle, p.color) for p, (x, y, s, _) in zip(scene.parts, placed))
    return Scene(scene.label, scene.class_name, parts, scene.background), factor


def make_scene(label: int, u: Union[_Uniforms, int], task: str = 'layouts') -> Scene:
    """Sample one scene of class ``label`` of ``task`` from uniforms ``u`` (or from a generator seed)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(repr(t) for t in TASKS)}, got {task!r}")
    if not isinstance(u, _Uniforms):
        u = _Uniforms(int(u))
    if task == 'clock':
        return _clock_scene(label, u)
    name = TASKS[task][label]
    kinds = [u.choice(KINDS) for _ in range(3)]
    layout = _layout_for(name, kinds, u)
    c0 = (u(0.15, 0.85), u(0.15, 0.85), u(0.15, 0.85))
    c1 = tuple(min(1.0, max(0.0, c + u(-0.3, 0.3))) for c in c0)
    waves = []
    for _ in range(3):
        freq, direction = u(1.0, 3.0), u(0, 2 * math.pi)
        waves.append((freq * math.cos(direction), freq * math.sin(direction), u(0, 2 * math.pi), u(0.01, 0.035)))
    background = Background(c0, c1, u(0, 2 * math.pi), tuple(waves))
    colors = _colors(u, (c0, c1), len(layout))
    parts = []
    for (x, y, size, kind), color in zip(layout, colors):
        angle = u(0, 2 * math.pi / SIDES[kind]) if kind in SIDES else 0.0
        parts.append(Part(kind, x, y, size, angle, color))
    parts.sort(key=lambda p: -p.size)  # paint largest first: smaller parts (e.g. nested ones) stay visible
    return Scene(label, name, tuple(parts), background)


# ---------------------------------------------------------------------------------------------- rendering

def _pixel_centres(height: int, width: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """x (1, W) and y (H, 1) of pixel centres in scene units; the unit square fills and centres on min(H, W)."""
    size = min(height, width)
    xs = 0.5 + (torch.arange(width, dtype=dtype) + 0.5 - width / 2) / size
    ys = 0.5 + (torch.arange(height, dtype=dtype) + 0.5 - height / 2) / size
    return xs.view(1, width), ys.view(height, 1), size


def render_scene(scene: Scene, height: int, width: Optional[int] = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rasterise ``scene`` at pixel centres: (3, height, width) in [0, 1].

    Anti-aliasing: each part's coverage is ``clamp(0.5 - d * S, 0, 1)`` with ``d`` its signed distance
    (half-plane distance for polygons) and ``S`` pixels per unit, i.e. a one-pixel linear ramp that
    approximates the part's area fraction in each pixel, so a rendering area-downsampled from a higher
    resolution matches the direct low-resolution rendering.
    """
    width = height if width is None else width
    x, y, size = _pixel_centres(height, width, dtype)
    bg = scene.background
    t = ((x - 0.5) * math.cos(bg.angle) + (y - 0.5) * math.sin(bg.angle) + 0.5).clamp(0, 1)  # (H, W)
    c0 = torch.tensor(bg.color0, dtype=dtype).view(3, 1, 1)
    c1 = torch.tensor(bg.color1, dtype=dtype).view(3, 1, 1)
    noise = sum(a * torch.sin((2 * math.pi * fx) * x + (2 * math.pi * fy) * y + phase) for fx, fy, phase, a in bg.waves)
    image = c0 + (c1 - c0) * t + noise
    for part in scene.parts:
        qx, qy = x - part.x, y - part.y
        if part.kind == 'disc':
            distance = torch.sqrt(qx * qx + qy * qy) - part.radius
        else:
            n = SIDES[part.kind]
            angles = part.angle + 2 * math.pi * torch.arange(n, dtype=dtype) / n
            distance = (qx * angles.cos().view(n, 1, 1) + qy * angles.sin().view(n, 1, 1)).amax(0) - part.inradius
        coverage = (0.5 - distance * size).clamp(0, 1)
        image = image + (torch.tensor(part.color, dtype=dtype).view(3, 1, 1) - image) * coverage
    return image.clamp(0, 1)


# ------------------------------------------------------------------------------------------------ dataset

def _resolution(value: Union[int, Sequence[int]]) -> Tuple[int, int]:
    dims = [value] if isinstance(value, int) else list(value) if isinstance(value, (tuple, list)) else None
    if dims is None or len(dims) not in (1, 2) or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
        raise ValueError(f'resolution must be an int or a (height, width) pair of ints, got {value!r}')
    if min(dims) <= 0:
        raise ValueError(f'resolution must be positive, got {value!r}')
    return dims[0], dims[-1]


def check_zoom_range(zoom: Sequence[float]) -> Tuple[float, float]:
    """``(low, high)`` as floats, 0 < low <= high < inf, or a ValueError naming the value."""
    try:
        low, high = (float(z) for z in zoom)
    except (TypeError, ValueError):
        raise ValueError(f'zoom must be a pair (low, high) of numbers, got {zoom!r}') from None
    if not (0 < low <= high < math.inf):
        raise ValueError(f'zoom must satisfy 0 < low <= high < inf, got {zoom!r}')
    return low, high


class SpatialScenes(Dataset):
    """Scenes of parts whose class is a spatial relation; deterministic per (seed, split, index).

    ``task='clock'``: a white disc of size 0.13-0.18 and a red disc 1.7-2.2x smaller on black, centres
    (s_big + s_small + 0.08) to 0.55 apart, the red disc's direction from the white one k * 30 +- 7.5
    degrees clockwise from up for class k (``CLOCK_CLASSES``: 12, 1, ..., 11 o'clock); translated
    uniformly inside the unit square.

    ``task='layouts'``: every scene has exactly three parts of random kind (disc / square / pentagon), rotation and
    colour (RGB distance >= 0.4 from both background colours, >= 0.35 from each other) on a random gradient with
    smooth waves; the configuration is translated uniformly inside the unit square (y grows downward).

    Terms: a part's size s is the radius of the disc of equal area (so equal sizes look equally big); its
    circumradius R and inradius r follow from its kind (disc R = r = s; square R = 1.25 s, r = 0.89 s;
    pentagon R = 1.15 s, r = 0.93 s). With d the distance between two centres, the parts are
    "separated" when d > R1 + R2 + 0.05 (a visible gap of >= 1.6 px at 32 px); "overlapping" when
    d <= 0.85 (r1 + r2) (they share area) and d >= R1 - r2 + 0.015 and d >= R2 - r1 + 0.015 (each pokes
    out of the other: neither looks nested); "aligned" horizontally (vertically) when their centres'
    y (x) differ by <= 0.012.

    Classes (label = index % 12):
        0 row: all pairs separated; centres aligned on one horizontal line; sizes within 7% of each other.
        1 column: as row, on one vertical line.
        2 diagonal: as row, on one line at 45 +- 8 or 135 +- 8 degrees from horizontal.
        3 row_big_middle: all separated, on one horizontal line; the middle part's size is >= 1.4x each
            end's (ends within 7% of each other).
        4 tower: all separated, on one vertical line; sizes grow downward by >= 1.28x per step.
        5 inverted_tower: as tower, sizes grow upward.
        6 triangle_up: all separated; two parts aligned horizontally (the base, centres 0.33-0.5 apart),
            the third 0.3-0.4 above them with its x within 8% of the base width of the base's midpoint.
        7 triangle_down: as triangle_up, the third part below the base.
        8 l_shape: all separated; a corner part with one part vertically aligned with it (0.31-0.5 above
            or below) and one horizontally aligned with it (0.31-0.5 left or right): four orientations.
        9 nested: a part lies inside a larger one (d + R_inner <= r_outer - 0.015); the third
            part is separated from both.
        10 touching: two parts overlap; the third is separated from both.
        11 chain: parts A-B overlap and B-C overlap while A and C are separated.

    Args:
        split: 'train' or 'val'; the two use disjoint seed streams.
        num_samples: Dataset length (default 12000 for train, 2400 for val).
        resolution: Output size, an int (square) or (height, width). Any resolution renders the same scenes;
            non-square images centre the unit square on the shorter side and show more background.
        seed: Dataset seed.
        transform: Optional callable applied to the PIL RGB image (e.g. ``timm.data.create_transform``);
            without it, items are float tensors (3, H, W) in [0, 1].
        task: 'layouts' (three parts, twelve configurations) or 'clock' (two parts, twelve directions).
        zoom: (low, high): each scene's parts magnified by a factor drawn log-uniformly from this range
            (:func:`zoom_scene`: capped so every part stays whole in view; drawn from its own stream, so the
            scenes themselves are the same with or without it). (1, 1), the default, leaves scenes as sampled.
    """

    def __init__(self, split: str = 'train', num_samples: Optional[int] = None,
                 resolution: Union[int, Tuple[int, int]] = 32, seed: int = 0,
                 transform: Optional[Callable] = None, task: str = 'layouts',
                 zoom: Tuple[float, float] = (1.0, 1.0)) -> None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(repr(t) for t in TASKS)}, got {task!r}")
        self.task = task
        self.classes: List[str] = list(TASKS[task])
        self.num_classes: int = len(self.classes)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(repr(s) for s in SPLITS)}, got {split!r}")
        if num_samples is None:
            num_samples = DEFAULT_NUM_SAMPLES[split]
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
            raise ValueError(f'num_samples must be a positive int, got {num_samples!r}')
        self.split = split
        self.num_samples = num_samples
        self.resolution = _resolution(resolution)
        self.seed = int(seed)
        self.transform = transform
        self.zoom = check_zoom_range(zoom)

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f'SpatialScenes(split={self.split!r}, num_samples={self.num_samples}, '
                f'resolution={self.resolution}, seed={self.seed}, task={self.task!r}'
                + (f', zoom={self.zoom})' if self.zoom != (1.0, 1.0) else ')'))

    def label(self, index: int) -> int:
        """Class of item ``index`` (balanced: index % num_classes)."""
        return self._check_index(index) % self.num_classes

    def scene(self, index: int) -> Scene:
        """Parameters of item ``index``: the same at every resolution."""
        index = self._check_index(index)
        scene = make_scene(index % self.num_classes, scene_seed(self.seed, self.split, index), self.task)
        if self.zoom == (1.0, 1.0):
            return scene
        u = _Uniforms(scene_seed(self.seed, f'{self.split}|zoom', index))
        low, high = self.zoom
        return zoom_scene(scene, math.exp(u(math.log(low), math.log(high))), u)[0]

    @staticmethod
    def render(scene: Scene, height: int, width: Optional[int] = None) -> torch.Tensor:
        """Rasterise ``scene`` at (height, width) (width defaults to height): float (3, H, W) in [0, 1]."""
        width = height if width is None else width
        _resolution((height, width))
        return render_scene(scene, height, width)

    def __getitem__(self, index: int):
        scene = self.scene(index)
        image = render_scene(scene, *self.resolution)
        if self.transform is not None:
            from PIL import Image
            array = (image * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
            image = self.transform(Image.fromarray(array, mode='RGB'))
        return image, scene.label

    def _check_index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int):
            try:
                index = index.__index__()
            except AttributeError:
                raise TypeError(f'index must be an int, got {index!r}') from None
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f'index {index} out of range for {self.num_samples} samples')
        return index


class RenderedScenes(Dataset):
    """A :class:`SpatialScenes` without a transform, rendered once into memory.

    Items are the same ``(float (3, H, W) image, label)`` pairs; a sweep that trains several models on
    one scene stream renders it once instead of once per run (``float32``, 12 KiB per 32 px image).
    Reading an item draws no random numbers (``draws_random``: the training loader skips per-sample seeding).
    """

    draws_random = False

    def __init__(self, scenes: SpatialScenes) -> None:
        if scenes.transform is not None:
            raise ValueError('RenderedScenes stores tensors: pass a SpatialScenes without a transform')
        self.source = repr(scenes)
        self.task, self.classes, self.num_classes = scenes.task, scenes.classes, scenes.num_classes
        self.resolution = scenes.resolution
        self.images = torch.stack([scenes[i][0] for i in range(len(scenes))])
        self.labels = torch.tensor([scenes.label(i) for i in range(len(scenes))], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __repr__(self) -> str:
        return f'RenderedScenes({self.source})'

    def __getitem__(self, index: int):
        return self.images[index], int(self.labels[index])


# ---------------------------------------------------------------------------------------------------- CLI

def save_grid(path: Path, resolutions: Sequence[int], per_class: int = 3, split: str = 'train',
              seed: int = 0, task: str = 'layouts', zoom: Tuple[float, float] = (1.0, 1.0)) -> Path:
    """Save a PNG grid: one row per class, ``per_class`` scenes each shown at every resolution (``zoom``: as
    ``SpatialScenes``, to see what ``--scene-zoom`` trains on)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    classes = TASKS[task]
    dataset = SpatialScenes(split, num_samples=per_class * len(classes), seed=seed, task=task, zoom=zoom)
    cols = per_class * len(resolutions)
    fig, axes = plt.subplots(len(classes), cols, figsize=(1.1 * cols + 1.2, 1.1 * len(classes)), squeeze=False)
    for label, name in enumerate(classes):
        for k in range(per_class):
            scene = dataset.scene(label + k * len(classes))
            for j, res in enumerate(resolutions):
                ax = axes[label, k * len(resolutions) + j]
                ax.imshow(render_scene(scene, res).permute(1, 2, 0).numpy(), interpolation='nearest')
                ax.set_xticks([])
                ax.set_yticks([])
                if label == 0:
                    ax.set_title(f'{res}px', fontsize=8)
        axes[label, 0].set_ylabel(name, rotation=0, ha='right', va='center', fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``vision-priors scenes``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', type=Path, default=Path('outputs/builtin_scenes.png'), help='PNG to write')
    parser.add_argument('--resolution', type=int, nargs='+', default=[32, 64],
                        help='square resolutions to show each scene at (default: 32 64)')
    parser.add_argument('--per-class', type=int, default=3, help='scenes per class (default: 3)')
    parser.add_argument('--split', choices=SPLITS, default='train', help='split to draw from')
    parser.add_argument('--seed', type=int, default=0, help='dataset seed')
    parser.add_argument('--task', choices=sorted(TASKS), default='layouts', help='class set to show')
    parser.add_argument('--zoom', type=float, nargs=2, default=(1.0, 1.0), metavar=('LOW', 'HIGH'),
                        help="magnify each scene by a factor drawn log-uniformly from [LOW, HIGH] (the resolution "
                             "recipe's --scene-zoom; default 1 1 = off)")
    return parser


def validate(args: argparse.Namespace) -> None:
    """Checks argparse cannot express; ValueError names the flag."""
    if min(args.resolution) <= 0:
        raise ValueError(f'--resolution: every value must be a positive int, got {args.resolution}')
    if args.per_class <= 0:
        raise ValueError(f'--per-class must be a positive int, got {args.per_class}')
    try:
        check_zoom_range(args.zoom)
    except ValueError as error:
        raise ValueError(f'--zoom: {error}') from None


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_checked(build_parser(), validate, argv)
    print(f'saved {save_grid(args.out, args.resolution, args.per_class, args.split, args.seed, args.task, args.zoom)}')


if __name__ == '__main__':
    main()
