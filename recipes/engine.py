"""Shared recipe machinery: one training loop on accelerate, atomic checkpoints, JSON-lines logs.

Every recipe builds its model, data and loss, then calls :func:`fit`. Devices, mixed precision,
gradient accumulation and multi-process runs (``accelerate launch``) come from ``accelerate``;
optimizers, schedulers, EMA and mixup from timm.

Checkpoints: ``accelerator.save_state`` (model weights as safetensors, optimizer, scheduler, step
counter, EMA and every process's RNG states) is written to a temporary folder, renamed into
``checkpoint-<step>`` and only then published by atomically replacing ``latest.json``; a run killed at
any moment leaves the previous checkpoint intact. ``--resume`` restores all of it and skips the
batches already seen in the current epoch (the sampler is seeded per epoch), so a resumed run
reproduces an uninterrupted one.
"""
import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, send_to_device, set_seed

LATEST = 'latest.json'


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
        torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            torch.manual_seed(sample_seed)
            random.seed(sample_seed)
            np.random.seed(sample_seed % (2 ** 32))
            return self.dataset[index]
        finally:
            torch.set_rng_state(torch_state)
            random.setstate(py_state)
            np.random.set_state(np_state)


class StepCounter:
    """Optimizer-update and micro-batch counters, checkpointed with the rest of the state."""

    def __init__(self) -> None:
        self.micro_step = 0
        self.update = 0

    def state_dict(self) -> Dict[str, int]:
        return {'micro_step': self.micro_step, 'update': self.update}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.micro_step = int(state['micro_step'])
        self.update = int(state['update'])


class JsonlLogger:
    """Appends one JSON object per line (main process only), flushed at once."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, **record: Any) -> None:
        if not self.enabled:
            return
        record.setdefault('time', time.time())
        with self.path.open('a') as f:
            f.write(json.dumps(record) + '\n')


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to ``path`` via a temporary file and ``os.replace`` (never a half-written file)."""
    path = Path(path)
    tmp = path.with_name(f'.{path.name}.tmp-{os.getpid()}')
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


def make_accelerator(
        seed: int,
        mixed_precision: str = 'no',
        grad_accum: int = 1,
        cpu: bool = False,
) -> Accelerator:
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


def latest_checkpoint(out_dir: Path) -> Optional[Path]:
    """The checkpoint named by ``latest.json`` in ``out_dir``, or None when there is none."""
    pointer = Path(out_dir) / LATEST
    if not pointer.exists():
        return None
    name = json.loads(pointer.read_text())['checkpoint']
    path = Path(out_dir) / name
    if not path.is_dir():
        raise FileNotFoundError(f'{pointer} names {name}, but {path} does not exist')
    return path


def save_checkpoint(accelerator: Accelerator, out_dir: Path, step: int, keep: int = 2) -> Path:
    """Atomically write ``out_dir/checkpoint-<step>`` and point ``latest.json`` at it; keep ``keep``."""
    out_dir = Path(out_dir)
    final = out_dir / f'checkpoint-{step:08d}'
    tmp = out_dir / f'.tmp-checkpoint-{step:08d}'
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_json_atomic(out_dir / LATEST, {'checkpoint': final.name, 'step': step})
        old = sorted(p for p in out_dir.glob('checkpoint-*') if p.is_dir() and p != final)
        for path in old[:max(0, len(old) - (keep - 1))]:
            shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


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
        resume: bool = False,
        stop_after: Optional[int] = None,
        log_every: int = 10,
        logger: Optional[JsonlLogger] = None,
        epoch_length: Optional[int] = None,
        step_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
) -> Dict[str, Any]:
    """Train for ``total_updates`` optimizer updates.

    Args:
        accelerator: From :func:`make_accelerator`; ``model``, ``optimizer`` and a map-style
            ``train_loader`` must already be ``accelerator.prepare``-d (an iterable / webdataset
            loader is not: it is split per rank by its reader).
        scheduler: timm scheduler stepped per update (``step_update``), checkpointed.
        loss_fn: ``loss_fn(logits, targets)`` for loaders of ``(images, targets)``; unused with ``step_fn``.
        batch_transform: ``(images, targets) -> (images, targets)`` on device (e.g. timm Mixup).
        ema: timm ``ModelEmaV3`` updated after each optimizer update, checkpointed.
        checkpoint_every: Save every this many updates (and at the end); 0 = only at the end.
        resume: Continue from ``out_dir/latest.json`` if present.
        stop_after: Stop (after checkpointing) once this many updates are done: simulates a kill.
        epoch_length: Micro-batches per epoch for loaders without ``len``.
        step_fn: For batches of any structure (e.g. a dict): ``step_fn(model, batch) -> loss``, called
            under autocast with the batch already on the device; replaces ``loss_fn(model(images), targets)``.

    Returns:
        ``{'updates': ..., 'last_loss': ..., 'checkpoint': path}``.
    """
    out_dir = Path(out_dir)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    if scheduler is not None:
        accelerator.register_for_checkpointing(scheduler)
    if ema is not None:
        accelerator.register_for_checkpointing(ema)
    if resume:
        path = latest_checkpoint(out_dir)
        if path is not None:
            accelerator.load_state(str(path))
            accelerator.print(f'resumed from {path} at update {counter.update}')

    micro_per_epoch = epoch_length or len(train_loader)  # type: ignore[arg-type]
    if micro_per_epoch < 1:
        raise ValueError('the training loader is empty')
    if step_fn is None and loss_fn is None:
        raise ValueError('fit() needs loss_fn (for (images, targets) batches) or step_fn')
    progress = tqdm(total=total_updates, initial=counter.update, disable=not accelerator.is_main_process,
                    desc='train', dynamic_ncols=True)
    last_loss = math.nan
    model.train()
    done = counter.update >= total_updates
    while not done:
        epoch, offset = divmod(counter.micro_step, micro_per_epoch)
        if hasattr(train_loader, 'set_epoch'):
            train_loader.set_epoch(epoch)  # the sampler's per-epoch seed
        if hasattr(getattr(train_loader, 'dataset', None), 'set_epoch'):
            train_loader.dataset.set_epoch(epoch)  # e.g. PerSampleSeeds
        loader = accelerator.skip_first_batches(train_loader, offset) if offset else train_loader
        # creating a loader iterator draws a worker base seed from the global RNG; keep that draw out
        # of the model's RNG stream so a resumed run (one extra iterator) matches an uninterrupted one
        rng = torch.get_rng_state()
        batches = iter(loader)
        torch.set_rng_state(rng)
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
                    if step_fn is None:
                        loss = loss_fn(model(images), targets)
                    else:
                        loss = step_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and clip_grad:
                    accelerator.clip_grad_norm_(model.parameters(), clip_grad)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            counter.micro_step += 1
            seen += 1
            if not accelerator.sync_gradients:
                continue
            counter.update += 1
            if scheduler is not None:
                scheduler.step_update(num_updates=counter.update)
            if ema is not None:
                ema.update(accelerator.unwrap_model(model), step=counter.update)
            last_loss = accelerator.gather(loss.detach()[None]).float().mean().item()
            progress.update(1)
            progress.set_postfix(loss=f'{last_loss:.4f}')
            if logger is not None and (counter.update % log_every == 0 or counter.update == total_updates):
                logger.log(event='train', update=counter.update, epoch=epoch, loss=last_loss,
                           lr=optimizer.param_groups[0]['lr'])
            at_end = counter.update >= total_updates
            stopping = stop_after is not None and counter.update >= stop_after
            if at_end or stopping or (checkpoint_every and counter.update % checkpoint_every == 0):
                save_checkpoint(accelerator, out_dir, counter.update)
            if at_end or stopping:
                done = True
                break
            if epoch_length is not None and seen >= epoch_length - offset:
                break
        else:
            if seen == 0:
                raise ValueError(f'the training loader yielded no batch in epoch {epoch}')
    progress.close()
    return {'updates': counter.update, 'last_loss': last_loss, 'checkpoint': latest_checkpoint(out_dir)}


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
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        correct1 += (top[:, 0] == targets).sum().item()
        correct5 += (top == targets[:, None]).any(dim=1).sum().item()
        loss_sum += nn.functional.cross_entropy(logits, targets, reduction='sum').item()
        total += targets.numel()
    if total == 0:
        raise ValueError('the evaluation loader is empty')
    return {'top1': 100.0 * correct1 / total, 'top5': 100.0 * correct5 / total, 'loss': loss_sum / total,
            'samples': total}
