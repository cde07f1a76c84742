"""Every recipe trains and evaluates on a CUDA device (``benchmarks/gpu_check.sh`` runs this file there).

The recipe tests run on the CPU (``--cpu``); these runs take the same tiny settings without ``--cpu``, so
``accelerate`` puts them on the GPU, and check that the run log says so and that every figure they report is
finite. On CUDA they also run the GOAT / PoPE flash-prior kernel in the models (``VISION_PRIORS_KERNELS=triton``,
which 'auto' does not pick there), bf16 autocast and LAVO's kernels ('auto'). Without CUDA the file skips, unless
``VISION_PRIORS_SMOKE_ON_CPU=1`` asks for the same runs on the CPU: that is how it is checked on a machine
without a GPU.
"""
import json
import math
import os
from pathlib import Path
from typing import Any, List

import pytest
import torch

import test_forecast_recipe as forecast_tests
import test_language_recipe as language_tests
import test_pcn_recipe as pcn_tests
import test_resolution_recipe as resolution_tests
import test_spatial_vqa as vqa_tests
import test_spatial_vqa_fusion as fusion_tests
from vision_priors.recipes import forecast, language, pcn, resolution_extrapolation, spatial_vqa
from vision_priors.recipes.data.ett import write_ett_csv

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA and os.environ.get('VISION_PRIORS_SMOKE_ON_CPU') != '1',
                                reason='needs CUDA (or VISION_PRIORS_SMOKE_ON_CPU=1)')
DEVICE = 'cuda' if CUDA else 'cpu'
AMP = ['--amp', 'bf16'] if CUDA else []


def on_device(args: List[str]) -> List[str]:
    """A recipe test's tiny arguments without ``--cpu`` (and with bf16 autocast on CUDA)."""
    return [a for a in args if a != '--cpu'] + AMP


def started_on(run: Path) -> str:
    """The device a run's log says it trained on."""
    start = next(json.loads(line) for line in (run / 'log.jsonl').read_text().splitlines()
                 if json.loads(line)['event'] == 'start')
    return start['device']


def numbers(value: Any) -> List[float]:
    """Every int / float inside a result (nested dicts and lists)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in numbers(v)]
    return []


def assert_finite_rows(result: dict) -> None:
    values = numbers(result['rows'])
    assert values and all(math.isfinite(v) for v in values), result['rows']


@pytest.fixture(params=['auto', 'triton'])
def kernels(request, monkeypatch):
    """The layers' kernel choice: 'auto' (SDPA for GOAT / PoPE, LAVO's kernels on CUDA) or every kernel."""
    if request.param == 'triton' and not CUDA:
        pytest.skip('the Triton kernels need CUDA here (the interpreter tests cover them on the CPU)')
    monkeypatch.setenv('VISION_PRIORS_KERNELS', request.param)
    return request.param


def test_resolution_compare(tmp_path, kernels):
    models = ['vit_tiny_patch16_224', 'vit_small_patch16_rope_224', 'vit_tiny_patch16_goat_224',
              'vit_tiny_patch16_pope_224', 'vit_tiny_patch16_lavo_224']
    out = tmp_path / 'compare'
    resolution_extrapolation.main([
        'compare', '--models', *models, '--seeds', '0', '--updates', '2', '--batch-size', '8',
        '--train-samples', '32', '--val-samples', '16', '--size-overrides', resolution_tests.TINY,
        '--train-res', '32', '--eval-res', '32', '48', '64', '--out', str(out), '--jobs', '1', *AMP])
    for model in models:
        assert started_on(out / model / 'seed0').startswith(DEVICE)
    summary = json.loads((out / 'results.json').read_text())['summary']
    assert set(summary) == set(models)
    assert all(math.isfinite(v) for v in numbers(summary))


def test_spatial_vqa_single_stream_and_fusion(tmp_path, kernels):
    runs = {'goat': ['--method', 'goat', *on_device(vqa_tests.TINY)],
            'pope-fusion-lavo': ['--arch', 'fusion', '--cross-attn', 'lavo', '--method', 'pope',
                                 *on_device(fusion_tests.TINY)]}
    for name, args in runs.items():
        run = tmp_path / name
        spatial_vqa.main(['train', *args, '--updates', '2', '--out', str(run)])
        assert started_on(run).startswith(DEVICE)
        assert_finite_rows(spatial_vqa.main(['eval', str(run), '--out', str(tmp_path / f'{name}-eval'),
                                             '--batch-size', '4']))


def test_pcn_completion(tmp_path):
    run = tmp_path / 'pcn'
    pcn.main(['train', '--cross-attn', 'lavo', *on_device(pcn_tests.tiny(tmp_path / 'data')), '--updates', '2',
              '--out', str(run)])
    assert started_on(run).startswith(DEVICE)
    assert_finite_rows(pcn.main(['eval', str(run), '--out', str(tmp_path / 'eval'), '--batch-size', '4',
                                 '--renders', '1']))


def test_forecast(tmp_path):
    csv = write_ett_csv(tmp_path / 'tiny.csv', rows=300, seed=2)
    for cross_attn in ('full', 'lavo'):
        run = tmp_path / cross_attn
        forecast.main(['train', '--cross-attn', cross_attn, *on_device(forecast_tests.tiny(csv)), '--pred-len', '4',
                       '--updates', '2', '--out', str(run)])
        assert started_on(run).startswith(DEVICE)
        assert_finite_rows(forecast.main(['eval', str(run), '--out', str(tmp_path / f'{cross_attn}-eval'),
                                          '--batch-size', '16', '--plot-windows', '1']))


def test_language(tmp_path, kernels):
    out = tmp_path / 'lm'
    language.main(['train', '--methods', 'goat', 'pope', 'lavo', *on_device(language_tests.tiny()), '--updates', '2',
                   '--out', str(out)])
    for method in ('goat', 'pope', 'lavo'):
        run = out / method / 'seed0'
        assert started_on(run).startswith(DEVICE)
        assert_finite_rows(language.main(['ppl', str(run), '--multiples', '1', '2', '--eval-windows', '2',
                                          '--out', str(tmp_path / f'{method}-ppl')]))
