"""Shared training machinery: one loop on accelerate, with evaluation, best checkpoint and early stopping.

Every recipe builds its model, data and loss, then calls :func:`fit`. Devices, mixed precision,
gradient accumulation and multi-process runs (``accelerate launch``) come from ``accelerate``;
optimizers, schedulers, EMA and mixup from timm. Checkpoints (``checkpoints.py``) hold the model,
optimizer, scheduler, counters, EMA, best-metric state and every process's RNG state; ``--resume``
restores all of it and skips the batches already seen in the current epoch (the sampler is seeded per
epoch), so a resumed run reproduces an uninterrupted one bit for bit.
"""
import contextlib
import math
import random
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, send_to_device, set_seed
from timm.scheduler import create_scheduler_v2
from timm.utils import accuracy

from .checkpoints import (WEIGHTS, latest_checkpoint, load_checkpoint, save_checkpoint, save_module_weights,
                          write_json_atomic, write_manifest)
from .logs import JsonlLogger

PROGRESS = True  # training progress bars (sweep workers turn theirs off: see runs.train_sweep)
BEST_DIR = 'best'


class PerSampleSeeds(Dataset):
    """Makes a map-style dataset's random augmentation a function of (seed, epoch, index).

    Each ``__getitem__`` runs under torch / numpy / python RNGs seeded from (seed, epoch, index) and
    restores the previous states afterwards, so augmentation neither depends on worker count or on
    the loader's prefetching nor consumes the model's RNG stream: a resumed run sees the very same
    augmented batches as an uninterrupted one. :func:`fit` calls ``set_epoch``.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        sample_seed = (self.seed * 1_000_003 + self.epoch * 9_176_467 + int(index)) % (2 ** 63)
        with preserved_rng():
            # the CPU generator only (what data loading draws from): torch.manual_seed would also queue a
            # lazy seeding of every CUDA / XPU / MTIA device, recording a stack trace per sample on a
            # machine without one (2 ms, most of a small model's training step)
            torch.random.default_generator.manual_seed(sample_seed)
            random.seed(sample_seed)
            np.random.seed(sample_seed % (2 ** 32))
            return self.dataset[index]


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the python / numpy / torch (CPU and CUDA) RNG states on exit."""
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


class TrainState:
    """Update / micro-batch counters, the last training loss read back and best-metric bookkeeping, checkpointed
    with the rest (so a finished run resumed reports what it ended with)."""

    def __init__(self) -> None:
        self.micro_step = 0
        self.update = 0
        self.last_loss = math.nan
        self.best_value: Optional[float] = None
        self.best_update = 0
        self.evals_since_best = 0

    def state_dict(self) -> Dict[str, Any]:
        return dict(micro_step=self.micro_step, update=self.update, last_loss=self.last_loss,
                    best_value=self.best_value, best_update=self.best_update, evals_since_best=self.evals_since_best)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.micro_step = int(state['micro_step'])
        self.update = int(state['update'])
        self.last_loss = float(state.get('last_loss', math.nan))  # checkpoints before stop 54 lack it
        self.best_value = state.get('best_value')
        self.best_update = int(state.get('best_update', 0))
        self.evals_since_best = int(state.get('evals_since_best', 0))

    def stopped_early(self, total_updates: int, patience: int) -> bool:
        """Patience ran out before the last update (at the last update the run simply ends)."""
        return bool(patience) and self.evals_since_best >= patience and self.update < total_updates


def make_accelerator(seed: int, mixed_precision: str = 'no', grad_accum: int = 1, cpu: bool = False) -> Accelerator:
    """Accelerator with a per-epoch seeded sampler (deterministic data order, exact resume)."""
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=grad_accum,
        cpu=cpu,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
    )
    set_seed(seed, device_specific=True)
    return accelerator


def close_distributed() -> None:
    """Destroy the process group (if any) at the end of a launched run, so its threads join before exit."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def train_loader(dataset: Dataset, batch_size: int, seed: int, num_workers: int = 0) -> DataLoader:
    """Shuffled, seeded, drop-last loader over a map-style dataset whose augmentation is per-sample seeded.

    A dataset whose class sets ``draws_random = False`` (its items are fixed tensors, e.g. pre-rendered scenes) is
    read directly: seeding three RNGs per sample would cost about a third of a small model's training step and
    change nothing."""
    items = PerSampleSeeds(dataset, seed) if getattr(dataset, 'draws_random', True) else dataset
    loader = DataLoader(items, batch_size=batch_size, shuffle=True, drop_last=True,
                        num_workers=num_workers, generator=torch.Generator().manual_seed(seed))
    if len(loader) == 0:
        raise ValueError(f'{len(dataset)} training samples < --batch-size {batch_size}: no full batch')
    return loader


def count_updates(updates: int, epochs: int, micro_batches_per_epoch: int, grad_accum: int) -> int:
    """``updates`` when set, else ``epochs`` worth of optimizer updates."""
    return updates or max(1, epochs * (micro_batches_per_epoch // grad_accum))


def cosine_schedule(optimizer: torch.optim.Optimizer, lr: float, total_updates: int, warmup_frac: float):
    """timm cosine schedule in optimizer updates (one scheduler 'epoch' = one update), linear warm-up
    over ``warmup_frac`` of them from lr / 100, ending at lr / 100."""
    scheduler, _ = create_scheduler_v2(
        optimizer, sched='cosine', num_epochs=total_updates, warmup_epochs=int(round(warmup_frac * total_updates)),
        warmup_lr=lr * 0.01, min_lr=lr * 0.01, step_on_epochs=False, updates_per_epoch=1)
    return scheduler


def _improved(value: float, best: Optional[float], mode: str) -> bool:
    if best is None:
        return True
    return value < best if mode == 'min' else value > best


def save_best(accelerator: Accelerator, model: nn.Module, out_dir: Path, update: int,
              metrics: Dict[str, float]) -> None:
    """Write the model weights to ``out_dir/best`` (safetensors + manifest + metrics.json), replacing the old ones."""
    if not accelerator.is_main_process:
        return
    import shutil
    best, tmp = Path(out_dir) / BEST_DIR, Path(out_dir) / f'.tmp-{BEST_DIR}'
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_module_weights(accelerator.unwrap_model(model), tmp / WEIGHTS)
    write_json_atomic(tmp / 'metrics.json', dict(update=update, **metrics))
    write_manifest(tmp)
    shutil.rmtree(best, ignore_errors=True)
    tmp.rename(best)


def check_finite_loss(loss: float, update: int, micro_batches: int, out_dir: Path) -> None:
    """A diverged run stops with an error instead of training on and saving NaN weights as a result."""
    if not math.isfinite(loss):
        last_saved = latest_checkpoint(out_dir)
        saved = f'the last checkpoint, {last_saved}, is from before' if last_saved else 'no checkpoint was saved'
        raise FloatingPointError(
            f'training loss is {loss} at update {update} (mean of the last {micro_batches} micro-batches): the run '
            f'diverged and was stopped; {saved} (lower --lr, raise --warmup-frac or set --clip-grad, then start a '
            f'new run)')


def fit(
        accelerator: Accelerator,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        train_loader: Iterable,
        loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
        total_updates: int,
        out_dir: Path,
        *,
        batch_transform: Optional[Callable] = None,
        ema: Optional[nn.Module] = None,
        clip_grad: Optional[float] = None,
        checkpoint_every: int = 0,
        keep_checkpoints: int = 2,
        resume: bool = False,
        stop_after: Optional[int] = None,
        log_every: int = 10,
        logger: Optional[JsonlLogger] = None,
        epoch_length: Optional[int] = None,
        step_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
        eval_every: int = 0,
        evaluate: Optional[Callable[[], Dict[str, float]]] = None,
        best_metric: Optional[str] = None,
        best_mode: str = 'max',
        patience: int = 0,
) -> Dict[str, Any]:
    """Train for ``total_updates`` optimizer updates.

    Args:
        accelerator: From :func:`make_accelerator`; ``model``, ``optimizer`` and a map-style
            ``train_loader`` must already be ``accelerator.prepare``-d (an iterable / webdataset
            loader is not: it is split per rank by its reader).
        scheduler: timm scheduler stepped per update (``step_update``), checkpointed.
        loss_fn: ``loss_fn(logits, targets)`` for loaders of ``(images, targets)``; unused with ``step_fn``.
        batch_transform: ``(images, targets) -> (images, targets)`` on device (e.g. timm Mixup).
        ema: timm ``ModelEmaV3`` updated after each optimizer update, checkpointed. Its averaged weights are
            the run's result (timm's convention): ``evaluate`` must evaluate ``ema.module``, ``best`` holds them
            and every checkpoint has them as ``ema.safetensors`` (what ``load_weights`` returns).
        checkpoint_every: Save every this many updates (and at the end); 0 = only at the end.
        keep_checkpoints: Keep the newest this many checkpoints in ``out_dir``; 0 = all (e.g. to test every epoch's
            weights afterwards).
        resume: Continue from ``out_dir/latest.json`` if present (verified file by file).
        stop_after: Stop (after checkpointing) once this many updates are done: simulates a kill.
        log_every: Log the mean training loss of the last updates every this many updates, with the number of
            micro-batches it averages (``micro_batches``: fewer right after a resume); the loss is read back
            from the device only then (no per-step synchronisation).
        epoch_length: Micro-batches per epoch for loaders without ``len``.
        step_fn: For batches of any structure (e.g. a dict): ``step_fn(model, batch) -> loss``, called
            under autocast with the batch already on the device; replaces ``loss_fn(model(images), targets)``.
        eval_every: Call ``evaluate`` every this many updates (and at the end); 0 = never.
        evaluate: ``() -> metrics`` (runs with the RNG states preserved, so evaluation never changes training).
        best_metric: Metric of ``evaluate`` to track: its best value's weights go to ``out_dir/best``.
        best_mode: 'max' or 'min': which direction is better.
        patience: Stop early after this many evaluations without improvement of ``best_metric``; 0 = never.

    Returns:
        ``{'updates', 'last_loss', 'checkpoint', 'best_value', 'best_update', 'stopped_early'}``.
    """
    if step_fn is None and loss_fn is None:
        raise ValueError('fit() needs loss_fn (for (images, targets) batches) or step_fn')
    if (eval_every or best_metric or patience) and evaluate is None:
        raise ValueError('eval_every / best_metric / patience need an evaluate callback')
    if patience and not best_metric:
        raise ValueError('early stopping (patience) needs best_metric')
    if best_mode not in ('max', 'min'):
        raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
    out_dir = Path(out_dir)
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    if scheduler is not None:
        accelerator.register_for_checkpointing(scheduler)
    if ema is not None:
        accelerator.register_for_checkpointing(ema)
    if resume:
        path = latest_checkpoint(out_dir)
        if path is not None:
            load_checkpoint(accelerator, path)
            accelerator.print(f'resumed from {path} at update {state.update}')

    micro_per_epoch = epoch_length or len(train_loader)  # type: ignore[arg-type]
    if micro_per_epoch < 1:
        raise ValueError('the training loader is empty')
    progress = tqdm(total=total_updates, initial=state.update, disable=not accelerator.is_main_process or not PROGRESS,
                    desc='train', dynamic_ncols=True)
    loss_sum = torch.zeros((), device=accelerator.device)
    losses_summed = 0
    last_loss = state.last_loss
    stopped_early = state.stopped_early(total_updates, patience)  # a resumed run that had already stopped

    def run_evaluation() -> bool:
        """Evaluate, track the best value; True when patience is exhausted."""
        with preserved_rng():
            metrics = evaluate()
        model.train()
        if logger is not None:
            logger.log(event='eval', update=state.update, **metrics)
        if not best_metric:
            return False
        if best_metric not in metrics:
            raise KeyError(f'best metric {best_metric!r} is not among the evaluation metrics {sorted(metrics)}')
        value = float(metrics[best_metric])
        if _improved(value, state.best_value, best_mode):
            state.best_value, state.best_update, state.evals_since_best = value, state.update, 0
            save_best(accelerator, model if ema is None else ema.module, out_dir, state.update, metrics)
            return False
        state.evals_since_best += 1
        return bool(patience) and state.evals_since_best >= patience

    model.train()
    done = state.update >= total_updates or stopped_early
    while not done:
        epoch, offset = divmod(state.micro_step, micro_per_epoch)
        if hasattr(train_loader, 'set_epoch'):
            train_loader.set_epoch(epoch)  # the sampler's per-epoch seed
        if hasattr(getattr(train_loader, 'dataset', None), 'set_epoch'):
            train_loader.dataset.set_epoch(epoch)  # e.g. PerSampleSeeds
        loader = accelerator.skip_first_batches(train_loader, offset) if offset else train_loader
        # creating a loader iterator draws a worker base seed from the global RNG; keep that draw out
        # of the model's RNG stream so a resumed run (one extra iterator) matches an uninterrupted one
        with preserved_rng():
            batches = iter(loader)
        seen = 0
        for batch in batches:
            if step_fn is None:
                images, targets = batch
                images, targets = images.to(accelerator.device), targets.to(accelerator.device)
                if batch_transform is not None:
                    images, targets = batch_transform(images, targets)
            else:
                batch = send_to_device(batch, accelerator.device)
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    loss = loss_fn(model(images), targets) if step_fn is None else step_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and clip_grad:
                    accelerator.clip_grad_norm_(model.parameters(), clip_grad)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state.micro_step += 1
            seen += 1
            loss_sum += loss.detach().float()
            losses_summed += 1
            if not accelerator.sync_gradients:
                continue
            state.update += 1
            if scheduler is not None:
                scheduler.step_update(num_updates=state.update)
            if ema is not None:
                ema.update(accelerator.unwrap_model(model), step=state.update)
            progress.update(1)
            at_end = state.update >= total_updates
            logging = state.update % log_every == 0 or at_end
            evaluating = evaluate is not None and ((eval_every and state.update % eval_every == 0) or at_end)
            saving = at_end or (checkpoint_every and state.update % checkpoint_every == 0) or (
                stop_after is not None and state.update >= stop_after)
            if logging or ((evaluating or saving) and losses_summed):
                # read back at the log interval and before every evaluation or checkpoint, so diverged weights
                # are never evaluated, kept as the best or saved
                last_loss = accelerator.gather((loss_sum / max(1, losses_summed))[None]).float().mean().item()
                check_finite_loss(last_loss, state.update, losses_summed, out_dir)
                state.last_loss = last_loss
            if logging:
                progress.set_postfix(loss=f'{last_loss:.4f}')
                if logger is not None:
                    logger.log(event='train', update=state.update, epoch=epoch, loss=last_loss,
                               micro_batches=losses_summed, lr=optimizer.param_groups[0]['lr'])
                loss_sum.zero_()
                losses_summed = 0
            if evaluating:
                stopped_early = run_evaluation() and not at_end
                if stopped_early and logger is not None:
                    logger.log(event='early_stop', update=state.update, best_update=state.best_update,
                               best_value=state.best_value)
            stopping = stopped_early or (stop_after is not None and state.update >= stop_after)
            if at_end or stopping or (checkpoint_every and state.update % checkpoint_every == 0):
                save_checkpoint(accelerator, out_dir, state.update, keep=keep_checkpoints,
                                ema_model=None if ema is None else ema.module)
            if at_end or stopping:
                done = True
                break
            if epoch_length is not None and seen >= epoch_length - offset:
                break
        else:
            if seen == 0:
                raise ValueError(f'the training loader yielded no batch in epoch {epoch}')
    progress.close()
    return {'updates': state.update, 'last_loss': last_loss, 'checkpoint': latest_checkpoint(out_dir),
            'best_value': state.best_value, 'best_update': state.best_update, 'stopped_early': stopped_early}


@torch.no_grad()
def evaluate_classifier(model: nn.Module, loader: Iterable, accelerator: Accelerator) -> Dict[str, float]:
    """Top-1 / top-5 accuracy (%) and mean cross-entropy over a (prepared) loader, all processes."""
    model.eval()
    correct1 = correct5 = total = 0
    loss_sum = 0.0
    for images, targets in loader:
        images, targets = images.to(accelerator.device), targets.to(accelerator.device)
        with accelerator.autocast():
            logits = model(images)
        logits, targets = accelerator.gather_for_metrics((logits.float(), targets))
        top1, top5 = accuracy(logits, targets, topk=(1, 5))
        correct1 += round(top1.item() * targets.numel() / 100.0)
        correct5 += round(top5.item() * targets.numel() / 100.0)
        loss_sum += nn.functional.cross_entropy(logits, targets, reduction='sum').item()
        total += targets.numel()
    if total == 0:
        raise ValueError('the evaluation loader is empty')
    return {'top1': 100.0 * correct1 / total, 'top5': 100.0 * correct5 / total, 'loss': loss_sum / total,
            'samples': total}
