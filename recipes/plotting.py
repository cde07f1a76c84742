"""matplotlib for the recipes, set up once: the non-interactive Agg backend, figures saved as PNG."""
from pathlib import Path
from typing import Any, Dict, Tuple

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


VIEWS = ((20, -60), (20, 30), (85, -90))  # (elevation, azimuth) of the three views of a point cloud


def render_clouds(path: Path, clouds: Dict[str, Any], title: str = '', max_points: int = 4096, seed: int = 0) -> Path:
    """PNG of point clouds (name -> (N, 3) array), one row per cloud, three views per row (3D scatter).

    Larger clouds are subsampled to ``max_points`` (a fixed random subset) so renders stay light.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    fig = plt.figure(figsize=(9, 3 * len(clouds)))
    for row, (name, points) in enumerate(clouds.items()):
        points = np.asarray(points, dtype=np.float32)
        if len(points) > max_points:
            points = points[rng.choice(len(points), max_points, replace=False)]
        for col, (elev, azim) in enumerate(VIEWS):
            ax = fig.add_subplot(len(clouds), len(VIEWS), row * len(VIEWS) + col + 1, projection='3d')
            # PCN clouds are y-up: show y as the vertical axis
            ax.scatter(points[:, 0], points[:, 2], points[:, 1], s=0.5, c=points[:, 1], cmap='viridis')
            ax.view_init(elev=elev, azim=azim)
            ax.set_box_aspect((1, 1, 1))
            lim = 0.55 if len(points) == 0 else max(0.55, float(np.abs(points).max()))
            ax.set_xlim(-lim, lim)
            ax.set_ylim(-lim, lim)
            ax.set_zlim(-lim, lim)
            ax.set_axis_off()
            if col == 0:
                ax.set_title(f'{name} ({len(points)} pts shown)', fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)
