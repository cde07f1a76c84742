"""matplotlib for the recipes, set up once: the non-interactive Agg backend, figures saved as PNG."""
from pathlib import Path
from typing import Any, Tuple

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def figure(rows: int = 1, cols: int = 1, size: Tuple[float, float] = (6.4, 4.2), **kwargs: Any):
    """``(fig, axes)`` with ``axes`` always a 2D array (``squeeze=False``)."""
    return plt.subplots(rows, cols, figsize=size, squeeze=False, **kwargs)


def save_figure(fig: Any, path: Path, dpi: int = 120) -> Path:
    """Lay out, save as PNG and close ``fig``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
