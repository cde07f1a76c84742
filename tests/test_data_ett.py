"""ETT / CSV forecasting data: Informer's borders, scaling, windows and time features; every error names its place."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from vision_priors.recipes.data.ett import (ForecastSeries, read_series_csv, split_borders, time_features,
                                            write_ett_csv)

REAL_ETTH1 = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'ett' / 'ETTh1.csv'


@pytest.fixture(scope='module')
def ett_hour_csv(tmp_path_factory) -> Path:
    """A generated ETT-format hourly file, 20 months of 30 x 24 rows (the ETTh layout's minimum)."""
    return write_ett_csv(tmp_path_factory.mktemp('ett') / 'ETTh_generated.csv', rows=14400, seed=3)


def small_csv(path: Path, rows: int = 120, columns=('a', 'OT', 'b')) -> Path:
    frame = pd.DataFrame({'date': pd.date_range('2020-01-01', periods=rows, freq='h').strftime('%Y-%m-%d %H:%M:%S')})
    for k, name in enumerate(columns):
        frame[name] = np.arange(rows, dtype=np.float64) * (k + 1) + np.sin(np.arange(rows) * (k + 1))
    frame.to_csv(path, index=False)
    return path


def test_ett_hour_borders_and_train_only_scaling(ett_hour_csv):
    series = ForecastSeries(ett_hour_csv, seq_len=96, label_len=48, pred_len=24)
    # Informer: [0, 12*30*24), [12*30*24 - seq_len, 16*30*24), [16*30*24 - seq_len, 20*30*24)
    assert series.layout == 'ett_hour' and series.freq == 'h'
    assert series.borders == {'train': (0, 8640), 'val': (8544, 11520), 'test': (11424, 14400)}
    raw = pd.read_csv(ett_hour_csv)[['HUFL', 'HULL', 'MUFL', 'MULL', 'LUFL', 'LULL', 'OT']].to_numpy()
    assert series.columns == ['HUFL', 'HULL', 'MUFL', 'MULL', 'LUFL', 'LULL', 'OT']
    np.testing.assert_allclose(series.mean, raw[:8640].mean(0), rtol=1e-12)
    np.testing.assert_allclose(series.std, raw[:8640].std(0), rtol=1e-12)  # population std (Informer's scaler)
    np.testing.assert_allclose(series.data[11424], (raw[11424] - raw[:8640].mean(0)) / raw[:8640].std(0), rtol=1e-12)
    np.testing.assert_allclose(series.data[:8640].mean(0), 0, atol=1e-10)  # zero mean on train rows only
    assert abs(series.data[8640:].mean()) > 1e-6
    assert [len(series.split(s)) for s in ('train', 'val', 'test')] == [8640 - 120 + 1, 2976 - 120 + 1, 2976 - 120 + 1]
    np.testing.assert_allclose(series.inverse(series.data[5:9]), raw[5:9], rtol=1e-12)
    np.testing.assert_allclose(series.inverse(series.data[5:9, -1:]), raw[5:9, -1:], rtol=1e-12)  # target alone


def test_minute_and_custom_borders_arithmetic():
    month = 4 * 30 * 24
    assert split_borders(20 * month, 96, 'ett_minute') == {
        'train': (0, 12 * month), 'val': (12 * month - 96, 16 * month), 'test': (16 * month - 96, 20 * month)}
    # custom 70 / 10 / 20 with int() truncation: n = 1003 -> train 702, test 200, val 101
    assert split_borders(1003, 24, 'custom') == {'train': (0, 702), 'val': (678, 803), 'test': (779, 1003)}


def test_windows_shapes_contents_and_feature_modes(tmp_path):
    path = small_csv(tmp_path / 'tiny.csv', rows=120)
    series = ForecastSeries(path, seq_len=10, label_len=4, pred_len=3, features='M')
    assert series.layout == 'custom' and series.columns == ['a', 'b', 'OT']  # target moved last
    assert series.borders == {'train': (0, 84), 'val': (74, 96), 'test': (86, 120)}
    test = series.split('test')
    assert len(test) == 34 - 10 - 3 + 1
    item = test[5]
    assert item['x'].shape == (10, 3) and item['y'].shape == (7, 3) and item['x_mark'].shape == (10, 4)
    begin = 86 + 5
    np.testing.assert_allclose(item['x'].numpy(), series.data[begin:begin + 10], rtol=1e-6)
    np.testing.assert_allclose(item['y'].numpy(), series.data[begin + 10 - 4:begin + 10 + 3], rtol=1e-6)
    np.testing.assert_allclose(item['y_mark'].numpy(), series.marks[begin + 6:begin + 13], rtol=1e-6)
    with pytest.raises(IndexError):
        test[len(test)]
    single = ForecastSeries(path, 10, 4, 3, features='S')
    assert single.columns == ['OT'] and single.out_channels == 1 and single.split('train')[0]['x'].shape == (10, 1)
    multi_to_one = ForecastSeries(path, 10, 4, 3, features='MS', target='a')
    assert multi_to_one.columns == ['OT', 'b', 'a'] and multi_to_one.out_channels == 1


def test_time_features_for_known_dates():
    dates = pd.DatetimeIndex(['2016-07-01 00:00:00', '2017-12-31 23:45:00'])
    # 2016-07-01: Friday (dayofweek 4), day-of-year 183 (leap year); 2017-12-31: Sunday, day-of-year 365, ISO week 52
    np.testing.assert_allclose(time_features(dates, 'h'), [[0 / 23 - .5, 4 / 6 - .5, 0 / 30 - .5, 182 / 365 - .5],
                                                           [23 / 23 - .5, 6 / 6 - .5, 30 / 30 - .5, 364 / 365 - .5]])
    np.testing.assert_allclose(time_features(dates, 't')[1], [45 / 59 - .5, .5, .5, .5, 364 / 365 - .5])
    np.testing.assert_allclose(time_features(dates, '15min'), time_features(dates, 't'))
    np.testing.assert_allclose(time_features(dates, 'd'), time_features(dates, 'h')[:, 1:])
    np.testing.assert_allclose(time_features(dates, 'w'), [[0 / 30 - .5, 25 / 52 - .5], [30 / 30 - .5, 51 / 52 - .5]])
    np.testing.assert_allclose(time_features(dates, 'm'), [[6 / 11 - .5], [11 / 11 - .5]])
    np.testing.assert_array_equal(time_features(dates, 't', timeenc=0), [[7, 1, 4, 0, 0], [12, 31, 6, 23, 3]])
    with pytest.raises(ValueError, match="unknown frequency 'fortnightly'"):
        time_features(dates, 'fortnightly')


def test_generator_writes_ett_format(ett_hour_csv):
    table = read_series_csv(ett_hour_csv)
    assert table.columns == ['HUFL', 'HULL', 'MUFL', 'MULL', 'LUFL', 'LULL', 'OT'] and table.values.shape == (14400, 7)
    assert (str(table.dates[0]) == '2016-07-01 00:00:00'
            and (table.dates[1:] - table.dates[:-1] == pd.Timedelta('1h')).all())
    ot = table.values[:, -1] - table.values[:, -1].mean()
    daily = np.corrcoef(ot[:-24], ot[24:])[0, 1]
    assert daily > 0.5  # daily seasonality carried into the target


@pytest.mark.parametrize('edit, message', [
    (lambda f: f.drop(columns=['OT']), r"bad.csv: missing target column 'OT'"),
    (lambda f: f.drop(columns=['date']), r'bad.csv: missing column "date"'),
    (lambda f: f.assign(date=f['date'].where(f.index != 7, '2020-13-45 99:00')),
     r"bad.csv: row 7 \(line 9\): unparsable date '2020-13-45 99:00'"),
    (lambda f: f.assign(date=f['date'].where(f.index != 9, f['date'][3])),
     r"bad.csv: row 9 \(line 11\): date '2020-01-01 03:00:00' is not after"),
    (lambda f: f.assign(b=f['b'].astype(object).where(f.index != 11, '')),
     r"bad.csv: row 11 \(line 13\), column 'b': empty / NaN cell"),
    (lambda f: f.assign(a=f['a'].astype(object).where(f.index != 4, 'n/a?')),
     r"bad.csv: row 4 \(line 6\), column 'a': not a finite number \('n/a\?'\)"),
    (lambda f: f.assign(a=1.0), r"bad.csv: column 'a' is constant over the training rows \[0, 84\)"),
    (lambda f: f.iloc[:0], r'bad.csv: no data rows'),
])
def test_bad_csv_errors_name_file_row_and_value(tmp_path, edit, message):
    frame = pd.read_csv(small_csv(tmp_path / 'good.csv'))
    edit(frame).to_csv(tmp_path / 'bad.csv', index=False)
    with pytest.raises(ValueError, match=message):
        ForecastSeries(tmp_path / 'bad.csv', 10, 4, 3)


def test_too_few_rows_and_missing_file(tmp_path):
    path = small_csv(tmp_path / 'short.csv', rows=60)  # custom: train 42, val [32, 48) = 16 rows, test [38, 60)
    with pytest.raises(ValueError, match=r'short.csv: too few rows: the val split has rows \[32, 48\) = 16 rows, '
                                         r'fewer than seq_len \+ pred_len = 10 \+ 7'):
        ForecastSeries(path, 10, 4, 7)
    with pytest.raises(ValueError, match=r'short.csv: 60 rows, but the ett_hour layout needs 14400'):
        ForecastSeries(path, 10, 4, 3, layout='ett_hour')
    with pytest.raises(ValueError, match=r'too few rows for seq_len 50: the training split has 42 rows'):
        ForecastSeries(path, 50, 4, 3)
    with pytest.raises(ValueError, match=r'label_len must be in \[0, seq_len=10\]'):
        ForecastSeries(path, 10, 11, 3)
    with pytest.raises(FileNotFoundError, match='nowhere.csv'):
        ForecastSeries(tmp_path / 'nowhere.csv', 10, 4, 3)
    (tmp_path / 'empty.csv').write_text('')
    with pytest.raises(ValueError, match='empty.csv: not a readable CSV'):
        ForecastSeries(tmp_path / 'empty.csv', 10, 4, 3)


@pytest.mark.skipif(not REAL_ETTH1.exists(), reason='real ETTh1 not available (../shared/data/ett)')
def test_real_etth1_matches_informer_split():
    series = ForecastSeries(REAL_ETTH1, seq_len=96, label_len=48, pred_len=24)
    assert series.layout == 'ett_hour' and len(series.dates) == 17420
    assert series.borders == {'train': (0, 8640), 'val': (8544, 11520), 'test': (11424, 14400)}
    assert [len(series.split(s)) for s in ('train', 'val', 'test')] == [8521, 2857, 2857]
    raw = pd.read_csv(REAL_ETTH1)
    ot = raw['OT'].to_numpy()
    assert series.data[11424, -1] == pytest.approx((ot[11424] - ot[:8640].mean()) / ot[:8640].std(), rel=1e-12)
    assert series.marks.shape == (17420, 4) and str(series.dates[0]) == '2016-07-01 00:00:00'
