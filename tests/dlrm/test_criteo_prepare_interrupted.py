"""A Criteo conversion that does not finish: killed halfway, or out of disk space.

Oracles: what is on disk afterwards (no ``metadata.json``, hence nothing the reader takes for
prepared data; no staging directory after the next run) and an uninterrupted conversion of the same
file, whose parts the run after the kill must reproduce byte for byte.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from recforge.data.criteo.fullsize import GENERATORS
from recforge.data.criteo.prepare import main, prepare_criteo
from recforge.data.criteo.prepared import PreparedDataError, read_metadata

SETTINGS = ["--max-ind-range", "997", "--chunk-rows", "300"]


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("raw")
    GENERATORS["criteo-kaggle"](out, 5e-4, 0)  # 22,920 rows: ~76 runs of 300 lines
    return out / "train.txt"


def _parts(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*.parquet"))}


def _staging(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.endswith(".tmp")]


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while listing
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="lists worker processes through /proc")
def test_a_conversion_killed_halfway_leaves_nothing_taken_for_prepared_data(raw, tmp_path):
    out = tmp_path / "prepared"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "recforge.data.criteo.prepare", "--raw", str(raw), "--out", str(out), *SETTINGS,
               "--workers", "1"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    # Kill once the staging directory holds a part being written.
    while not any(s.is_dir() and any(s.rglob("*.parquet")) for s in _staging(tmp_path)):
        assert proc.poll() is None, "the conversion ended before it could be killed"
        assert time.monotonic() < deadline, "no staging directory appeared"
        time.sleep(0.01)
    workers = _children(proc.pid)
    assert workers, "the conversion runs no worker process"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 20
    while any(_alive(w) for w in workers):  # they notice their parent is gone and end
        assert time.monotonic() < deadline, "worker processes outlived the killed conversion"
        time.sleep(0.1)
    assert _staging(tmp_path), "the kill left no staging directory: it did not interrupt anything"
    with pytest.raises(PreparedDataError):
        read_metadata(out)  # the reader does not take the leftover for prepared data

    prepare_criteo(raw, out, max_ind_range=997, chunk_rows=300)  # the next run starts over
    assert _staging(tmp_path) == []
    clean = prepare_criteo(raw, tmp_path / "clean", max_ind_range=997, chunk_rows=300)
    assert _parts(out) == _parts(clean) and len(_parts(out)) >= 3
    assert read_metadata(out)["splits"] == read_metadata(clean)["splits"]


def test_a_full_disk_is_one_line_naming_the_directory_and_leaves_nothing(raw, tmp_path, monkeypatch):
    real_write = pq.ParquetWriter.write_table
    calls = []

    def write_until_full(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 2:  # the first row groups went through; then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", write_until_full)
    out = tmp_path / "prepared"
    with pytest.raises(SystemExit) as caught:
        main(["--raw", str(raw), "--out", str(out), *SETTINGS])
    message = str(caught.value)
    assert message == f"recforge: {out}: writing the prepared data failed (the disk is full); nothing was left there"
    assert len(calls) == 3
    assert not out.exists() and _staging(tmp_path) == []
