"""The command-line flags every recipe shares, defined once and validated before anything runs.

Value checks live in the argparse ``type`` functions, so a bad value stops the command at parse time
with the flag and the value in the message (``argument --batch-size: must be an integer >= 1, got
'0'``); checks that combine flags or look at the device are in :func:`validate_common`. A recipe builds
its parser from these groups and adds only its own flags; :func:`run_main` parses, validates, sets the
CPU thread count and dispatches.
"""
import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch

AMP_CHOICES = ('no', 'fp16', 'bf16')
T = TypeVar('T')


# ------------------------------------------------------------------------------------ value types

def _number(kind: Callable[[str], Any], low: Optional[float] = None, high: Optional[float] = None,
            low_open: bool = False, high_open: bool = False) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` within [low, high] (ends open where asked), finite."""
    name = 'an integer' if kind is int else 'a number'
    bounds = []
    if low is not None:
        bounds.append(f'{">" if low_open else ">="} {low:g}')
    if high is not None:
        bounds.append(f'{"<" if high_open else "<="} {high:g}')
    wanted = f'{name}{" " + " and ".join(bounds) if bounds else ""}'

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f'must be {wanted}, got {text!r}')
        if value != value or value in (float('inf'), float('-inf')):
            raise argparse.ArgumentTypeError(f'must be {wanted}, got {text!r}')
        if low is not None and (value < low or (low_open and value == low)):
            raise argparse.ArgumentTypeError(f'must be {wanted}, got {text!r}')
        if high is not None and (value > high or (high_open and value == high)):
            raise argparse.ArgumentTypeError(f'must be {wanted}, got {text!r}')
        return value

    parse.__name__ = wanted  # argparse names the type in some messages
    return parse


positive_int = _number(int, 1)
nonnegative_int = _number(int, 0)
positive_float = _number(float, 0, low_open=True)
nonnegative_float = _number(float, 0)
unit_fraction = _number(float, 0, 1, high_open=True)        # [0, 1)
open_fraction = _number(float, 0, 1, low_open=True, high_open=True)  # (0, 1)
probability = _number(float, 0, 1)                            # [0, 1]


def optimizer_name(text: str) -> str:
    """An argparse type for ``--opt``: a name timm can build an optimizer from (tried on a one-weight model, so an
    unknown name or a missing optional package fails at parse time naming the flag, not after the data is built)."""
    from timm.optim import create_optimizer_v2
    try:
        create_optimizer_v2(torch.nn.Linear(1, 1), opt=text, lr=1e-3)
    except Exception as e:  # noqa: BLE001 - timm raises ValueError, AssertionError, ImportError ...
        raise argparse.ArgumentTypeError(f'must be a timm optimizer (timm.optim.list_optimizers()), got {text!r}: '
                                         f'{type(e).__name__}: {e}')
    return text


optimizer_name.__name__ = 'a timm optimizer'


def location(text: str) -> str:
    """An argparse type for a file or folder: the path made absolute (``~`` expanded, ``..`` folded), so a run's
    stored settings say where its data is, and ``--resume`` compares places, not spellings (``../data/x.csv``
    and ``/work/data/x.csv`` from ``/work/main`` are the same setting)."""
    if not text:
        raise argparse.ArgumentTypeError('must be a file or folder path, got an empty string')
    return os.path.abspath(os.path.expanduser(text))


def data_source(keywords: Sequence[str] = (), schemes: Sequence[str] = ()) -> Callable[[str], str]:
    """An argparse type for a data flag that takes a keyword (``cifar10``), ``SCHEME:PATH`` (``wds:FOLDER``) or a
    path: keywords stay as they are, the path part is made absolute as in :func:`location`."""

    def parse(text: str) -> str:
        if text in keywords:
            return text
        for scheme in schemes:
            if text.startswith(scheme + ':'):
                return f'{scheme}:{location(text[len(scheme) + 1:])}'
        return location(text)

    parse.__name__ = 'a data source'
    return parse


# ----------------------------------------------------------------------------------------- parser

def command_parser(prog: str,
                   description: str) -> Tuple[argparse.ArgumentParser, Callable[..., argparse.ArgumentParser]]:
    """A recipe's parser (its module docstring as description) and ``add_command(name, help)`` for its
    sub-commands (each shows its defaults in ``--help``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest='command', required=True)

    def add_command(name: str, help: str) -> argparse.ArgumentParser:
        # no abbreviations: a shortened or misspelt flag is an error, never silently another flag
        return sub.add_parser(name, help=help, allow_abbrev=False,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    return parser, add_command


# ----------------------------------------------------------------------------------------- groups

def add_run_flags(parser: argparse.ArgumentParser, *, out: str, sweep: bool = False,
                  default_seeds: Sequence[int] = (0,), default_jobs: int = 1) -> None:
    """``--out``, ``--seed`` (or ``--seeds`` and ``--jobs`` for a sweep), checkpointing, resume, logging,
    evaluation cadence."""
    g = parser.add_argument_group('run')
    g.add_argument('--out', default=out, help='output folder' + (' (one run folder per model / seed)' if sweep else ''))
    if sweep:
        g.add_argument('--seeds', type=nonnegative_int, nargs='+', default=list(default_seeds), help='training seeds')
        g.add_argument('--jobs', type=nonnegative_int, default=default_jobs,
                       help='runs trained at once, in worker processes sharing --threads (0 = one per CPU core '
                            'when no GPU is present); a run\'s result does not depend on it')
    else:
        g.add_argument('--seed', type=nonnegative_int, default=default_seeds[0],
                       help='training seed (init, data order)')
    g.add_argument('--checkpoint-every', type=nonnegative_int, default=0,
                   help='checkpoint every N updates (and at the end); 0 = only at the end')
    g.add_argument('--keep-checkpoints', type=nonnegative_int, default=2,
                   help='checkpoints kept in a run folder, the newest N (0 = all, e.g. to test each epoch\'s weights '
                        'afterwards with the recipe\'s eval); best/ is kept apart')
    g.add_argument('--resume', action='store_true',
                   help='continue the run in OUT (its settings must match; see --help of the recipe)')
    g.add_argument('--stop-after', type=positive_int, default=None, help='stop after N updates (simulates a kill)')
    g.add_argument('--log-every', type=positive_int, default=10, help='log the mean training loss every N updates')
    g.add_argument('--eval-every', type=nonnegative_int, default=0,
                   help='evaluate on the validation data every N updates (and at the end); 0 = never')
    g.add_argument('--patience', type=nonnegative_int, default=0,
                   help='stop after N evaluations without improvement (needs --eval-every); 0 = never')


def add_device_flags(parser: argparse.ArgumentParser, *, batch_size: int) -> None:
    """``--batch-size``, ``--num-workers``, ``--amp``, ``--cpu``, ``--threads``."""
    g = parser.add_argument_group('device')
    g.add_argument('--batch-size', type=positive_int, default=batch_size, help='per-process batch size')
    g.add_argument('--num-workers', '--workers', dest='num_workers', type=nonnegative_int, default=0,
                   help='data loader worker processes')
    g.add_argument('--amp', choices=AMP_CHOICES, default='no',
                   help='mixed precision (fp16 needs a CUDA GPU; bf16 a GPU that has it, or the CPU)')
    g.add_argument('--cpu', action='store_true', help='force the CPU even when a GPU is present')
    g.add_argument('--threads', type=nonnegative_int, default=0,
                   help="torch CPU threads (0 = torch's default); 1 is much faster on a machine whose cores are busy")


def add_optim_flags(parser: argparse.ArgumentParser, *, lr: float, epochs: int, warmup_frac: Optional[float],
                    weight_decay: float = 0.05, clip_grad: float = 0.0, warmup_help: Optional[str] = None) -> None:
    """``--epochs`` / ``--updates``, ``--grad-accum``, ``--opt``, ``--lr``, ``--weight-decay``, ``--warmup-frac``,
    ``--clip-grad`` (cosine schedule in updates, see ``engine.cosine_schedule``). ``warmup_frac=None``: the recipe
    resolves a default per run before training (``warmup_help`` says how)."""
    g = parser.add_argument_group('optimisation')
    g.add_argument('--epochs', type=positive_int, default=epochs,
                   help='training epochs (ignored when --updates is set)')
    g.add_argument('--updates', type=nonnegative_int, default=0, help='total optimizer updates (0 = use --epochs)')
    g.add_argument('--grad-accum', type=positive_int, default=1, help='gradient accumulation steps')
    g.add_argument('--opt', type=optimizer_name, default='adamw', help='timm optimizer name')
    g.add_argument('--lr', type=positive_float, default=lr, help='peak learning rate')
    g.add_argument('--weight-decay', type=nonnegative_float, default=weight_decay)
    g.add_argument('--warmup-frac', type=unit_fraction, default=warmup_frac,
                   help=warmup_help or 'linear warm-up over this share of the updates')
    g.add_argument('--clip-grad', type=nonnegative_float, default=clip_grad, help='gradient norm clip (0 = off)')


def model_overrides(text: str, flag: str = '--model-overrides') -> Dict[str, Any]:
    """A flag's JSON dict of model constructor overrides (``'{"embed_dim": 256}'``); anything else is an error
    naming the flag and the text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f'{flag} {text!r} is not a JSON dict: {e}') from e
    if not isinstance(value, dict):
        raise ValueError(f'{flag} {text!r} is not a JSON dict')
    return value


# what a model constructor raises for arguments it rejects: an unknown keyword (TypeError), a checked value
# (ValueError, AssertionError), a size torch cannot allocate (RuntimeError: 'negative dimension'), a zero size or
# head count (ZeroDivisionError: 'integer modulo by zero'), an unknown layer name (KeyError: timm's act_layer)
BUILD_ERRORS = (TypeError, ValueError, RuntimeError, AssertionError, ArithmeticError, LookupError)


def build_or_explain(build: Callable[[], T], flag: str, text: str, what: str) -> T:
    """``build()``, a model built from the user's ``flag`` (its text ``text``); a constructor that rejects it
    (:data:`BUILD_ERRORS`) is a ValueError naming the flag, the text and ``what`` (e.g. 'the goat model') instead of
    a bare error from deep inside the model. Call it before the run's first write, so nothing is written."""
    try:
        return build()
    except BUILD_ERRORS as e:
        raise ValueError(f'{flag} {text} cannot build {what}: {e}') from e


def add_prior_lr_flag(parser: argparse.ArgumentParser, default: float) -> None:
    """``--prior-lr-scale``: learning-rate multiplier of the positional-prior parameters (GOAT alpha, beta, key
    default; PoPE delta), their own optimizer group without weight decay
    (``vision_priors.optim.prior_param_groups``)."""
    parser.add_argument('--prior-lr-scale', type=positive_float, default=default,
                        help='learning-rate multiplier of the positional priors: GOAT alpha / beta / key default, '
                             f'PoPE delta, LAVO relative bias (default {default:g})')


# ------------------------------------------------------------------------------------- validation

def check_amp(amp: str, cpu: bool) -> None:
    """Reject a mixed-precision mode the chosen device cannot run (accelerate would silently run float32)."""
    on_cuda = torch.cuda.is_available() and not cpu
    if amp == 'fp16' and not on_cuda:
        raise ValueError('--amp fp16 needs a CUDA GPU (on the CPU it would run in float32); use --amp bf16 or no')
    if amp == 'bf16' and on_cuda and not torch.cuda.is_bf16_supported():
        raise ValueError(f'--amp bf16: GPU {torch.cuda.get_device_name()} has no bfloat16; use --amp fp16 or no')


def check_unique(flag: str, values: Sequence[Any]) -> None:
    """A list flag (``--models``, ``--seeds``) must not name an entry twice."""
    repeated = sorted({str(v) for v in values if list(values).count(v) > 1})
    if repeated:
        raise ValueError(f'{flag} lists {", ".join(repeated)} more than once')


def check_folder(path: str, what: str = '--out') -> None:
    """``path`` is a folder or can be made one: neither it nor a folder above it is an existing file (checked
    before any work, not when the first result is written)."""
    for part in (Path(os.path.abspath(path)), *Path(os.path.abspath(path)).parents):
        if part.exists():
            if not part.is_dir():
                raise NotADirectoryError(f'{what} {path}: {part} is a file, not a folder')
            return


def writes_one_run(args: argparse.Namespace) -> bool:
    """Whether the command's ``--out`` is the folder of the one run it trains: the commands with ``--seed``
    (:func:`add_run_flags` without ``sweep``). Every other command (evaluation, a sweep) writes its results, or
    its runs in sub-folders, under ``--out``."""
    return hasattr(args, 'seed')


def validate_common(args: argparse.Namespace) -> None:
    """Checks that combine the shared flags (per-value checks already ran at parse time)."""
    if getattr(args, 'out', None) is not None:
        check_folder(args.out)
        from .runs import check_not_a_run, check_not_inside_a_run  # runs.py imports this module
        if not writes_one_run(args):
            check_not_a_run(args.out, getattr(args, 'command', None))
        check_not_inside_a_run(args.out, getattr(args, 'command', None))
    if hasattr(args, 'amp'):
        check_amp(args.amp, getattr(args, 'cpu', False))
    if getattr(args, 'patience', 0) and not getattr(args, 'eval_every', 0):
        raise ValueError('--patience needs --eval-every (early stopping counts evaluations)')
    updates = getattr(args, 'updates', 0)
    stop_after = getattr(args, 'stop_after', None)
    if updates and stop_after is not None and stop_after > updates:
        raise ValueError(f'--stop-after {stop_after} is beyond --updates {updates}: it would never stop early')


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run with ``threads`` torch CPU threads (0 = unchanged); restore the previous count afterwards."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)  # main() may be called in-process (tests, notebooks)


def parse_checked(parser: argparse.ArgumentParser, validate: Callable[[argparse.Namespace], None],
                  argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse ``argv`` and run ``validate``; a ``ValueError`` from it exits with the parser's usage and message."""
    args = parser.parse_args(argv)
    try:
        validate(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def run_main(parser: argparse.ArgumentParser, dispatch: Callable[[argparse.Namespace], Any],
             argv: Optional[List[str]] = None, validate: Optional[Callable[[argparse.Namespace], None]] = None) -> Any:
    """Parse, validate (shared then the recipe's own checks), set threads, run ``dispatch(args)``."""
    args = parser.parse_args(argv)
    validate_common(args)
    if validate is not None:
        validate(args)
    with torch_threads(getattr(args, 'threads', 0)):
        return dispatch(args)
