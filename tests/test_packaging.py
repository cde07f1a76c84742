"""Packaging: one top-level import name, the console command, and a model library that needs no recipe extras."""
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE_ONLY = ('accelerate', 'webdataset', 'matplotlib', 'scipy', 'vision_priors.recipes')


@pytest.fixture(scope='module')
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the tree (the checkout stays untouched)."""
    work = tmp_path_factory.mktemp('wheel')
    source = work / 'src'
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns('.venv', '.cache', '.git', 'outputs', 'build', 'dist',
                                                                 '*.egg-info', '__pycache__', '.pytest_cache'))
    result = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '--quiet',
                             '-w', str(work / 'dist'), str(source)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    wheels = list((work / 'dist').glob('vision_priors-*.whl'))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_has_one_top_level_import_name_and_its_data(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(archive.read(n).decode() for n in names if n.endswith('.dist-info/entry_points.txt'))
        top_level = {n.split('/')[0] for n in names if not n.split('/')[0].endswith('.dist-info')}
    assert top_level == {'vision_priors'}
    for path in ('vision_priors/kernels/pope_cpu.cpp', 'vision_priors/kernels/pope_cpu.py',
                 'vision_priors/kernels/flash_prior.py', 'vision_priors/recipes/spatial_vqa.py',
                 'vision_priors/recipes/data/builtin_scenes.py', 'vision_priors/recipes/README.md',
                 'vision_priors/layers/goat.py', 'vision_priors/models/vision_transformer_priors.py',
                 'vision_priors/kernels/_backend.py', 'vision_priors/kernels/lavo_ref.py',
                 'vision_priors/kernels/lavo_torch.py', 'vision_priors/kernels/chamfer_ref.py'):
        assert path in names, path
    # the ahead-of-time compile tool is development tooling (tools/aot.py), not part of the runtime package
    assert not [n for n in names if n.endswith('/aot.py') or n.startswith('tools/')]
    assert 'vision-priors = vision_priors.recipes.console:main' in entry_points


def _run_outside(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_console_command_help_from_outside_the_repository(tmp_path):
    script = Path(sys.executable).with_name('vision-priors')
    command = [str(script)] if script.exists() else [sys.executable, '-m', 'vision_priors.recipes.console']
    result = _run_outside(tmp_path, *command, '--help')
    assert result.returncode == 0, result.stderr
    assert 'resolution' in result.stdout and 'vqa' in result.stdout
    result = _run_outside(tmp_path, *command, 'vqa', 'train', '--help')
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('usage: vision-priors vqa train') and '--eval-every' in result.stdout
    result = _run_outside(tmp_path, *command, 'nonsense')
    assert result.returncode == 2 and "unknown command 'nonsense'" in result.stderr
    result = _run_outside(tmp_path, sys.executable, '-m', 'vision_priors.recipes.resolution_extrapolation', '--help')
    assert result.returncode == 0 and 'compare' in result.stdout, result.stderr


def test_generic_top_level_names_are_not_installed(tmp_path):
    for name in ('kernels', 'recipes'):
        result = _run_outside(tmp_path, sys.executable, '-c', f'import {name}')
        assert result.returncode != 0 and f"No module named '{name}'" in result.stderr


def test_model_library_works_without_the_recipe_extras(tmp_path):
    """``import vision_priors`` and ``timm.create_model`` with accelerate, webdataset, matplotlib, scipy and the
    recipes made unimportable (as after ``pip install vision_priors`` without ``[recipes]``)."""
    code = textwrap.dedent(f'''
        import sys
        import importlib.abc

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + '.') for b in {RECIPE_ONLY!r}):
                    raise ImportError(f'blocked: {{name}}')
                return None

        sys.meta_path.insert(0, Block())
        import torch, timm
        import vision_priors
        from vision_priors.layers import GoatAttention
        from vision_priors.kernels import chamfer_distance
        model = timm.create_model('vit_tiny_patch16_goat_224', num_classes=3, img_size=32, patch_size=8)
        out = model(torch.randn(1, 3, 32, 48))
        assert out.shape == (1, 3), out.shape
        loaded = [n for n in {RECIPE_ONLY!r} if n in sys.modules]
        assert not loaded, loaded
        print('OK')
    ''')
    result = _run_outside(tmp_path, sys.executable, '-c', code)
    assert result.returncode == 0 and result.stdout.strip().endswith('OK'), result.stderr[-3000:]
