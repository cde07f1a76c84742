"""Reporting shared by every recipe: mean +- std over seeds, markdown tables, ``results.json``."""
import statistics
from pathlib import Path
from typing import Any, Dict, Hashable, Iterable, List, Sequence

from .checkpoints import write_json_atomic
from .runs import to_json

RESULTS = 'results.json'


def mean_std(values: Iterable[float]) -> Dict[str, float]:
    """``{'mean', 'std', 'n'}`` (sample std; 0 for one value)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError('mean_std of no values')
    return dict(mean=statistics.fmean(values), std=statistics.stdev(values) if len(values) > 1 else 0.0,
                n=len(values))


def group_rows(rows: Iterable[Dict[str, Any]], field: str) -> Dict[Hashable, List[Dict[str, Any]]]:
    """``rows`` grouped by ``row[field]``: value -> its rows, values in first-seen order, rows in their order."""
    groups: Dict[Hashable, List[Dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row[field], []).append(row)
    return groups


def format_cell(cell: Dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    """'mean ± std' (just 'mean' for a single seed)."""
    text = f"{cell['mean'] * scale:.{digits}f}"
    return text + (f" ± {cell['std'] * scale:.{digits}f}" if cell['n'] > 1 else '')


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ['| ' + ' | '.join(map(str, header)) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(map(str, row)) + ' |' for row in rows]
    return '\n'.join(lines)


def write_results(out_dir: Path, *, rows: List[Dict[str, Any]], summary: Any, table_markdown: str, args: Any,
                  **extra: Any) -> Path:
    """Atomically write ``out_dir/results.json``: per-run rows, the summary, the table, the command's
    flags and the seeds, so every figure sits beside the configuration that produced it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = to_json({k: v for k, v in vars(args).items() if not callable(v)})
    seeds = sorted({r['seed'] for r in rows if r.get('seed') is not None})
    payload = dict(rows=rows, summary=summary, table_markdown=table_markdown, config=config, seeds=seeds, **extra)
    path = out_dir / RESULTS
    write_json_atomic(path, to_json(payload))
    return path
