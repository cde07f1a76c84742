"""PCN data: PCD / PLY readers and writers, fault injection, the built-in generator and PCNDataset."""
import hashlib
import json
import math
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from vision_priors.recipes.data import pcn
from vision_priors.recipes.data.pcn import (BUILTIN_CATEGORIES, CATEGORY_FILE, TAXONOMY_IDS, PCNDataset, read_pcd,
                                            read_point_cloud, write_builtin_pcn, write_pcd)
from vision_priors.recipes.engine import PerSampleSeeds

DEMO = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'pcn_demo'
TINY = dict(models_per_split=(2, 1, 1), num_views=2, num_complete=2048, seed=0)
HEADER = ('# .PCD v0.7 - Point Cloud Data file format\nVERSION 0.7\nFIELDS {fields}\nSIZE {size}\nTYPE {type}\n'
          'COUNT {count}\nWIDTH {n}\nHEIGHT 1\nVIEWPOINT 0 0 0 1 0 0 0\nPOINTS {n}\nDATA {data}\n')


def pcd_header(n, fields='x y z', size='4 4 4', type='F F F', count='1 1 1', data='ascii'):
    return HEADER.format(fields=fields, size=size, type=type, count=count, n=n, data=data)


def write_text(path, text):
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def cloud(n, seed=0):
    return (np.random.default_rng(seed).random((n, 3)) - 0.5).astype(np.float32)


@pytest.fixture(scope='session')
def builtin_root(tmp_path_factory):
    return write_builtin_pcn(tmp_path_factory.mktemp('pcn') / 'PCN', **TINY)


def make_pcn(root, models, split='train'):
    """A hand-made PCN folder: models = {(taxonomy_name, taxonomy_id): {model_id: (complete, [views])}}."""
    entries = []
    for (name, taxonomy), items in models.items():
        entries.append({'taxonomy_id': taxonomy, 'taxonomy_name': name, 'train': [], 'val': [], 'test': []})
        for model, (complete, views) in items.items():
            entries[-1][split].append(model)
            (root / split / 'complete' / taxonomy).mkdir(parents=True, exist_ok=True)
            write_pcd(root / split / 'complete' / taxonomy / f'{model}.pcd', complete)
            folder = root / split / 'partial' / taxonomy / model
            folder.mkdir(parents=True, exist_ok=True)
            for v, view in enumerate(views):
                write_pcd(folder / f'{v:02d}.pcd', view)
    for sub in ('complete', 'partial'):
        (root / split / sub).mkdir(parents=True, exist_ok=True)
    (root / CATEGORY_FILE).write_text(json.dumps(entries))
    return root


# ----------------------------------------------------------------------------------------- PCD round trip

@pytest.mark.parametrize('binary', [True, False])
def test_pcd_round_trip(tmp_path, binary):
    points = cloud(1000)
    path = tmp_path / 'a.pcd'
    write_pcd(path, points, binary=binary)
    assert f'DATA {"binary" if binary else "ascii"}\n'.encode() in path.read_bytes()[:300]
    back = read_pcd(path)
    assert back.dtype == np.float32 and back.shape == (1000, 3) and back.flags.c_contiguous
    if binary:
        np.testing.assert_array_equal(back, points)
    else:   # pypcd4 writes ASCII with %.10f
        np.testing.assert_allclose(back, points, rtol=0, atol=1e-9)
    np.testing.assert_array_equal(read_point_cloud(path), back)


def test_pcd_binary_compressed_round_trip(tmp_path):
    # LZF only shrinks repetitive data: coordinates on a coarse grid compress, random floats do not
    points = (np.random.default_rng(0).integers(-4, 5, size=(4000, 3)) / 8).astype(np.float32)
    path = tmp_path / 'c.pcd'
    write_pcd(path, points, compressed=True)
    assert b'DATA binary_compressed\n' in path.read_bytes()[:300]
    np.testing.assert_array_equal(read_pcd(path), points)
    # incompressible data: pypcd4 silently writes plain binary, which still reads back exactly
    write_pcd(path, cloud(500), compressed=True)
    assert b'DATA binary\n' in path.read_bytes()[:300]
    np.testing.assert_array_equal(read_pcd(path), cloud(500))


def test_pcd_binary_compressed_from_pcl_layout(tmp_path):
    # a binary_compressed file with x y z float64 + an rgb field, as PCL lays it out (field by field)
    from pypcd4 import Encoding, PointCloud
    xyz = np.random.default_rng(1).integers(-8, 9, size=(300, 3)) / 16
    rgb = np.zeros(300, np.uint32)
    pc = PointCloud.from_points([xyz[:, 0], xyz[:, 1], xyz[:, 2], rgb], ('x', 'y', 'z', 'rgb'),
                                (np.float64, np.float64, np.float64, np.uint32))
    path = tmp_path / 'pcl.pcd'
    pc.save(path, encoding=Encoding.BINARY_COMPRESSED)
    assert b'DATA binary_compressed\n' in path.read_bytes()[:300]
    np.testing.assert_array_equal(read_pcd(path), xyz.astype(np.float32))


def test_pcd_header_and_ascii_variants_pypcd4_rejects(tmp_path):
    rows = [[0.1, 0.2, 0.3], [-0.4, 0.5, -0.6]]
    body = ''.join(f'{a} {b} {c} \n' for a, b, c in rows)   # trailing spaces (pypcd4's loadtxt fails)
    write_text(tmp_path / 'trailing.pcd', pcd_header(2) + body)
    write_text(tmp_path / 'tabs.pcd', pcd_header(2) + ''.join(f'{a}\t{b}  {c}\r\n' for a, b, c in rows))
    # an extra header line: pypcd4 stops after 10 lines and would miss DATA
    write_text(tmp_path / 'extra.pcd', pcd_header(2).replace('WIDTH', 'EXTRA something\nWIDTH') + body)
    # PCD v0.6 without COUNT / VIEWPOINT (pypcd4 accepts only VERSION 0.7 and requires COUNT)
    old = 'VERSION .6\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nWIDTH 2\nHEIGHT 1\nPOINTS 2\nDATA ascii\n'
    write_text(tmp_path / 'old.pcd', old + body)
    # organised cloud (WIDTH x HEIGHT) with extra fields
    organised = pcd_header(2, 'x y z intensity', '4 4 4 4', 'F F F F', '1 1 1 1').replace(
        'WIDTH 2\nHEIGHT 1', 'WIDTH 1\nHEIGHT 2')
    write_text(tmp_path / 'organised.pcd', organised + ''.join(f'{a} {b} {c} 7\n' for a, b, c in rows))
    write_text(tmp_path / 'one.pcd', pcd_header(1) + '0.1 0.2 0.3\n')
    for name in ('trailing', 'tabs', 'extra', 'old', 'organised'):
        np.testing.assert_allclose(read_pcd(tmp_path / f'{name}.pcd'), rows, rtol=1e-7, err_msg=name)
    assert read_pcd(tmp_path / 'one.pcd').shape == (1, 3)


# ----------------------------------------------------------------------------------------- fault injection

GOOD = '0.1 0.2 0.3\n0.4 0.5 0.6\n0.7 0.8 0.9\n'
PCD_FAULTS = {
    'garbage': ('hello world\n1 2 3\n', "not a PCD file"),
    'no_data_line': (pcd_header(3).replace('DATA ascii\n', ''), 'no DATA line'),
    'binary_header': (b'\x00\xff\xfe\x01' * 10 + b'\n', 'not a PCD file'),
    'missing_z': (pcd_header(3, fields='x y w') + GOOD, r'no z field \(FIELDS x y w\)'),
    'missing_xy': (pcd_header(3, fields='a b z') + GOOD, r'no x/y field'),
    'int_dtype': (pcd_header(3, type='I I I') + '1 2 3\n4 5 6\n7 8 9\n', 'wrong dtype for field x: TYPE I SIZE 4'),
    'float16': (pcd_header(3, size='2 2 2') + GOOD, 'wrong dtype for field x: TYPE F SIZE 2'),
    'count_2': (pcd_header(3, count='1 2 1') + GOOD, 'wrong dtype for field y: TYPE F SIZE 4 COUNT 2'),
    'size_mismatch': (pcd_header(3, size='4 4') + GOOD, 'SIZE has 2 values for 3 FIELDS'),
    'encoding': (pcd_header(3, data='binary_zstd') + GOOD, "unsupported PCD encoding DATA 'binary_zstd'"),
    'bad_points': (pcd_header(3).replace('POINTS 3', 'POINTS three') + GOOD, "POINTS must be an integer, got 'three'"),
    'nan': (pcd_header(3) + '0.1 0.2 0.3\n0.4 0.5 0.6\n0.7 nan 0.9\n', r'point 2 is not finite: \[0\.7'),
    'inf': (pcd_header(3) + '0.1 0.2 0.3\n0.4 -inf 0.6\n0.7 0.8 0.9\n', 'point 1 is not finite'),
    'float32_overflow': (pcd_header(3, size='8 8 8') + '0.1 0.2 0.3\n1e300 0 0\n0 0 0\n', 'point 1 is not finite'),
    'empty': (pcd_header(0), r'empty point cloud \(0 points\)'),
    'too_few_rows': (pcd_header(4) + GOOD, 'holds 3 points but the header says POINTS 4'),
    'not_numbers': (pcd_header(3) + '0.1 0.2 0.3\n0.4 abc 0.6\n0.7 0.8 0.9\n', 'cannot decode ascii PCD data'),
}


@pytest.mark.parametrize('name', sorted(PCD_FAULTS))
def test_pcd_faults_name_the_file(tmp_path, name):
    content, message = PCD_FAULTS[name]
    path = write_text(tmp_path / f'{name}_cloud.pcd', content)
    with pytest.raises(ValueError, match=re.escape(str(path)) + '.*' + message):
        read_pcd(path)
    with pytest.raises(ValueError, match=re.escape(path.name)):
        read_point_cloud(path)


def test_binary_pcd_faults(tmp_path):
    good = tmp_path / 'good.pcd'
    write_pcd(good, cloud(100))
    raw = good.read_bytes()
    truncated = write_text(tmp_path / 'truncated.pcd', raw[:-12])            # one point short
    with pytest.raises(ValueError,
                       match=re.escape(str(truncated)) + '.*holds 99 points but the header says POINTS 100'):
        read_pcd(truncated)
    ragged = write_text(tmp_path / 'ragged.pcd', raw[:-7])                   # cut inside a point
    with pytest.raises(ValueError, match=re.escape(str(ragged)) + '.*cannot decode binary PCD data'):
        read_pcd(ragged)
    compressed = tmp_path / 'compressed.pcd'
    write_pcd(compressed, np.zeros((100, 3), np.float32) + 0.25, compressed=True)
    raw = compressed.read_bytes()
    start = raw.index(b'DATA binary_compressed\n') + len(b'DATA binary_compressed\n')
    size, full = struct.unpack('II', raw[start:start + 8])
    damaged = write_text(tmp_path / 'damaged.pcd', raw[:start] + struct.pack('II', size, full) + b'\xff' * size)
    with pytest.raises(ValueError, match=re.escape(str(damaged)) + '.*cannot decode binary_compressed PCD data'):
        read_pcd(damaged)
    nan = cloud(10)
    nan[6, 2] = np.nan
    from pypcd4 import PointCloud
    PointCloud.from_xyz_points(nan).save(tmp_path / 'nan.pcd')
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / 'nan.pcd')) + '.*point 6 is not finite'):
        read_pcd(tmp_path / 'nan.pcd')
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / 'missing.pcd'))):
        read_pcd(tmp_path / 'missing.pcd')


PLY = 'ply\nformat ascii 1.0\nelement vertex {n}\nproperty float x\nproperty float y\nproperty float z\nend_header\n'


def test_ply_reader_and_faults(tmp_path):
    path = write_text(tmp_path / 'ok.ply', PLY.format(n=2) + '1 2 3\n4 5 6\n')
    np.testing.assert_array_equal(read_point_cloud(path), [[1, 2, 3], [4, 5, 6]])
    assert read_point_cloud(path).dtype == np.float32
    faces_only = write_text(tmp_path / 'faces_only.ply', 'ply\nformat ascii 1.0\nelement face 0\n'
                            'property list uchar int vertex_indices\nend_header\n')
    with pytest.raises(ValueError, match=re.escape(str(faces_only)) + '.*PLY file has no vertices'):
        read_point_cloud(faces_only)
    zero = write_text(tmp_path / 'zero.ply', PLY.format(n=0))
    with pytest.raises(ValueError, match=re.escape(str(zero)) + '.*no vertices'):
        read_point_cloud(zero)
    no_z = write_text(tmp_path / 'no_z.ply', PLY.format(n=1).replace('property float z\n', '') + '1 2\n')
    with pytest.raises(ValueError, match=re.escape(str(no_z)) + '.*cannot read PLY'):
        read_point_cloud(no_z)
    nan = write_text(tmp_path / 'nan.ply', PLY.format(n=2) + '1 2 3\n4 nan 6\n')
    with pytest.raises(ValueError, match=re.escape(str(nan)) + '.*point 1 is not finite'):
        read_point_cloud(nan)
    garbage = write_text(tmp_path / 'garbage.ply', 'hello\n')
    with pytest.raises(ValueError, match=re.escape(str(garbage))):
        read_point_cloud(garbage)
    unsupported = re.escape(str(tmp_path / 'a.xyz')) + ".*unsupported point cloud file type '.xyz'"
    with pytest.raises(ValueError, match=unsupported):
        read_point_cloud(tmp_path / 'a.xyz')


def test_write_pcd_rejects_bad_points(tmp_path):
    path = tmp_path / 'out.pcd'
    with pytest.raises(TypeError, match='out.pcd.*dtype int64'):
        write_pcd(path, np.zeros((4, 3), np.int64))
    with pytest.raises(ValueError, match=r'out.pcd.*shape \(N, 3\), got \(4, 2\)'):
        write_pcd(path, np.zeros((4, 2), np.float32))
    bad = cloud(5)
    bad[3, 0] = np.inf
    with pytest.raises(ValueError, match='out.pcd.*point 3 is not finite'):
        write_pcd(path, bad)
    with pytest.raises(ValueError, match='out.pcd.*empty point cloud'):
        write_pcd(path, np.zeros((0, 3), np.float32))
    assert not path.exists()


# ----------------------------------------------------------------------------------------- real PCN files

@pytest.mark.skipif(not DEMO.is_dir(), reason=f'{DEMO} is absent (shared data not mounted)')
def test_real_pcn_demo_files():
    files = sorted(DEMO.glob('*.pcd')) + sorted((DEMO / 'pcn_repo_demo').glob('*.pcd'))
    assert len(files) >= 2
    for path in files:
        header = path.read_text().split('DATA ascii\n')[0]
        count = int(re.search(r'^POINTS (\d+)$', header, re.M).group(1))
        points = read_pcd(path)
        assert points.shape == (count, 3) and points.dtype == np.float32, path
        np.testing.assert_allclose(points, np.loadtxt(path, skiprows=header.count('\n') + 1), rtol=1e-6, atol=1e-8)
        assert np.abs(points).max() < 0.6, path    # PCN clouds are normalised, not re-normalised here
    ply = read_point_cloud(DEMO / 'input.ply')     # binary little endian PLY with colour
    assert ply.shape == (4096, 3) and ply.dtype == np.float32 and np.isfinite(ply).all()


# ----------------------------------------------------------------------------------------- built-in generator

def test_builtin_layout_and_category_file(builtin_root):
    entries = json.loads((builtin_root / CATEGORY_FILE).read_text())
    assert [e['taxonomy_name'] for e in entries] == list(BUILTIN_CATEGORIES) == sorted(BUILTIN_CATEGORIES)
    assert len(BUILTIN_CATEGORIES) >= 8
    assert {'chair', 'table', 'lamp', 'airplane', 'car', 'sofa', 'cabinet', 'watercraft'} <= set(BUILTIN_CATEGORIES)
    for entry in entries:
        assert set(entry) == {'taxonomy_id', 'taxonomy_name', 'train', 'val', 'test'}
        assert entry['taxonomy_id'] == TAXONOMY_IDS[entry['taxonomy_name']]
        for split, count in zip(('train', 'val', 'test'), TINY['models_per_split']):
            assert len(entry[split]) == count
            for model in entry[split]:
                assert re.fullmatch('[0-9a-f]{32}', model)
                complete = read_pcd(builtin_root / split / 'complete' / entry['taxonomy_id'] / f'{model}.pcd')
                assert complete.shape == (TINY['num_complete'], 3)
                assert np.abs(complete).max() <= 0.5 + 1e-6                      # ShapeNet-like scale
                assert np.linalg.norm(complete.max(0) - complete.min(0)) > 0.9     # bounding box diagonal ~1
                views = sorted((builtin_root / split / 'partial' / entry['taxonomy_id'] / model).iterdir())
                assert [v.name for v in views] == ['00.pcd', '01.pcd']
                for view in views:
                    assert 50 < len(read_pcd(view)) < 4096 * 0.75   # a part of the 4096-point pool
    ids = [m for e in entries for s in ('train', 'val', 'test') for m in e[s]]
    assert len(set(ids)) == len(ids)


def _tree_digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob('*')) if p.is_file()}


def test_builtin_is_deterministic_and_cached(tmp_path, builtin_root):
    kwargs = dict(TINY, categories=('chair', 'lamp'), models_per_split=(1, 1, 0))
    a = write_builtin_pcn(tmp_path / 'a', **kwargs)
    b = write_builtin_pcn(tmp_path / 'b', **kwargs)
    assert _tree_digest(a) == _tree_digest(b)
    # per-model generators: the same models as in the 8-category fixture, byte for byte
    chair = TAXONOMY_IDS['chair']
    model = json.loads((a / CATEGORY_FILE).read_text())[0]['train'][0]
    for rel in (f'train/complete/{chair}/{model}.pcd', f'train/partial/{chair}/{model}/01.pcd'):
        assert (a / rel).read_bytes() == (builtin_root / rel).read_bytes()
    other = write_builtin_pcn(tmp_path / 'c', **dict(kwargs, seed=1))
    assert _tree_digest(other).keys().isdisjoint(_tree_digest(a).keys() - {CATEGORY_FILE, pcn.BUILTIN_MARKER})
    # same arguments again: returned as is; a different folder content: refused
    before = (a / CATEGORY_FILE).stat().st_mtime_ns
    assert write_builtin_pcn(a, **kwargs) == a and (a / CATEGORY_FILE).stat().st_mtime_ns == before
    with pytest.raises(FileExistsError, match=re.escape(str(a))):
        write_builtin_pcn(a, **dict(kwargs, num_views=3))
    assert not list(tmp_path.glob('.*tmp*'))


def _nearest_on_mesh(points, mesh):
    """(distance to the mesh, outward normal of the nearest triangle) of each point (no rtree needed)."""
    from trimesh.triangles import closest_point
    triangles = mesh.triangles
    pairs_t = np.repeat(triangles[None], len(points), axis=0).reshape(-1, 3, 3)
    pairs_p = np.repeat(points.astype(np.float64), len(triangles), axis=0)
    distance = np.linalg.norm(closest_point(pairs_t, pairs_p) - pairs_p, axis=1).reshape(len(points), -1)
    return distance.min(axis=1), mesh.face_normals[distance.argmin(axis=1)]


@pytest.mark.parametrize('category', ['chair', 'airplane', 'lamp', 'car'])
def test_builtin_views_are_visible_surface_subsets(builtin_root, category):
    import trimesh
    taxonomy = TAXONOMY_IDS[category]
    model = json.loads((builtin_root / CATEGORY_FILE).read_text())[BUILTIN_CATEGORIES.index(category)]['train'][1]
    assert model == pcn.model_id(0, category, 'train', 1)
    rng = pcn.model_rng(0, category, 'train', 1)
    parts = pcn.make_shape(category, rng)
    mesh = trimesh.util.concatenate(parts)
    complete, views, directions = pcn.sample_model(parts, rng, num_complete=TINY['num_complete'],
                                                   num_views=TINY['num_views'], return_directions=True)
    folder = builtin_root / 'train' / 'partial' / taxonomy / model
    np.testing.assert_array_equal(read_pcd(builtin_root / 'train' / 'complete' / taxonomy / f'{model}.pcd'), complete)
    pick = np.random.default_rng(0).choice(len(complete), 150, replace=False)
    distance, complete_normals = _nearest_on_mesh(complete[pick], mesh)
    assert distance.max() < 1e-5
    for v, (view, direction) in enumerate(zip(views, directions)):
        np.testing.assert_array_equal(read_pcd(folder / f'{v:02d}.pcd'), view)
        camera = 2.0 * direction
        # every view point lies on the surface (float32 rounding only) and faces the camera...
        sample = view[np.random.default_rng(v).choice(len(view), 60, replace=False)]
        distance, normals = _nearest_on_mesh(sample, mesh)
        assert distance.max() < 1e-5
        assert (np.einsum('ij,ij->i', normals, camera - sample) > 0).all()
        # ... so the far side (a good share of the complete surface faces away) is missing
        assert (np.einsum('ij,ij->i', complete_normals, camera - complete[pick]) < 0).mean() > 0.3
        gap = torch.cdist(torch.from_numpy(complete), torch.from_numpy(view)).min(dim=1).values
        assert (gap > 0.02).float().mean() > 0.1 and gap.min() < 0.01
    assert not np.array_equal(views[0], views[1])


def test_visibility_hides_the_far_side_and_occluded_parts():
    import trimesh
    near = trimesh.creation.box((0.3, 0.3, 0.05))
    near.apply_translation([0, 0, 0.3])
    far = trimesh.creation.box((0.2, 0.2, 0.05))
    far.apply_translation([0, 0, -0.3])
    points, normals, area = pcn._surface_points([near, far], 20000, np.random.default_rng(0))
    mask = pcn._visible(points, normals, np.arange(len(points)), np.array([0.0, 0.0, 1.0]),
                        1.5 * math.sqrt(area / len(points)))
    seen = points[mask]
    assert (seen[:, 2] < 0).sum() == 0                                # far box hidden behind the near one
    np.testing.assert_allclose(seen[:, 2], 0.325, atol=1e-6)          # only the near box's facing side
    assert mask.sum() > 0.8 * np.isclose(points[:, 2], 0.325).sum()


# ----------------------------------------------------------------------------------------- PCNDataset

def test_dataset_items_and_collation(builtin_root):
    dataset = PCNDataset(builtin_root, 'train', num_partial=512, num_complete=1024)
    assert dataset.categories == list(BUILTIN_CATEGORIES)
    assert len(dataset) == len(BUILTIN_CATEGORIES) * TINY['models_per_split'][0]
    item = dataset[3]
    assert item['partial'].shape == (512, 3) and item['complete'].shape == (1024, 3)
    assert item['partial'].dtype == item['complete'].dtype == torch.float32
    assert item['category'].dtype == item['index'].dtype == torch.int64 and item['category'].ndim == 0
    taxonomy, model, paths = dataset.samples[3]
    assert int(item['category']) == dataset.taxonomy_ids.index(taxonomy) == 1 and int(item['index']) == 3
    assert paths.complete.name == f'{model}.pcd' and [p.name for p in paths.partials] == ['00.pcd', '01.pcd']
    batch = next(iter(DataLoader(dataset, batch_size=4)))
    assert batch['partial'].shape == (4, 512, 3) and batch['category'].tolist() == [0, 0, 1, 1]
    assert batch['index'].tolist() == [0, 1, 2, 3]


def test_dataset_categories_filter_keeps_file_order(builtin_root):
    dataset = PCNDataset(builtin_root, 'val', categories=['chair', TAXONOMY_IDS['airplane']], num_complete=64)
    assert dataset.categories == ['airplane', 'chair'] and len(dataset) == 2
    assert [int(dataset[i]['category']) for i in range(2)] == [0, 1]
    with pytest.raises(ValueError, match=re.escape(str(builtin_root / CATEGORY_FILE)) + '.*no category bicycle'):
        PCNDataset(builtin_root, 'val', categories=['bicycle'])


def test_eval_items_are_deterministic_by_index(builtin_root):
    dataset = PCNDataset(builtin_root, 'test', num_partial=256, num_complete=512)
    np.random.seed(1)
    state = np.random.get_state()
    first = dataset[2]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state()[1:], state[1:]))  # global RNG untouched
    np.random.seed(99)
    again = dataset[2]
    for key in first:
        assert torch.equal(first[key], again[key])
    # view 0 and a resampling seeded by the index
    view0 = read_pcd(dataset.samples[2].paths.partials[0])
    expected = pcn.resample_points(view0, 256, np.random.default_rng(2))
    np.testing.assert_array_equal(first['partial'].numpy(), expected)


def rows(array):
    return {tuple(r) for r in np.asarray(array).tolist()}


def unmirror(points, reference):
    """``points`` with the x / z mirror (PoinTr's four cases) undone so that its rows are ``reference`` rows."""
    for signs in ((1, 1, 1), (-1, 1, 1), (1, 1, -1), (-1, 1, -1)):
        if rows(points * np.array(signs, np.float32)) <= rows(reference):
            return points * np.array(signs, np.float32), signs
    raise AssertionError('no mirror of the points matches the reference')


def test_resampling_both_directions(tmp_path):
    partial, complete = cloud(10, seed=1), cloud(50, seed=2)
    root = make_pcn(tmp_path / 'PCN', {('chair', '03001627'): {'m0': (complete, [partial])}})
    for augment in (False, True):
        np.random.seed(0)
        item = PCNDataset(root, 'train', num_partial=16, num_complete=20, augment=augment, scale_range=(1, 1))[0]
        p, signs = unmirror(item['partial'].numpy(), partial)
        c = item['complete'].numpy() * np.array(signs, np.float32)
        # fewer points than asked: every point once, then random repeats of them
        assert len(p) == 16 and rows(p) == rows(partial)
        # more points than asked: a subset without replacement
        assert len(rows(c)) == 20 and rows(c) <= rows(complete)
    assert pcn.resample_points(partial, 10, np.random.default_rng(0)).shape == (10, 3)
    with pytest.raises(ValueError, match='empty.pcd: empty point cloud'):
        pcn.resample_points(np.zeros((0, 3), np.float32), 4, None, 'empty.pcd')


def test_augmentation_transforms_partial_and_complete_alike(tmp_path):
    points = cloud(64, seed=3)
    root = make_pcn(tmp_path / 'PCN', {('car', '02958343'): {'m0': (points, [points, points])}})
    dataset = PCNDataset(root, 'train', num_partial=64, num_complete=64, augment=True)
    by_x = lambda a: a[np.argsort(a[:, 0])]
    mirrors, scales = set(), []
    for seed in range(24):
        np.random.seed(seed)
        item = dataset[0]
        p, c = item['partial'].numpy(), item['complete'].numpy()
        assert rows(p) == rows(c)                       # one transform for both clouds (same points here)
        scale = float(np.median(np.linalg.norm(p, axis=1)) / np.median(np.linalg.norm(points, axis=1)))
        matches = [signs for signs in ((1, 1), (-1, 1), (1, -1), (-1, -1))
                   if np.allclose(by_x(points @ np.diag([signs[0] * scale, scale, signs[1] * scale])), by_x(p),
                                  atol=1e-5)]
        assert len(matches) == 1                        # a mirror of x and / or z times an isotropic scale
        mirrors.add(matches[0])
        scales.append(scale)
        np.random.seed(seed)
        again = dataset[0]
        assert torch.equal(again['partial'], item['partial']) and torch.equal(again['complete'], item['complete'])
    assert len(mirrors) == 4
    assert 0.8 <= min(scales) < 0.9 and 1.1 < max(scales) <= 1.2


def test_random_mirror_scale_cases():
    matrices = []
    for seed in range(200):
        np.random.seed(seed)
        matrices.append(pcn.random_mirror_scale((0.8, 1.2)))
    signs = {tuple(np.sign(np.diag(m)).astype(int)) for m in matrices}
    assert signs == {(1, 1, 1), (-1, 1, 1), (1, 1, -1), (-1, 1, -1)}   # y (up) is never mirrored
    scales = [abs(m[1, 1]) for m in matrices]
    assert 0.8 <= min(scales) < 0.85 and 1.15 < max(scales) <= 1.2
    assert all(np.allclose(np.abs(np.diag(m)), abs(m[1, 1])) for m in matrices)   # isotropic


def test_training_items_follow_per_sample_seeds(tmp_path, builtin_root):
    dataset = PCNDataset(builtin_root, 'train', num_partial=128, num_complete=256, augment=True)
    wrapped = PerSampleSeeds(dataset, seed=7)
    a, b = wrapped[5], wrapped[5]
    assert torch.equal(a['partial'], b['partial']) and torch.equal(a['complete'], b['complete'])
    wrapped.set_epoch(1)
    assert not torch.equal(wrapped[5]['partial'], a['partial'])
    # a random view per item and epoch
    views = [cloud(20, seed=10), cloud(20, seed=11), cloud(20, seed=12)]
    root = make_pcn(tmp_path / 'PCN', {('sofa', '04256520'): {'m0': (cloud(40), views)}})
    wrapped = PerSampleSeeds(PCNDataset(root, 'train', num_partial=8, num_complete=8, augment=True,
                                        scale_range=(1, 1)), seed=0)
    seen = set()
    for epoch in range(12):
        wrapped.set_epoch(epoch)
        partial = wrapped[0]['partial'].numpy()
        seen.update(k for k, view in enumerate(views)
                    if any(rows(partial * np.array(s, np.float32)) <= rows(view)
                           for s in ((1, 1, 1), (-1, 1, 1), (1, 1, -1), (-1, 1, -1))))
    assert seen == {0, 1, 2}


# ----------------------------------------------------------------------------------------- layout faults

def _copy_tiny(tmp_path, builtin_root):
    import shutil
    root = tmp_path / 'PCN'
    shutil.copytree(builtin_root, root)
    return root


def test_dataset_layout_faults(tmp_path, builtin_root):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / 'nowhere'))):
        PCNDataset(tmp_path / 'nowhere', 'train')
    with pytest.raises(ValueError, match="unknown PCN split 'training'"):
        PCNDataset(builtin_root, 'training')
    root = _copy_tiny(tmp_path, builtin_root)
    category_file = root / CATEGORY_FILE
    entries = json.loads(category_file.read_text())
    chair = TAXONOMY_IDS['chair']
    model = entries[BUILTIN_CATEGORIES.index('chair')]['val'][0]

    def expect(error, pattern, split='val'):
        with pytest.raises(error, match=pattern):
            PCNDataset(root, split)

    # PCN.json faults
    category_file.write_text('[{"taxonomy_id": "1",')
    expect(ValueError, re.escape(str(category_file)) + '.*not valid JSON')
    category_file.write_text('{"taxonomy_id": "1"}')
    expect(ValueError, re.escape(str(category_file)) + '.*expected a non-empty JSON list')
    broken = [dict(e) for e in entries]
    del broken[2]['taxonomy_name']
    category_file.write_text(json.dumps(broken))
    expect(ValueError, re.escape(str(category_file)) + ".*entry 2 has no 'taxonomy_name' key")
    broken = [dict(e) for e in entries]
    del broken[4]['val']
    category_file.write_text(json.dumps(broken))
    expect(ValueError, re.escape(str(category_file)) + ".*entry 4 has no 'val' key")
    PCNDataset(root, 'train', num_complete=8)   # only the split asked for must be there
    broken = [dict(e) for e in entries]
    broken[1]['val'] = 'abc'
    category_file.write_text(json.dumps(broken))
    expect(ValueError, re.escape(str(category_file)) + r".*entry 1 \(cabinet\) 'val' must be a list")
    category_file.write_text(json.dumps(entries + [entries[0]]))
    expect(ValueError, re.escape(str(category_file)) + ".*taxonomy_id '02691156' appears twice")
    category_file.write_text(json.dumps([dict(e, val=[]) for e in entries]))
    expect(ValueError, re.escape(str(category_file)) + '.*lists no val models')
    category_file.unlink()
    expect(FileNotFoundError, re.escape(str(category_file)) + ' does not exist')
    category_file.write_text(json.dumps(entries))
    # files listed but missing
    complete = root / 'val' / 'complete' / chair / f'{model}.pcd'
    complete.rename(complete.with_suffix('.bak'))
    expect(FileNotFoundError, re.escape(str(complete)) + ' does not exist')
    complete.with_suffix('.bak').rename(complete)
    views = root / 'val' / 'partial' / chair / model
    for view in views.iterdir():
        view.rename(view.with_suffix('.bak'))
    expect(FileNotFoundError, re.escape(str(views)) + ' has no views')
    for view in views.iterdir():
        view.rename(view.with_suffix('.pcd'))
    views.rename(views.with_name('moved'))
    expect(FileNotFoundError, re.escape(str(views)) + ' does not exist')
    views.with_name('moved').rename(views)
    assert len(PCNDataset(root, 'val', num_complete=8)) == len(BUILTIN_CATEGORIES)
    # split folders
    (root / 'test' / 'partial').rename(root / 'test' / 'partial_')
    expect(FileNotFoundError, re.escape(str(root / 'test' / 'partial')) + ' does not exist', split='test')
    import shutil
    shutil.rmtree(root / 'test')
    expect(FileNotFoundError, re.escape(str(root / 'test')) + ' does not exist', split='test')


def test_dataset_content_faults_name_the_file(tmp_path):
    good = cloud(30)
    root = make_pcn(tmp_path / 'PCN', {('lamp', '03636649'): {'m0': (good, [good]), 'm1': (good, [good])}})
    view = root / 'train' / 'partial' / '03636649' / 'm1' / '00.pcd'
    write_text(view, pcd_header(2) + '0.1 0.2 0.3\nnan 0 0\n')
    dataset = PCNDataset(root, 'train', num_complete=8)
    dataset[0]
    with pytest.raises(ValueError, match=re.escape(str(view)) + '.*point 1 is not finite'):
        dataset[1]
    write_text(view, pcd_header(0))
    with pytest.raises(ValueError, match=re.escape(str(view)) + '.*empty point cloud'):
        dataset[1]
    complete = root / 'train' / 'complete' / '03636649' / 'm1.pcd'
    write_text(view, pcd_header(1) + '0 0 0\n')
    write_text(complete, pcd_header(1, fields='x y q') + '0 0 0\n')
    with pytest.raises(ValueError, match=re.escape(str(complete)) + '.*no z field'):
        dataset[1]
