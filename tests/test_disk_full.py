"""A full disk, for real: a 2 MiB tmpfs (mounted as root; skipped with the reason where it
cannot be), filled by the store itself or by another process after the store opened. Every
case runs in a child process, so a SIGBUS shows as the child's signal exit. A full disk must
be StoreFull for the put that met it, with everything committed before it still readable."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

BB = 4096
TESTS = str(Path(__file__).parent)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs: writes past it fail with ENOSPC (or SIGBUS through a mmap)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    try:
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as e:
        pytest.skip(f"cannot mount a 2 MiB tmpfs: {e}")
    if result.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs (needs root): {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _run_child(code: str, *args: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter: a SIGBUS shows as a signal exit, not as a dead
    test run. The child prints one JSON line."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode} (negative: killed by that signal)\n{proc.stderr}"
    )
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# -- 3 and 10: a full file system is StoreFull (not SIGBUS), and changes nothing -----------

_ON_TINY_FS = (
    f"import sys\nsys.path.insert(0, {TESTS!r})\n"
    + """
import json
import numpy as np
from helpers import keys, payload, payloads
from kvbridge.store import BlockNotFound, StoreFull, TieredStore
from kvbridge.store.local import RemoteAccess
BB = 64 << 10
def readable(store, ks):
    out = np.empty((1, BB), np.uint8)
    good = 0
    for k in ks:
        try:
            store.get([k], out)
        except BlockNotFound:
            continue
        good += bool((out[0] == payload(k, BB)).all())
    return good
host, via = int(sys.argv[2]), sys.argv[3]
store = TieredStore(BB, host_capacity=host * BB, disk_path=sys.argv[1],
                    disk_capacity=1024 * BB, write_through=host > 0)
def write(ks):
    if via == "put":
        return store.put(ks, payloads(ks, BB))
    lease, slots = RemoteAccess(store).stage(ks)
    for slot, k in zip(slots, ks):
        store.tiers[0].memory.slot(slot)[:] = payload(k, BB)
    return RemoteAccess(store).commit(lease)
first, big, after = keys(0, 8), keys(100, 132), keys(200, 204)
write(first)                  # 512 KiB: fits in the 2 MiB
error = None
try:
    write(big)                # 2 MiB more: the file system fills up
except StoreFull as e:
    error = type(e).__name__
result = {"error": error, "visible": sum(store.contains(big))}
write(after)                  # 256 KiB: fits in what is left
if host:                      # every slot not holding a block can be staged
    RemoteAccess(store).abort(RemoteAccess(store).stage(keys(300, 300 + host - 12))[0])
store.close()
store = TieredStore(BB, host_capacity=0, disk_path=sys.argv[1], disk_capacity=1024 * BB)
result["readable"] = readable(store, first + after)
result["big_on_disk"] = sum(store.contains(big))
store.close()
print(json.dumps(result))
"""
)


@pytest.mark.parametrize(
    ("host_blocks", "via"),
    [(0, "put"), (64, "put"), (64, "commit")],
    ids=["disk-only-put", "write-through-put", "write-through-commit"],
)
def test_a_full_filesystem_is_store_full_and_the_process_survives(
    tiny_fs: Path, host_blocks: int, via: str
) -> None:
    result = _run_child(_ON_TINY_FS, str(tiny_fs / "tier"), str(host_blocks), via)
    assert result == {"error": "StoreFull", "visible": 0, "readable": 12, "big_on_disk": 0}


_FILLED_BY_OTHERS = (
    f"import sys\nsys.path.insert(0, {TESTS!r})\n"
    + """
import json, os
import numpy as np
from helpers import keys, payload, payloads
from kvbridge.store import BlockNotFound, StoreFull, TieredStore
BB = 64 << 10
store = TieredStore(BB, host_capacity=0, disk_path=sys.argv[1], disk_capacity=1024 * BB)
first = keys(0, 4)
store.put(first, payloads(first, BB))
hog = os.path.join(os.path.dirname(sys.argv[1]), "hog")
with open(hog, "wb") as f:          # another process fills the file system to the last block
    try:
        while True:
            f.write(b"\\0" * 65536)
            f.flush()
    except OSError:
        pass
stored, refused = 0, 0
for i in range(100, 140):           # writes go on into the blocks the tier allocated, or fail
    try:
        store.put([keys(i, i + 1)[0]], payloads(keys(i, i + 1), BB))
        stored += 1
    except StoreFull:
        refused += 1
out = np.empty((1, BB), np.uint8)
good = 0
for k in first + keys(100, 140):
    try:
        store.get([k], out)
    except BlockNotFound:
        continue
    good += bool((out[0] == payload(k, BB)).all())
store.close()
print(json.dumps({"stored": stored, "refused": refused, "good": good}))
"""
)


def test_a_file_system_filled_by_another_process_is_store_full_not_sigbus(tiny_fs: Path) -> None:
    """With writemap, LMDB writes into its mapping: the tier keeps the map within the disk
    blocks it allocated, so a disk filled by someone else after the tier opened makes puts
    fail with StoreFull (or land in what the tier holds already), never a SIGBUS."""
    result = _run_child(_FILLED_BY_OTHERS, str(tiny_fs / "tier"))
    assert result["stored"] + result["refused"] == 40  # type: ignore[operator]
    assert result["good"] == 4 + result["stored"]  # type: ignore[operator]
