"""Helpers shared by the recipe tests (imported by them, not a test module)."""
from pathlib import Path
from typing import Dict

import torch
from safetensors.torch import load_file

from vision_priors.recipes.checkpoints import latest_checkpoint


def final_weights(run: Path) -> Dict[str, torch.Tensor]:
    """The weights of a run folder's latest checkpoint."""
    return load_file(str(latest_checkpoint(run) / 'model.safetensors'))


def assert_same_final_weights(a_run: Path, b_run: Path) -> None:
    """Two runs end with bit-identical weights (a resumed run against an uninterrupted one)."""
    a, b = final_weights(a_run), final_weights(b_run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
