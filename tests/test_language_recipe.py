"""Language recipe on the shared layer: train, kill + resume (bit-exact), ppl of a hand-checkable model, passkey /
index metrics, a tiny compare, and the recipe's own bad inputs (rejected before any folder is written)."""
import json
import math
import re
from pathlib import Path

import pytest
import torch

from run_helpers import assert_same_final_weights
from vision_priors.recipes import language as recipe
from vision_priors.recipes.data.text import PasskeyTask

TINY_MODEL = dict(dim=32, depth=1, num_heads=2, goat_modes=2, lavo_window=8, lavo_slots=8)


def tiny(*extra: str) -> list:
    return ['--model-overrides', json.dumps(TINY_MODEL), '--train-length', '96', '--batch-size', '4', '--cpu',
            '--threads', '1', '--block-bytes', '4096', *extra]


def test_train_kill_resume_equals_uninterrupted_then_ppl(tmp_path):
    common = ['train', '--methods', 'pope', *tiny(), '--updates', '6', '--checkpoint-every', '2', '--eval-every', '3']
    full, killed = tmp_path / 'full', tmp_path / 'killed'
    recipe.main([*common, '--out', str(full)])
    recipe.main([*common, '--out', str(killed), '--stop-after', '3'])
    recipe.main([*common, '--out', str(killed), '--resume'])
    assert_same_final_weights(full / 'pope' / 'seed0', killed / 'pope' / 'seed0')
    assert (full / 'pope' / 'seed0' / 'best' / 'model.safetensors').exists()  # best-on-validation weights
    result = recipe.main(['ppl', str(full / 'pope' / 'seed0'), '--multiples', '1', '3', '--eval-windows', '2',
                          '--cpu', '--out', str(tmp_path / 'ppl')])
    row = result['rows'][0]
    assert row['attn'] == 'pope' and set(row['ppl']) == {'1', '3'}
    assert row['ppl']['3']['tokens'] == 2 * 288 and 1 < row['ppl']['1']['ppl'] < 256 * 2  # full 3x windows
    assert row['ppl']['1']['tokens'] == 6 * 96  # the same validation bytes at every length
    saved = json.loads((tmp_path / 'ppl' / 'results.json').read_text())
    assert saved['seeds'] == [0] and 'ppl @ 288 (3x)' in saved['table_markdown']
    assert (tmp_path / 'ppl' / 'lm_ppl_vs_length.png').stat().st_size > 5000
    result = recipe.main(['passkey', str(full / 'pope' / 'seed0'), '--passkey-updates', '2', '--multiples', '1', '2',
                          '--depths', '0.5', '--passkey-samples', '2', '--cpu', '--batch-size', '2',
                          '--passkey-scratch-updates', '3', '--out', str(tmp_path / 'pk')])
    assert set(result['summary']) == {'passkey', 'passkey_scratch'}  # both starts by default
    for row in result['rows']:
        cells = row['cells']
        assert set(cells) == {'1x@0.5', '2x@0.5'} and all(0 <= c['digit_accuracy'] <= 1 for c in cells.values())
    for folder, start, updates in (('pope', 'pretrained', 2), ('scratch/pope', 'scratch', 3)):
        run_dir = tmp_path / 'pk' / folder / 'seed0'  # each passkey training is a run of its own
        config = json.loads((run_dir / 'config.json').read_text())
        assert config['passkey_start'] == start and config['init_from'] == str(full / 'pope' / 'seed0')
        assert json.loads((run_dir / 'latest.json').read_text())['step'] == updates
    for name in ('lm_passkey_heatmap.png', 'lm_passkey_scratch_heatmap.png'):
        assert (tmp_path / 'pk' / name).stat().st_size > 5000


class KnownNextByte(torch.nn.Module):
    """Logit ``a`` on (token + 1) mod 256, 0 elsewhere: on the stream 0, 1, 2, ... p(correct) = e^a / (e^a + 255)."""

    def __init__(self, a: float) -> None:
        super().__init__()
        self.a = a

    def forward(self, tokens):
        return torch.nn.functional.one_hot((tokens + 1) % 256, 256).double() * self.a


def test_perplexity_and_answer_accuracy_of_hand_checkable_models():
    windows = (torch.arange(40).reshape(4, 10) % 256)
    assert recipe.perplexity(KnownNextByte(0.0), windows, 3, 'cpu')['ppl'] == pytest.approx(256.0)
    a = 2.0
    expected = (math.exp(a) + 255) / math.exp(a)
    measured = recipe.perplexity(KnownNextByte(a), windows, 3, 'cpu')
    assert measured['ppl'] == pytest.approx(expected) and measured['tokens'] == 36
    counting = [dict(tokens=torch.arange(5, 12), answer_start=4),
                dict(tokens=torch.tensor([1, 2, 3, 9]), answer_start=2)]
    metrics = recipe.answer_accuracy(KnownNextByte(1.0), counting, 1, 'cpu')  # one length per batch
    assert metrics == dict(digit_accuracy=4 / 5, exact_match=0.5)  # the second item's last byte (9) is missed
    # grouped by an item key: exact match per value, values in increasing order; the first item is solved, the
    # second is not, so each value's figure says which items it counted
    grouped = [dict(counting[i], offset=o, letters=n) for i, o, n in zip((0, 1, 0, 1, 0), (3, -2, 3, -2, -2),
                                                                          (9, 9, 10, 10, 10))]
    metrics = recipe.answer_accuracy(KnownNextByte(1.0), grouped, 1, 'cpu', groups=['offset', 'letters'])
    assert metrics['exact_match'] == 3 / 5 and list(metrics['by_offset']) == ['-2', '3']
    assert metrics['by_offset'] == {'-2': dict(exact_match=1 / 3, items=3), '3': dict(exact_match=1.0, items=2)}
    assert metrics['by_letters'] == {'9': dict(exact_match=0.5, items=2), '10': dict(exact_match=2 / 3, items=3)}


class ScriptedAttention(torch.nn.Module):
    """One block of two heads with known maps on offset-anchor prompts: head 1 looks 2 bytes back and its answer
    query at the target (half of it, the other half on byte 0, when the offset is negative); head 2 looks at
    itself and its answer query at the anchor."""

    def attention_maps(self, tokens):
        B, N = tokens.shape
        maps = torch.zeros(B, 2, N, N, dtype=torch.float64)
        positions = torch.arange(N)
        maps[:, 0, positions, (positions - 2).clamp(min=0)] = 1.0
        maps[:, 1, positions, positions] = 1.0
        for b, row in enumerate(tokens.tolist()):
            anchor = row.index(row[-1])  # the anchor byte ends the prompt; its first place is in the string
            offset = int(bytes(row[-4:-1]).decode())  # sign and two digits before it
            maps[b, :, -1] = 0.0
            maps[b, 0, -1, anchor + offset] = maps[b, 1, -1, anchor] = 1.0
            if offset < 0:
                maps[b, 0, -1, anchor + offset] = maps[b, 0, -1, 0] = 0.5
        return [maps, None]


class PaddedIndexTask(recipe.IndexTask):
    """Prompts with two more spaces in front, so every letter has two bytes before it."""

    def __getitem__(self, index: int) -> dict:
        item = super().__getitem__(index)
        return dict(item, tokens=torch.cat([torch.full((2,), ord(' ')), item['tokens']]),
                    answer_start=item['answer_start'] + 2)


def test_index_attention_of_hand_checkable_maps():
    data = PaddedIndexTask(9, 3, recipe.IndexSpec(5, 7, 2, 'offset-anchor'))
    attention = recipe.index_attention(ScriptedAttention(), data, 4, 'cpu')  # batches of 4, 4 and 1 items
    offsets = [data[i]['offset'] for i in range(9)]
    assert set(offsets) == {-2, -1, 1, 2}
    negative = sum(o < 0 for o in offsets)
    assert attention == dict(back=[[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]], anchor=[[0.0, 1.0]],
                             target=[[pytest.approx(1 - 0.5 * negative / 9), 0.0]],
                             anchor_by_offset={o: [[0.0, 1.0]] for o in ('-2', '-1', '1', '2')},
                             target_by_offset={'-2': [[0.5, 0.0]], '-1': [[0.5, 0.0]], '1': [[1.0, 0.0]],
                                               '2': [[1.0, 0.0]]})
    assert list(attention['target_by_offset']) == ['-2', '-1', '1', '2']
    lavo = type('Lavo', (), dict(attention_maps=lambda self, tokens: [None], eval=lambda self: None))()
    assert recipe.index_attention(lavo, data, 4, 'cpu') is None


def test_compare_two_methods_writes_every_section(tmp_path):
    out = tmp_path / 'cmp'
    result = recipe.main(['compare', '--methods', 'goat', 'lavo', '--seeds', '0', *tiny(), '--updates', '2',
                          '--passkey-updates', '2', '--passkey-scratch-updates', '2', '--index-updates', '2',
                          '--passkey-starts', 'pretrained', 'scratch',
                          '--multiples', '1', '2', '--depths', '0', '1', '--passkey-samples', '2',
                          '--eval-windows', '1', '--index-test', '4', '--out', str(out)])
    summary = result['summary']
    assert list(summary) == ['ppl', 'passkey', 'passkey_scratch', 'index'] and set(summary['ppl']) == {'goat', 'lavo'}
    for section in ('passkey', 'passkey_scratch'):
        assert set(summary[section]['goat']['cells']) == {'1x@0', '1x@1', '2x@0', '2x@1'}
    assert 0 <= summary['index']['lavo']['accuracy']['mean'] <= 1 and 'ratio_4x' not in summary['ppl']['goat']
    for name in ('lm_ppl_vs_length.png', 'lm_passkey_heatmap.png', 'lm_passkey_scratch_heatmap.png',
                 'lm_index_accuracy.png'):
        assert (out / name).stat().st_size > 5000
    for folder, start in (('goat', 'pretrained'), ('scratch/goat', 'scratch')):
        config = json.loads((out / 'passkey' / folder / 'seed0' / 'config.json').read_text())
        assert config['task'] == 'passkey' and config['init_from'] == str(out / 'train' / 'goat' / 'seed0')
        assert config['passkey_start'] == start
    with pytest.raises(FileExistsError, match='already hold a run'):
        recipe.main(['compare', '--methods', 'goat', '--seeds', '0', *tiny(), '--out', str(out)])


def test_passkey_scratch_start_trains_a_fresh_model_of_the_runs_architecture(tmp_path):
    """--passkey-starts: 'pretrained' starts from the run's weights, 'scratch' from a fresh model built from the run's
    model config (GOAT options included) and the seed. One update at a negligible lr keeps each at its start."""
    from safetensors.torch import load_file
    train = tmp_path / 'train'
    overrides = dict(TINY_MODEL, goat_kwargs=dict(key_mlp_hidden=0))
    recipe.main(['train', '--methods', 'goat', *tiny(), '--model-overrides', json.dumps(overrides), '--updates', '3',
                 '--lr', '1e-2', '--out', str(train)])
    run = train / 'goat' / 'seed0'
    recipe.main(['passkey', str(run), '--passkey-updates', '1', '--passkey-scratch-updates', '1', '--passkey-lr',
                 '1e-12', '--multiples', '1', '--depths', '0.5', '--passkey-samples', '1', '--cpu', '--batch-size',
                 '2', '--out', str(tmp_path / 'pk')])

    def weights(folder: Path) -> dict:
        latest = json.loads((folder / 'latest.json').read_text())['checkpoint']
        return load_file(str(folder / latest / 'model.safetensors'))

    trained, pretrained, scratch = weights(run), weights(tmp_path / 'pk' / 'goat' / 'seed0'), \
        weights(tmp_path / 'pk' / 'scratch' / 'goat' / 'seed0')
    assert set(trained) == set(scratch) and not any('key_mlp' in k for k in scratch)  # the run's architecture
    for name, value in trained.items():
        torch.testing.assert_close(pretrained[name], value, rtol=0, atol=1e-8)
    moved = [name for name, value in trained.items() if not torch.allclose(scratch[name], value, atol=1e-4)]
    assert any(name.endswith('embed.weight') for name in moved)
    assert any('qkv.weight' in name for name in moved)


def test_passkey_scratch_without_runs_trains_fresh_models_of_methods_x_seeds(tmp_path):
    """``passkey --passkey-starts scratch`` with no RUN: one fresh model per --methods x --seeds pair, each seeded
    by itself (the same weights as the scratch model built from a run of that method and seed), at
    --train-length; the runs' flags and the fresh models' flags are not mixed."""
    from safetensors.torch import load_file
    flags = ['--passkey-starts', 'scratch', '--passkey-scratch-updates', '2', '--multiples', '1', '2', '--depths',
             '0.5', '--passkey-samples', '2', '--cpu', '--batch-size', '2', '--threads', '1']
    out = tmp_path / 'pk'
    result = recipe.main(['passkey', '--methods', 'goat', 'rope', '--seeds', '0', '1', '--train-length', '96',
                          '--model-overrides', json.dumps(TINY_MODEL), *flags, '--out', str(out)])
    assert list(result['summary']) == ['passkey_scratch']
    assert {(r['attn'], r['seed']) for r in result['rows']} == {('goat', 0), ('goat', 1), ('rope', 0), ('rope', 1)}
    config = json.loads((out / 'scratch' / 'goat' / 'seed1' / 'config.json').read_text())
    assert config['task'] == 'passkey' and config['passkey_start'] == 'scratch' and config['init_from'] is None
    assert config['data'] == {'train_length': 96} and config['model']['overrides']['dim'] == TINY_MODEL['dim']
    assert config['model']['overrides']['goat_kwargs'] == recipe.resolve_goat_kwargs(None)  # resolved, recorded
    assert set(result['rows'][0]['cells']) == {'1x@0.5', '2x@0.5'}
    compare = recipe.build_parser().parse_args(['compare'])  # the compare's passkey trainings: the same optimizer
    assert (config['args']['weight_decay'], config['args']['warmup_frac'], config['args']['clip_grad']) == \
        (compare.weight_decay, compare.warmup_frac, compare.clip_grad)

    # the same model and seed from a trained run of that architecture: the same fresh weights, the same training
    train = tmp_path / 'train'
    recipe.main(['train', '--methods', 'rope', *tiny(), '--updates', '1', '--out', str(train)])
    from_run = tmp_path / 'from_run'
    recipe.main(['passkey', str(train / 'rope' / 'seed0'), *flags, '--out', str(from_run)])

    def weights(folder: Path) -> dict:
        latest = json.loads((folder / 'latest.json').read_text())['checkpoint']
        return load_file(str(folder / latest / 'model.safetensors'))

    alone, via_run = weights(out / 'scratch' / 'rope' / 'seed0'), weights(from_run / 'scratch' / 'rope' / 'seed0')
    assert set(alone) == set(via_run)
    for name, value in alone.items():
        torch.testing.assert_close(via_run[name], value, rtol=0, atol=0)

    bad = tmp_path / 'bad'
    with pytest.raises(ValueError, match='passkey without RUN folders trains fresh models only'):
        recipe.main(['passkey', '--methods', 'rope', '--cpu', '--out', str(bad)])  # both starts by default
    with pytest.raises(ValueError, match='--methods, --train-length: these describe fresh models'):
        recipe.main(['passkey', str(train / 'rope' / 'seed0'), '--methods', 'rope', '--train-length', '96',
                     *flags, '--out', str(bad)])
    with pytest.raises(ValueError, match='a passkey prompt needs at least 81 bytes'):
        recipe.main(['passkey', '--train-length', '64', *flags, '--out', str(bad)])
    with pytest.raises(ValueError, match='cannot build the goat model'):
        recipe.main(['passkey', '--model-overrides', '{"goat_modes": 20}', *flags, '--out', str(bad)])
    assert not bad.exists()


def test_passkey_training_items_are_answerable():
    item = PasskeyTask(96, 1, 0)[0]
    text = bytes(item['tokens'].tolist())
    assert text[item['answer_start']:].isdigit() and text.count(text[item['answer_start']:]) == 2


def test_recipe_errors_before_anything_is_written(tmp_path):
    r = str(tmp_path / 'r')
    with pytest.raises(ValueError, match='cannot build the goat model'):
        recipe.main(['train', *tiny(), '--model-overrides', '{"goat_modes": 20}', '--out', r])
    with pytest.raises(ValueError, match='is not a JSON dict'):
        recipe.main(['train', *tiny(), '--model-overrides', '[1]', '--out', r])
    # what torch or the constructor raise (negative sizes, a zero width, unknown options) names the flag too
    with pytest.raises(ValueError,
                       match=r'--model-overrides \{"mlp_ratio": -1\} cannot build the goat model: .*negative'):
        recipe.main(['train', *tiny(), '--model-overrides', '{"mlp_ratio": -1}', '--out', r])
    with pytest.raises(ValueError, match=r'--model-overrides \{"dim": 0\} cannot build the lavo model'):
        recipe.main(['train', *tiny(), '--methods', 'lavo', '--model-overrides', '{"dim": 0}', '--out', r])
    with pytest.raises(ValueError, match=r'--model-overrides \{"bogus": 1\} cannot build the rope model: .*bogus'):
        recipe.main(['index', *tiny(), '--methods', 'rope', '--model-overrides', '{"bogus": 1}', '--out', r])
    with pytest.raises(ValueError, match=r'--index-letters / --index-max-offset: .*got 30\.\.20'):
        recipe.main(['index', *tiny(), '--index-letters', '30', '20', '--out', r])
    with pytest.raises(ValueError, match=r'--index-letters / --index-max-offset: .*max_offset must be in 1\.\.99'):
        recipe.main(['index', *tiny(), '--index-max-offset', '100', '--out', r])
    with pytest.raises(ValueError, match='--methods lists rope more than once'):
        recipe.main(['train', *tiny(), '--methods', 'rope', 'rope', '--out', r])
    with pytest.raises(ValueError, match='cannot hold an evaluation window of 769 bytes'):
        recipe.main(['compare', *tiny(), '--multiples', '1', '8', '--block-bytes', '512', '--out', r])
    with pytest.raises(ValueError, match='a passkey prompt needs at least 81 bytes'):
        recipe.main(['compare', *tiny(), '--train-length', '64', '--out', r])
    (tmp_path / 'empty.txt').write_text('')
    with pytest.raises(ValueError, match=r'empty\.txt is empty'):
        recipe.main(['train', *tiny(), '--text', str(tmp_path / 'empty.txt'), '--out', r])
    (tmp_path / 'short.txt').write_text('tiny text')
    with pytest.raises(ValueError, match='too few for a 10% validation split'):
        recipe.main(['train', *tiny(), '--text', str(tmp_path / 'short.txt'), '--out', r])
    with pytest.raises(ValueError, match=r'training samples < --batch-size 100000'):  # the loader, before config.json
        recipe.main(['train', *tiny(), '--batch-size', '100000', '--out', r])
    assert not Path(r).exists()


def test_passkey_starts_share_one_budget_and_compare_fine_tunes_by_default():
    """Both passkey starts train for the same number of updates by default (the start is the only difference), the
    ``passkey`` command runs both starts, and ``compare`` fine-tunes the pre-trained runs only (the issue's protocol,
    within its time budget); the flags still choose."""
    parser = recipe.build_parser()
    passkey = parser.parse_args(['passkey', 'RUN'])
    compare = parser.parse_args(['compare'])
    for args in (passkey, compare):
        assert args.passkey_updates == args.passkey_scratch_updates == recipe.PASSKEY_UPDATES == 2500
    assert passkey.passkey_starts == ['pretrained', 'scratch'] and compare.passkey_starts == ['pretrained']
    chosen = parser.parse_args(['compare', '--passkey-starts', 'scratch', '--passkey-updates', '300'])
    assert chosen.passkey_starts == ['scratch'] and chosen.passkey_updates == 300


def test_passkey_jobs_fine_tune_in_worker_processes(tmp_path):
    """``passkey --jobs 2`` fine-tunes the runs in two spawned workers (``runs.train_sweep``): every fine-tuned
    run ends with the weights it gets when the runs fine-tune one at a time, and the results are the same."""
    from run_helpers import assert_same_final_weights
    train = tmp_path / 'train'
    recipe.main(['train', '--methods', 'goat', 'rope', *tiny(), '--updates', '2', '--out', str(train)])
    runs = [str(train / 'goat' / 'seed0'), str(train / 'rope' / 'seed0')]
    flags = ['--passkey-updates', '2', '--passkey-scratch-updates', '2', '--multiples', '1', '--depths', '0.5',
             '--passkey-samples', '2', '--cpu', '--batch-size', '2', '--threads', '1']
    one = recipe.main(['passkey', *runs, *flags, '--jobs', '1', '--out', str(tmp_path / 'one')])
    two = recipe.main(['passkey', *runs, *flags, '--jobs', '2', '--out', str(tmp_path / 'two')])
    for name in ('goat', 'rope'):
        assert_same_final_weights(tmp_path / 'one' / name / 'seed0', tmp_path / 'two' / name / 'seed0')
    assert [r['cells'] for r in one['rows']] == [r['cells'] for r in two['rows']]


@pytest.fixture
def text_run(tmp_path):
    """An LM run on a text file the test wrote (80 KB of pydoc prose), stopped after 1 of 2 updates."""
    from vision_priors.recipes.data.text import builtin_corpus
    text = tmp_path / 'corpus.txt'
    text.write_bytes(b'\n'.join(d.data for d in builtin_corpus())[:80_000])
    out = tmp_path / 'train'
    common = ['train', '--methods', 'rope', *tiny(), '--text', str(text), '--updates', '2', '--checkpoint-every', '1',
              '--out', str(out)]
    recipe.main([*common, '--stop-after', '1'])
    return out / 'rope' / 'seed0', text, common


def test_changed_text_refuses_resume_and_ppl_naming_the_file(text_run, tmp_path):
    """The --text file's fingerprint is in the run's config: the file edited (same size) refuses --resume and ppl,
    naming it, with the run folder byte-for-byte unchanged and nothing written; passkey, which fine-tunes on
    synthetic prompts and reads no text, is not refused; the original bytes back, the run resumes and ppl runs."""
    from run_helpers import snapshot
    run, text, common = text_run
    original = text.read_bytes()
    stored = json.loads((run / 'config.json').read_text())['data_fingerprint']
    assert list(stored) == [str(text)] and stored[str(text)]['bytes'] == len(original)
    text.write_bytes(original.replace(b'the', b'THE', 1))
    before = snapshot(run)
    with pytest.raises(ValueError, match=re.escape(f'the data changed since the run in {run} was trained ({text}: '
                                                   f'sha256 ')):
        recipe.main([*common, '--resume'])
    ppl = ['ppl', str(run), '--multiples', '1', '--eval-windows', '1', '--cpu', '--out', str(tmp_path / 'ppl')]
    with pytest.raises(ValueError, match=re.escape(f'the data changed since run {run} was trained: {text}: sha256 ')):
        recipe.main(ppl)
    assert snapshot(run) == before and not (tmp_path / 'ppl').exists()
    recipe.main(['passkey', str(run), '--passkey-updates', '1', '--passkey-starts', 'pretrained', '--multiples', '1',
                 '--depths', '0.5', '--passkey-samples', '1', '--cpu', '--batch-size', '2', '--out',
                 str(tmp_path / 'pk')])
    assert json.loads((tmp_path / 'pk' / 'rope' / 'seed0' / 'config.json').read_text())['data_fingerprint'] == {}
    text.write_bytes(original)
    recipe.main([*common, '--resume'])
    assert json.loads((run / 'latest.json').read_text())['step'] == 2
    assert recipe.main(ppl)['rows'][0]['ppl']['1']['ppl'] > 1


def test_lm_run_without_fingerprints_still_evaluates(text_run, tmp_path):
    """A config without data_fingerprint (a run stored before them) loads and evaluates as before."""
    from run_helpers import drop_data_fingerprint
    run, _, _ = text_run
    drop_data_fingerprint(run)
    rows = recipe.main(['ppl', str(run), '--multiples', '1', '--eval-windows', '1', '--cpu',
                        '--out', str(tmp_path / 'ppl')])['rows']
    assert rows[0]['attn'] == 'rope'


def test_hidden_files_in_a_text_folder_do_not_refuse_resume_or_ppl(tmp_path):
    """The text loader skips hidden files, so does the run's fingerprint of a --text folder: a .DS_Store or an
    editor's swap file written into it after training does not refuse --resume or ppl; a new visible file does."""
    from vision_priors.recipes.data.text import builtin_corpus
    folder = tmp_path / 'texts'
    folder.mkdir()
    (folder / 'corpus.txt').write_bytes(b'\n'.join(d.data for d in builtin_corpus())[:80_000])
    out = tmp_path / 'train'
    common = ['train', '--methods', 'rope', *tiny(), '--text', str(folder), '--updates', '2', '--checkpoint-every', '1',
              '--out', str(out)]
    recipe.main([*common, '--stop-after', '1'])
    run = out / 'rope' / 'seed0'
    stored = json.loads((run / 'config.json').read_text())['data_fingerprint'][str(folder)]
    assert stored['hidden'] == 'skipped' and stored['files'] == 1
    (folder / '.DS_Store').write_bytes(bytes(range(256)))
    (folder / '.corpus.txt.swp').write_text('swap')
    recipe.main([*common, '--resume'])
    assert json.loads((run / 'latest.json').read_text())['step'] == 2
    ppl = ['ppl', str(run), '--multiples', '1', '--eval-windows', '1', '--cpu']
    assert recipe.main([*ppl, '--out', str(tmp_path / 'ppl')])['rows'][0]['ppl']['1']['ppl'] > 1
    (folder / 'more.txt').write_text('more prose')
    with pytest.raises(ValueError,
                       match=re.escape(f'the data changed since run {run} was trained: {folder}: files 1 -> 2')):
        recipe.main([*ppl, '--out', str(tmp_path / 'ppl2')])
    assert not (tmp_path / 'ppl2').exists()


def test_index_runs_keep_their_task_and_are_tested_on_it(tmp_path, monkeypatch):
    """``--index-letters / --index-max-offset / --index-layout`` reach the training items, the run's config and the
    held-out test; a resume with another task is refused (the data config changed)."""
    out = tmp_path / 'idx'
    flags = ['index', '--methods', 'rope', *tiny(), '--index-updates', '3', '--index-test', '6', '--index-letters', '5',
             '7', '--index-max-offset', '2', '--index-layout', 'offset-anchor', '--checkpoint-every', '1']
    recipe.main([*flags, '--stop-after', '2', '--out', str(out)])
    config = json.loads((out / 'rope' / 'seed0' / 'config.json').read_text())
    assert config['data'] == dict(train_length=13, index=dict(min_letters=5, max_letters=7, max_offset=2,
                                                              layout='offset-anchor'))
    with pytest.raises(ValueError, match=r"data\.index\.layout: 'offset-anchor' -> 'anchor-offset'"):
        recipe.main([*flags[:-2], '--index-layout', 'anchor-offset', '--resume', '--out', str(out)])
    result = recipe.main([*flags, '--resume', '--out', str(out)])
    row = result['rows'][0]
    assert row['attn'] == 'rope' and 0 <= row['accuracy'] <= 1
    # per signed offset: the held-out items split by the offset they ask, adding up to the whole test
    assert set(row['items_by_offset']) <= {'-2', '-1', '1', '2'} and sum(row['items_by_offset'].values()) == 6
    assert row['accuracy'] == pytest.approx(sum(row['accuracy_by_offset'][o] * n for o, n in
                                                row['items_by_offset'].items()) / 6)
    for key, values in (('offset', {'-2', '-1', '1', '2'}), ('letters', {'5', '6', '7'}),
                        ('anchor_back', {str(v) for v in range(7)})):
        assert set(row[f'items_by_{key}']) <= values and sum(row[f'items_by_{key}'].values()) == 6
        by_value = result['summary']['index']['rope'][f'by_{key}']
        assert {v: c['mean'] for v, c in by_value.items()} == row[f'accuracy_by_{key}']
    assert row['offsets'] == result['summary']['index']['rope']['offsets'] == 4  # -2..+2 without 0
    for label in recipe.INDEX_BREAKDOWNS.values():
        assert f'method (accuracy % per {label})' in result['table_markdown']
    # where the heads look: 1 block x 2 heads, distances 0..max_offset, attention weights (shares of 1)
    attention = row['attention']
    assert [len(h) for b in attention['back'] for h in b] == [3, 3] and len(attention['anchor'][0]) == 2
    assert all(0 <= w <= 1 for b in attention['back'] for h in b for w in h)
    assert result['summary']['index']['rope']['attention'] == {'0': attention}
    assert '| rope | 0 | 1 | 2 |' in result['table_markdown'] and 'answer -> target (%)' in result['table_markdown']
    assert set(attention['anchor_by_offset']) == set(row['items_by_offset'])
    lines = result['table_markdown'].split('\n')
    header = next(line for line in lines if line.startswith('| method (answer -> anchor / target, % per signed'))
    assert header.rstrip(' |').split(' | ')[4:] == [f'{int(o):+d}' for o in sorted(row['items_by_offset'], key=int)]
    tested = []
    original = recipe.IndexTask

    def recording(size, seed, spec):
        tested.append(spec)
        return original(size, seed, spec)
    monkeypatch.setattr(recipe, 'IndexTask', recording)
    recipe.run_index(recipe.build_parser().parse_args([*flags, '--resume', '--out', str(out)]), out)
    assert tested[-1] == recipe.IndexSpec(5, 7, 2, 'offset-anchor')


def test_goat_options_are_recorded_and_a_legacy_config_rebuilds_the_old_model():
    """A GOAT run's config records its resolved GoatPrior options (LM_GOAT_DEFAULTS under --model-overrides), so it
    is rebuilt as trained whatever the defaults become; a config stored before they were recorded (stop 45) gets
    the options of then: the linear slope from zero and the key-default MLP."""
    from vision_priors.models.language_model import LM_GOAT_DEFAULTS
    args = recipe.build_parser().parse_args(['train', '--model-overrides', '{"goat_kwargs": {"prior_init": "zero"}}'])
    config = recipe.model_config(args, 'goat')
    assert config['overrides']['goat_kwargs'] == dict(LM_GOAT_DEFAULTS, prior_init='zero')
    prior = recipe.build_model(config).blocks[0].attn.layer.prior
    assert prior.key_mlp is None and prior.key_slope_raw is not None
    assert float(prior.key_slopes().max().detach()) < 1e-12
    legacy = dict(attn='goat', overrides=dict(recipe.CPU_MODEL))  # no goat_kwargs: an old run
    prior = recipe.build_model(legacy).blocks[0].attn.layer.prior
    assert prior.key_mlp is not None and prior.key_slope is not None and not prior.key_slope.any()
    assert recipe.LEGACY_LM_GOAT == dict(key_slope_param='linear', prior_init='zero', key_mlp_hidden=32)
