"""Helpers shared by the recipe tests (imported by them, not a test module)."""
from pathlib import Path
from typing import Dict

import torch
from safetensors.torch import load_file

from vision_priors.recipes.checkpoints import latest_checkpoint


def snapshot(folder: Path) -> Dict[str, bytes]:
    """Every file under ``folder`` with its bytes (empty when the folder does not exist)."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob('*')) if p.is_file()}


def drop_data_fingerprint(run: Path) -> None:
    """Make ``run`` look like a run stored before data fingerprints: its config without ``data_fingerprint``."""
    import json
    path = Path(run) / 'config.json'
    config = json.loads(path.read_text())
    config.pop('data_fingerprint')
    path.write_text(json.dumps(config))


def final_weights(run: Path) -> Dict[str, torch.Tensor]:
    """The weights of a run folder's latest checkpoint."""
    return load_file(str(latest_checkpoint(run) / 'model.safetensors'))


def assert_same_final_weights(a_run: Path, b_run: Path) -> None:
    """Two runs end with bit-identical weights (a resumed run against an uninterrupted one)."""
    a, b = final_weights(a_run), final_weights(b_run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train_or_fail(args, name: str, seed: int, run_dir: Path, resume: bool) -> None:
    """A stand-in for a recipe's ``run_train`` (module level, so sweep workers can import it): writes a
    marker into ``run_dir``, or raises for the run named 'broken'."""
    if name == 'broken':
        raise ValueError(f'run {name} seed {seed} failed on purpose')
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / 'trained.txt').write_text(f'{name} {seed} resume={resume}')


def train_with_settings(args, name: str, seed: int, run_dir: Path, resume: bool) -> None:
    """A stand-in for a recipe's ``run_train`` that stores and checks its settings like one (``RunFolder`` first,
    ``commit`` of ``args.setting``), then writes a marker counting how often it trained."""
    from vision_priors.recipes.runs import RunFolder
    folder = RunFolder(Path(run_dir), resume)
    folder.commit(dict(name=name, seed=seed, model=name, data=None, data_fingerprint={},
                       args=dict(setting=args.setting)))
    marker = Path(run_dir) / 'trained.txt'
    marker.write_text(str(int(marker.read_text()) + 1 if marker.exists() else 1))


def train_until_stopped(args, name: str, seed: int, run_dir: Path, resume: bool) -> None:
    """A stand-in for a recipe's ``run_train`` that never finishes: writes its process id into ``run_dir`` and
    sleeps (the sweep-stopping test ends it from outside)."""
    import os
    import time
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / 'pid.tmp').write_text(str(os.getpid()))
    (Path(run_dir) / 'pid.tmp').rename(Path(run_dir) / 'pid.txt')
    while True:
        time.sleep(1)
