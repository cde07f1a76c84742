"""The 1D language path: byte-level causal LMs with GOAT, PoPE, LAVO, RoPE, ALiBi or no positions.

Papers: GOAT (000) perplexity under length extrapolation and passkey retrieval (Fig. 2-3, Table 1), PoPE (004)
indirect indexing (Sec. 4, App. B.1), LAVO (002) causal LM with an O(1) decoding state (Table 2).

Commands (``vision-priors lm COMMAND --help`` explains every option):

  train     train LMs, one per --methods x --seeds, one budget (accelerate, verified checkpoints, exact
            --resume, validation loss every --eval-every updates with the best weights in RUN/best).
  ppl       perplexity of trained runs at 1x, 2x, 4x, 8x the training length, full context (each window is
            one forward pass, no sliding), mean over every predicted byte of the same validation text at every
            length (shorter lengths use proportionally more windows); table, JSON, plot.
  passkey   train on passkey prompts at the training length (answer digits only), then test at 1x..8x and
            several depths: digit accuracy and exact match; table, JSON, heatmap PNG. Two starts
            (--passkey-starts), both by default, with the same budget: 'pretrained' fine-tunes each run;
            'scratch' trains a fresh model of the run's architecture on the prompts alone, the GOAT authors'
            synthetic benchmark protocol; with no RUN (--passkey-starts scratch alone), fresh models of
            --methods x --seeds.
  index     PoPE's indirect indexing: train a fresh model per method and seed on it, test on held-out items
            (--index-letters / --index-max-offset / --index-layout give smaller tasks than the paper's).
  compare   all of the above for all methods in one command: one results.json and the plots (the passkey
            fine-tuned from the pre-trained runs; --passkey-starts pretrained scratch adds the other start).

Data (``vision_priors.recipes.data.text``): bytes of ``--text`` files / folders / webdataset ``.tar`` shards,
or by default the English prose of CPython's ``pydoc_data.topics`` (``--with-stdlib`` adds the standard
library's sources); blocks of ``--block-bytes`` split into train / validation by a seeded choice.

The README's CPU result (training length 128, seeds 0 1; about 20 minutes on 2 cores, see there):

  vision-priors lm compare --seeds 0 1 --batch-size 16 --updates 1000 --passkey-updates 2500 --index-updates 200 \\
      --depths 0 0.5 1 --passkey-samples 8 --eval-windows 4 --threads 1 --jobs 2 --out outputs/lm/compare

GPU scale, e.g. a larger model on the stdlib corpus:

  vision-priors lm compare --with-stdlib --train-length 512 --model-overrides '{"dim": 512, "depth": 8, \\
      "num_heads": 8}' --batch-size 32 --updates 20000 --eval-every 1000 --out runs/lm
"""
import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from timm.optim import create_optimizer_v2

from vision_priors.models.language_model import ATTENTIONS, create_language_model, resolve_goat_kwargs

from . import cli
from .data.text import (INDEX_LAYOUTS, INDEX_MAX_OFFSET, IndexSpec, IndexTask, PasskeyTask, TrainWindows,
                        builtin_corpus, eval_windows, read_corpus, split_corpus)
from .engine import close_distributed, cosine_schedule, count_updates, fit, make_accelerator, train_loader
from .logs import JsonlLogger
from .plotting import figure, save_figure
from .report import format_cell, group_rows, markdown_table, mean_std, write_results
from .runs import RunFolder, data_fingerprints, holds_run, load_finished_run, run_settings, sweep_folders, train_sweep

CPU_MODEL = dict(dim=64, depth=2, num_heads=2, goat_modes=4, lavo_window=32, lavo_slots=16, weight_init='fan_in')
# flags that never change what a run trains (evaluation settings, later stages' budgets)
# (an indexing run keeps its task in its data config, which a resume checks)
EVAL_ONLY_FLAGS = ('multiples', 'eval_windows', 'depths', 'passkey_samples', 'index_test', 'passkey_updates',
                   'passkey_lr', 'passkey_starts', 'passkey_scratch_updates', 'index_updates', 'index_lr',
                   'index_train_items', 'index_letters', 'index_max_offset', 'index_layout', 'eval_batch_size')
# the LM's GOAT options before stop 45, for run configs that do not record them
LEGACY_LM_GOAT = dict(key_slope_param='linear', prior_init='zero', key_mlp_hidden=32)
PASSKEY_STARTS = ('pretrained', 'scratch')
# passkey training updates of both starts, the same budget, so the start is the only difference (README, Language):
# 300 fine-tuning updates left every method but ALiBi / NoPE at one constant digit; from scratch, 1,500 left GOAT's
# seed 1 half-trained; 3,000 (the scratch probe's) would take the compare past 20 minutes on 2 cores
PASSKEY_UPDATES = 2500
PASSKEY_EVAL_SEED = 10_000  # held-out prompts: a different seed stream from the fine-tuning items
INDEX_TEST_SEED = 20_000
# ``passkey`` without runs: the fresh models' defaults (the compare's CPU model at its training length)
SCRATCH_MODELS = dict(methods=list(ATTENTIONS), seeds=[0], train_length=128, model_overrides='{}')


# ------------------------------------------------------------------------------------- arguments

def add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('data')
    g.add_argument('--text', type=cli.location, nargs='+', default=None,
                   help='text files, folders or webdataset .tar shards; default: pydoc_data.topics prose')
    g.add_argument('--with-stdlib', action='store_true', help='built-in corpus: add the stdlib .py sources')
    g.add_argument('--block-bytes', type=cli.positive_int, default=16384, help='split unit (bytes)')
    g.add_argument('--val-fraction', type=cli.open_fraction, default=0.1, help='share of blocks for validation')
    g.add_argument('--split-seed', type=cli.nonnegative_int, default=0, help='seed of the block choice')
    g.add_argument('--train-length', type=cli.positive_int, default=128, help='training context (bytes)')


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('model')
    g.add_argument('--model-overrides', default='{}',
                   help=f'JSON dict of LanguageModel options over the CPU model {json.dumps(CPU_MODEL)}, e.g. '
                        '\'{"goat_relative": "none"}\'')


def add_eval_args(p: argparse.ArgumentParser, what: Sequence[str]) -> None:
    g = p.add_argument_group('evaluation')
    g.add_argument('--eval-batch-size', type=cli.positive_int, default=8, help='windows per evaluation forward')
    if 'ppl' in what or 'passkey' in what:
        g.add_argument('--multiples', type=cli.positive_int, nargs='+', default=[1, 2, 4, 8],
                       help='evaluation lengths as multiples of the training length')
    if 'ppl' in what:
        g.add_argument('--eval-windows', type=cli.positive_int, default=16,
                       help='validation windows at the longest length; a length m times shorter uses m times as many, '
                            'so every length scores (nearly) the same validation bytes')
    if 'passkey' in what:
        g.add_argument('--passkey-updates', type=cli.positive_int, default=PASSKEY_UPDATES,
                       help="passkey fine-tuning updates of the 'pretrained' start (the from-scratch budget: 300 "
                            'left GOAT, PoPE and RoPE at one constant digit)')
        g.add_argument('--passkey-lr', type=cli.positive_float, default=1e-3,
                       help='passkey peak lr (both starts)')
        g.add_argument('--passkey-starts', nargs='+', choices=PASSKEY_STARTS, default=list(PASSKEY_STARTS),
                       help="'pretrained': fine-tune each trained run (--passkey-updates); 'scratch': train a fresh "
                            "model of the run's architecture and seed on passkey prompts only "
                            "(--passkey-scratch-updates), as the GOAT authors' synthetic benchmark does")
        g.add_argument('--passkey-scratch-updates', type=cli.positive_int, default=PASSKEY_UPDATES,
                       help='updates of the from-scratch passkey training')
        g.add_argument('--depths', type=cli.probability, nargs='+', default=[0.0, 0.25, 0.5, 0.75, 1.0],
                       help='relative depths of the key in the filler')
        g.add_argument('--passkey-samples', type=cli.positive_int, default=16, help='test prompts per length x depth')
    if 'index' in what:
        g.add_argument('--index-updates', type=cli.positive_int, default=200, help='indirect-indexing training updates')
        g.add_argument('--index-lr', type=cli.positive_float, default=2e-3, help='indirect-indexing peak lr')
        g.add_argument('--index-test', type=cli.positive_int, default=512, help='held-out indirect-indexing items')
        spec = IndexSpec()
        g.add_argument('--index-letters', type=cli.positive_int, nargs=2, metavar=('MIN', 'MAX'),
                       default=[spec.min_letters, spec.max_letters], help='distinct letters per indexing string')
        g.add_argument('--index-max-offset', type=cli.positive_int, default=spec.max_offset,
                       help='indexing offsets are -N..+N (never 0)')
        g.add_argument('--index-layout', choices=INDEX_LAYOUTS, default=spec.layout,
                       help="indexing prompt: 'anchor-offset' <letters>|<anchor><+-NN>=<target> (the paper's task) or "
                            "'offset-anchor' <letters>|<+-NN><anchor><target> (the anchor is the byte the target is "
                            "predicted from)")


def add_training_args(p: argparse.ArgumentParser, out: str) -> None:
    p.add_argument('--methods', nargs='+', choices=ATTENTIONS, default=list(ATTENTIONS), help='attention types')
    add_data_args(p)
    add_model_args(p)
    cli.add_optim_flags(p, lr=3e-3, epochs=1, warmup_frac=0.05, weight_decay=0.05, clip_grad=1.0)
    cli.add_device_flags(p, batch_size=8)
    cli.add_run_flags(p, out=out, sweep=True)


def build_parser() -> argparse.ArgumentParser:
    parser, add_command = cli.command_parser('vision-priors lm', __doc__)
    p = add_command('train', 'train language models (--methods x --seeds)')
    add_training_args(p, 'outputs/lm/train')
    add_eval_args(p, ())
    p.set_defaults(methods=['goat'], updates=300)
    for name, what, help in (('ppl', ('ppl',), 'perplexity at 1x..8x the training length'),
                             ('passkey', ('passkey',), 'passkey fine-tuning and retrieval at 1x..8x')):
        p = add_command(name, help)
        if name == 'ppl':
            p.add_argument('runs', nargs='+', help='trained run folders (or their best/ / checkpoint folders)')
        else:
            p.add_argument('runs', nargs='*',
                           help='trained run folders (or their best/ / checkpoint folders); none with '
                                '--passkey-starts scratch alone: fresh models of --methods x --seeds')
            g = p.add_argument_group('fresh models, when no run is given (--passkey-starts scratch)')
            g.add_argument('--methods', nargs='+', choices=ATTENTIONS, default=None,
                           help=f'attention types (default: all, {" ".join(ATTENTIONS)})')
            g.add_argument('--seeds', type=cli.nonnegative_int, nargs='+', default=None, help='seeds (default: 0)')
            g.add_argument('--train-length', type=cli.positive_int, default=None,
                           help=f'passkey prompt length in training (default: {SCRATCH_MODELS["train_length"]})')
            g.add_argument('--model-overrides', default=None,
                           help=f'JSON dict of LanguageModel options over the CPU model {json.dumps(CPU_MODEL)}')
        add_eval_args(p, what)
        cli.add_device_flags(p, batch_size=8)
        p.add_argument('--out', default=f'outputs/lm/{name}', help='folder for results.json and the plot')
        if name == 'passkey':
            p.add_argument('--resume', action='store_true',
                           help='continue the fine-tuning runs in OUT/<method>/seed<k>')
            p.add_argument('--checkpoint-every', type=cli.nonnegative_int, default=0,
                           help='checkpoint the fine-tuning every N updates; 0 = only at the end')
            p.add_argument('--weight-decay', type=cli.nonnegative_float, default=0.05,
                           help="the passkey trainings' AdamW weight decay (compare: its --weight-decay, the same "
                                'default)')
            p.add_argument('--jobs', type=cli.nonnegative_int, default=1,
                           help='fine-tunings run at once, in worker processes sharing --threads (0 = one per CPU '
                                'core when no GPU is present); a run\'s result does not depend on it')
    p = add_command('index', 'indirect indexing: train and test a fresh model per method and seed')
    add_training_args(p, 'outputs/lm/index')
    add_eval_args(p, ('index',))
    p = add_command('compare', 'train, ppl, passkey and index for every method over seeds')
    add_training_args(p, 'outputs/lm/compare')
    add_eval_args(p, ('ppl', 'passkey', 'index'))
    # 1000 updates of 16 x 128 bytes: the least pre-training after which RoPE's 4x perplexity more than doubles
    # on the built-in corpus (700 updates: x1.8); 300 x 8 left every model near a unigram model (README).
    # The passkey is fine-tuned from the pre-trained runs (the protocol); both starts at 2,500 updates would
    # take the CPU compare from 20 to about 33 minutes, so the from-scratch start is asked for with --passkey-starts
    p.set_defaults(updates=1000, batch_size=16, passkey_starts=['pretrained'])
    return parser


def resolve_passkey_models(args: argparse.Namespace) -> None:
    """``passkey`` trains from the RUN folders given (their architecture, seed and length) or, given none, fresh
    models of ``--methods`` x ``--seeds`` (``--passkey-starts scratch`` alone); the flags of the one are errors
    with the other, and the fresh models' unset flags get ``SCRATCH_MODELS``."""
    given = [f'--{name.replace("_", "-")}' for name in SCRATCH_MODELS if getattr(args, name) is not None]
    if args.runs:
        if given:
            raise ValueError(f'{", ".join(given)}: these describe fresh models when no run is given; the runs given '
                             'fix their own method, seed, length and model')
        return
    if args.passkey_starts != ['scratch']:
        raise ValueError('passkey without RUN folders trains fresh models only: give trained runs, or pass '
                         '--passkey-starts scratch')
    for name, default in SCRATCH_MODELS.items():
        if getattr(args, name) is None:
            setattr(args, name, list(default) if isinstance(default, list) else default)


def validate(args: argparse.Namespace) -> None:
    """Recipe-specific checks, before any folder is touched (lengths that cannot work fail here)."""
    if args.command == 'passkey':
        resolve_passkey_models(args)
    if getattr(args, 'model_overrides', None) is not None:
        overrides = cli.model_overrides(args.model_overrides)
        if 'attn' in overrides:
            raise ValueError('--model-overrides may not set "attn": use --methods')
        for attn in args.methods:  # every model must build (unknown options, GOAT modes vs head dim, ...)
            cli.build_or_explain(lambda: create_language_model(attn, **dict(CPU_MODEL, **overrides)),
                                 '--model-overrides', args.model_overrides, f'the {attn} model')
    if getattr(args, 'methods', None):
        cli.check_unique('--methods', args.methods)
    if getattr(args, 'multiples', None):
        cli.check_unique('--multiples', args.multiples)
    if getattr(args, 'depths', None):
        cli.check_unique('--depths', args.depths)
    if getattr(args, 'passkey_starts', None):
        cli.check_unique('--passkey-starts', args.passkey_starts)
    if hasattr(args, 'index_letters'):
        index_spec(args)  # bad letter counts / offsets fail here, naming the flag
    length = getattr(args, 'train_length', None)
    if length is not None and args.command in ('passkey', 'compare') and length < 81:
        raise ValueError(f'--train-length {length}: a passkey prompt needs at least 81 bytes')
    if length is not None and getattr(args, 'block_bytes', None) is not None and args.command in ('train', 'compare'):
        longest = length * max(getattr(args, 'multiples', [1]))
        if args.block_bytes < longest + 1:
            raise ValueError(f'--block-bytes {args.block_bytes} cannot hold an evaluation window of {longest + 1} '
                             f'bytes (--train-length {length} x {max(getattr(args, "multiples", [1]))}); '
                             'raise --block-bytes')


# ------------------------------------------------------------------------------------------ data

def index_spec(args: argparse.Namespace) -> IndexSpec:
    """The indirect-indexing task of ``--index-letters / --index-max-offset / --index-layout``."""
    try:
        return IndexSpec(*args.index_letters, args.index_max_offset, args.index_layout)
    except ValueError as err:
        raise ValueError(f'--index-letters / --index-max-offset: {err}') from None


def data_config(args: argparse.Namespace) -> Dict[str, Any]:
    """Everything that fixes the text of a run (saved in config.json, reused by ``ppl``)."""
    return dict(text=args.text, with_stdlib=args.with_stdlib, block_bytes=args.block_bytes,
                val_fraction=args.val_fraction, split_seed=args.split_seed, train_length=args.train_length)


def corpus(dcfg: Dict[str, Any]):
    docs = read_corpus(dcfg['text']) if dcfg['text'] else builtin_corpus(with_stdlib=dcfg['with_stdlib'])
    return split_corpus(docs, dcfg['val_fraction'], dcfg['block_bytes'], dcfg['split_seed'])


# ----------------------------------------------------------------------------------------- model

def model_config(args: argparse.Namespace, attn: str) -> Dict[str, Any]:
    """The run's model: the CPU model under ``--model-overrides``; GOAT's options resolved, so the run keeps them
    whatever later defaults become."""
    overrides = dict(CPU_MODEL, **cli.model_overrides(args.model_overrides))
    if attn == 'goat':
        overrides['goat_kwargs'] = resolve_goat_kwargs(overrides.get('goat_kwargs'),
                                                       overrides.get('goat_key_linear', True))
    return dict(attn=attn, overrides=overrides)


def build_model(mcfg: Dict[str, Any]) -> nn.Module:
    overrides = dict(mcfg['overrides'])
    if mcfg['attn'] == 'goat':  # a run stored before GOAT's options were recorded had the defaults of then
        overrides['goat_kwargs'] = dict(LEGACY_LM_GOAT, **overrides.get('goat_kwargs', {}))
    return create_language_model(mcfg['attn'], **overrides)


def load_model(run: Path, kind: str = 'lm', reads: Optional[Sequence[str]] = None):
    """(config, model) of a trained run; ``reads``: the run's data paths the caller reads (``load_finished_run``:
    ``None`` all of them, checked unchanged; ``()`` none, e.g. a passkey fine-tuning starting from the weights)."""
    loaded = load_finished_run(Path(run), kind, reads=reads)
    model = build_model(loaded.config['model'])
    model.load_state_dict(loaded.state_dict)
    return loaded.config, model


# ------------------------------------------------------------------------------------------ step

def lm_step(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy over a batch of (B, L + 1) windows."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def answer_logits(model: nn.Module, batch: Dict[str, torch.Tensor]):
    """(logits, targets, mask) of the answer bytes: positions >= answer_start, predicted from the byte before."""
    tokens = batch['tokens']
    logits = model(tokens[:, :-1]).float()
    positions = torch.arange(1, tokens.shape[1], device=tokens.device)[None]
    return logits, tokens[:, 1:], positions >= batch['answer_start'][:, None]


def answer_step(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the answer bytes only (passkey digits, indexing target)."""
    logits, targets, mask = answer_logits(model, batch)
    return F.cross_entropy(logits[mask], targets[mask])


# ------------------------------------------------------------------------------------ evaluation

def item_batches(data, batch_size: int, device) -> Iterator[Tuple[List[Dict[str, Any]], torch.Tensor]]:
    """The items of ``data`` in order, ``batch_size`` at a time (the last batch may be shorter), each batch as
    (its items, their stacked ``tokens`` on ``device``)."""
    for start in range(0, len(data), batch_size):
        chunk = [data[i] for i in range(start, min(len(data), start + batch_size))]
        yield chunk, torch.stack([item['tokens'] for item in chunk]).to(device)


@torch.no_grad()
def perplexity(model: nn.Module, windows: torch.Tensor, batch_size: int, device) -> Dict[str, float]:
    """exp(mean next-byte NLL) over every predicted byte of the (W, n + 1) windows, each one full forward."""
    model.eval()
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        logits = model(batch[:, :-1]).float()
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction='sum').item()
        count += batch[:, 1:].numel()
    loss = total / count
    return dict(loss=loss, ppl=float(np.exp(loss)), bits_per_byte=loss / np.log(2), tokens=count)


@torch.no_grad()
def answer_accuracy(model: nn.Module, data, batch_size: int, device, groups: Sequence[str] = ()) -> Dict[str, Any]:
    """Argmax accuracy of the answer bytes (teacher forced; exact match = every answer byte right, which is
    exactly when greedy generation reproduces the answer). For each item key in ``groups`` (e.g. ``'offset'``)
    also ``by_<key>``: value -> {'exact_match', 'items'}, in increasing order of the value."""
    model.eval()
    right = total = exact = 0
    per_value: Dict[str, Dict[Any, List[int]]] = {key: {} for key in groups}  # key -> value -> [exact, items]
    for chunk, tokens in item_batches(data, batch_size, device):
        batch = {'tokens': tokens, 'answer_start': torch.tensor([it['answer_start'] for it in chunk], device=device)}
        logits, targets, mask = answer_logits(model, batch)
        correct = logits.argmax(-1) == targets
        solved = (correct | ~mask).all(-1)
        right += int((correct & mask).sum())
        total += int(mask.sum())
        exact += int(solved.sum())
        for item, item_solved in zip(chunk, solved.tolist()):
            for key in groups:
                counts = per_value[key].setdefault(item[key], [0, 0])
                counts[0] += int(item_solved)
                counts[1] += 1
    metrics: Dict[str, Any] = dict(digit_accuracy=right / total, exact_match=exact / len(data))
    for key, values in per_value.items():
        metrics[f'by_{key}'] = {str(v): dict(exact_match=values[v][0] / values[v][1], items=values[v][1])
                                for v in sorted(values)}
    return metrics


@torch.no_grad()
def index_attention(model: nn.Module, data: IndexTask, batch_size: int, device) -> Optional[Dict[str, Any]]:
    """Where each head looks on indirect-indexing items, per block and head (None where no block has a softmax
    matrix, LAVO): ``back[b][h][d]``, the mean attention from a letter of the string to the letter ``d`` places
    before it (d = 0..max_offset; per item over its letters that have one d places back, then over the items
    that have any); ``anchor[b][h]`` / ``target[b][h]``, the answer query's (the last input byte's) mean
    attention on the anchor letter and on the target letter, and the same per signed offset asked in
    ``anchor_by_offset[o][b][h]`` / ``target_by_offset[o][b][h]`` (offsets in increasing order)."""
    model.eval()
    reach = data.spec.max_offset
    # per item: back (blocks, H, d), has a letter d places back (d), answer query on anchor / target, offset
    back, has, on_anchor, on_target, offsets = [], [], [], [], []
    for chunk, tokens in item_batches(data, batch_size, device):
        tokens = tokens[:, :-1]
        maps = model.attention_maps(tokens)
        if all(m is None for m in maps):
            return None
        bar = (tokens == ord('|')).int().argmax(-1)  # the letters are the bytes right before the first '|'
        first = bar - torch.tensor([it['letters'] for it in chunk], device=device)
        anchor = bar - 1 - torch.tensor([it['anchor_back'] for it in chunk], device=device)
        offset = torch.tensor([it['offset'] for it in chunk], device=device)
        target = anchor + offset
        rows = torch.arange(len(chunk), device=device)
        weights = torch.stack([m for m in maps if m is not None]).transpose(0, 1)  # (B, blocks, H, N, N)
        item_back, item_has = [], []
        for d in range(reach + 1):
            diagonal = torch.diagonal(weights, offset=-d, dim1=-2, dim2=-1)  # [..., i]: query i + d, key i
            keys = torch.arange(diagonal.shape[-1], device=device)
            mask = ((keys >= first[:, None]) & (keys + d < bar[:, None])).to(diagonal.dtype)  # both are letters
            count = mask.sum(-1)
            item_back.append((diagonal * mask[:, None, None]).sum(-1) / count.clamp(min=1)[:, None, None])
            item_has.append((count > 0).to(diagonal.dtype))
        back.append(torch.stack(item_back, -1))
        has.append(torch.stack(item_has, -1))
        last = weights[:, :, :, -1]  # (B, blocks, H, N): the answer query's row
        on_anchor.append(last[rows, ..., anchor])  # (B, blocks, H)
        on_target.append(last[rows, ..., target])
        offsets.append(offset)
    back, has, on_anchor, on_target, offsets = (torch.cat(v) for v in (back, has, on_anchor, on_target, offsets))
    asked = {o: offsets == o for o in sorted(offsets.unique().tolist())}
    return dict(back=(back.sum(0) / has.sum(0).clamp(min=1)).tolist(), anchor=on_anchor.mean(0).tolist(),
                target=on_target.mean(0).tolist(),
                anchor_by_offset={str(o): on_anchor[chosen].mean(0).tolist() for o, chosen in asked.items()},
                target_by_offset={str(o): on_target[chosen].mean(0).tolist() for o, chosen in asked.items()})


def passkey_grid(model: nn.Module, train_length: int, args: argparse.Namespace, device) -> Dict[str, Any]:
    """Digit accuracy and exact match per (length multiple, depth) on held-out prompts."""
    cells = {}
    for multiple in args.multiples:
        for depth in args.depths:
            data = PasskeyTask(train_length * multiple, args.passkey_samples, PASSKEY_EVAL_SEED, depths=[depth])
            cells[f'{multiple}x@{depth:g}'] = dict(multiple=multiple, depth=depth,
                                                   **answer_accuracy(model, data, args.eval_batch_size, device))
    return cells


# ----------------------------------------------------------------------------------------- train

TASKS = ('lm', 'passkey', 'index')


def run_train(args: argparse.Namespace, attn: str, seed: int, out_dir: Path, resume: bool, task: str = 'lm',
              init_from: Optional[Path] = None, base_config: Optional[Dict[str, Any]] = None,
              passkey_start: str = 'pretrained') -> Path:
    """Train ``attn`` with ``seed`` on ``task`` into ``out_dir``; returns the final checkpoint folder.

    'lm': next-byte prediction on the corpus; 'passkey': passkey prompts at the training length of the run
    ``init_from``, starting from its weights (``passkey_start='pretrained'``) or from a fresh model of its
    architecture ('scratch'), or, with no run, from a fresh model of ``base_config`` (``{'model': model config,
    'data': {'train_length': L}}``, 'scratch' only); 'index': a fresh model on indirect indexing.
    """
    folder = RunFolder(out_dir, resume)
    accelerator = make_accelerator(seed, mixed_precision=args.amp, grad_accum=args.grad_accum, cpu=args.cpu)
    if task == 'passkey':
        if passkey_start not in PASSKEY_STARTS:
            raise ValueError(f'passkey_start must be one of {PASSKEY_STARTS}, got {passkey_start!r}')
        if init_from is not None and passkey_start == 'pretrained':
            init_config, model = load_model(init_from, reads=())  # synthetic prompts: the run's text is not read
        elif init_from is not None:  # only its config: the fresh model is the first one built after seeding
            init_config = load_finished_run(Path(init_from), 'lm', reads=()).config
        elif passkey_start == 'scratch' and base_config is not None:
            init_config = base_config
        else:
            raise ValueError("a passkey training needs a run to start from (init_from) or, from 'scratch', a "
                             'base_config')
        mcfg, dcfg = init_config['model'], init_config['data']
        if passkey_start == 'scratch':
            model = build_model(mcfg)  # the run's architecture, fresh weights
        updates = args.passkey_updates if passkey_start == 'pretrained' else args.passkey_scratch_updates
        train_set = PasskeyTask(dcfg['train_length'], updates * args.batch_size, seed)
        lr = args.passkey_lr
    else:
        spec = index_spec(args) if task == 'index' else None
        dcfg = data_config(args) if task == 'lm' else dict(train_length=spec.length, index=asdict(spec))
        mcfg = model_config(args, attn)
        model = build_model(mcfg)
        if task == 'lm':
            split = corpus(dcfg)
            train_set = TrainWindows(split.train, dcfg['train_length'])
            updates, lr = args.updates, args.lr
        else:
            train_set = IndexTask(args.index_updates * args.batch_size, seed, spec)
            updates, lr = args.index_updates, args.index_lr
    # the text files read (none for the built-in corpus, the synthetic passkey prompts and indexing items)
    text = dcfg.get('text') if task == 'lm' else None
    config = dict(task=task, attn=attn, seed=seed, model=mcfg, data=dcfg,
                  init_from=str(init_from) if init_from else None,
                  **(dict(passkey_start=passkey_start) if task == 'passkey' else {}),
                  parameters=sum(p.numel() for p in model.parameters()), args=run_settings(args),
                  data_fingerprint=data_fingerprints(text or [], skip_hidden=True))  # as the text loader reads
    loader = train_loader(train_set, args.batch_size, seed, args.num_workers)
    total_updates = count_updates(updates, args.epochs, len(loader), args.grad_accum)
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=lr, weight_decay=args.weight_decay)
    scheduler = cosine_schedule(optimizer, lr, total_updates, args.warmup_frac)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    evaluate = None
    if args.eval_every:
        device = accelerator.device
        if task == 'lm':
            windows = eval_windows(split.val_blocks, dcfg['train_length'], getattr(args, 'eval_windows', 16))

            def evaluate() -> Dict[str, float]:
                return perplexity(accelerator.unwrap_model(model), windows, args.eval_batch_size, device)
        else:
            held_out = (PasskeyTask(dcfg['train_length'], 64, PASSKEY_EVAL_SEED) if task == 'passkey'
                        else IndexTask(256, INDEX_TEST_SEED + 1, spec))

            def evaluate() -> Dict[str, float]:
                metrics = answer_accuracy(accelerator.unwrap_model(model), held_out, args.eval_batch_size, device)
                return dict(metrics, loss=-metrics['exact_match'])

    # the first write: loader, optimizer, schedule and evaluation data are built (a bad input has failed)
    folder.commit(config, may_change=EVAL_ONLY_FLAGS, write=accelerator.is_main_process)
    logger = JsonlLogger(out_dir / 'log.jsonl', enabled=accelerator.is_main_process)
    logger.log(event='start', task=task, attn=attn, seed=seed, total_updates=total_updates,
               parameters=config['parameters'], processes=accelerator.num_processes, device=str(accelerator.device))
    step = lm_step if task == 'lm' else answer_step
    result = fit(accelerator, model, optimizer, scheduler, loader, None, total_updates, out_dir,
                 step_fn=step, clip_grad=args.clip_grad, checkpoint_every=args.checkpoint_every,
                 keep_checkpoints=args.keep_checkpoints,
                 resume=resume, stop_after=args.stop_after, logger=logger, log_every=args.log_every,
                 eval_every=args.eval_every, evaluate=evaluate, best_metric='loss' if evaluate else None,
                 best_mode='min', patience=args.patience)
    logger.log(event='end', **{k: str(v) for k, v in result.items()})
    return Path(result['checkpoint'])


# ------------------------------------------------------------------------------------- measuring

def eval_device(args: argparse.Namespace) -> torch.device:
    return torch.device('cuda' if torch.cuda.is_available() and not args.cpu else 'cpu')


def run_ppl(args: argparse.Namespace, runs: Sequence[str]) -> List[Dict[str, Any]]:
    """One row per run: perplexity at each multiple of its training length (full context)."""
    device, rows = eval_device(args), []
    for run in runs:
        config, model = load_model(Path(run))
        model.to(device)
        length = config['data']['train_length']
        split = corpus(config['data'])
        row = dict(run=str(run), attn=config['attn'], seed=config['seed'], train_length=length, ppl={})
        longest = max(args.multiples)
        for multiple in args.multiples:  # the same validation bytes at every length: more, shorter windows
            windows = eval_windows(split.val_blocks, length * multiple, args.eval_windows * longest // multiple)
            row['ppl'][str(multiple)] = perplexity(model, windows, args.eval_batch_size, device)
        print(f"{config['attn']} seed={config['seed']}: ppl " + ', '.join(
            f"{m}x {row['ppl'][str(m)]['ppl']:.3f}" for m in args.multiples))
        rows.append(row)
    return rows


def passkey_sources(args: argparse.Namespace, runs: Sequence[str]) -> List[Tuple[str, int, Any]]:
    """(attn, seed, source) of every passkey training: each run's (source: its folder) or, with no runs, every
    ``--methods`` x ``--seeds`` pair (source: the fresh model's ``{'model', 'data'}`` config)."""
    if runs:
        configs = [load_finished_run(Path(run), 'lm', reads=()).config for run in runs]  # its text is not read
        return [(c['attn'], c['seed'], Path(run)) for run, c in zip(runs, configs)]
    return [(attn, seed, dict(model=model_config(args, attn), data=dict(train_length=args.train_length)))
            for attn in args.methods for seed in args.seeds]


def run_passkey(args: argparse.Namespace, runs: Sequence[str], out: Path,
                start: str = 'pretrained') -> List[Dict[str, Any]]:
    """Train on passkey prompts from each run (``start``: its weights, or a fresh model of its architecture) or,
    with no runs, fresh models of ``--methods`` x ``--seeds``, into ``out/<attn>/seed<k>`` ('pretrained') or
    ``out/scratch/<attn>/seed<k>``, then test the length x depth grid."""
    out = out / 'scratch' if start == 'scratch' else out
    device, rows = eval_device(args), []
    sources = passkey_sources(args, runs)
    folders = [out / attn / f'seed{seed}' for attn, seed, _ in sources]
    cli.check_unique('the runs (method / seed pairs)', [f'{f.parent.name}/{f.name}' for f in folders])
    taken = [str(f) for f in folders if holds_run(f)]
    if taken and not args.resume:
        raise FileExistsError(f'{len(taken)} passkey run folder(s) already hold a run ({", ".join(taken)}); pass '
                              f'--resume to continue them or choose another --out')
    train_sweep(train_passkey, passkey_args(args),
                [(*source, run_dir) for source, run_dir in zip(sources, folders)], start=start)
    for (attn, seed, _), run_dir in zip(sources, folders):
        config, model = load_model(run_dir)
        model.to(device)
        cells = passkey_grid(model, config['data']['train_length'], args, device)
        rows.append(dict(run=str(run_dir), attn=attn, seed=seed, cells=cells))
        print(f'{attn} seed={seed}: passkey ({start}) exact match ' + ', '.join(
            f"{m}x {np.mean([c['exact_match'] for c in cells.values() if c['multiple'] == m]):.2f}"
            for m in args.multiples))
    return rows


def train_passkey(args: argparse.Namespace, attn: str, seed: int, source: Any, run_dir: Path, resume: bool,
                  start: str = 'pretrained') -> Path:
    """One passkey training from ``source``: a run folder, or the config of a fresh model (``passkey_sources``);
    a module-level function: sweep workers import it."""
    if isinstance(source, dict):
        return run_train(args, attn, seed, run_dir, resume, task='passkey', base_config=source, passkey_start=start)
    return run_train(args, attn, seed, run_dir, resume, task='passkey', init_from=source, passkey_start=start)


def passkey_sections(args: argparse.Namespace, runs: Sequence[str], out: Path) -> Dict[str, List[Dict[str, Any]]]:
    """The report sections of ``--passkey-starts``: 'passkey' (fine-tuned) and / or 'passkey_scratch'."""
    return {('passkey' if start == 'pretrained' else 'passkey_scratch'): run_passkey(args, runs, out, start)
            for start in args.passkey_starts}


def passkey_args(args: argparse.Namespace) -> argparse.Namespace:
    """The training flags a passkey fine-tuning needs, with the shared defaults where the command has none."""
    defaults = dict(grad_accum=1, epochs=1, opt='adamw', warmup_frac=0.05, clip_grad=1.0,  # weight decay: a flag
                    stop_after=None, eval_every=0, patience=0, checkpoint_every=0, keep_checkpoints=2, log_every=10,
                    amp='no')
    return argparse.Namespace(**dict(defaults, **vars(args)))


# the held-out accuracy is also reported per value of each: the signed offset asked, the string's length, and
# the letters after the anchor in the string (how far the anchor sits from the query)
INDEX_BREAKDOWNS = {'offset': 'signed offset (target - anchor)', 'letters': 'letters in the string',
                    'anchor_back': 'letters after the anchor'}


def run_index(args: argparse.Namespace, out: Path) -> List[Dict[str, Any]]:
    """Train a fresh model per method and seed on indirect indexing and test it on held-out items."""
    device, rows = eval_device(args), []
    runs = sweep_folders(out, args.methods, args.seeds, args.resume, flag='--methods')
    train_sweep(run_train, args, runs, task='index')
    for attn, seed, run_dir in runs:
        config, model = load_model(run_dir)
        model.to(device)
        spec = IndexSpec(**config['data'].get('index', {}))  # the task this run trained on (older runs: the default)
        test = IndexTask(args.index_test, INDEX_TEST_SEED + seed, spec)
        metrics = answer_accuracy(model, test, args.eval_batch_size, device, groups=list(INDEX_BREAKDOWNS))
        rows.append(dict(run=str(run_dir), attn=attn, seed=seed, accuracy=metrics['exact_match'],
                         offsets=2 * spec.max_offset,
                         attention=index_attention(model, test, args.eval_batch_size, device),
                         **{f'{kind}_by_{key}': {v: c[metric] for v, c in metrics[f'by_{key}'].items()}
                            for key in INDEX_BREAKDOWNS for kind, metric in (('accuracy', 'exact_match'),
                                                                             ('items', 'items'))}))
        # the breakdowns and where the heads look are in the report's tables
        print(f'{attn} seed={seed}: indirect-indexing accuracy {metrics["exact_match"]:.3f}')
    return rows


# ---------------------------------------------------------------------------------------- report

def ppl_summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """method -> {'seeds', 'ppl': multiple -> mean/std, 'ratio_4x': ppl(4x) / ppl(1x) mean/std}."""
    table = {}
    for attn, mine in group_rows(rows, 'attn').items():
        multiples = list(mine[0]['ppl'])
        table[attn] = dict(seeds=[r['seed'] for r in mine], train_length=mine[0]['train_length'],
                           ppl={m: mean_std(r['ppl'][m]['ppl'] for r in mine) for m in multiples})
        if '1' in multiples and '4' in multiples:
            table[attn]['ratio_4x'] = mean_std(r['ppl']['4']['ppl'] / r['ppl']['1']['ppl'] for r in mine)
    return table


def ppl_table(table: Dict[str, Any]) -> str:
    multiples = list(next(iter(table.values()))['ppl'])
    length = next(iter(table.values()))['train_length']
    has_ratio = all('ratio_4x' in t for t in table.values())
    header = ['method'] + [f'ppl @ {int(m) * length} ({m}x)' for m in multiples] + (['4x / 1x'] if has_ratio else [])
    return markdown_table(header, [[a] + [format_cell(t['ppl'][m], digits=3) for m in multiples]
                                   + ([format_cell(t['ratio_4x'], digits=3)] if has_ratio else [])
                                   for a, t in table.items()])


def plot_ppl(table: Dict[str, Any], path: Path, title: str) -> Path:
    fig, axes = figure()
    ax = axes[0][0]
    for attn, t in table.items():
        lengths = [int(m) * t['train_length'] for m in t['ppl']]
        ax.errorbar(lengths, [c['mean'] for c in t['ppl'].values()], yerr=[c['std'] for c in t['ppl'].values()],
                    marker='o', capsize=3, label=attn)
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xlabel('evaluation length (bytes, full context)')
    ax.set_ylabel('perplexity per byte (log)')
    ax.axvline(next(iter(table.values()))['train_length'], color='grey', ls=':', lw=1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def passkey_summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """method -> cell -> {'multiple', 'depth', 'exact_match', 'digit_accuracy'} mean/std; per multiple the mean
    over depths."""
    table = {}
    for attn, mine in group_rows(rows, 'attn').items():
        cells = {k: dict(multiple=c['multiple'], depth=c['depth'],
                         exact_match=mean_std(r['cells'][k]['exact_match'] for r in mine),
                         digit_accuracy=mean_std(r['cells'][k]['digit_accuracy'] for r in mine))
                 for k, c in mine[0]['cells'].items()}
        multiples = list(dict.fromkeys(c['multiple'] for c in cells.values()))
        per_length = {str(m): {metric: mean_std(np.mean([r['cells'][k][metric] for k, c in cells.items()
                                                         if c['multiple'] == m]) for r in mine)
                               for metric in ('exact_match', 'digit_accuracy')} for m in multiples}
        table[attn] = dict(seeds=[r['seed'] for r in mine], cells=cells, per_length=per_length)
    return table


def passkey_table(table: Dict[str, Any]) -> str:
    multiples = list(next(iter(table.values()))['per_length'])
    return markdown_table(['method'] + [f'{m}x exact / digits' for m in multiples],
                          [[a] + [f"{format_cell(t['per_length'][m]['exact_match'])} / "
                                  f"{format_cell(t['per_length'][m]['digit_accuracy'])}" for m in multiples]
                           for a, t in table.items()])


def plot_passkey(table: Dict[str, Any], path: Path, title: str) -> Path:
    """Length x depth heatmaps, one column per method: key-digit accuracy (top) and exact match (bottom),
    each cell annotated with its mean over seeds."""
    fig, axes = figure(2, len(table), size=(2.4 * len(table) + 1.2, 5.6))
    for col, (attn, t) in enumerate(table.items()):
        multiples = list(dict.fromkeys(c['multiple'] for c in t['cells'].values()))
        depths = list(dict.fromkeys(c['depth'] for c in t['cells'].values()))
        for row, metric in enumerate(('digit_accuracy', 'exact_match')):
            ax = axes[row][col]
            grid = np.array([[t['cells'][f'{m}x@{d:g}'][metric]['mean'] for m in multiples] for d in depths])
            image = ax.imshow(grid, vmin=0, vmax=1, cmap='viridis', aspect='auto', origin='lower')
            for (y, x), value in np.ndenumerate(grid):
                ax.text(x, y, f'{value:.2f}', ha='center', va='center', fontsize=7,
                        color='white' if value < 0.6 else 'black')
            ax.set_xticks(range(len(multiples)), [f'{m}x' for m in multiples])
            ax.set_yticks(range(len(depths)), [f'{d:g}' for d in depths])
            ax.set_title(f'{attn}: {metric.replace("_", " ")}', fontsize=8)
            if col == 0:
                ax.set_ylabel('key depth')
            if row == 1:
                ax.set_xlabel('length / train length')
    fig.colorbar(image, ax=axes[1][-1])
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def index_summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """method -> {'seeds', 'accuracy': mean/std, 'offsets': how many the task has, and for each breakdown key
    'by_<key>': value -> mean/std over the seeds whose held-out items had that value}."""
    table = {}
    for attn, mine in group_rows(rows, 'attn').items():
        table[attn] = dict(seeds=[r['seed'] for r in mine], accuracy=mean_std(r['accuracy'] for r in mine),
                           offsets=mine[0].get('offsets', 2 * INDEX_MAX_OFFSET))
        for key in INDEX_BREAKDOWNS:
            measured = [r[f'accuracy_by_{key}'] for r in mine if f'accuracy_by_{key}' in r]
            values = sorted({int(v) for m in measured for v in m})
            table[attn][f'by_{key}'] = {str(v): mean_std(m[str(v)] for m in measured if str(v) in m) for v in values}
        # per seed, not averaged: head h of one run has nothing to do with head h of another
        table[attn]['attention'] = {str(r['seed']): r['attention'] for r in mine if r.get('attention')}
    return table


def index_table(table: Dict[str, Any]) -> str:
    """The accuracy per method and, where measured, per value of each breakdown."""
    texts = [markdown_table(['method', 'indirect-indexing accuracy (%)'],
                            [[a, format_cell(t['accuracy'], scale=100, digits=1)] for a, t in table.items()])]
    for key, label in INDEX_BREAKDOWNS.items():
        values = sorted({int(v) for t in table.values() for v in t.get(f'by_{key}', {})})
        if values:
            texts.append(markdown_table(
                [f'method (accuracy % per {label})'] + [f'{v:+d}' if key == 'offset' else str(v) for v in values],
                [[a] + [format_cell(t[f'by_{key}'][str(v)], scale=100, digits=1) if str(v) in t[f'by_{key}'] else ''
                        for v in values] for a, t in table.items()]))
    # where the heads look, one row per run, block and head
    heads = [(a, seed, profile, b, h) for a, t in table.items() for seed, profile in t.get('attention', {}).items()
             for b, block in enumerate(profile['back']) for h in range(len(block))]
    if heads:
        def percent(share: float) -> str:
            return f'{100 * share:.0f}'
        reach = len(heads[0][2]['back'][0][0])
        texts.append(markdown_table(
            ['method', 'seed', 'block', 'head'] + [f'letter -> {d} back (%)' for d in range(reach)]
            + ['answer -> anchor (%)', 'answer -> target (%)'],
            [[a, seed, b + 1, h + 1] + [percent(w) for w in profile['back'][b][h]]
             + [percent(profile['anchor'][b][h]), percent(profile['target'][b][h])]
             for a, seed, profile, b, h in heads]))
        offsets = sorted({int(o) for _, _, profile, _, _ in heads for o in profile['anchor_by_offset']})
        texts.append(markdown_table(
            ['method (answer -> anchor / target, % per signed offset)', 'seed', 'block', 'head']
            + [f'{o:+d}' for o in offsets],
            [[a, seed, b + 1, h + 1] + [
                f"{percent(profile['anchor_by_offset'][str(o)][b][h])} / "
                f"{percent(profile['target_by_offset'][str(o)][b][h])}" if str(o) in profile['anchor_by_offset'] else ''
                for o in offsets] for a, seed, profile, b, h in heads]))
    return '\n\n'.join(texts)


def plot_index(table: Dict[str, Any], path: Path, title: str) -> Path:
    """Accuracy per method (bars) and per value of each breakdown (one line per method), mean and std over seeds."""
    fig, axes = figure(2, 2, size=(11.0, 8.0))
    ax = axes[0][0]
    names = list(table)
    ax.bar(names, [100 * t['accuracy']['mean'] for t in table.values()],
           yerr=[100 * t['accuracy']['std'] for t in table.values()], capsize=3)
    offsets = next(iter(table.values()))['offsets']
    ax.axhline(100 / offsets, color='grey', ls=':', lw=1, label=f'the anchor found, the offset guessed (1 / {offsets})')
    ax.set_ylabel('accuracy (%)')
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    for ax, (key, label) in zip((axes[0][1], axes[1][0], axes[1][1]), INDEX_BREAKDOWNS.items()):
        for attn, t in table.items():
            values = sorted(t.get(f'by_{key}', {}), key=int)
            ax.errorbar([int(v) for v in values], [100 * t[f'by_{key}'][v]['mean'] for v in values],
                        yerr=[100 * t[f'by_{key}'][v]['std'] for v in values], marker='o', capsize=3, label=attn)
        ax.set_xlabel(label)
        ax.set_ylabel('accuracy (%)')
        ax.set_ylim(-2, 102)
        ax.set_title(f'per {label}', fontsize=9)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def report(args: argparse.Namespace, out: Path, **sections: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Tables, one results.json with a section per measurement, and the plots."""
    makers = dict(ppl=(ppl_summary, ppl_table, plot_ppl, 'lm_ppl_vs_length.png', 'perplexity vs evaluation length'),
                  passkey=(passkey_summary, passkey_table, plot_passkey, 'lm_passkey_heatmap.png',
                           'passkey, fine-tuned from the LM (held-out prompts)'),
                  passkey_scratch=(passkey_summary, passkey_table, plot_passkey, 'lm_passkey_scratch_heatmap.png',
                                   'passkey, trained from scratch on the prompts (held-out prompts)'),
                  index=(index_summary, index_table, plot_index, 'lm_index_accuracy.png', 'indirect indexing'))
    summary, texts, plots = {}, [], {}
    rows = [dict(r, section=name) for name, section in sections.items() for r in section]
    for name, section in sections.items():
        summarize, tabulate, plot, filename, title = makers[name]
        summary[name] = summarize(section)
        texts.append(f'### {name}\n\n' + tabulate(summary[name]))
        seeds = sorted({r['seed'] for r in section})
        plots[name] = str(plot(summary[name], out / filename, f'{title}, seeds {seeds}'))
    text = '\n\n'.join(texts)
    print(text)
    results = write_results(out, rows=rows, summary=summary, table_markdown=text, args=args, plots=plots)
    print(f'saved {results} and {", ".join(plots.values())}')
    return dict(rows=rows, summary=summary, table_markdown=text, plots=plots)


# ------------------------------------------------------------------------------------------ main

def train_all(args: argparse.Namespace, out: Path) -> List[Path]:
    runs = sweep_folders(out, args.methods, args.seeds, args.resume, flag='--methods')
    train_sweep(run_train, args, runs)
    return [run_dir for _, _, run_dir in runs]


def dispatch(args: argparse.Namespace) -> Any:
    out = Path(args.out)
    if args.command == 'train':
        runs = train_all(args, out)
        return dict(runs=[str(r) for r in runs])
    if args.command == 'ppl':
        return report(args, out, ppl=run_ppl(args, args.runs))
    if args.command == 'passkey':
        return report(args, out, **passkey_sections(args, args.runs, out))
    if args.command == 'index':
        return report(args, out, index=run_index(args, out))
    runs = [str(r) for r in train_all(args, out / 'train')]
    return report(args, out, ppl=run_ppl(args, runs), **passkey_sections(args, runs, out / 'passkey'),
                  index=run_index(args, out / 'index'))


def main(argv: Optional[List[str]] = None) -> Any:
    return cli.run_main(build_parser(), dispatch, argv, validate)


if __name__ == '__main__':
    main()
    close_distributed()
