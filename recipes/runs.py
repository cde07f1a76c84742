"""Run folders: the guard before a run starts, its stored settings, and loading a finished run.

Order of a training command: the flags are validated (``cli.py``), then :class:`RunFolder` checks the
folder (a new run needs a folder without a run, ``--resume`` one with a run; no file in the way), the recipe
builds its data, model, loader, optimizer, schedule and evaluation data (nothing written yet, so a bad input
or setting fails with the folder as it was), and :meth:`RunFolder.commit` either writes ``config.json`` (new run)
or compares it with the stored one (``--resume``): any difference outside the keys the recipe allows
to change is an error listing the keys, and the folder is left untouched. A sweep with ``--resume``
first takes every run that holds one through these checks (:func:`check_resumed_runs`), so a changed
setting stops the sweep before any of its runs trains.

Data: a run's config stores the fingerprints of the data files it reads (``data_fingerprint``,
``fingerprint.py``). ``--resume`` refuses data that changed since (the error names the file and what changed), and
:func:`load_finished_run` checks them before any evaluation (:func:`fingerprint.check_data_unchanged`).
"""
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .cli import check_folder, check_unique
from .checkpoints import LATEST, CheckpointError, latest_checkpoint, load_weights, read_json, write_json_atomic
from .fingerprint import (DATA_FINGERPRINT, check_data_unchanged, check_stored_fingerprints, data_fingerprints,
                          fingerprint_changes)

CONFIG = 'config.json'
# flags that never change what a run computes: a resumed run may use other values
# (``builtin_root`` only says where the built-in data are cached; the generator settings that define them are
# compared)
RESUMABLE_FLAGS = ('resume', 'stop_after', 'num_workers', 'threads', 'log_every', 'checkpoint_every',
                   'keep_checkpoints', 'cpu', 'builtin_root')
# flags that describe a command, not one run (a sweep's lists, the output root), or that the config
# stores on its own (the model / method and the seed of the run)
COMMAND_FLAGS = ('command', 'out', 'models', 'methods', 'seeds', 'sources', 'runs', 'model', 'method', 'seed',
                 'cross_attn', 'cross_attns', 'jobs')


def run_settings(args: Any, **extra: Any) -> Dict[str, Any]:
    """The flags that define one run (JSON-safe), plus ``extra`` (e.g. the model name and seed)."""
    flags = {k: v for k, v in vars(args).items() if k not in COMMAND_FLAGS and not callable(v)}
    return to_json(dict(flags, **extra))


def to_json(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value))


def _flatten(value: Any, prefix: str = '') -> Dict[str, Any]:
    if isinstance(value, dict):
        out: Dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f'{prefix}.{key}' if prefix else str(key)))
        return out
    return {prefix: value}


def config_differences(stored: Dict[str, Any], new: Dict[str, Any], may_change: Iterable[str] = ()) -> List[str]:
    """Dotted keys whose values differ between two configs, ignoring keys whose last part is in ``may_change``."""
    allowed = set(RESUMABLE_FLAGS) | set(may_change)
    a, b = _flatten(to_json(stored)), _flatten(to_json(new))
    return sorted(k for k in set(a) | set(b)
                  if k.split('.')[-1] not in allowed and a.get(k, '<absent>') != b.get(k, '<absent>'))


class SettingsChecked(Exception):
    """Raised by :meth:`RunFolder.commit` inside :func:`settings_check_only`: the settings were checked, nothing
    was written and nothing trained."""


_CHECK_ONLY = [False]


@contextlib.contextmanager
def settings_check_only() -> Iterator[None]:
    """Within this block :meth:`RunFolder.commit` checks the settings and then raises :class:`SettingsChecked`."""
    _CHECK_ONLY[0] = True
    try:
        yield
    finally:
        _CHECK_ONLY[0] = False


# what every recipe's config.json holds (the recipes add their own keys; a new run also holds DATA_FINGERPRINT,
# which runs stored before it existed lack)
CONFIG_KEYS = ('model', 'seed', 'data', 'args')


def read_config(path: Path) -> Dict[str, Any]:
    """A run's ``config.json``: a JSON object with :data:`CONFIG_KEYS`; anything else is a :class:`CheckpointError`
    naming the file."""
    config = read_json(path, 'run config')
    missing = [k for k in CONFIG_KEYS if k not in config] if isinstance(config, dict) else list(CONFIG_KEYS)
    if missing:
        found = f'keys {sorted(config)}' if isinstance(config, dict) else f'a JSON {type(config).__name__}'
        raise CheckpointError(f'run config {path} is damaged: it lacks {", ".join(map(repr, missing))} (found {found})')
    return config


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds a training run (its ``config.json`` or ``latest.json``)."""
    folder = Path(folder)
    return (folder / CONFIG).exists() or (folder / LATEST).exists()


def enclosing_run(folder: Path) -> Optional[Path]:
    """The nearest folder strictly above ``folder`` (resolved) that holds a training run, or None."""
    for parent in Path(os.path.abspath(folder)).parents:
        if holds_run(parent):
            return parent
    return None


def check_not_inside_a_run(out: Path, command: Optional[str] = None, what: str = '--out') -> None:
    """Nothing is written inside another run's folder (``RUN/eval``, ``RUN/best/x``, a run nested in a run): a run
    folder changes only through its own training. Called for every command's ``--out``, before any work."""
    run = enclosing_run(Path(out))
    if run is not None:
        raise FileExistsError(f'{command + ": " if command else ""}{what} {out} lies inside the training run {run} '
                              f'({CONFIG} / {LATEST}); a run folder is written only by its own training: choose '
                              f'a {what} outside it')


def check_not_a_run(out: Path, command: Optional[str] = None, what: str = '--out') -> None:
    """An output folder that is not one run's folder (an evaluation's results, a sweep's root) must not hold a
    training run: its results.json, plots or runs would be written into the run. Called by
    ``cli.validate_common`` for every command but a one-run ``train``, before any work."""
    if holds_run(Path(out)):
        raise FileExistsError(f'{command + ": " if command else ""}{what} {out} holds a training run ({CONFIG} / '
                              f'{LATEST}); its results would be written into the run folder: choose another {what}')


class RunFolder:
    """Guard of one run's folder; construct it before building data or model.

    Args:
        path: The run folder.
        resume: ``--resume``: the folder must hold a run, whose settings the new ones must match.
    """

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = Path(path)
        self.resume = resume
        check_folder(self.path, 'run folder')
        if resume and not (self.path / CONFIG).is_file():
            raise FileNotFoundError(f'--resume: {self.path} holds no run (no {CONFIG}); check the folder name, '
                                    f'or drop --resume to start a new run')
        if not resume and holds_run(self.path):
            raise FileExistsError(f'{self.path} already holds a run ({CONFIG}); pass --resume to continue it '
                                  f'or choose another --out')
        if resume:
            self.stored = read_config(self.path / CONFIG)
            latest_checkpoint(self.path)  # a damaged pointer or checkpoint fails now, before any work

    def commit(self, config: Dict[str, Any], may_change: Sequence[str] = (), write: bool = True) -> None:
        """New run: write ``config.json``. Resume: refuse any difference outside ``may_change``, and data whose
        fingerprints (``config['data_fingerprint']``) changed; write nothing.

        ``write`` is False on the non-main processes of a launched run. A stored config without fingerprints (a run
        from before they existed) resumes as before: there is nothing to compare the data with.
        """
        # a recipe's bug: what it stores must read back through read_config, with its data's fingerprints ({} when
        # it reads no data file)
        missing = [k for k in (*CONFIG_KEYS, DATA_FINGERPRINT) if k not in config]
        if missing:
            raise KeyError(f'run config for {self.path} lacks {", ".join(map(repr, missing))}')
        if self.resume:
            stored, new = dict(self.stored), dict(config)
            stored_data, new_data = stored.pop(DATA_FINGERPRINT, None), new.pop(DATA_FINGERPRINT, None)
            problems = []
            if stored_data is not None:
                check_stored_fingerprints(stored_data, self.path / CONFIG)
                changes = fingerprint_changes(stored_data, to_json(new_data or {}))
                if changes:
                    problems.append(f'the data changed since the run in {self.path} was trained ({"; ".join(changes)})')
            diff = config_differences(stored, new, may_change)
            if diff:
                flat_old, flat_new = _flatten(to_json(stored)), _flatten(to_json(new))
                details = '; '.join(f'{k}: {flat_old.get(k, "<absent>")!r} -> {flat_new.get(k, "<absent>")!r}'
                                    for k in diff)
                problems.append(f'the settings differ from those of the run in {self.path} ({details})')
            if problems:
                raise ValueError(f'--resume: {"; and ".join(problems)}. Resume with the stored settings '
                                 f'({self.path / CONFIG}) on the data it was trained on, or start a new run with '
                                 f'another --out')
        if _CHECK_ONLY[0]:
            raise SettingsChecked(str(self.path))
        if self.resume:
            return
        if write:
            self.path.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path / CONFIG, to_json(config))


class FinishedRun(NamedTuple):
    """A trained run loaded for evaluation."""
    run_dir: Path
    config: Dict[str, Any]
    checkpoint: Path
    state_dict: Dict[str, torch.Tensor]


def load_finished_run(source: Path, kind: str, reads: Optional[Iterable[Any]] = None) -> FinishedRun:
    """A run folder (its latest checkpoint), a checkpoint folder or a run's ``best`` folder, verified: the config,
    the checkpoint's manifest and the run's data (the stored fingerprints against the files as they are now,
    :func:`fingerprint.check_data_unchanged`; a changed file is a ValueError naming it).

    Args:
        source: The folder.
        kind: The recipe's name for messages (e.g. 'spatial_vqa').
        reads: The data paths the command reads: ``None`` (default) the run's own data, all checked; else only
            the stored paths among these are (``()``: the command reads none of the run's data, e.g. a fine-tuning
            that starts from its weights, or an ``eval`` given another data source).
    """
    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f'{source} does not exist (expected a {kind} run or checkpoint folder)')
    run_dir = source if (source / CONFIG).exists() else source.parent
    if not (run_dir / CONFIG).exists():
        raise FileNotFoundError(f'{source}: no {CONFIG} in it or its parent '
                                f'(expected a {kind} run or checkpoint folder)')
    config = read_config(run_dir / CONFIG)
    checkpoint = latest_checkpoint(source) if source == run_dir else source
    if checkpoint is None:
        raise FileNotFoundError(f'{source}: no trained weights ({LATEST} missing); train it first')
    check_data_unchanged(config, run_dir, reads)
    return FinishedRun(run_dir, config, checkpoint, load_weights(checkpoint))


def sweep_folders(out: Path, names: Sequence[str], seeds: Sequence[int], resume: bool,
                  flag: str = '--models') -> List[Tuple[str, int, Path]]:
    """(name, seed, run folder) for every pair, checked up front: no duplicates; without ``--resume``
    no folder may hold a run yet (all offenders listed before anything trains)."""
    check_unique(flag, names)
    check_unique('--seeds', seeds)
    runs = [(name, seed, Path(out) / name / f'seed{seed}') for name in names for seed in seeds]
    taken = [str(path) for _, _, path in runs if holds_run(path)]
    if taken and not resume:
        raise FileExistsError(f'{len(taken)} run folder(s) already hold a run ({", ".join(taken)}); pass --resume '
                              f'to continue them or choose another --out')
    return runs


def resume_flag(resume: bool, run_dir: Path) -> bool:
    """In a sweep with ``--resume``, a run that never started starts fresh."""
    return resume and holds_run(run_dir)


def sweep_jobs(jobs: int, num_runs: int) -> int:
    """Worker processes for a sweep of ``num_runs`` runs: ``--jobs`` (0 = one per CPU core when no GPU is
    present, else 1), never more than the runs, and 1 under a multi-process launch (``accelerate launch``)."""
    if int(os.environ.get('WORLD_SIZE', '1')) > 1:
        return 1
    if jobs == 0:
        jobs = 1 if torch.cuda.is_available() else (os.cpu_count() or 1)
    return max(1, min(jobs, num_runs))


def _stop_when_parent_ends(parent: Any) -> None:
    """Block until the sweep's parent process has ended (however it ended: SIGTERM, SIGKILL or a crash), then end
    this worker at once. Without it a stopped sweep leaves its workers training: they hold the cores and may
    still write checkpoints into run folders nobody is watching."""
    multiprocessing.connection.wait([parent.sentinel])
    print(f'sweep worker {os.getpid()}: the sweep (process {parent.pid}) has ended; stopping', flush=True)
    os._exit(1)


def _start_worker(threads: int) -> None:
    from . import engine
    engine.PROGRESS = False  # one progress bar per worker would interleave; the sweep reports finished runs
    torch.set_num_threads(threads)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_stop_when_parent_ends, args=(parent,), name='sweep-parent-watch', daemon=True).start()


def check_resumed_runs(train: Callable[..., Any], args: Any, runs: Sequence[Tuple[Any, ...]], **kwargs: Any) -> None:
    """Every run of a ``--resume`` sweep that holds one goes through ``train`` up to :meth:`RunFolder.commit` (its
    folder, checkpoint and settings checks), in this process, before any run trains; each failure is printed and
    the first one raised, so one changed setting or damaged checkpoint stops the whole sweep with nothing trained."""
    errors = []
    with settings_check_only():
        for run in runs:
            if not resume_flag(True, Path(run[-1])):
                continue
            try:
                train(args, *run, True, **kwargs)
            except SettingsChecked:
                continue
            except Exception as error:  # noqa: BLE001 - reported below, the first one raised
                print(f'FAILED: {run[-1]}: {type(error).__name__}: {error}', flush=True)
                errors.append(error)
                continue
            raise RuntimeError(f'{train.__name__} returned without reaching RunFolder.commit for {run[-1]}: its '
                               f'settings could not be checked')
    if errors:
        raise errors[0]


def train_sweep(train: Callable[..., Any], args: Any, runs: Sequence[Tuple[Any, ...]], **kwargs: Any) -> None:
    """Train every run of a sweep: ``train(args, *run, resume, **kwargs)`` with ``run = (..., run_dir)`` and
    ``resume`` from :func:`resume_flag`.

    With ``args.jobs`` > 1 (see :func:`sweep_jobs`) the runs train in that many spawned worker processes, each
    with ``threads // jobs`` torch threads (at least 1; ``threads`` is ``--threads`` or torch's default). Every
    run is seeded by itself, so at the same threads per run its weights are those it gets when trained alone
    (other thread counts change float rounding only). A failed run does not stop the others: each is reported
    as it is collected, and once all have finished or failed the first failure is raised. Each worker ends as
    soon as this process ends, however it was stopped (:func:`_stop_when_parent_ends`). With ``args.resume``,
    :func:`check_resumed_runs` runs first.
    """
    if getattr(args, 'resume', False):
        check_resumed_runs(train, args, runs, **kwargs)
    jobs = sweep_jobs(getattr(args, 'jobs', 1), len(runs))
    if jobs == 1:
        for run in runs:
            train(args, *run, resume_flag(args.resume, Path(run[-1])), **kwargs)
        return
    threads = max(1, (getattr(args, 'threads', 0) or torch.get_num_threads()) // jobs)
    context = multiprocessing.get_context('spawn')
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_start_worker, initargs=(threads,)) as pool:
        futures = [(run, pool.submit(train, args, *run, resume_flag(args.resume, Path(run[-1])), **kwargs))
                   for run in runs]
        errors = []
        for run, future in futures:
            try:
                future.result()
                print(f'trained: {run[-1]}', flush=True)
            except Exception as error:  # noqa: BLE001 - reported below, the first one raised
                print(f'FAILED: {run[-1]}: {type(error).__name__}: {error}', flush=True)
                errors.append(error)
        if errors:
            raise errors[0]


__all__ = ['CONFIG', 'CONFIG_KEYS', 'DATA_FINGERPRINT', 'CheckpointError', 'FinishedRun', 'RunFolder',
           'SettingsChecked', 'check_not_a_run', 'check_not_inside_a_run', 'check_resumed_runs', 'config_differences',
           'data_fingerprints', 'enclosing_run', 'holds_run', 'load_finished_run', 'read_config', 'resume_flag',
           'run_settings', 'settings_check_only', 'sweep_folders', 'sweep_jobs', 'to_json', 'train_sweep']
