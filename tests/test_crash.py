"""SIGKILL in the middle of a stream of puts: the disk tier reopens clean and loses nothing
that was committed to it (with write-through: nothing whose put returned)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import key, payloads

from kvbridge.store import TieredStore

BB = 64 << 10
BATCH = 8

_WRITER = """
import sys
sys.path.insert(0, {tests!r})
from helpers import key, payloads
from kvbridge.store import TieredStore

write_through = sys.argv[2] == "1"
store = TieredStore({bb}, host_capacity=16 * {bb}, disk_path=sys.argv[1],
                    disk_capacity=100_000 * {bb}, write_through=write_through)
disk = store.tiers[-1]
reported = set()
i = 0
while True:
    ks = [key(n) for n in range(i, i + {batch})]
    store.put(ks, payloads(ks, {bb}))
    i += {batch}
    # Report what is committed now: with write-through, every key of this put; without,
    # whatever eviction has demoted to disk so far.
    committed = ks if write_through else [k for k in disk.keys() if k not in reported]
    reported.update(committed)
    print(" ".join(k.hex() for k in committed), flush=True)
"""


def _run_and_kill(path: Path, write_through: bool, lines_before_kill: int) -> set[bytes]:
    code = _WRITER.format(tests=str(Path(__file__).parent), bb=BB, batch=BATCH)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path), "1" if write_through else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    committed: set[bytes] = set()
    for _ in range(lines_before_kill):
        line = proc.stdout.readline()
        assert line, "writer died early"
        committed.update(bytes.fromhex(h) for h in line.split())
    os.kill(proc.pid, signal.SIGKILL)  # mid-stream: the writer never stops between puts
    proc.wait(30)
    proc.stdout.close()
    return committed


@pytest.mark.slow
@pytest.mark.parametrize("write_through", [False, True])
@pytest.mark.parametrize("lines_before_kill", [7, 40])
def test_sigkill_loses_nothing_committed(
    tmp_path: Path, write_through: bool, lines_before_kill: int
) -> None:
    committed = _run_and_kill(tmp_path, write_through, lines_before_kill)
    assert committed  # the scenario really wrote to disk before the kill
    ordered = sorted(committed)
    with TieredStore(
        BB,
        host_capacity=0,
        disk_path=tmp_path,
        disk_capacity=100_000 * BB,
    ) as store:
        report = store.check()
        assert report.ok, report
        assert store.contains(ordered) == [True] * len(ordered)
        out = np.zeros((len(ordered), BB), np.uint8)
        store.get(ordered, out)
        np.testing.assert_array_equal(out, payloads(ordered, BB))
        # Blocks that were committed after the last report are fine too; any block the
        # store does hold must be a complete, correct one.
        extra = [k for k in store.tiers[0].keys() if k not in committed]  # noqa: SIM118
        if extra:
            got = np.zeros((len(extra), BB), np.uint8)
            store.get(extra, got)
            np.testing.assert_array_equal(got, payloads(extra, BB))


def test_write_through_keeps_every_returned_put(tmp_path: Path) -> None:
    """Without a kill: every block put with write-through is on disk at once."""
    with TieredStore(
        BB, host_capacity=4 * BB, disk_path=tmp_path, disk_capacity=64 * BB, write_through=True
    ) as store:
        ks = [key(i) for i in range(10)]
        store.put(ks, payloads(ks, BB))
        assert all(k in store.tiers[-1] for k in ks)
        assert len(store.tiers[0]) == 4
