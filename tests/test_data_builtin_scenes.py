"""vision_priors.recipes.data.builtin_scenes: the built-in spatial-relation dataset.

The class rules are re-checked here from the scene parameters with geometry written independently of the
generator (sizes, circumradii and inradii derived from each kind's area; tolerances slightly looser than
the generator's margins), and every scene must satisfy its own class's rule and no other class's.
Resolution consistency: an area-downsampled 128 px rendering must match the 32 px rendering to a mean
absolute difference < 0.01 per image (observed ~0.001).
"""
import math
import subprocess
import sys
from dataclasses import replace
from itertools import combinations, permutations
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vision_priors.recipes.data.builtin_scenes import CLASSES, CLOCK_CLASSES, Scene, SpatialScenes, main, zoom_scene

NUM_CLASSES = len(CLASSES)
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------- independent geometry

def _n_sides(kind):
    return {'disc': 0, 'square': 4, 'pentagon': 5}[kind]


def circumradius(part):
    """R from area pi s^2: a regular n-gon of circumradius R has area (n / 2) R^2 sin(2 pi / n)."""
    n = _n_sides(part.kind)
    return part.size if n == 0 else part.size * math.sqrt(math.pi / (0.5 * n * math.sin(2 * math.pi / n)))


def inradius(part):
    n = _n_sides(part.kind)
    return part.size if n == 0 else circumradius(part) * math.cos(math.pi / n)


def dist(a, b):
    return math.hypot(a.x - b.x, a.y - b.y)


def separated(a, b):
    return dist(a, b) > circumradius(a) + circumradius(b) + 0.045


def overlapping(a, b):
    d = dist(a, b)
    return d < 0.9 * (inradius(a) + inradius(b)) and d > circumradius(a) - inradius(b) \
        and d > circumradius(b) - inradius(a)


def inside(a, b):
    """a entirely within b's inscribed circle."""
    return dist(a, b) + circumradius(a) < inradius(b)


def h_aligned(a, b):
    return abs(a.y - b.y) < 0.015


def v_aligned(a, b):
    return abs(a.x - b.x) < 0.015


def equal_sizes(parts):
    sizes = [p.size for p in parts]
    return max(sizes) / min(sizes) < 1.1


def all_separated(p):
    return all(separated(a, b) for a, b in combinations(p, 2))


def collinear_angle(p):
    """Angle (degrees, [0, 180)) of the line through the two farthest parts, or None if the third part is
    not on it (within 0.02: every centre may be jittered by 0.006 per coordinate) or not between them."""
    a, c = max(combinations(p, 2), key=lambda ab: dist(*ab))
    b = next(q for q in p if q is not a and q is not c)
    ux, uy = (c.x - a.x) / dist(a, c), (c.y - a.y) / dist(a, c)
    along = (b.x - a.x) * ux + (b.y - a.y) * uy
    off = abs(-(b.x - a.x) * uy + (b.y - a.y) * ux)
    if off > 0.02 or not 0 < along < dist(a, c):
        return None
    return math.degrees(math.atan2(uy, ux)) % 180


def rule_row(p):
    return all_separated(p) and all(h_aligned(a, b) for a, b in combinations(p, 2)) and equal_sizes(p)


def rule_column(p):
    return all_separated(p) and all(v_aligned(a, b) for a, b in combinations(p, 2)) and equal_sizes(p)


def rule_diagonal(p):
    angle = collinear_angle(p) if all_separated(p) else None
    return angle is not None and min(abs(angle - 45), abs(angle - 135)) < 10 and equal_sizes(p)


def rule_row_big_middle(p):
    if not (all_separated(p) and all(h_aligned(a, b) for a, b in combinations(p, 2))):
        return False
    left, middle, right = sorted(p, key=lambda q: q.x)
    return middle.size >= 1.35 * max(left.size, right.size) and equal_sizes([left, right])


def _tower(p, grows_down):
    if not (all_separated(p) and all(v_aligned(a, b) for a, b in combinations(p, 2))):
        return False
    top, middle, bottom = sorted(p, key=lambda q: q.y)      # y grows downward
    if not grows_down:
        top, bottom = bottom, top
    return middle.size >= 1.25 * top.size and bottom.size >= 1.25 * middle.size


def _triangle(p, apex_up):
    if not all_separated(p):
        return False
    for a, b, c in permutations(p):
        width = abs(a.x - b.x)
        height = (min(a.y, b.y) - c.y) if apex_up else (c.y - max(a.y, b.y))
        if h_aligned(a, b) and width > 0.3 and height > 0.25 and abs(c.x - (a.x + b.x) / 2) < 0.1 * width:
            return True
    return False


def rule_l_shape(p):
    if not all_separated(p):
        return False
    return any(v_aligned(a, corner) and abs(a.y - corner.y) > 0.28 and
               h_aligned(c, corner) and abs(c.x - corner.x) > 0.28 for corner, a, c in permutations(p))


def rule_nested(p):
    return any(inside(a, b) and separated(c, a) and separated(c, b) for a, b, c in permutations(p))


def _contacts(p):
    pairs = list(combinations(p, 2))
    if any(inside(a, b) or inside(b, a) for a, b in pairs):
        return None
    kinds = ['overlap' if overlapping(a, b) else 'separated' if separated(a, b) else 'ambiguous' for a, b in pairs]
    return None if 'ambiguous' in kinds else kinds.count('overlap')


RULES = {
    'row': rule_row,
    'column': rule_column,
    'diagonal': rule_diagonal,
    'row_big_middle': rule_row_big_middle,
    'tower': lambda p: _tower(p, grows_down=True),
    'inverted_tower': lambda p: _tower(p, grows_down=False),
    'triangle_up': lambda p: _triangle(p, apex_up=True),
    'triangle_down': lambda p: _triangle(p, apex_up=False),
    'l_shape': rule_l_shape,
    'nested': rule_nested,
    'touching': lambda p: _contacts(p) == 1,
    'chain': lambda p: _contacts(p) == 2,
}


def _mirror(scene: Scene) -> Scene:
    return replace(scene, parts=tuple(replace(q, x=1 - q.x) for q in scene.parts))


# ---------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize('task', ['layouts', 'clock'])
def test_classes_and_balance(task):
    data = SpatialScenes('train', num_samples=10 * NUM_CLASSES + 5, task=task)
    assert len(data.classes) >= 10 and data.num_classes == NUM_CLASSES == len(CLOCK_CLASSES)
    assert set(data.classes) == (set(RULES) if task == 'layouts' else {f'{h}_oclock' for h in range(1, 13)})
    labels = [data.label(i) for i in range(len(data))]
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    assert counts.min() >= 10 and counts.max() - counts.min() <= 1
    assert all(0 <= y < NUM_CLASSES for y in labels)
    image, label = data[7]
    assert label == labels[7] == data.scene(7).label
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert image.min() >= 0 and image.max() <= 1


@pytest.mark.parametrize('split', ['train', 'val'])
def test_every_scene_satisfies_exactly_its_rule(split):
    data = SpatialScenes(split, num_samples=150 * NUM_CLASSES, seed=3)
    for index in range(len(data)):
        scene = data.scene(index)
        assert scene.class_name == data.classes[scene.label] and len(scene.parts) == 3
        for candidate in (scene, _mirror(scene)):   # every rule is left/right symmetric: hflip keeps the label
            holds = [name for name, rule in RULES.items() if rule(candidate.parts)]
            assert holds == [scene.class_name], (index, scene)
        for q in scene.parts:
            assert 0 <= q.x - circumradius(q) and q.x + circumradius(q) <= 1
            assert 0 <= q.y - circumradius(q) and q.y + circumradius(q) <= 1


@pytest.mark.parametrize('split', ['train', 'val'])
def test_every_clock_scene_has_its_direction(split):
    """Red disc at k * 30 +- 7.5 degrees clockwise from up seen from the white one, 1.7-2.2x smaller, apart."""
    data = SpatialScenes(split, num_samples=150 * NUM_CLASSES, seed=3, task='clock')
    for index in range(len(data)):
        scene = data.scene(index)
        assert scene.class_name == CLOCK_CLASSES[scene.label] and len(scene.parts) == 2
        big, small = scene.parts
        assert big.color == (1.0, 1.0, 1.0) and small.color == (1.0, 0.0, 0.0) and big.kind == small.kind == 'disc'
        assert 1.7 - 1e-9 <= big.size / small.size <= 2.2 + 1e-9
        assert big.size + small.size + 0.08 - 1e-9 <= dist(big, small) <= 0.55 + 1e-9
        clockwise_from_up = math.degrees(math.atan2(small.x - big.x, big.y - small.y)) % 360   # y grows downward
        offset = (clockwise_from_up - 30 * scene.label + 180) % 360 - 180
        assert abs(offset) <= 7.5 + 1e-6, (index, offset)
        hour = round(clockwise_from_up / 30) % 12 or 12
        assert scene.class_name == f'{hour}_oclock'
        for q in scene.parts:
            assert 0 <= q.x - circumradius(q) and q.x + circumradius(q) <= 1
            assert 0 <= q.y - circumradius(q) and q.y + circumradius(q) <= 1


@pytest.mark.parametrize('task', ['layouts', 'clock'])
def test_size_is_area_equivalent_radius_and_parts_are_visible(task):
    """Rendered alone, a part covers pi size^2; in its scene every part keeps >= half its area visible."""
    data = SpatialScenes('val', num_samples=3 * NUM_CLASSES, task=task)
    black = dict(color0=(0.0, 0.0, 0.0), color1=(0.0, 0.0, 0.0), waves=())
    for index in range(len(data)):
        scene = data.scene(index)
        masks = []
        for q in scene.parts:
            alone = replace(scene, parts=(replace(q, color=(1.0, 1.0, 1.0)),),
                            background=replace(scene.background, **black))
            masks.append(data.render(alone, 96)[0])
            assert masks[-1].mean().item() == pytest.approx(math.pi * q.size ** 2, rel=0.03)
        for k, mask in enumerate(masks):      # parts are painted in order: later ones cover earlier ones
            visible = mask.clone()
            for later in masks[k + 1:]:
                visible *= 1 - later
            assert visible.sum() >= 0.5 * mask.sum(), (index, k)


@pytest.mark.parametrize('task', ['layouts', 'clock'])
def test_zoom_magnifies_every_offset_and_size_and_keeps_labels_and_parts_in_view(task):
    """zoom=(low, high): each scene is the unzoomed one with every centre offset and size multiplied by one factor
    f <= high (>= low unless the scene cannot grow that much), every part inside the unit square, the same label, kinds,
    rotations, colours and background; the unzoomed stream is unchanged, and (1, 1) is the identity. (The rules'
    absolute distances scale with f: a zoomed row is the unzoomed row, magnified.)"""
    plain = SpatialScenes('train', num_samples=4 * NUM_CLASSES, seed=2, task=task)
    zoomed = SpatialScenes('train', num_samples=4 * NUM_CLASSES, seed=2, task=task, zoom=(1.0, 2.0))
    assert SpatialScenes('train', num_samples=5, seed=2, task=task, zoom=(1, 1)).scene(3) == plain.scene(3)
    factors = []
    for index in range(len(plain)):
        a, b = plain.scene(index), zoomed.scene(index)
        assert (b.label, b.class_name, b.background) == (a.label, a.class_name, a.background)
        f = b.parts[0].size / a.parts[0].size
        factors.append(f)
        assert 1 - 1e-9 <= f <= 2.0 + 1e-9   # every scene here can grow: none is shrunk by the cap
        for p, q in zip(a.parts, b.parts):
            assert (q.kind, q.angle, q.color) == (p.kind, p.angle, p.color)
            assert q.size == pytest.approx(f * p.size, rel=1e-12)
            assert 0 <= q.x - circumradius(q) and q.x + circumradius(q) <= 1
            assert 0 <= q.y - circumradius(q) and q.y + circumradius(q) <= 1
        for (p0, p1), (q0, q1) in zip(combinations(a.parts, 2), combinations(b.parts, 2)):
            assert q1.x - q0.x == pytest.approx(f * (p1.x - p0.x), abs=1e-12)
            assert q1.y - q0.y == pytest.approx(f * (p1.y - p0.y), abs=1e-12)
    assert max(factors) > 1.6 and min(factors) < 1.3 and len(set(np.round(factors, 6))) > len(factors) // 2
    if task == 'clock':
        for index in range(len(zoomed)):   # the direction is a ratio of offsets: unchanged by the factor
            big, small = zoomed.scene(index).parts
            offset = (math.degrees(math.atan2(small.x - big.x, big.y - small.y)) - 30 * zoomed.label(index)
                      + 180) % 360 - 180
            assert abs(offset) <= 7.5 + 1e-6


def test_zoom_scene_caps_the_factor_and_validates():
    """A factor too large for the square is capped at the one that fits (a part then touches the margin); 0, a
    negative, an infinite or a reversed range is refused naming the value."""
    scene = SpatialScenes('val', num_samples=1, task='clock').scene(0)
    big, factor = zoom_scene(scene, 50.0, 0)
    assert 1 < factor < 50

    def widest_extent(parts):  # the larger of the x and y extents of the parts' circumscribed circles
        return max(max(getattr(q, axis) + circumradius(q) for q in parts) - min(getattr(q, axis) - circumradius(q)
                                                                                for q in parts) for axis in 'xy')
    assert widest_extent(big.parts) == pytest.approx(0.96, abs=1e-6)   # the square less its 0.02 margins
    assert factor == pytest.approx(0.96 / widest_extent(scene.parts), rel=1e-6)
    small, factor = zoom_scene(scene, 0.5, 0)
    assert factor == 0.5 and small.parts[0].size == pytest.approx(0.5 * scene.parts[0].size)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match='zoom must be a positive finite number'):
            zoom_scene(scene, bad, 0)
    for bad in ((2.0, 1.0), (0.0, 1.0), (1.0, math.inf), (1.0,), 'ab'):
        with pytest.raises(ValueError, match='zoom must'):
            SpatialScenes('train', num_samples=2, zoom=bad)


def test_determinism_seeds_and_splits():
    a = SpatialScenes('train', num_samples=40, seed=0)
    b = SpatialScenes('train', num_samples=40, seed=0)
    other_seed = SpatialScenes('train', num_samples=40, seed=1)
    val = SpatialScenes('val', num_samples=40, seed=0)
    for i in (0, 5, 39):
        assert torch.equal(a[i][0], b[i][0]) and a.scene(i) == b.scene(i)
    train_scenes = {a.scene(i) for i in range(40)}
    assert not train_scenes & {other_seed.scene(i) for i in range(40)}
    assert not train_scenes & {val.scene(i) for i in range(40)}
    for i in range(12):
        assert (a[i][0] - other_seed[i][0]).abs().mean() > 0.02
        assert (a[i][0] - val[i][0]).abs().mean() > 0.02
    assert a[i][1] == val[i][1] == other_seed[i][1]      # labels depend on the index only


@pytest.mark.parametrize('task', ['layouts', 'clock'])
def test_same_scene_at_every_resolution(task):
    data = SpatialScenes('val', num_samples=NUM_CLASSES, task=task)
    for index in range(len(data)):
        scene = data.scene(index)
        low = data.render(scene, 32)
        for height, width in [(128, 128), (64, 64)]:
            high = F.interpolate(data.render(scene, height, width)[None], size=(32, 32), mode='area')[0]
            assert (high - low).abs().mean() < 0.01, (index, height)
        wide_low = data.render(scene, 32, 48)
        wide_high = F.interpolate(data.render(scene, 128, 192)[None], size=(32, 48), mode='area')[0]
        assert (wide_high - wide_low).abs().mean() < 0.01
        # Non-square: the unit square is centred on the shorter side, the extra columns show more background.
        assert torch.allclose(wide_low[:, :, 8:40], low, atol=1e-6)
        assert torch.allclose(data.render(scene, 48, 32)[:, 8:40, :], low, atol=1e-6)
    assert SpatialScenes('val', num_samples=3, resolution=(24, 40), task=task)[1][0].shape == (3, 24, 40)
    assert torch.equal(SpatialScenes('val', num_samples=3, resolution=64, task=task)[2][0],
                       data.render(data.scene(2), 64))


@pytest.mark.parametrize('task', ['layouts', 'clock'])
def test_mean_colour_does_not_predict_the_class(task):
    """Nearest-class-mean on the mean RGB of each image: fit on train, score on val; chance is 1/12."""
    def features(split):
        data = SpatialScenes(split, num_samples=40 * NUM_CLASSES, resolution=16, task=task)
        x = torch.stack([data[i][0].mean((1, 2)) for i in range(len(data))])
        return x, torch.tensor([data.label(i) for i in range(len(data))])

    x, y = features('train')
    means = torch.stack([x[y == c].mean(0) for c in range(NUM_CLASSES)])
    xv, yv = features('val')
    accuracy = (torch.cdist(xv, means).argmin(1) == yv).float().mean().item()
    assert accuracy < 2 / NUM_CLASSES, accuracy


def test_transform_receives_the_pil_image_and_its_output_is_returned():
    from PIL import Image
    seen = []

    def probe(image):
        seen.append(image)
        return 'out'

    data = SpatialScenes('train', num_samples=12, resolution=(24, 40), transform=probe)
    assert data[3] == ('out', data.label(3))
    image = seen[0]
    assert isinstance(image, Image.Image) and image.mode == 'RGB' and image.size == (40, 24)
    expected = SpatialScenes('train', num_samples=12, resolution=(24, 40))[3][0]
    assert np.abs(np.asarray(image) / 255.0 - expected.permute(1, 2, 0).numpy()).max() <= 0.5 / 255 + 1e-6

    import torchvision.transforms as T
    tv = SpatialScenes('train', num_samples=12, resolution=32, transform=T.Compose([T.Resize(48), T.ToTensor()]))
    out, label = tv[3]
    assert out.shape == (3, 48, 48) and label == 3

    from timm.data import create_transform
    transform = create_transform(input_size=(3, 32, 32), is_training=False, crop_pct=1.0)
    out, _ = SpatialScenes('train', num_samples=12, resolution=32, transform=transform)[3]
    plain, _ = SpatialScenes('train', num_samples=12, resolution=32)[3]
    mean = torch.as_tensor(transform.transforms[-1].mean).view(3, 1, 1)
    std = torch.as_tensor(transform.transforms[-1].std).view(3, 1, 1)
    assert out.shape == (3, 32, 32)
    assert torch.allclose(out * std + mean, plain, atol=1 / 255)


@pytest.mark.parametrize('kwargs, match', [
    (dict(split='test'), "'test'.*'train', 'val'|'train', 'val'.*'test'"),
    (dict(resolution=0), 'resolution must be positive, got 0'),
    (dict(resolution=(32, -4)), r'resolution must be positive, got \(32, -4\)'),
    (dict(resolution='32'), "resolution must be an int or a \\(height, width\\) pair of ints, got '32'"),
    (dict(num_samples=0), 'num_samples must be a positive int, got 0'),
    (dict(num_samples=2.5), 'num_samples must be a positive int, got 2.5'),
    (dict(task='clocks'), "task must be one of 'clock', 'layouts', got 'clocks'"),
])
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpatialScenes(**kwargs)


def test_index_errors():
    data = SpatialScenes('val', num_samples=5)
    with pytest.raises(IndexError, match='index 5 out of range for 5 samples'):
        data[5]
    assert data.scene(-1) == data.scene(4)


def test_cli_help_and_grid(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(['--help'])
    assert exit_info.value.code == 0 and '--resolution' in capsys.readouterr().out
    out = tmp_path / 'grid.png'
    main(['--out', str(out), '--resolution', '16', '24', '--per-class', '1', '--task', 'clock'])
    assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    zoomed = tmp_path / 'zoomed.png'
    main(['--out', str(zoomed), '--resolution', '16', '--per-class', '1', '--task', 'clock', '--zoom', '1', '2'])
    assert zoomed.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(['--out', str(tmp_path / 'bad.png'), '--zoom', '2', '1'])
    assert exit_info.value.code == 2 and '--zoom: zoom must satisfy 0 < low <= high' in capsys.readouterr().err
    assert not (tmp_path / 'bad.png').exists()


def test_cli_runs_as_a_module(tmp_path):
    """``python -m vision_priors.recipes.data.builtin_scenes`` (warnings as errors: the package must not import it
    first)."""
    out = tmp_path / 'grid.png'
    cmd = [sys.executable, '-W', 'error::RuntimeWarning', '-m', 'vision_priors.recipes.data.builtin_scenes',
           '--out', str(out), '--resolution', '16', '--per-class', '1', '--task', 'clock']
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'saved {out}' in result.stdout and out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
