"""End-to-end tests of the resolution-extrapolation recipe on tiny data written by the tests."""
import io
import json
import math
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from run_helpers import final_weights
from vision_priors.recipes import resolution_extrapolation as recipe
from vision_priors.recipes.checkpoints import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = json.dumps(dict(embed_dim=64, depth=1, num_heads=1, patch_size=8))
CLASSES = ['circle', 'square', 'stripe']


def _image(cls: int, seed: int, size: int = 40) -> Image.Image:
    rng = np.random.default_rng(seed)
    img = (rng.random((size, size, 3)) * 60).astype(np.uint8)
    img[..., cls] += 150
    return Image.fromarray(img)


@pytest.fixture(scope='module')
def image_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('imagenet_like')
    for split, count in (('train', 8), ('val', 4)):
        for c, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                _image(c, hash((split, c, i)) % 1000).save(folder / f'{i}.jpg')
    return root


@pytest.fixture(scope='module')
def wds_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('wds')
    info = {'name': 'tiny', 'splits': {}}
    for split, shards, per_shard in (('train', 2, 12), ('validation', 1, 6)):
        filenames = []
        for s in range(shards):
            name = f'{split}-{s:06d}.tar'
            with tarfile.open(root / name, 'w') as tar:
                for i in range(per_shard):
                    cls = (s * per_shard + i) % 3
                    buf = io.BytesIO()
                    _image(cls, s * 100 + i).save(buf, format='JPEG')
                    for ext, payload in (('jpg', buf.getvalue()), ('cls', str(cls).encode())):
                        member = tarfile.TarInfo(f'{s:03d}{i:05d}.{ext}')
                        member.size = len(payload)
                        tar.addfile(member, io.BytesIO(payload))
            filenames.append(name)
        info['splits'][split] = dict(name=split, num_samples=shards * per_shard, filenames=filenames,
                                     shard_lengths=[per_shard] * shards)
    (root / '_info.json').write_text(json.dumps(info))
    return root


def _train_args(out: Path, data: str, *extra: str) -> list:
    return ['train', '--model', 'vit_tiny_patch16_goat_224', '--data', data, '--out', str(out),
            '--size-overrides', TINY, '--train-res', '32', '--batch-size', '4', '--cpu', *extra]


def test_folder_train_checkpoint_eval_json_png(image_folder, tmp_path):
    run = tmp_path / 'run'
    recipe.main(_train_args(run, str(image_folder), '--updates', '4', '--checkpoint-every', '2'))
    latest = json.loads((run / 'latest.json').read_text())
    assert latest['step'] == 4 and (run / latest['checkpoint'] / 'model.safetensors').exists()
    assert len(list(run.glob('checkpoint-*'))) <= 2 and not list(run.glob('.tmp-*'))
    log = [json.loads(line) for line in (run / 'log.jsonl').read_text().splitlines()]
    assert log[0]['event'] == 'start' and any(r['event'] == 'train' for r in log)
    out = tmp_path / 'eval'
    recipe.main(['eval', str(run), '--data', str(image_folder), '--eval-res', '32', '48', '32x64',
                 '--out', str(out), '--batch-size', '4', '--cpu'])
    results = json.loads((out / 'results.json').read_text())
    assert [(r['res'], r['positions']) for r in results['rows']] == [
        (res, positions) for positions in ('native', 'interpolated') for res in ('32', '48', '32x64')]
    assert all(r['samples'] == 12 and 0 <= r['top1'] <= 100 for r in results['rows'])
    by = {(r['res'], r['positions']): r for r in results['rows']}
    # on the training grid the two ways of measuring positions are the same positions
    assert by['32', 'native']['top1'] == by['32', 'interpolated']['top1']
    assert by['32', 'native']['loss'] == pytest.approx(by['32', 'interpolated']['loss'], rel=1e-6)
    assert set(results['summaries']) == {'native', 'interpolated'}
    assert results['summary'] == results['summaries']['native']
    assert 'interpolated onto the training grid' in results['table_markdown']
    assert (out / 'accuracy_vs_resolution.png').stat().st_size > 1000
    recipe.main(['eval', str(run), '--data', str(image_folder), '--eval-res', '48', '--positions', 'interpolated',
                 '--out', str(tmp_path / 'eval_interpolated'), '--batch-size', '4', '--cpu'])
    only = json.loads((tmp_path / 'eval_interpolated' / 'results.json').read_text())['rows']
    assert [(r['res'], r['positions'], r['top1']) for r in only] == [
        ('48', 'interpolated', by['48', 'interpolated']['top1'])]


@pytest.mark.parametrize('data', ['folder', 'builtin'])  # builtin: scene zoom and coordinate rescale (defaults) on
def test_kill_and_resume_equals_uninterrupted(image_folder, tmp_path, data):
    full, killed = tmp_path / 'full', tmp_path / 'killed'
    common = ['--updates', '9', '--checkpoint-every', '3', '--drop-path', '0.1', '--seed', '3']

    def train(out, *extra):
        if data == 'folder':
            return recipe.main(_train_args(out, str(image_folder), *common, *extra))
        return recipe.main(['train', '--model', 'vit_tiny_patch16_goat_224', '--size-overrides', TINY, '--train-res',
                            '32', '--batch-size', '4', '--cpu', '--train-samples', '24', '--val-samples', '8',
                            '--out', str(out), *common, *extra])
    train(full)
    train(killed, '--stop-after', '5')
    assert json.loads((killed / 'latest.json').read_text())['step'] == 5
    train(killed, '--resume')
    if data == 'builtin':
        assert json.loads((full / 'config.json').read_text())['model_kwargs']['rescale_coords'] == 2.0
    a, b = final_weights(full), final_weights(killed)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_model_ema_weights_are_the_ones_evaluated_kept_and_reported(image_folder, tmp_path):
    """With --ema-decay the averaged weights are the run's result (timm's convention): every checkpoint holds them
    as ema.safetensors (in its manifest), load_weights returns them, the in-training evaluation and the best folder
    use them, `eval` reports them, and a killed + resumed run ends with bit-identical EMA weights."""
    from safetensors.torch import load_file
    from vision_priors.recipes.checkpoints import EMA_WEIGHTS, load_weights

    full, killed = tmp_path / 'full', tmp_path / 'killed'
    common = ['--updates', '6', '--checkpoint-every', '3', '--eval-every', '6', '--ema-decay', '0.5', '--seed', '1',
              '--lr', '0.01']
    recipe.main(_train_args(full, str(image_folder), *common))
    checkpoint = latest_checkpoint(full)
    assert EMA_WEIGHTS in json.loads((checkpoint / 'manifest.json').read_text())['files']
    ema, raw = load_file(str(checkpoint / EMA_WEIGHTS)), final_weights(full)
    assert ema.keys() == raw.keys() and any(not torch.equal(ema[k], raw[k]) for k in ema)
    reported = load_weights(checkpoint)
    assert all(torch.equal(reported[k], ema[k]) for k in ema)
    best = load_weights(full / 'best')  # the only evaluation is the last update's: the final EMA weights
    assert all(torch.equal(best[k], ema[k]) for k in ema)

    kept = json.loads((full / 'best' / 'metrics.json').read_text())
    row = recipe.main(['eval', str(full), '--data', str(image_folder), '--eval-res', '32', '--out', str(tmp_path / 'e'),
                       '--batch-size', '4', '--cpu'])['rows'][0]
    assert row['top1'] == pytest.approx(kept['top1']) and row['loss'] == pytest.approx(kept['loss'])

    recipe.main(_train_args(killed, str(image_folder), *common, '--stop-after', '3'))
    recipe.main(_train_args(killed, str(image_folder), *common, '--resume'))
    resumed = load_file(str(latest_checkpoint(killed) / EMA_WEIGHTS))
    assert all(torch.equal(resumed[k], ema[k]) for k in ema)


def test_ema_warmup_ramps_the_decay_as_timm(image_folder, tmp_path):
    """--ema-warmup: the EMA after update 2 is d w1 + (1 - d) w2 with timm's warmup decay d = 1 - 2 ** (-2/3)
    (0.37, not the 0.99 asked for); without it d is the decay itself. An --ema-warmup without an EMA is refused
    before the run folder exists."""
    from safetensors.torch import load_file
    from vision_priors.recipes.checkpoints import EMA_WEIGHTS, checkpoint_folders

    for warmup, decay in ((True, 1 - 2 ** (-2 / 3)), (False, 0.99)):
        run = tmp_path / f'warmup_{warmup}'
        recipe.main(_train_args(run, str(image_folder), '--updates', '2', '--checkpoint-every', '1', '--lr', '0.01',
                                '--ema-decay', '0.99', *(['--ema-warmup'] if warmup else [])))
        first, second = checkpoint_folders(run)  # updates 1 and 2, oldest first
        w1, w2 = (load_file(str(folder / 'model.safetensors')) for folder in (first, second))
        ema = load_file(str(second / EMA_WEIGHTS))
        moved = [k for k in ema if not torch.equal(w1[k], w2[k])]
        assert moved
        for key in moved:
            torch.testing.assert_close(ema[key], decay * w1[key] + (1 - decay) * w2[key], rtol=1e-5, atol=1e-6,
                                       msg=key)
    refused = tmp_path / 'refused'
    with pytest.raises(ValueError, match='--ema-warmup'):
        recipe.main(_train_args(refused, str(image_folder), '--updates', '2', '--ema-warmup'))
    assert not refused.exists()


def test_webdataset_shards_train_and_eval(wds_folder, tmp_path):
    run = tmp_path / 'wds_run'
    recipe.main(_train_args(run, f'wds:{wds_folder}', '--updates', '3', '--num-classes', '3'))
    assert (latest_checkpoint(run) / 'model.safetensors').exists()
    out = tmp_path / 'wds_eval'
    recipe.main(['eval', str(run), '--data', f'wds:{wds_folder}', '--num-classes', '3', '--eval-res', '32', '48',
                 '--out', str(out), '--batch-size', '3', '--cpu'])
    rows = json.loads((out / 'results.json').read_text())['rows']
    assert [(r['samples'], r['positions']) for r in rows] == [(6, 'native')] * 2 + [(6, 'interpolated')] * 2


def test_two_process_accelerate_launch_keeps_parameters_in_sync(image_folder, tmp_path):
    script = tmp_path / 'ddp_check.py'
    script.write_text(f'''
import sys, torch
sys.path.insert(0, {str(ROOT)!r})
from vision_priors.recipes import resolution_extrapolation as recipe
from vision_priors.recipes.checkpoints import latest_checkpoint
from accelerate import PartialState
from safetensors.torch import load_file
recipe.main({_train_args(tmp_path / 'ddp', str(image_folder), '--updates', '3')!r})
state = PartialState()
model = recipe.build_model('vit_tiny_patch16_goat_224', dict(num_classes=3, img_size=(32, 32), embed_dim=64,
                           depth=1, num_heads=1, patch_size=8))
model.load_state_dict(load_file(str(latest_checkpoint({str(tmp_path / 'ddp')!r}) / 'model.safetensors')))
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(flat) for _ in range(state.num_processes)]
torch.distributed.all_gather(gathered, flat)
assert state.num_processes == 2, state.num_processes
assert torch.equal(gathered[0], gathered[1])
print('IN_SYNC', state.process_index, flush=True)
state.destroy_process_group()  # join gloo's threads before exit (else an exit-time abort is possible)
''')
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS='1')
    # torchrun-style launcher (accelerate's --cpu launcher wants mpirun); the recipe's --cpu selects gloo
    cmd = [sys.executable, '-m', 'accelerate.commands.launch', '--multi_gpu', '--num_processes', '2',
           '--num_machines', '1', '--mixed_precision', 'no', '--dynamo_backend', 'no', str(script)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count('IN_SYNC') == 2


def test_clear_errors(image_folder, wds_folder, tmp_path):
    with pytest.raises(FileNotFoundError, match='does not exist'):
        recipe.main(_train_args(tmp_path / 'r', str(tmp_path / 'nowhere'), '--updates', '1'))
    empty = tmp_path / 'empty_class'
    for split in ('train', 'val'):
        (empty / split / 'a').mkdir(parents=True)
        _image(0, 0).save(empty / split / 'a' / '0.jpg')
        (empty / split / 'b').mkdir(parents=True)
    with pytest.raises(ValueError, match=r'class folder .*train/b is empty'):
        recipe.main(_train_args(tmp_path / 'r', str(empty), '--updates', '1'))
    broken = tmp_path / 'broken'
    for split in ('train', 'val'):
        for c in ('a', 'b'):
            (broken / split / c).mkdir(parents=True)
            for i in range(4):
                _image(0, i).save(broken / split / c / f'{i}.jpg')
    (broken / 'train' / 'b' / '2.jpg').write_bytes(b'not a jpeg at all')
    with pytest.raises(ValueError, match=r'cannot read image .*train/b/2.jpg'):
        recipe.main(_train_args(tmp_path / 'r2', str(broken), '--updates', '4', '--batch-size', '8'))
    # webdataset folders are checked before training starts (nothing is written)
    no_shards = tmp_path / 'no_shards'
    no_shards.mkdir()
    with pytest.raises(ValueError, match=r'webdataset folder .*no_shards holds no .tar shards'):
        recipe.main(_train_args(tmp_path / 'w1', f'wds:{no_shards}', '--updates', '1', '--num-classes', '3'))
    with pytest.raises(ValueError, match=r"webdataset folder .* has no split 'val': _info.json names splits"):
        recipe.main(_train_args(tmp_path / 'w2', f'wds:{wds_folder}', '--updates', '1', '--num-classes', '3',
                                '--train-split', 'val'))
    assert not (tmp_path / 'w1').exists() and not (tmp_path / 'w2').exists()
    with pytest.raises(ValueError, match=r'training samples < --batch-size 1000'):  # the loader, before config.json
        recipe.main(_train_args(tmp_path / 'r3', str(image_folder), '--updates', '1', '--batch-size', '1000'))
    assert not (tmp_path / 'r3').exists()
    with pytest.raises(ValueError, match=r'resolution 36 is not divisible by the patch size 8x8'):
        recipe.main(['eval', 'vit_tiny_patch16_goat_224', '--data', str(image_folder), '--size-overrides', TINY,
                     '--num-classes', '3', '--eval-res', '32', '36', '--out', str(tmp_path / 'e'), '--cpu'])
    with pytest.raises(SystemExit):
        recipe.main(['eval', 'x', '--eval-res', '32y'])
    # --size-overrides timm's constructor rejects: an error naming the flag, for train and for eval of a model name
    bad = json.dumps(dict(json.loads(TINY), embed_dim=-8))
    with pytest.raises(ValueError, match=rf'--size-overrides {re.escape(bad)} cannot build the '
                                         r'vit_tiny_patch16_goat_224 model \(with --train-res 32, --drop-path 0\): '
                                         r'.*negative dimension'):
        recipe.main(_train_args(tmp_path / 'r4', str(image_folder), '--updates', '1', '--size-overrides', bad))
    with pytest.raises(ValueError, match=r'--size-overrides \{"act_layer": "nope"\} cannot build .*nope'):
        recipe.main(_train_args(tmp_path / 'r4', str(image_folder), '--updates', '1',
                                '--size-overrides', '{"act_layer": "nope"}'))
    with pytest.raises(ValueError, match=r'--size-overrides \{"bogus": 1\} cannot build the vit_tiny_patch16_goat_224 '
                                         r'model .*unexpected keyword argument .bogus.'):
        recipe.main(['eval', 'vit_tiny_patch16_goat_224', '--data', str(image_folder), '--size-overrides',
                     '{"bogus": 1}', '--num-classes', '3', '--eval-res', '32', '--out', str(tmp_path / 'e'), '--cpu'])
    assert not (tmp_path / 'r4').exists() and not (tmp_path / 'e').exists()


def test_refuses_to_overwrite_a_run_without_resume(image_folder, tmp_path):
    run = tmp_path / 'run'
    recipe.main(_train_args(run, str(image_folder), '--updates', '1'))
    with pytest.raises(FileExistsError, match=r'already holds a run .* --resume'):
        recipe.main(_train_args(run, str(image_folder), '--updates', '1'))


def test_eval_without_an_interpolated_form_reports_native_rows_only(tmp_path, capsys):
    """A model with no position scheme interpolate_positions knows (here a timm ViT without a position table) is
    evaluated natively and says why; the interpolated table holds the others."""
    no_table = json.dumps(dict(json.loads(TINY), pos_embed='none'))
    out = tmp_path / 'eval'
    result = recipe.main(['eval', 'vit_tiny_patch16_224', '--size-overrides', no_table, '--val-samples', '8',
                          '--eval-res', '32', '48', '--out', str(out), '--cpu', '--threads', '1'])
    assert [(r['res'], r['positions']) for r in result['rows']] == [('32', 'native'), ('48', 'native')]
    assert 'evaluated with native positions only (VisionTransformer has no position scheme' in capsys.readouterr().out
    assert list(result['summaries']) == ['native']


def test_builtin_compare_and_analyze(tmp_path):
    out = tmp_path / 'compare'
    recipe.main(['compare', '--models', 'vit_tiny_patch16_224', 'vit_tiny_patch16_goat_224', '--seeds', '0', '1',
                 '--updates', '2', '--batch-size', '8', '--train-samples', '32', '--val-samples', '16',
                 '--size-overrides', TINY.replace('"depth": 1', '"depth": 2'), '--train-res', '32',
                 '--eval-res', '32', '48', '64', '--out', str(out), '--cpu'])
    results = json.loads((out / 'results.json').read_text())
    assert set(results['summary']) == {'vit_tiny_patch16_224', 'vit_tiny_patch16_goat_224'}
    for per_res in results['summary'].values():
        assert set(per_res) == {'32', '48', '64'} and all(cell['n'] == 2 for cell in per_res.values())
    assert len(results['rows']) == 2 * 2 * 3 * 2 and (out / 'accuracy_vs_resolution.png').exists()  # x 2 positions
    assert results['summaries']['interpolated'].keys() == results['summary'].keys()
    analysis = tmp_path / 'analysis'
    recipe.main(['analyze', str(out / 'vit_tiny_patch16_goat_224' / 'seed0'), '--layers', '0', '--heads', '0',
                 '--out', str(analysis)])
    stats = json.loads((analysis / 'spectral_statistics.json').read_text())
    # zero-initialised prior, trained away from 0 (at depth 1 only the class token reaches the head and
    # a prefix query has no relative term, so depth 2 is needed for alpha / beta to get gradient)
    assert len(stats) == 2 and stats[0]['heads'] == 1 and stats[0]['mean_amplitude'] > 0
    assert (analysis / 'prior_heads.png').stat().st_size > 1000
    with pytest.raises(ValueError, match='needs a GOAT model'):
        recipe.main(['analyze', str(out / 'vit_tiny_patch16_224' / 'seed0'), '--out', str(analysis)])


def test_sincos_start_of_the_absolute_embedding():
    """``--abs-pos-init sincos`` writes the 2D sin-cos table of the grid into timm's learned pos_embed (patch part
    only, class token untouched); 'timm' and models without a learned embedding are left alone."""
    import timm
    from timm.layers import build_sincos2d_pos_embed
    torch.manual_seed(0)
    for class_token in (True, False):
        model = timm.create_model('vit_tiny_patch16_224', embed_dim=64, depth=1, num_heads=2, patch_size=8,
                                  img_size=(32, 48), class_token=class_token,
                                  global_pool='token' if class_token else 'avg')
        before = model.pos_embed.detach().clone()
        assert recipe.init_abs_pos_embed(model, 'sincos')
        table = build_sincos2d_pos_embed([4, 6], 64)
        assert torch.equal(model.pos_embed[0, -24:].detach(), table) and model.pos_embed.requires_grad
        assert torch.equal(model.pos_embed[0, :-24].detach(), before[0, :-24])
        assert not recipe.init_abs_pos_embed(model, 'timm')
    goat = timm.create_model('vit_tiny_patch16_goat_224', embed_dim=64, depth=1, num_heads=2, patch_size=8, img_size=32)
    assert not recipe.init_abs_pos_embed(goat, 'sincos')


def test_jax_weight_init_restarts_every_default_model_alike():
    """``--weight-init jax`` gives every Linear layer of every default model (timm's ViT, its Eva RoPE models and
    ours) the Xavier-uniform start and a zero head, and leaves what is not a Linear / Conv2d weight where the model
    put it (the GOAT prior, layer scale, norms, mixed RoPE's frequencies); 'timm' changes nothing."""
    import timm
    from torch import nn
    for name in recipe.DEFAULT_MODELS:
        torch.manual_seed(0)
        model = timm.create_model(name, num_classes=12, img_size=32, dynamic_img_size=True, **recipe.BUILTIN_OVERRIDES)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        recipe.init_weights(model, 'timm')
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), name
        recipe.init_weights(model, 'jax')
        linear_weights = set()
        for module_name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            linear_weights.add(f'{module_name}.weight')
            w = module.weight.detach()
            if module_name.startswith('head'):
                assert not w.any() and not module.bias.any(), name
                continue
            bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
            assert w.abs().max() <= bound and 0.8 < w.std() * math.sqrt(3) / bound < 1.2, (name, module_name)
        assert len(linear_weights) >= 9, name  # qkv, proj, fc1, fc2 x depth 2 + head
        conv = model.patch_embed.proj.weight.detach()
        assert abs(conv.std().item() - 1 / math.sqrt(conv[0].numel())) < 0.15 / math.sqrt(conv[0].numel()), name
        for key, value in model.state_dict().items():
            if key not in linear_weights and not key.startswith('patch_embed.proj') and not key.endswith('.bias'):
                assert torch.equal(value, before[key]), (name, key)


def test_weight_init_is_recorded_and_a_changed_one_refuses_resume(image_folder, tmp_path, monkeypatch):
    calls = []
    real_init = recipe.init_weights
    monkeypatch.setattr(recipe, 'init_weights', lambda model, mode: calls.append(mode) or real_init(model, mode))
    recipe.main(_train_args(tmp_path / 'default', str(image_folder), '--updates', '1'))
    assert calls == ['jax']  # the default start is applied to the trained model
    run = tmp_path / 'run'
    recipe.main(_train_args(run, str(image_folder), '--updates', '2', '--stop-after', '1', '--weight-init', 'timm'))
    assert calls == ['jax', 'timm']
    assert json.loads((run / 'config.json').read_text())['args']['weight_init'] == 'timm'
    config_before = (run / 'config.json').read_bytes()
    with pytest.raises(ValueError, match=r'settings differ .*weight_init'):
        recipe.main(_train_args(run, str(image_folder), '--updates', '2', '--resume'))  # the default is jax
    assert (run / 'config.json').read_bytes() == config_before
    with pytest.raises(SystemExit):
        recipe.main(_train_args(tmp_path / 'bad', str(image_folder), '--updates', '1', '--weight-init', 'xavier'))
    assert not (tmp_path / 'bad').exists()


def test_goat_top_frequency_is_recorded_and_eval_rebuilds_the_trained_ladder(image_folder, tmp_path, monkeypatch):
    """A GOAT ViT's default top frequency follows its training grid; the run's config records the value, and eval
    rebuilds that ladder even where today's default differs (a run stored before the record had 0.4)."""
    from vision_priors.models import vision_transformer_priors as vit_module
    run = tmp_path / 'run'
    patch4 = json.dumps(dict(embed_dim=64, depth=1, num_heads=1, patch_size=4))  # 32 px: an 8 x 8 grid
    recipe.main(['train', '--model', 'vit_tiny_patch16_goat_224', '--data', str(image_folder), '--out', str(run),
                 '--size-overrides', patch4, '--train-res', '32', '--batch-size', '4', '--cpu', '--updates', '1'])
    config = json.loads((run / 'config.json').read_text())
    assert config['goat_max_freq'] == pytest.approx(0.4 * 7 / 15) == vit_module.vit_goat_max_freq((8, 8))
    args = recipe.build_parser().parse_args(['eval', str(run), '--data', str(image_folder), '--cpu'])

    def ladder_top(model) -> float:
        return model.blocks[0].attn.prior.max_freq

    _, model, _ = recipe.load_for_eval(str(run), args)
    assert ladder_top(model) == config['goat_max_freq']
    monkeypatch.setattr(vit_module, 'vit_goat_max_freq', lambda grid: 1.0)  # a later, different default
    _, model, _ = recipe.load_for_eval(str(run), args)
    assert ladder_top(model) == model.goat_max_freq == config['goat_max_freq']
    del config['goat_max_freq']  # a run stored before the record: trained with 0.4 on every grid
    (run / 'config.json').write_text(json.dumps(config))
    _, model, _ = recipe.load_for_eval(str(run), args)
    assert ladder_top(model) == recipe.LEGACY_GOAT_MAX_FREQ == 0.4
    _, fresh, _ = recipe.load_for_eval('vit_small_patch16_rope_224', args)  # models without the ladder: untouched
    assert getattr(fresh, 'goat_max_freq', None) is None


def test_builtin_scenes_are_rendered_once_per_process():
    from vision_priors.recipes.data.builtin_scenes import SpatialScenes
    args = recipe.build_parser().parse_args(['train', '--train-samples', '24', '--val-samples', '12'])
    first = recipe.builtin_dataset('train', args, (32, 32))
    assert recipe.builtin_dataset('train', args, (32, 32)) is first  # cached
    source = SpatialScenes('train', num_samples=24, resolution=32, seed=0, task='clock', zoom=recipe.BUILTIN_SCENE_ZOOM)
    for i in (0, 5, 23):
        image, label = first[i]
        assert torch.equal(image, source[i][0]) and label == source[i][1]
    assert first.num_classes == 12 and len(first) == 24
    with pytest.raises(ValueError, match='without a transform'):
        from vision_priors.recipes.data.builtin_scenes import RenderedScenes
        RenderedScenes(SpatialScenes('val', num_samples=2, transform=lambda im: im))


def test_cifar10_data_trains_and_evaluates_at_larger_resolutions(tmp_path, monkeypatch):
    """``--data cifar10:FOLDER`` (python batches) and ``cifar10:FILE.npz`` train and evaluate at 1x / 1.5x;
    a bad spec, a missing path and a failed download are errors naming what to do."""
    from test_data_image_pools import write_cifar_folder
    from vision_priors.recipes.data import image_pools
    folder = tmp_path / 'cifar-10-batches-py'
    write_cifar_folder(folder, per_batch=4)
    npz = tmp_path / 'c.npz'
    rng = np.random.default_rng(0)
    np.savez(npz, images=rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8), labels=np.arange(40) % 10)
    for spec in (f'cifar10:{folder}', f'cifar10:{npz}'):
        out = tmp_path / spec[-5:].replace('/', '_').replace('.', '_')
        recipe.main(['compare', '--models', 'vit_tiny_patch16_goat_224', '--seeds', '0', '--data', spec,
                     '--updates', '2', '--batch-size', '4', '--size-overrides', TINY, '--train-res', '16',
                     '--eval-res', '16', '24', '--out', str(out), '--cpu', '--threads', '1'])
        results = json.loads((out / 'results.json').read_text())
        rows = results['rows']
        per_res = 4 if 'npz' not in spec else 10  # test_batch; 1 of 4 per class
        assert [r['res'] for r in rows] == ['16', '24'] * 2 and all(r['samples'] == per_res for r in rows)
        config = json.loads((out / 'vit_tiny_patch16_goat_224' / 'seed0' / 'config.json').read_text())
        assert config['data_kind'] == 'cifar10' and config['model_kwargs']['num_classes'] == 10
    with pytest.raises(ValueError, match=r"expected 'cifar10' \(download\) or 'cifar10:PATH'"):
        image_pools.cifar10_pools('cifar10:', 0)
    with pytest.raises(FileNotFoundError, match='does not exist'):
        image_pools.cifar10_pools(f'cifar10:{tmp_path / "nowhere"}', 0)

    class Offline:
        def __init__(self, *args, **kwargs):
            raise OSError('network is unreachable')
    monkeypatch.setattr('torchvision.datasets.CIFAR10', Offline)
    with pytest.raises(RuntimeError,
                       match=r'downloading CIFAR-10 into .* failed .*network is unreachable.*cifar10:FOLDER'):
        image_pools.cifar10_pools('cifar10', 0, download_root=tmp_path / 'download')


def test_changed_image_folder_refuses_resume_and_eval_on_it(image_folder, tmp_path):
    """The training folder's fingerprint (its listing: files and sizes) is in the run's config: an image added to it
    refuses --resume and an eval with --data naming it (the error names the folder and the file count), run folder
    unchanged and nothing written; eval on another --data source is the user's choice and runs."""
    import shutil
    from run_helpers import snapshot
    data = tmp_path / 'data'
    shutil.copytree(image_folder, data)
    run = tmp_path / 'run'
    common = _train_args(run, str(data), '--updates', '2', '--checkpoint-every', '1', '--threads', '1')
    recipe.main([*common, '--stop-after', '1'])
    stored = json.loads((run / 'config.json').read_text())['data_fingerprint'][str(data)]
    assert stored['kind'] == 'folder' and stored['files'] == 36
    shutil.copy(data / 'val' / 'circle' / '0.jpg', data / 'val' / 'circle' / 'extra.jpg')
    before = snapshot(run)
    with pytest.raises(ValueError, match=re.escape(f'the data changed since the run in {run} was trained ({data}: '
                                                   f'files 36 -> 37, bytes ')):
        recipe.main([*common, '--resume'])
    evaluation = ['eval', str(run), '--eval-res', '32', '--batch-size', '4', '--cpu', '--threads', '1']
    with pytest.raises(ValueError, match=re.escape(f'the data changed since run {run} was trained: {data}: files 36 '
                                                   f'-> 37')):
        recipe.main([*evaluation, '--data', str(data), '--out', str(tmp_path / 'eval')])
    assert snapshot(run) == before and not (tmp_path / 'eval').exists()
    rows = recipe.main([*evaluation, '--data', str(image_folder), '--out', str(tmp_path / 'other')])['rows']
    assert rows[0]['samples'] == 12
    (data / 'val' / 'circle' / 'extra.jpg').unlink()
    recipe.main([*common, '--resume'])
    assert json.loads((run / 'latest.json').read_text())['step'] == 2


def test_scene_zoom_trains_on_magnified_scenes_is_recorded_and_checked(image_folder, tmp_path):
    """--scene-zoom LOW HIGH: the training stream is SpatialScenes(zoom=(LOW, HIGH)) while validation stays unzoomed;
    the default is BUILTIN_SCENE_ZOOM (1, 2) on the built-in scenes and off for real images, and a run's config.json
    stores the range it trained with; a resume with another range is refused with the folder untouched; a reversed
    or non-positive range, or a zoom asked of real images, is refused before the run folder exists."""
    from vision_priors.recipes.data.builtin_scenes import SpatialScenes
    assert recipe.BUILTIN_SCENE_ZOOM == (1.0, 2.0)
    args = recipe.build_parser().parse_args(['train', '--train-samples', '24', '--val-samples', '12',
                                             '--scene-zoom', '1', '1.5'])
    train, val = recipe.builtin_dataset('train', args, (32, 32)), recipe.builtin_dataset('val', args, (32, 32))
    zoomed = SpatialScenes('train', num_samples=24, resolution=32, seed=0, task='clock', zoom=(1.0, 1.5))
    plain_val = SpatialScenes('val', num_samples=12, resolution=32, seed=0, task='clock')
    assert all(torch.equal(train[i][0], zoomed[i][0]) and torch.equal(val[i][0], plain_val[i][0]) for i in (0, 7, 11))
    assert not torch.equal(train[7][0], SpatialScenes('train', num_samples=24, task='clock')[7][0])

    builtin = ['train', '--model', 'vit_tiny_patch16_goat_224', '--size-overrides', TINY, '--train-res', '32',
               '--batch-size', '4', '--cpu', '--train-samples', '24', '--val-samples', '12', '--updates', '2']
    recipe.main([*builtin, '--out', str(tmp_path / 'default'), '--updates', '1'])
    assert json.loads((tmp_path / 'default' / 'config.json').read_text())['args']['scene_zoom'] == [1.0, 2.0]
    recipe.main(_train_args(tmp_path / 'real', str(image_folder), '--updates', '1'))
    assert json.loads((tmp_path / 'real' / 'config.json').read_text())['args']['scene_zoom'] == [1.0, 1.0]
    run = tmp_path / 'run'
    recipe.main([*builtin, '--out', str(run), '--scene-zoom', '1', '1', '--stop-after', '1'])
    assert json.loads((run / 'config.json').read_text())['args']['scene_zoom'] == [1.0, 1.0]
    config_before = (run / 'config.json').read_bytes()
    with pytest.raises(ValueError, match=r'settings differ .*scene_zoom'):
        recipe.main([*builtin, '--out', str(run), '--resume'])  # the default is (1, 2)
    assert (run / 'config.json').read_bytes() == config_before
    recipe.main([*builtin, '--out', str(run), '--scene-zoom', '1', '1', '--resume'])

    for extra, error in ((['--scene-zoom', '2', '1'], ValueError), (['--scene-zoom', '0', '1'], SystemExit),
                         (['--scene-zoom', '1', '2', '--data', str(image_folder)], ValueError)):
        bad = tmp_path / 'bad'
        with pytest.raises(error):
            recipe.main([*builtin, '--out', str(bad), *extra])
        assert not bad.exists()


def test_rescale_coords_default_reaches_the_models_that_have_coordinates(image_folder, tmp_path):
    """--rescale-coords R: GOAT / PoPE get rescale_coords, timm's RoPE ViTs rope_rescale_coords, the absolute-table
    ViT and LAVO nothing; the default is BUILTIN_RESCALE_COORDS on the built-in scenes and 1 (off) for real images,
    stored in config.json; a resume with another factor is refused with the folder untouched; R < 1 is refused
    before the run folder exists."""
    assert recipe.BUILTIN_RESCALE_COORDS == 2.0
    common = ['--size-overrides', TINY, '--train-res', '32', '--batch-size', '4', '--cpu', '--train-samples', '8',
              '--val-samples', '4', '--updates', '1', '--threads', '1']
    expected = {'vit_tiny_patch16_goat_224': {'rescale_coords': 2.0},
                'vit_small_patch16_rope_224': {'rope_rescale_coords': 2.0},
                'vit_tiny_patch16_224': {}, 'vit_tiny_patch16_lavo_224': {}}
    for name, extra in expected.items():
        run = tmp_path / name
        recipe.main(['train', '--model', name, *common, '--out', str(run)])
        config = json.loads((run / 'config.json').read_text())
        assert config['args']['rescale_coords'] == 2.0
        assert {k: v for k, v in config['model_kwargs'].items() if 'rescale' in k} == extra
    recipe.main(_train_args(tmp_path / 'real', str(image_folder), '--updates', '1'))
    config = json.loads((tmp_path / 'real' / 'config.json').read_text())
    assert config['args']['rescale_coords'] == 1.0 and 'rescale_coords' not in config['model_kwargs']
    run = tmp_path / 'off'
    goat = ['train', '--model', 'vit_tiny_patch16_goat_224', *common, '--updates', '2', '--out', str(run)]
    recipe.main([*goat, '--rescale-coords', '1', '--stop-after', '1'])
    assert 'rescale_coords' not in json.loads((run / 'config.json').read_text())['model_kwargs']
    config_before = (run / 'config.json').read_bytes()
    with pytest.raises(ValueError, match=r'settings differ .*rescale_coords'):
        recipe.main([*goat, '--resume'])  # the default is 2
    assert (run / 'config.json').read_bytes() == config_before
    recipe.main([*goat, '--rescale-coords', '1', '--resume'])
    bad = tmp_path / 'bad'
    with pytest.raises(ValueError, match=r'--rescale-coords is a factor >= 1 .*got 0.5'):
        recipe.main(['train', '--model', 'vit_tiny_patch16_goat_224', *common, '--rescale-coords', '0.5',
                     '--out', str(bad)])
    assert not bad.exists()
