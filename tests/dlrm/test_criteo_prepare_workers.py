"""The Criteo conversion in worker processes (``workers=N``) against the serial one (``workers=0``).

Oracle: the serial conversion. With workers the prepared parts must be the same bytes and the
metadata the same but for the clock and the worker count, over several day files, a vocabulary
pass, malformed lines and runs much smaller than the files; and the in-order pool must hand back
results in task order with a bounded number of runs in flight.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from recforge.data.criteo.fullsize import GENERATORS
from recforge.data.criteo.prepare import main, prepare_criteo
from recforge.data.criteo.raw import MalformedInputError
from recforge.data.criteo.workers import OrderedPool
from recforge.errors import UserInputError

TINY = 2e-5  # 3,565 rows per day file, 917 Kaggle rows


@pytest.fixture(scope="module")
def day_files(tmp_path_factory) -> list[Path]:
    """day_0 .. day_2 (each from its own seed); day_1 with two malformed lines in its middle."""
    root = tmp_path_factory.mktemp("days")
    paths = []
    for day in range(3):
        GENERATORS["criteo-day"](root / f"gen{day}", TINY, day)
        lines = (root / f"gen{day}" / "day_0").read_bytes().split(b"\n")
        if day == 1:
            lines[1000:1000] = [b"not a criteo row", b"1" + b"\tzz" * 39]
        path = root / f"day_{day}"
        path.write_bytes(b"\n".join(lines))
        paths.append(path)
    return paths


def _parts(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*.parquet"))}


def _metadata(directory: Path) -> dict:
    meta = json.loads((directory / "metadata.json").read_text())
    for key in ("elapsed_seconds", "workers"):
        meta["conversion"].pop(key)
    return meta


def _assert_same(serial: Path, parallel: Path) -> None:
    parts = _parts(serial)
    assert len(parts) >= 2 and parts == _parts(parallel)
    assert _metadata(serial) == _metadata(parallel)
    assert json.loads((parallel / "metadata.json").read_text())["conversion"]["workers"] == 2


def test_day_files_hashed_in_workers_are_the_serial_bytes(day_files, tmp_path):
    settings = dict(split="days", max_ind_range=997, chunk_rows=700, max_malformed_fraction=0.01)
    serial = prepare_criteo(day_files, tmp_path / "serial", workers=0, **settings)
    parallel = prepare_criteo(day_files, tmp_path / "parallel", workers=2, **settings)
    _assert_same(serial, parallel)
    meta = _metadata(serial)
    assert meta["malformed"]["count"] == 2
    assert meta["split"]["rows"]["train"] == 2 * 3565  # days 0 and 1 (day 1 less its 2 bad lines: 3,567 lines)


def test_a_vocabulary_conversion_in_workers_is_the_serial_bytes(tmp_path):
    GENERATORS["criteo-kaggle"](tmp_path / "raw", TINY, 5)
    raw = tmp_path / "raw" / "train.txt"
    serial = prepare_criteo(raw, tmp_path / "serial", chunk_rows=100, workers=0)
    parallel = prepare_criteo(raw, tmp_path / "parallel", chunk_rows=100, workers=2)
    _assert_same(serial, parallel)
    assert _metadata(serial)["categorical"]["mode"] == "vocab"


def test_malformed_fail_policy_names_the_same_line_with_workers(day_files, tmp_path):
    messages = []
    for workers in (0, 2):
        with pytest.raises(MalformedInputError) as caught:
            prepare_criteo(day_files, tmp_path / f"w{workers}", split="days", max_ind_range=997, chunk_rows=700,
                           on_malformed="fail", workers=workers)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert f"{day_files[1]}:1001: " in messages[0]
    assert not (tmp_path / "w2").exists()


def test_workers_option_is_checked(tmp_path, day_files, capsys):
    with pytest.raises(UserInputError, match="workers must be an integer >= 0"):
        prepare_criteo(day_files, tmp_path / "p", split="days", max_ind_range=9, workers=-1)
    with pytest.raises(SystemExit) as caught:
        main(["--raw", *map(str, day_files), "--out", str(tmp_path / "p"), "--split", "days",
              "--max-ind-range", "9", "--workers", "-2"])
    assert str(caught.value).startswith("recforge: workers must be an integer >= 0") and "\n" not in str(caught.value)


def test_the_pool_keeps_task_order_and_bounds_runs_in_flight():
    pulled = []

    def tasks():
        for i in range(40):
            pulled.append(i)
            yield i, 3

    for workers in (0, 2):
        pulled.clear()
        with OrderedPool(workers) as pool:
            results = pool.map(pow, tasks())
            first = next(results)
            in_flight = len(pulled)
            assert [first, *results] == [i**3 for i in range(40)]
        assert in_flight <= 2 * workers + 1


def test_a_task_error_is_raised_in_its_turn():
    with OrderedPool(2) as pool:
        results = pool.map(pow, [(2, 1), (0, -1), (3, 1)])
        assert next(results) == 2
        with pytest.raises(ZeroDivisionError):
            next(results)


def test_the_data_config_passes_workers_to_the_conversion(day_files, tmp_path):
    from recforge.data.criteo.datamodule import CriteoDataModule

    dm = CriteoDataModule(raw_path=[str(p) for p in day_files], cache_dir=str(tmp_path / "cache"),
                          prepare={"split": "days", "max_ind_range": 997, "max_malformed_fraction": 0.01,
                                   "workers": 1})
    assert dm.metadata["conversion"]["workers"] == 1
    assert dm.metadata["split"]["rows"]["train"] == 2 * 3565
