"""Soak: a real ``kvbridge serve`` under churn, with clients that die and a hostile neighbour.

For ``KVBRIDGE_SOAK_S`` seconds (15 by default, so that the default suite stays under 10
minutes on 2 cores; set it longer for a longer soak) eight worker processes put prefixes of
blocks and read back blocks that they or others put, in two namespaces of a server whose
memory holds 64 blocks per namespace (eviction and slot reuse never stop) and whose leases
last 2 s. At random a worker closes its client in the middle of a put, or stalls until its
lease expired before it commits or releases (the server must refuse: ``LeaseExpired``); the
driver SIGKILLs a random worker every few seconds and starts a new one. Meanwhile the test
process floods the control port with unauthenticated hellos, holds slow-loris connections
on the data port, and sends late writes (a write admitted under a lease whose bytes arrive
after the lease was aborted or expired).

Every block's bytes are a pure function of its key and namespace, so every reader checks
every byte it reads. What must hold:

(a) no reader ever gets a wrong byte (a miss is fine);
(b) every block whose put returned normally is readable with its bytes afterwards (the
    server has a disk tier larger than every key the workers can ever write, and write
    through: the store never has to drop a committed block);
(c) the server's threads and memory come back to where they were once every client left;
(d) the server is alive, answers ``kvbridge stats``, and holds no lease once every client
    left; its stderr has no traceback.

``KVBRIDGE_SOAK_S`` sets the duration and ``KVBRIDGE_SOAK_SEED`` the driver's seed (printed
with the summary; the workers' seeds derive from it). Run with ``-s`` to see the summary.
A worker is ``tests/soak_worker.py`` run as a script.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import IO

import numpy as np
import pytest
from soak_common import (
    BB,
    DISK_CAPACITY,
    HOST_CAPACITY,
    KILL_EVERY_S,
    LEASE_TTL,
    LEASES_GONE_S,
    NAMESPACES,
    RSS_SLACK_BYTES,
    SETTLE_S,
    STOP_GRACE_S,
    WORKERS,
    block_key,
    soak_seconds,
    wrong_bytes,
)
from soak_hostile import _Hostile

from kvbridge.store import (
    StoreClient,
)
from kvbridge.tools._serve_cmds import read_listening
from kvbridge.tools._stats_cmd import server_stats

# -- the driver --------------------------------------------------------------------------


def _proc_status(pid: int, disk: Path) -> dict[str, int]:
    """Threads, and resident memory in kB: all of it (VmRSS), and the part that is pages of
    the disk tier's files mapped in by LMDB reads (page cache the kernel reclaims at will,
    as large as the blocks read from disk: not the server's own memory)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("Threads", "VmRSS"):
                fields[name] = int(value.split()[0])
    mapped = 0
    on_disk = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if not head[0].endswith(":"):  # a mapping's first line: range perms ... path
                on_disk = len(head) >= 6 and head[5].startswith(str(disk))
            elif head[0] == "Rss:" and on_disk:
                mapped += int(head[1])
    fields["DiskMapped"] = mapped
    fields["Own"] = fields["VmRSS"] - mapped
    return fields


class _Soak:
    def __init__(self, tmp: Path, duration: float, seed: int) -> None:
        self.tmp = tmp
        self.duration = duration
        self.rng = random.Random(seed)
        self.server: subprocess.Popen[str] | None = None
        self.server_err: IO[str] | None = None
        self.address = ""
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.worker_errs: dict[int, IO[bytes]] = {}
        self.next_worker = 0
        self.kills = 0
        self.stop_file = tmp / "stop"
        self.deadline = 0.0
        self.failures: list[str] = []

    def start_server(self) -> None:
        self.server_err = open(self.tmp / "server.stderr", "w")  # noqa: SIM115
        self.server = subprocess.Popen(
            [
                *(sys.executable, "-m", "kvbridge", "serve", "--port", "0"),
                *("--host-capacity", str(HOST_CAPACITY), "--max-namespaces", "2"),
                *("--lease-ttl", str(LEASE_TTL)),
                *("--disk-path", str(self.tmp / "disk"), "--disk-capacity", str(DISK_CAPACITY)),
            ],
            stdout=subprocess.PIPE,
            stderr=self.server_err,
            text=True,
        )
        assert self.server.stdout is not None
        try:
            self.address, _ = read_listening(self.server.stdout)
        except RuntimeError:
            raise AssertionError(self.server_stderr()) from None

    def server_stderr(self) -> str:
        return (self.tmp / "server.stderr").read_text(errors="replace")

    def start_worker(self) -> None:
        wid = self.next_worker
        self.next_worker += 1
        config = {
            "address": self.address,
            "deadline": self.deadline,
            "stop": str(self.stop_file),
            "seed": self.rng.randrange(1 << 63),
            "log": str(self.tmp / f"worker-{wid}.log"),
        }
        self.worker_errs[wid] = open(self.tmp / f"worker-{wid}.stderr", "wb")  # noqa: SIM115
        self.workers[wid] = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve().parent / "soak_worker.py"),
                "worker",
                json.dumps(config),
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.worker_errs[wid],
        )

    def kill_worker(self, wid: int) -> None:
        proc = self.workers.pop(wid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def stop_all(self) -> None:
        """Kill whatever is still running (the test's finally)."""
        for wid in list(self.workers):
            with contextlib.suppress(Exception):
                self.kill_worker(wid)
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.server.communicate(timeout=30)
        for f in [self.server_err, *self.worker_errs.values()]:
            if f is not None:
                f.close()

    def open_namespaces(self) -> None:
        for ns in NAMESPACES:
            with StoreClient(self.address, block_bytes=BB, namespace=ns) as client:
                assert client.capacity_blocks == HOST_CAPACITY // 2 // BB

    def open_leases(self) -> int:
        return int(server_stats(self.address)["server"]["open_leases"])

    def status(self) -> dict[str, int]:
        assert self.server is not None
        return _proc_status(self.server.pid, self.tmp / "disk")

    def leases_gone(self, within_s: float) -> tuple[int, float]:
        """Poll until the server holds no lease: (leases left, seconds it took)."""
        started = time.monotonic()
        leases = self.open_leases()
        while leases and time.monotonic() - started < within_s:
            time.sleep(0.2)
            leases = self.open_leases()
        return leases, time.monotonic() - started

    def settle(self, baseline_threads: int) -> dict[str, int]:
        """Wait (bounded) until the server runs no more threads than ``baseline_threads``."""
        give_up = time.monotonic() + SETTLE_S
        status = self.status()
        while status["Threads"] > baseline_threads and time.monotonic() < give_up:
            time.sleep(0.5)
            status = self.status()
        return status

    def read_logs(
        self,
    ) -> tuple[set[tuple[str, int, int]], Counter[str], list[tuple[str, str]]]:
        """Committed keys (ns, conversation, block), summed counters, and reported events
        (kind, text)."""
        committed: set[tuple[str, int, int]] = set()
        counts: Counter[str] = Counter()
        events: list[tuple[str, str]] = []
        for wid in range(self.next_worker):
            path = self.tmp / f"worker-{wid}.log"
            last: dict[str, int] = {}
            if path.exists():
                for line in path.read_text().splitlines():
                    kind, _, body = line.partition(" ")
                    try:
                        payload = json.loads(body)
                    except ValueError:
                        continue
                    if kind == "C":
                        ns, conversation, length = payload
                        committed.update((ns, conversation, i) for i in range(length))
                    elif kind == "S":
                        last = payload
                    elif kind in ("W", "B", "L", "X"):
                        events.append((kind, f"worker {wid}: {kind} {body}"))
                    if kind == "W":
                        counts["wrong_bytes_reported"] += int(payload["wrong"])
            counts.update(last)
        return committed, counts, events

    def verify_committed(self, committed: set[tuple[str, int, int]]) -> tuple[int, int, int]:
        """Read every committed block: (blocks read, blocks missing, wrong bytes)."""
        read = missing = wrong = 0
        for ns in NAMESPACES:
            keys = sorted(block_key(n, c, i) for n, c, i in committed if n == ns)
            with StoreClient(self.address, block_bytes=BB, namespace=ns, timeout=30) as client:
                step = client.request_keys
                for start in range(0, len(keys), step):
                    chunk = keys[start : start + step]
                    present = client.contains(chunk)
                    gone = [k for k, p in zip(chunk, present, strict=True) if not p]
                    if gone:
                        missing += len(gone)
                        self.failures.append(
                            f"{ns}: committed block {gone[0].hex()} gone "
                            f"({len(gone)} in this chunk)"
                        )
                    chunk = [k for k, p in zip(chunk, present, strict=True) if p]
                    if not chunk:
                        continue
                    out = np.full((len(chunk), BB), 0x5A, dtype=np.uint8)
                    client.get(chunk, out)
                    read += len(chunk)
                    for i, n in wrong_bytes(chunk, out):
                        wrong += n
                        self.failures.append(f"{ns}: committed block {chunk[i].hex()}: {n} wrong")
        return read, missing, wrong


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the server's /proc")
def test_soak(tmp_path: Path) -> None:
    duration = soak_seconds()
    seed = int(os.environ.get("KVBRIDGE_SOAK_SEED", random.randrange(1 << 32)))
    soak = _Soak(tmp_path, duration, seed)
    hostile: _Hostile | None = None
    try:
        soak.start_server()
        assert soak.server is not None
        soak.open_namespaces()  # the slabs are prefaulted here: measure after
        time.sleep(1.0)
        base = soak.status()
        peak_threads = base["Threads"]

        soak.deadline = time.time() + duration
        for _ in range(WORKERS):
            soak.start_worker()
        hostile = _Hostile(soak.address, seed)
        hostile.start()
        next_kill = time.monotonic() + soak.rng.uniform(*KILL_EVERY_S)
        crashed: list[str] = []
        while time.time() < soak.deadline:
            time.sleep(0.2)
            if soak.server.poll() is not None:
                soak.failures.append(f"the server exited ({soak.server.returncode}) mid-run")
                break
            peak_threads = max(peak_threads, soak.status()["Threads"])
            for wid, proc in list(soak.workers.items()):
                if proc.poll() is not None and time.time() < soak.deadline - 1:
                    crashed.append(f"worker {wid} exited {proc.returncode} before the end")
                    soak.workers.pop(wid)
                    soak.start_worker()
            if time.monotonic() >= next_kill and time.time() < soak.deadline - 1:
                soak.kill_worker(soak.rng.choice(list(soak.workers)))
                soak.kills += 1
                soak.start_worker()
                next_kill = time.monotonic() + soak.rng.uniform(*KILL_EVERY_S)

        stuck_threads = hostile.close()
        soak.stop_file.touch()
        give_up = time.monotonic() + STOP_GRACE_S
        while soak.workers and time.monotonic() < give_up:
            for wid, proc in list(soak.workers.items()):
                if proc.poll() is not None:
                    soak.workers.pop(wid)
                    if proc.returncode != 0:
                        crashed.append(f"worker {wid} exited {proc.returncode}")
            time.sleep(0.2)
        stragglers = sorted(soak.workers)
        for wid in stragglers:
            soak.kill_worker(wid)
        soak.failures += crashed
        if stragglers:
            soak.failures.append(f"workers {stragglers} still running {STOP_GRACE_S:.0f} s late")
        if stuck_threads:
            soak.failures.append(f"hostile threads {stuck_threads} did not stop")
        soak.failures += hostile.violations

        # Every client is gone: their sessions end with their streams, and their leases too.
        alive = soak.server.poll() is None
        leases, leases_s = soak.leases_gone(LEASES_GONE_S) if alive else (-1, 0.0)
        committed, counts, events = soak.read_logs()
        read = missing = wrong_after = 0
        if alive:
            read, missing, wrong_after = soak.verify_committed(committed)
        after = soak.settle(base["Threads"]) if alive else base
        final_leases = soak.open_leases() if alive else -1
        stats_cli = subprocess.run(
            [sys.executable, "-m", "kvbridge", "stats", soak.address],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        stderr = soak.server_stderr()
        tracebacks = stderr.count("Traceback")
        grown = (after["Own"] - base["Own"]) << 10
        print(
            f"\nsoak: {duration:.0f} s, seed {seed}: {counts['ops']} ops ({counts['puts']} puts, "
            f"{counts['gets']} gets), {counts['bytes_verified'] / 2**20:.0f} MiB verified, "
            f"{len(committed)} committed blocks re-read ({read} ok, {missing} missing), "
            f"{soak.kills} kills, {counts['expired_planned']} planned expiries refused "
            f"(+{counts['expired_unplanned']} unplanned), {counts['aborted_puts']} aborted puts, "
            f"wrong bytes {counts['wrong_bytes']} during + {wrong_after} after; "
            f"hostile: {hostile.counts['hellos']} hellos, "
            f"{hostile.counts['loris_connections']} slow-loris (longest "
            f"{hostile.loris_max_age:.1f} s), {hostile.counts['late_writes']} late writes; "
            f"leases {leases} after {leases_s:.1f} s; "
            f"server threads {base['Threads']}->{peak_threads}->{after['Threads']}, "
            f"RSS {base['VmRSS'] >> 10}->{after['VmRSS'] >> 10} MiB "
            f"(without LMDB file pages {base['Own'] >> 10}->{after['Own'] >> 10} MiB), "
            f"stderr {len(stderr.splitlines())} lines, {tracebacks} tracebacks",
            flush=True,
        )
        details = {k: v for k, v in sorted(counts.items()) if k not in ("ops", "bytes_verified")}
        print(f"soak details: workers {details}; hostile {dict(hostile.counts)}", flush=True)
        for line in [*(text for _, text in events[:20]), *hostile.errors[:10]]:
            print(f"soak event: {line}", flush=True)

        # (a) nobody read a wrong byte, during the run or after it
        assert counts["wrong_bytes"] == 0 and counts["wrong_bytes_reported"] == 0, events
        assert wrong_after == 0, soak.failures
        # (b) every committed block is still there, with its bytes
        assert alive, f"the server died: {stderr[-3000:]}"
        assert missing == 0, soak.failures
        assert not [e for kind, e in events if kind == "L"], events
        # no refused-by-contract operation was accepted, no call hung, no server bug surfaced
        assert not [e for kind, e in events if kind == "B"], events
        assert counts["internal_errors"] == 0, events
        # (c) threads and memory back where they started
        assert after["Threads"] <= base["Threads"], (base, after)
        assert grown <= RSS_SLACK_BYTES, (base, after)
        # (d) alive, answering, no lease left once the clients were gone, a clean log
        assert leases == 0, f"{leases} leases open {LEASES_GONE_S} s after every client left"
        assert final_leases == 0, final_leases
        assert stats_cli.returncode == 0, stats_cli.stderr
        assert "open leases 0" in stats_cli.stdout, stats_cli.stdout
        assert tracebacks == 0, stderr[-5000:]
        assert not soak.failures, soak.failures
    finally:
        if hostile is not None:
            hostile.close()
        soak.stop_all()
        shutil.rmtree(tmp_path / "disk", ignore_errors=True)
