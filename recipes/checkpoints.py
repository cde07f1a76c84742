"""Checkpoints that cannot lie: written atomically, verified file by file on every load.

A checkpoint is the folder ``accelerator.save_state`` writes (model weights as safetensors, optimizer,
scheduler, counters, EMA, every process's RNG state) plus ``manifest.json``: the size and SHA-256 of
every file in it. It is written to a temporary folder, the manifest added, the folder renamed to
``checkpoint-<update>`` and only then published by atomically replacing ``latest.json``; a run killed
at any moment leaves the previous checkpoint intact. Loading checks the manifest first: a missing,
truncated or altered file is an error naming the file (and, where one exists, the older intact
checkpoint to fall back to); RNG state that was not restored is an error too.
"""
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from accelerate import Accelerator

LATEST = 'latest.json'
MANIFEST = 'manifest.json'
WEIGHTS = 'model.safetensors'
EMA_WEIGHTS = 'ema.safetensors'  # a run with a model EMA: the averaged weights, the ones it evaluates and reports
CHECKPOINT_PREFIX = 'checkpoint-'


class CheckpointError(ValueError):
    """A checkpoint or its pointer is missing, damaged or inconsistent (the message names the file)."""


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to ``path`` via a temporary file and ``os.replace`` (never a half-written file)."""
    path = Path(path)
    tmp = path.with_name(f'.{path.name}.tmp-{os.getpid()}')
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


def read_json(path: Path, what: str) -> Any:
    """Parse a JSON file; an unreadable or malformed one is a :class:`CheckpointError` naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f'{what} {path} is damaged: {e}') from e


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open('rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Record size and SHA-256 of every file under ``folder`` in ``folder/manifest.json``."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob('*') if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {'bytes': p.stat().st_size, 'sha256': sha256(p)} for p in files}
    write_json_atomic(folder / MANIFEST, {'files': entries})


def verify_checkpoint(folder: Path) -> None:
    """Check every file listed in ``folder/manifest.json``; raise :class:`CheckpointError` naming the first bad one."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not folder.is_dir():
        raise CheckpointError(f'checkpoint folder {folder} does not exist')
    if not manifest_path.is_file():
        raise CheckpointError(f'checkpoint {folder} has no {MANIFEST}: it is incomplete or was not written by '
                              f'this package')
    manifest = read_json(manifest_path, 'checkpoint manifest')
    files = manifest.get('files') if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f'checkpoint manifest {manifest_path} is damaged: no file list')
    for name, expected in files.items():
        if (not isinstance(expected, dict) or not isinstance(expected.get('bytes'), int)
                or not isinstance(expected.get('sha256'), str) or Path(name).is_absolute() or '..' in Path(name).parts):
            raise CheckpointError(f'checkpoint manifest {manifest_path} is damaged: entry {name!r}: {expected!r} '
                                  'is not a file inside the checkpoint with its "bytes" and "sha256"')
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f'checkpoint file {path} is missing (listed in {manifest_path})')
        size = path.stat().st_size
        if size != expected['bytes']:
            raise CheckpointError(f'checkpoint file {path} is damaged: {size} bytes, {expected["bytes"]} written')
        if sha256(path) != expected['sha256']:
            raise CheckpointError(f'checkpoint file {path} is damaged: its SHA-256 differs from the one written '
                                  f'in {manifest_path}')


def checkpoint_folders(out_dir: Path) -> List[Path]:
    """Published checkpoint folders in ``out_dir``, oldest first."""
    return sorted(p for p in Path(out_dir).glob(f'{CHECKPOINT_PREFIX}*') if p.is_dir())


def _fallback_hint(out_dir: Path, damaged: Path) -> str:
    for older in reversed([p for p in checkpoint_folders(out_dir) if p.name < damaged.name]):
        try:
            verify_checkpoint(older)
        except CheckpointError:
            continue
        return (f' The older checkpoint {older} is intact: to continue from it, set "checkpoint": '
                f'"{older.name}" in {Path(out_dir) / LATEST}.')
    return ' No older intact checkpoint is left in the run folder.'


def latest_checkpoint(out_dir: Path, verify: bool = True) -> Optional[Path]:
    """The checkpoint named by ``out_dir/latest.json`` (verified), or None when there is no pointer."""
    out_dir = Path(out_dir)
    pointer = out_dir / LATEST
    if not pointer.exists():
        return None
    record = read_json(pointer, 'checkpoint pointer')
    name = record.get('checkpoint') if isinstance(record, dict) else None
    if not isinstance(name, str) or not name.startswith(CHECKPOINT_PREFIX) or '/' in name:
        raise CheckpointError(f'checkpoint pointer {pointer} is damaged: no valid "checkpoint" entry '
                              f'(found {record!r})' + _fallback_hint(out_dir, out_dir / '~'))
    path = out_dir / name
    if verify:
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            raise CheckpointError(f'{e}.{_fallback_hint(out_dir, path)}') from e
    return path


def save_checkpoint(accelerator: Accelerator, out_dir: Path, step: int, keep: int = 2,
                    ema_model: Optional[torch.nn.Module] = None) -> Path:
    """Atomically write ``out_dir/checkpoint-<step>`` with its manifest, point ``latest.json`` at it; keep the newest
    ``keep`` checkpoints (0 = all of them).

    ``ema_model``: a model EMA's averaged module; its weights are written as ``ema.safetensors`` beside the
    training state (which holds the EMA too, for ``--resume``) and are the checkpoint's evaluation weights."""
    out_dir = Path(out_dir)
    final = out_dir / f'{CHECKPOINT_PREFIX}{step:08d}'
    tmp = out_dir / f'.tmp-{CHECKPOINT_PREFIX}{step:08d}'
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if ema_model is not None:
            save_module_weights(ema_model, tmp / EMA_WEIGHTS)
        write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_json_atomic(out_dir / LATEST, {'checkpoint': final.name, 'step': step})
        old = [p for p in checkpoint_folders(out_dir) if p != final] if keep else []
        for path in old[:max(0, len(old) - (keep - 1))]:
            shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, path: Path) -> None:
    """Verify ``path`` and restore it with ``accelerator.load_state``; RNG state must be restored exactly.

    accelerate skips RNG state it cannot read with an INFO log line, after which a resumed run silently
    differs from an uninterrupted one: here that is an error naming the file.
    """
    path = Path(path)
    verify_checkpoint(path)
    rng_file = path / f'random_states_{accelerator.process_index}.pkl'
    if not rng_file.is_file():
        raise CheckpointError(f'checkpoint {path} has no RNG state for process {accelerator.process_index} '
                              f'({rng_file.name}): it was written by a run with fewer processes')
    try:
        states = torch.load(rng_file, weights_only=False)
        expected = states['torch_manual_seed']
    except Exception as e:  # noqa: BLE001  (any unreadable pickle)
        raise CheckpointError(f'RNG state {rng_file} cannot be restored: {type(e).__name__}: {e}') from e
    accelerator.load_state(str(path))
    if not torch.equal(torch.get_rng_state(), expected):
        raise CheckpointError(f'RNG state {rng_file} was not restored (accelerate could not apply it)')


def save_module_weights(module: torch.nn.Module, path: Path) -> None:
    """A module's state dict as safetensors (detached, on the CPU, contiguous)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}, str(path))


def load_weights(folder: Path) -> Dict[str, torch.Tensor]:
    """The evaluation weights of a verified checkpoint folder: ``ema.safetensors`` when the run kept a model
    EMA (as timm's training script, the averaged model is the one validated and exported), else
    ``model.safetensors``."""
    from safetensors.torch import load_file

    folder = Path(folder)
    verify_checkpoint(folder)
    weights = folder / EMA_WEIGHTS if (folder / EMA_WEIGHTS).is_file() else folder / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f'checkpoint {folder} has no {WEIGHTS}')
    try:
        return load_file(str(weights))
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise CheckpointError(f'model weights {weights} cannot be read: {e}') from e
