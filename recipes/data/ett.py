"""Time-series forecasting data as Informer reads it: ETT / generic CSVs, borders, scaling, windows, time features.

Facts follow ``zhouhaoyi/Informer2020`` (``data/data_loader.py``, ``utils/timefeatures.py``); the code is ours.

- CSV: a ``date`` column plus numeric columns (ETT: ``date,HUFL,HULL,MUFL,MULL,LUFL,LULL,OT``). Columns are
  ordered ``date, <others>, <target>`` (Informer's ``Dataset_Custom`` order; for ETT files, whose target
  ``OT`` is already last, the order is unchanged). Feature modes: ``M`` (all columns in, all out), ``S``
  (the target only), ``MS`` (all in, the target out; the target is the last channel).
- Borders (:func:`split_borders`), per split ``[border1, border2)`` rows, each window start shifted back by
  ``seq_len`` so the first validation / test window's input is the end of the previous split:
  ``ett_hour`` (``ETTh*.csv``): 12 / 4 / 4 months of 30 x 24 rows; ``ett_minute`` (``ETTm*.csv``): the same
  x 4; ``custom``: ``int(0.7 n)`` / rest / ``int(0.2 n)``.
- Scaling: mean and (population) std of the training rows only, every split scaled with them; metrics are
  computed on scaled values (as Informer's tables); :meth:`ForecastSeries.inverse` maps back for plots.
- Windows (:class:`ForecastWindows`): ``x`` = rows ``[s, s + seq_len)``, ``y`` = rows ``[s + seq_len - label_len,
  s + seq_len + pred_len)`` (start tokens + horizon), with their time features; ``len = rows - seq_len -
  pred_len + 1``.
- Time features (:func:`time_features`): Informer's ``timeenc=1`` (values in [-0.5, 0.5] chosen by the
  pandas offset of ``freq``) or ``timeenc=0`` (integer month, day, weekday, hour, minute // 15).
- :func:`write_ett_csv`: a generated ETT-format CSV (daily and weekly seasonality, a trend, noise), so the
  recipe runs without the real files.

Every error names the file and, where there is one, the row (0-based data row, and its line in the
file), the column and the value.
"""
import os
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import torch
from pandas.tseries import offsets
from pandas.tseries.frequencies import to_offset
from torch.utils.data import Dataset

__all__ = ['ETT_COLUMNS', 'FEATURE_MODES', 'LAYOUTS', 'SPLITS', 'SeriesTable', 'read_series_csv', 'detect_layout',
           'split_borders', 'time_features', 'freq_offset', 'ForecastSeries', 'ForecastWindows', 'write_ett_csv']

PathLike = Union[str, os.PathLike]
ETT_COLUMNS = ('date', 'HUFL', 'HULL', 'MUFL', 'MULL', 'LUFL', 'LULL', 'OT')
FEATURE_MODES = ('M', 'S', 'MS')
LAYOUTS = ('auto', 'ett_hour', 'ett_minute', 'custom')
SPLITS = ('train', 'val', 'test')
HOURS_PER_MONTH = 30 * 24  # Informer's "month" of hourly rows
# Informer's --freq letters -> pandas offset aliases (pandas >= 2.2 names); other pandas aliases pass through
INFORMER_FREQ = {'s': 's', 't': 'min', 'h': 'h', 'd': 'D', 'b': 'B', 'w': 'W', 'm': 'ME', 'q': 'QE', 'a': 'YE',
                 'y': 'YE'}


def _where(row: int) -> str:
    return f'row {row} (line {row + 2})'


# ---------------------------------------------------------------------------------------- reading

class SeriesTable(NamedTuple):
    """A validated CSV: dates, values (rows, channels) float64, channel names (target last)."""
    path: Path
    dates: pd.DatetimeIndex
    values: np.ndarray
    columns: List[str]


def read_series_csv(path: PathLike, features: str = 'M', target: str = 'OT') -> SeriesTable:
    """Read and check a ``date,<numeric columns>`` CSV; columns ordered ``<others>, target`` (``S``: target only).

    Errors name the file: missing file, empty file, missing ``date`` / target column, a non-numeric or empty
    cell (first one: row, column, value), an unparsable date or one not after its predecessor (first row).
    """
    path = Path(path)
    if features not in FEATURE_MODES:
        raise ValueError(f'features must be one of {FEATURE_MODES}, got {features!r}')
    if not path.is_file():
        raise FileNotFoundError(f'{path}: no such CSV file')
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ValueError(f'{path}: not a readable CSV ({e})') from e
    columns = [str(c).strip() for c in frame.columns]
    frame.columns = columns
    if 'date' not in columns:
        raise ValueError(f'{path}: missing column "date" (columns: {", ".join(columns)})')
    if target not in columns:
        raise ValueError(f'{path}: missing target column {target!r} (columns: {", ".join(columns)})')
    if len(set(columns)) != len(columns):
        raise ValueError(f'{path}: repeated column names in {columns}')
    if len(frame) == 0:
        raise ValueError(f'{path}: no data rows')
    others = [c for c in columns if c not in ('date', target)]
    channels = [target] if features == 'S' else others + [target]

    values = np.empty((len(frame), len(channels)), dtype=np.float64)
    for j, name in enumerate(channels):
        text = frame[name].str.strip()
        numbers = pd.to_numeric(text, errors='coerce').to_numpy(dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(numbers))
        if len(bad):
            row = int(bad[0])
            what = ('empty / NaN cell' if text.iloc[row].lower() in ('', 'nan', 'na', 'null', 'none')
                    else 'not a finite number')
            raise ValueError(f'{path}: {_where(row)}, column {name!r}: {what} ({frame[name].iloc[row]!r}); '
                             f'{len(bad)} such cell(s) in that column')
        values[:, j] = numbers

    raw_dates = frame['date'].str.strip()
    dates = pd.to_datetime(raw_dates, errors='coerce')  # one format, inferred from the first row (fast)
    if dates.isna().any():  # rows in another format: parse them one by one
        retry = dates.isna()
        dates[retry] = pd.to_datetime(raw_dates[retry], errors='coerce', format='mixed')
    bad = np.flatnonzero(dates.isna().to_numpy())
    if len(bad):
        row = int(bad[0])
        raise ValueError(f'{path}: {_where(row)}: unparsable date {raw_dates.iloc[row]!r}')
    stamps = dates.to_numpy()
    not_after = np.flatnonzero(stamps[1:] <= stamps[:-1])
    if len(not_after):
        row = int(not_after[0]) + 1
        raise ValueError(f'{path}: {_where(row)}: date {raw_dates.iloc[row]!r} is not after the previous row\'s '
                         f'{raw_dates.iloc[row - 1]!r} (dates must increase strictly)')
    return SeriesTable(path, pd.DatetimeIndex(dates), values, channels)


# ---------------------------------------------------------------------------------------- borders

def detect_layout(path: PathLike, layout: str = 'auto') -> str:
    """``auto``: ``ett_hour`` for ``ETTh*`` files, ``ett_minute`` for ``ETTm*``, else ``custom``."""
    if layout not in LAYOUTS:
        raise ValueError(f'layout must be one of {LAYOUTS}, got {layout!r}')
    if layout != 'auto':
        return layout
    stem = Path(path).stem
    return 'ett_hour' if stem.startswith('ETTh') else 'ett_minute' if stem.startswith('ETTm') else 'custom'


def split_borders(num_rows: int, seq_len: int, layout: str, path: PathLike = '<data>') -> Dict[str, Tuple[int, int]]:
    """Informer's ``[border1, border2)`` rows per split (window starts shifted back by ``seq_len``)."""
    if layout in ('ett_hour', 'ett_minute'):
        month = HOURS_PER_MONTH * (4 if layout == 'ett_minute' else 1)
        train, val, test = 12 * month, 4 * month, 4 * month
        if num_rows < train + val + test:
            raise ValueError(f'{path}: {num_rows} rows, but the {layout} layout needs {train + val + test} '
                             f'({train} train + {val} validation + {test} test)')
        ends = (train, train + val, train + val + test)
    elif layout == 'custom':
        train, test = int(num_rows * 0.7), int(num_rows * 0.2)
        ends = (train, num_rows - test, num_rows)
    else:
        raise ValueError(f'layout must be ett_hour, ett_minute or custom, got {layout!r}')
    starts = (0, ends[0] - seq_len, ends[1] - seq_len)
    if starts[1] < 0:
        raise ValueError(f'{path}: too few rows for seq_len {seq_len}: the training split has {ends[0]} rows '
                         f'(of {num_rows}), fewer than seq_len')
    return dict(zip(SPLITS, zip(starts, ends)))


# ----------------------------------------------------------------------------------- time features

def freq_offset(freq: str) -> pd.DateOffset:
    """The pandas offset of an Informer ``--freq`` letter (``h``, ``t``, ...) or a pandas alias (``15min``)."""
    try:
        return to_offset(INFORMER_FREQ.get(freq.lower(), freq) if len(freq) == 1 else freq)
    except ValueError as e:
        raise ValueError(f'unknown frequency {freq!r} (Informer letters: {", ".join(INFORMER_FREQ)}; or a '
                         f'pandas alias such as 15min)') from e


def _features_for(offset: pd.DateOffset) -> List[str]:
    """Informer's ``timeenc=1`` feature list for an offset type (utils/timefeatures.py)."""
    table = ((offsets.YearEnd, []), (offsets.QuarterEnd, ['month_of_year']), (offsets.MonthEnd, ['month_of_year']),
             (offsets.Week, ['day_of_month', 'week_of_year']),
             (offsets.Day, ['day_of_week', 'day_of_month', 'day_of_year']),
             (offsets.BusinessDay, ['day_of_week', 'day_of_month', 'day_of_year']),
             (offsets.Hour, ['hour_of_day', 'day_of_week', 'day_of_month', 'day_of_year']),
             (offsets.Minute, ['minute_of_hour', 'hour_of_day', 'day_of_week', 'day_of_month', 'day_of_year']),
             (offsets.Second, ['second_of_minute', 'minute_of_hour', 'hour_of_day', 'day_of_week', 'day_of_month',
                               'day_of_year']))
    for kind, names in table:
        if isinstance(offset, kind):
            return names
    raise ValueError(f'no time features for frequency {offset!r} (supported: yearly, quarterly, monthly, weekly, '
                     f'daily, business-daily, hourly, minutely, secondly)')


def time_features(dates: pd.DatetimeIndex, freq: str = 'h', timeenc: int = 1) -> np.ndarray:
    """(rows, F) float64 time features of ``dates``.

    ``timeenc=1``: per offset type, each feature scaled into [-0.5, 0.5] (hour / 23, day-of-week / 6,
    (day - 1) / 30, (day-of-year - 1) / 365, (month - 1) / 11, (ISO week - 1) / 52, minute / 59, second / 59,
    minus 0.5). ``timeenc=0``: integer month, day, weekday, hour, minute // 15, truncated by ``freq``.
    """
    dates = pd.DatetimeIndex(dates)
    if timeenc == 0:
        columns = {'month': dates.month, 'day': dates.day, 'weekday': dates.day_of_week, 'hour': dates.hour,
                   'minute': dates.minute // 15}
        keep = {'y': [], 'a': [], 'm': ['month'], 'w': ['month'], 'd': ['month', 'day', 'weekday'],
                'b': ['month', 'day', 'weekday'], 'h': ['month', 'day', 'weekday', 'hour'],
                't': ['month', 'day', 'weekday', 'hour', 'minute']}
        if freq.lower() not in keep:
            raise ValueError(f'timeenc 0 needs an Informer frequency letter {sorted(keep)}, got {freq!r}')
        names = keep[freq.lower()]
        return (np.stack([np.asarray(columns[n], dtype=np.float64) for n in names], 1) if names
                else np.zeros((len(dates), 0)))
    if timeenc != 1:
        raise ValueError(f'timeenc must be 0 or 1, got {timeenc!r}')
    encoders = {
        'second_of_minute': lambda d: d.second / 59.0 - 0.5,
        'minute_of_hour': lambda d: d.minute / 59.0 - 0.5,
        'hour_of_day': lambda d: d.hour / 23.0 - 0.5,
        'day_of_week': lambda d: d.day_of_week / 6.0 - 0.5,
        'day_of_month': lambda d: (d.day - 1) / 30.0 - 0.5,
        'day_of_year': lambda d: (d.day_of_year - 1) / 365.0 - 0.5,
        'month_of_year': lambda d: (d.month - 1) / 11.0 - 0.5,
        'week_of_year': lambda d: (d.isocalendar().week.to_numpy(dtype=np.float64) - 1) / 52.0 - 0.5,
    }
    names = _features_for(freq_offset(freq))
    if not names:
        return np.zeros((len(dates), 0))
    return np.stack([np.asarray(encoders[n](dates), dtype=np.float64) for n in names], 1)


# ---------------------------------------------------------------------------------------- windows

class ForecastWindows(Dataset):
    """Sliding windows over one split's rows ``[border1, border2)`` of a scaled series.

    Items: ``x`` (seq_len, C), ``x_mark`` (seq_len, F), ``y`` (label_len + pred_len, C), ``y_mark``
    (label_len + pred_len, F), float32, and ``index`` (the window start within the split). Reading one draws no
    random numbers (``draws_random``: the training loader skips per-sample seeding).
    """

    draws_random = False

    def __init__(self, values: np.ndarray, marks: np.ndarray, seq_len: int, label_len: int, pred_len: int) -> None:
        self.values = torch.as_tensor(values, dtype=torch.float32)
        self.marks = torch.as_tensor(marks, dtype=torch.float32)
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len

    def __len__(self) -> int:
        return max(0, len(self.values) - self.seq_len - self.pred_len + 1)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f'window {index} out of range [0, {len(self)})')
        s_end = index + self.seq_len
        r_begin, r_end = s_end - self.label_len, s_end + self.pred_len
        return dict(x=self.values[index:s_end], x_mark=self.marks[index:s_end], y=self.values[r_begin:r_end],
                    y_mark=self.marks[r_begin:r_end], index=torch.tensor(index))


class ForecastSeries:
    """A CSV read, split and scaled as Informer does; :meth:`split` gives a split's windows.

    Args:
        path: CSV with a ``date`` column.
        seq_len, label_len, pred_len: Encoder input, decoder start tokens, horizon (label_len <= seq_len).
        features: ``M``, ``S`` or ``MS``.
        target: Target column (the last channel).
        layout: ``auto`` (from the file name), ``ett_hour``, ``ett_minute`` or ``custom``.
        freq: Time-feature frequency (Informer letter or pandas alias); default ``h`` (``t`` for ``ett_minute``).
        timeenc: 1 (Informer's ``timeF``) or 0.
        scale: Standard scaling fitted on the training rows.
    """

    def __init__(self, path: PathLike, seq_len: int, label_len: int, pred_len: int, features: str = 'M',
                 target: str = 'OT', layout: str = 'auto', freq: Optional[str] = None, timeenc: int = 1,
                 scale: bool = True) -> None:
        for name, value in (('seq_len', seq_len), ('pred_len', pred_len)):
            if int(value) < 1:
                raise ValueError(f'{name} must be >= 1, got {value}')
        if not 0 <= label_len <= seq_len:
            raise ValueError(f'label_len must be in [0, seq_len={seq_len}], got {label_len}')
        self.path = Path(path)
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len
        self.features, self.target = features, target
        self.layout = detect_layout(path, layout)
        self.freq = freq or ('t' if self.layout == 'ett_minute' else 'h')
        table = read_series_csv(path, features, target)
        self.columns, self.dates = table.columns, table.dates
        self.borders = split_borders(len(table.values), seq_len, self.layout, path)
        for split, (begin, end) in self.borders.items():
            if end - begin < seq_len + pred_len:
                raise ValueError(f'{path}: too few rows: the {split} split has rows [{begin}, {end}) = {end - begin} '
                                 f'rows, fewer than seq_len + pred_len = {seq_len} + {pred_len} '
                                 f'(of {len(table.values)} rows)')
        train_begin, train_end = self.borders['train']
        train = table.values[train_begin:train_end]
        self.mean = train.mean(0) if scale else np.zeros(len(self.columns))
        self.std = train.std(0) if scale else np.ones(len(self.columns))
        flat = np.flatnonzero(self.std == 0)
        if len(flat):
            raise ValueError(f'{path}: column {self.columns[flat[0]]!r} is constant over the training rows '
                             f'[{train_begin}, {train_end}): it cannot be standard-scaled')
        self.data = (table.values - self.mean) / self.std
        self.marks = time_features(self.dates, self.freq, timeenc)

    @property
    def channels(self) -> int:
        return len(self.columns)

    @property
    def mark_dim(self) -> int:
        return self.marks.shape[1]

    @property
    def out_channels(self) -> int:
        """Channels the model predicts: all for ``M``, the target for ``S`` / ``MS``."""
        return self.channels if self.features == 'M' else 1

    def split(self, name: str) -> ForecastWindows:
        if name not in self.borders:
            raise ValueError(f'split must be one of {SPLITS}, got {name!r}')
        begin, end = self.borders[name]
        return ForecastWindows(self.data[begin:end], self.marks[begin:end], self.seq_len, self.label_len,
                               self.pred_len)

    def inverse(self, values: np.ndarray, channels: Optional[Sequence[int]] = None) -> np.ndarray:
        """Undo the scaling of ``values`` (..., len(channels)); default all channels, or the target for 1 channel."""
        values = np.asarray(values, dtype=np.float64)
        if channels is None:
            channels = list(range(self.channels)) if values.shape[-1] == self.channels else [self.channels - 1]
        return values * self.std[list(channels)] + self.mean[list(channels)]


# -------------------------------------------------------------------------------------- generator

def write_ett_csv(path: PathLike, rows: int = 20 * HOURS_PER_MONTH, seed: int = 0, freq: str = 'h',
                  start: str = '2016-07-01 00:00:00') -> Path:
    """Write an ETT-format CSV (``date,HUFL,...,OT``): six load series with daily and weekly seasonality,
    a slow trend and AR(1) noise, and an oil temperature ``OT`` that lags the total load. Deterministic per seed."""
    rng = np.random.default_rng(seed)
    dates = pd.date_range(start, periods=rows, freq=freq_offset(freq))
    hours = (dates - dates[0]).total_seconds().to_numpy() / 3600.0
    day, week = 2 * np.pi * hours / 24.0, 2 * np.pi * hours / (24.0 * 7)
    loads = []
    for k in range(6):
        level, amp_d, amp_w = rng.uniform(1, 8), rng.uniform(0.5, 2), rng.uniform(0.2, 1)
        noise = np.zeros(rows)
        shocks = rng.normal(0, 0.3, rows)
        for t in range(1, rows):
            noise[t] = 0.8 * noise[t - 1] + shocks[t]
        trend = rng.uniform(-1, 1) * hours / max(hours[-1], 1.0)
        loads.append(level + amp_d * np.sin(day + rng.uniform(0, 2 * np.pi)) + amp_w * np.sin(week + k) + trend + noise)
    total = np.sum(loads, 0)
    kernel = np.exp(-np.arange(24) / 6.0)
    lagged = np.convolve(total - total.mean(), kernel / kernel.sum(), mode='full')[:rows]
    oil = 20 + 1.5 * lagged + 5 * np.sin(2 * np.pi * hours / (24 * 365.0)) + rng.normal(0, 0.5, rows)
    frame = pd.DataFrame({'date': dates.strftime('%Y-%m-%d %H:%M:%S')})
    for name, series in zip(ETT_COLUMNS[1:], [*loads, oil]):
        frame[name] = np.round(series, 6)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f'.{path.name}.tmp')
    frame.to_csv(tmp, index=False)
    tmp.replace(path)
    return path
