"""NVIDIA NIXL (UCX backend) and kvbridge on the same ops in the same run, two processes.

``pip install --no-deps nixl-cu12`` (its plain install pulls torch, which the host-memory
path never imports). Two pairings, each against its own target processes on loopback:

- ``tcp``: kvbridge's TCP transport (2 streams) against NIXL with ``UCX_TLS=tcp``;
- ``sm``: kvbridge's UCX transport against NIXL, both with ``UCX_TLS=sm,self`` (shared
  memory, ``cma`` included: NIXL's RMA on ordinary host memory needs it, with
  ``posix,sysv,self`` alone it moved 0.14 GB/s; kvbridge's own default leaves ``cma`` out,
  ``sm,self`` measured no slower for it here).

Throughput: 256 MiB per round as 4 KiB, 64 KiB, 1 MiB and 16 MiB ops over a 256 MiB
buffer in shuffled order (no two ops of a batch adjacent, so neither side merges them),
batches of 128 ops (16 ops for 16 MiB: 128 would be 2 GiB), write and read, every batch
submitted before the first is waited for. kvbridge: ``peer.write(ops)``/``peer.read(ops)``
per batch. NIXL: its fast path as vLLM drives it, the descriptor lists of every block slot
prepared once (``prep_xfer_dlist``, untimed), then per batch ``make_prepped_xfer`` (by
index), ``transfer``, ``check_xfer_state`` until done, ``release``. Baseline: NIXL, so a
ratio above 1 means kvbridge is faster. Also the latency of one 8 KiB op in flight, p50
and p99 of 1,000 ops each, kvbridge and NIXL interleaved in chunks of 100 (NIXL both with a
new request per op and with one request re-posted).

NIXL runs as its Python API sets it up by default except two things: UCX error handling is
off (``ucx_error_handling_mode=none``; UCX's shared-memory transports have no peer failure
handler and NIXL's default, ``peer``, refuses them), and the initiator agent has no
progress thread (``check_xfer_state`` progresses it, as NIXL does without one). The target
agent keeps NIXL's default progress thread, which busy-polls a core (the Python API sets
its delay to 0); on a 2-core machine that core would be taken from kvbridge's rounds, so
the NIXL target is paused (SIGSTOP) outside NIXL's own rounds and resumed (SIGCONT) at the
end of each kvbridge round (after its last wait), so that NIXL's round finds it running.
kvbridge's target processes block when idle (no core taken from NIXL's rounds). NIXL's UCX
loads no ``ib`` module (``UCX_MODULES=^ib``, see :data:`UCX_MODULES`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _nixl_target import READY, UCX_PARAMS, nixl_api
from _transfer_target import TOTAL, read_ready, shuffled_offsets
from conftest import _EXTRA_LINES

from kvbridge.transfer import OP_DTYPE, TransferEngine, ucx_available
from kvbridge.transfer._nixl_agent import UCX_SEGMENTS

try:
    api = nixl_api()
except ImportError:
    pytest.skip("NIXL is not installed (pip install --no-deps nixl-cu12)", allow_module_level=True)

logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs each agent at INFO, to stdout
HERE = Path(__file__).parent
UCX_TLS = {"tcp": "tcp", "sm": "sm,self", "nixl-tcp": "tcp", "nixl-sm": "sm,self"}
KVBRIDGE_TRANSPORT = {"tcp": "tcp", "sm": "ucx", "nixl-tcp": "nixl", "nixl-sm": "nixl"}
LABEL = {"tcp": "tcp", "sm": "ucx/sm", "nixl-tcp": "nixl/tcp", "nixl-sm": "nixl/sm"}
"""The pairings: kvbridge's own transports (``tcp``, ``sm``: its UCX one) and kvbridge over
NIXL (``nixl-*``: the engine's ``nixl`` transport, its UCX on the same ``UCX_TLS``), each
against NIXL's own API on the same UCX transports. One process runs kvbridge's ucx or its
nixl, never both (``transfer/_ucx_builds.py``): run ``-k "nixl-"`` and ``-k "not nixl-"``
apart."""
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
BATCH = 128
BIG_BATCH = 16
"""Ops per batch for 16 MiB ops: 128 of them would be 2 GiB, the buffers are 256 MiB."""
LATENCY_BLOCK = 8 << 10
LATENCY_OPS = 1000
UCX_MODULES = os.environ.get("UCX_MODULES", "^ib")
"""For NIXL's UCX only: with its ``ib`` module loaded, the libnl-route bundled in the
nixl-cu12 1.5.1 wheel crashes in its exit handler (SIGSEGV in ``rtnl_tc_unregister`` at
process exit, even for a bare agent). Nothing here uses InfiniBand."""


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def _agent(name: str) -> Any:
    """A NIXL agent with the UCX backend and no progress thread (the caller progresses it),
    its UCX with the segment size kvbridge's nixl transport sets (``UCX_SEGMENTS``)."""
    with contextlib.ExitStack() as settings:
        for key, value in {"UCX_MODULES": UCX_MODULES, **UCX_SEGMENTS}.items():
            settings.enter_context(_environ(key, os.environ.get(key, value)))
        agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        if "UCX" not in agent.get_plugin_list():
            raise RuntimeError(f"no UCX plugin (plugins: {agent.get_plugin_list()})")
        agent.create_backend("UCX", UCX_PARAMS)
    return agent


@pytest.fixture(scope="module", autouse=True)
def _nixl_ucx() -> None:
    try:
        agent = _agent("kvbridge-bench-probe")
    except Exception as exc:
        pytest.skip(f"cannot create a NIXL agent with the UCX backend: {exc!r}")
    del agent


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    proc.stdout.close()


def _spawn(stack: contextlib.ExitStack, script: str, *args: str, **env_vars: str) -> Any:
    env = {**os.environ, **env_vars}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    stack.callback(_stop, proc)
    return proc


def _wait(agent: Any, handle: Any) -> None:
    state = agent.check_xfer_state(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer failed: {state}")


class _Rig:
    """Our end of one pairing: a kvbridge engine and a NIXL agent on one local buffer, each
    connected to its own target process; both targets run with the same UCX_TLS."""

    def __init__(self, mode: str, stack: contextlib.ExitStack) -> None:
        self.mode, tls, transport = mode, UCX_TLS[mode], KVBRIDGE_TRANSPORT[mode]
        self.label = LABEL[mode]
        kv_target = _spawn(
            stack,
            "_transfer_target.py",
            "2",
            transport,
            UCX_TLS=tls,
            KVBRIDGE_NIXL_UCX_TLS=tls,
            NIXL_LOG_LEVEL="WARN",
        )
        self.target = _spawn(
            stack,
            "_nixl_target.py",
            **{k: v for k, v in UCX_SEGMENTS.items() if k not in os.environ},
            UCX_TLS=tls,
            UCX_MODULES=UCX_MODULES,
            NIXL_LOG_LEVEL="WARN",
        )
        metadata_hex, _ = read_ready(kv_target.stdout)
        nixl_metadata, remote_base = self._nixl_ready()
        with _environ("UCX_TLS", tls), _environ("KVBRIDGE_NIXL_UCX_TLS", tls):
            self.engine = stack.enter_context(
                TransferEngine(f"bench-{mode}", streams=2, transports=[transport])
            )
            self.agent = _agent(f"kvbridge-bench-{mode}")
        self.local = np.random.default_rng(0).integers(0, 256, TOTAL, dtype=np.uint8)
        self.region = self.engine.register(self.local)
        self.peer = self.engine.connect(bytes.fromhex(metadata_hex))
        self.remote = next(iter(self.peer.regions.values())).id

        base = self.local.ctypes.data
        registered = self.agent.register_memory([(base, TOTAL, 0, "")], "DRAM")
        stack.callback(self.agent.deregister_memory, registered)
        self.remote_name = self.agent.add_remote_agent(bytes.fromhex(nixl_metadata))
        stack.callback(self.agent.remove_remote_agent, self.remote_name)
        self.bases = base, remote_base
        self.running = True
        self.prepped: dict[int, tuple[Any, Any]] = {}
        stack.callback(self._release_prepped)
        stack.callback(self.resume)  # runs first: the target answers while NIXL tears down
        self._check_nixl()
        self.pause()

    def _nixl_ready(self) -> tuple[str, int]:
        for line in self.target.stdout:
            if line.startswith(READY):
                _, metadata_hex, address = line.split()
                return metadata_hex, int(address)
        raise RuntimeError("the NIXL target exited before it was ready")

    def pause(self) -> None:
        if self.running and self.target.poll() is None:
            os.kill(self.target.pid, signal.SIGSTOP)
        self.running = False

    def resume(self) -> None:
        if not self.running and self.target.poll() is None:
            os.kill(self.target.pid, signal.SIGCONT)
        self.running = True

    def _remote_digest(self, offset: int, length: int) -> str:
        self.target.stdin.write(f"{offset} {length}\n")
        self.target.stdin.flush()
        for line in self.target.stdout:
            if len(line.strip()) == 128:  # a BLAKE2b digest; UCX may print warnings to stdout
                return str(line.strip())
        raise RuntimeError("the NIXL target exited")

    def _check_nixl(self) -> None:
        """One NIXL write and one read of 1 MiB, checked byte for byte."""
        block = 1 << 20
        local, remote = self.bases
        for op, local_at in (("WRITE", 0), ("READ", 4 * block)):
            handle = self.agent.initialize_xfer(
                op,
                self.agent.get_xfer_descs([(local + local_at, block, 0)], "DRAM"),
                self.agent.get_xfer_descs([(remote + block, block, 0)], "DRAM"),
                self.remote_name,
            )
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError(f"NIXL {op} could not be posted")
            _wait(self.agent, handle)
            handle.release()
        expected = hashlib.blake2b(self.local.data[:block]).hexdigest()
        assert self._remote_digest(block, block) == expected, "NIXL WRITE moved wrong bytes"
        assert hashlib.blake2b(self.local.data[4 * block : 5 * block]).hexdigest() == expected, (
            "NIXL READ moved wrong bytes"
        )

    def dlists(self, block: int) -> tuple[Any, Any]:
        """NIXL's prepared descriptor lists of every ``block``-sized slot, local and remote."""
        if block not in self.prepped:
            slots = TOTAL // block
            sides = []
            for agent_name, base in zip(
                ("NIXL_INIT_AGENT", self.remote_name), self.bases, strict=True
            ):
                descs = np.zeros((slots, 3), np.uint64)
                descs[:, 0] = base + np.arange(slots, dtype=np.uint64) * block
                descs[:, 1] = block
                sides.append(self.agent.prep_xfer_dlist(agent_name, descs, "DRAM"))
            self.prepped[block] = sides[0], sides[1]
        return self.prepped[block]

    def _release_prepped(self) -> None:
        for sides in self.prepped.values():
            for side in sides:
                side.release()

    def ops(self, block: int, count: int, seed: int) -> np.ndarray:
        ops = np.zeros(count, OP_DTYPE)
        ops["local_region"], ops["remote_region"] = self.region.id, self.remote
        ops["local_offset"] = shuffled_offsets(block, count, seed + 1)
        ops["remote_offset"] = shuffled_offsets(block, count, seed)
        ops["length"] = block
        return ops

    def nixl_round(self, op: str, block: int, batches: list[np.ndarray]) -> Callable[[], None]:
        """NIXL moving ``batches`` of kvbridge ops (same offsets, same order)."""
        local, remote = self.dlists(block)
        indices = [
            (
                (batch["local_offset"] // block).astype(np.int32),
                (batch["remote_offset"] // block).astype(np.int32),
            )
            for batch in batches
        ]
        agent, operation = self.agent, op.upper()

        def run() -> None:
            self.resume()  # a no-op after a kvbridge round, which resumed it
            handles = []
            try:
                for local_indices, remote_indices in indices:
                    handle = agent.make_prepped_xfer(
                        operation, local, local_indices, remote, remote_indices
                    )
                    handles.append(handle)
                    if agent.transfer(handle) == "ERR":
                        raise RuntimeError(f"NIXL {operation} could not be posted")
                for handle in handles:
                    _wait(agent, handle)
            finally:
                for handle in handles:
                    handle.release()
                self.pause()

        return run


@pytest.fixture(scope="module", params=list(UCX_TLS))
def rig(request: pytest.FixtureRequest) -> Iterator[_Rig]:
    mode = str(request.param)
    if mode == "sm" and not ucx_available():
        pytest.skip("ucxx is not installed: no kvbridge UCX transport to set against NIXL")
    with contextlib.ExitStack() as stack:
        yield _Rig(mode, stack)


@pytest.mark.parametrize("block", SIZES, ids=["4KiB", "64KiB", "1MiB", "16MiB"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_nixl_throughput(compare: Callable[..., Any], rig: _Rig, block: int, op: str) -> None:
    count = TOTAL // block
    batch = BIG_BATCH if block >= 16 << 20 else BATCH
    ops = rig.ops(block, count, seed=block)
    batches = [ops[i : i + batch] for i in range(0, count, batch)]
    submit = rig.peer.write if op == "write" else rig.peer.read

    def run_kvbridge() -> None:
        for handle in [submit(b) for b in batches]:
            handle.wait(120)
        rig.resume()  # after the last wait: NIXL's next round finds its target running

    size = f"{block >> 20} MiB" if block >= 1 << 20 else f"{block >> 10} KiB"
    compare(
        f"{rig.label} {op} {size} x {count}, batches of {batch}",
        run_kvbridge,
        rig.nixl_round(op, block, batches),
        baseline_name=f"NIXL UCX, UCX_TLS={UCX_TLS[rig.mode]}",
        nbytes=TOTAL,
        rounds=5,
        warmup=1,
    )


def _pct(xs: list[float], p: float) -> float:
    return sorted(xs)[int(p * (len(xs) - 1))] * 1e6


@pytest.mark.parametrize("op", ["write", "read"])
def test_nixl_latency(rig: _Rig, op: str) -> None:
    """One 8 KiB op in flight at a time, kvbridge and NIXL interleaved in chunks of 100."""
    block = LATENCY_BLOCK
    ops = rig.ops(block, 1, seed=3)
    move = rig.peer.write if op == "write" else rig.peer.read
    local, remote = rig.dlists(block)
    agent, operation = rig.agent, op.upper()
    local_index = (ops["local_offset"] // block).astype(np.int32)
    remote_index = (ops["remote_offset"] // block).astype(np.int32)
    reposted = agent.make_prepped_xfer(operation, local, local_index, remote, remote_index)
    ours: list[float] = []
    fresh: list[float] = []
    again: list[float] = []

    def nixl_fresh() -> None:
        handle = agent.make_prepped_xfer(operation, local, local_index, remote, remote_index)
        if agent.transfer(handle) == "ERR":
            raise RuntimeError(f"NIXL {operation} could not be posted")
        _wait(agent, handle)
        handle.release()

    def nixl_again() -> None:
        if agent.transfer(reposted) == "ERR":
            raise RuntimeError(f"NIXL {operation} could not be posted")
        _wait(agent, reposted)

    def timed(fn: Callable[[], None], into: list[float] | None, n: int) -> None:
        for _ in range(n):
            start = time.perf_counter()
            fn()
            if into is not None:
                into.append(time.perf_counter() - start)

    def kvbridge() -> None:
        move(ops).wait(10)

    try:
        timed(kvbridge, None, 50)
        rig.resume()
        timed(nixl_fresh, None, 50)
        timed(nixl_again, None, 50)
        rig.pause()
        for _ in range(LATENCY_OPS // 100):
            timed(kvbridge, ours, 100)
            rig.resume()
            timed(nixl_again, None, 5)  # untimed: the target's first ops after SIGCONT
            timed(nixl_fresh, fresh, 100)
            timed(nixl_again, again, 100)
            rig.pause()
    finally:
        reposted.release()
    line = (
        f"{rig.label} {op} 8 KiB latency: kvbridge p50 {_pct(ours, 0.5):.0f} us p99 "
        f"{_pct(ours, 0.99):.0f} us  vs NIXL (UCX_TLS={UCX_TLS[rig.mode]}) new request per op "
        f"p50 {_pct(fresh, 0.5):.0f} us p99 {_pct(fresh, 0.99):.0f} us, one request re-posted "
        f"p50 {_pct(again, 0.5):.0f} us p99 {_pct(again, 0.99):.0f} us  "
        f"ratio(p50, new request) {_pct(fresh, 0.5) / _pct(ours, 0.5):.2f}"
    )
    print("\n" + line)
    _EXTRA_LINES.append(line)
