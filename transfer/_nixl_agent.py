"""One NIXL agent (its UCX backend) behind one lock, and the threads that progress it.

NIXL's Python API makes an agent without thread synchronisation unless it listens for
metadata (``NIXL_THREAD_SYNC_NONE``): kvbridge calls it under one lock (``Agent.lock``).
UCX over TCP needs the target's worker progressed for a one-sided put or get to complete
(over shared memory, ``cma``, the initiator's process moves the bytes itself): NIXL's own
progress thread does that, waiting on UCX's event descriptors. NIXL's Python API sets that
thread's poll timeout to 0, a busy-polled core (2.0 s of CPU in 2 s idle, where with a
timeout it took none): kvbridge makes the agent with ``PROGRESS_TIMEOUT`` instead
(``_config_class``). What NIXL has no event for (its notifications, the state of a
transfer) kvbridge's own thread (``Progress``) polls: at once while there is work (a
transfer in flight, a notification in the last ``_BUSY_S``), every ``_IDLE_SLEEP_S`` at most
otherwise; a caller waiting for a batch polls for it itself (``TransferHandle``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

_log = logging.getLogger("kvbridge.transfer")

UCX_MODULES = "^ib"
"""NIXL's UCX loads no ``ib`` module unless ``UCX_MODULES`` says otherwise: with it loaded,
the libnl-route bundled in the nixl-cu12 1.5.1 wheel crashes in its exit handler (SIGSEGV
at process exit, even for an agent that did nothing)."""

ERROR_HANDLING = "none"
"""UCX error handling mode of the agent's backend (``KVBRIDGE_NIXL_ERROR_HANDLING``
overrides it). NIXL's default, ``peer``, refuses UCX's shared-memory transports, which
have no peer-failure handler; with ``none``, a transfer to a dead peer fails where the
transport reports it (``cma``: the process is gone) and otherwise at the batch deadline."""

UCX_SEGMENTS = {"UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"}
"""UCX over TCP moves a one-sided op as messages of at most a segment, each handled by
the target (UCX's default is 8 KiB): with 256 KiB, 4,032 pages of 32 KiB through a server
loaded at 1.37 GB/s where they loaded at 0.53 (saved at 0.74 where 0.61; ``benches/README.md``,
issue 36). Both ends of a link are kvbridge's, so both use the same; the environment's own
``UCX_TCP_*_SEG_SIZE`` wins."""

PROGRESS_TIMEOUT = 100_000
"""The poll timeout of NIXL's progress thread (``pthrDelay``): it wakes on UCX's events
before it, so this only bounds how long it sleeps with nothing to do."""

_ENV_LOCK = threading.Lock()
"""Held while an agent is made (the config class swapped) or ``UCX_TLS`` set for it."""

_BUSY_S = 0.005
"""After the last sign of work, the progress thread keeps polling this long before it
starts to sleep between polls."""

_BUSY_SLEEP_S = 0.00002
"""The sleep between polls while there is work (Linux sleeps ~60 us for it): a waiting
caller polls for itself meanwhile (``TransferHandle``), and a thread that spins would hold
the GIL from it."""

_WARM_S = 1.0
"""After the busy time, the progress thread keeps a short sleep this long: an agent that
had work a moment ago (a server between two of an engine's saves) will likely have more."""

_WARM_SLEEP_S = 0.0001
"""The sleep between polls of a warm agent: the delay a notification meets there (a put's
commit waits for it), at about 2-3% of a core while it lasts."""

_IDLE_SLEEP_S = 0.001
"""The longest sleep between two polls of an idle agent: the delay a first notification
or (over TCP) a first one-sided op can meet at an idle target."""


def nixl_api() -> ModuleType:
    """NIXL's Python API (``nixl_cu12``, the CUDA 12 wheel, or the ``nixl`` package);
    ``ImportError`` when neither loads."""
    errors = []
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError(
        "NIXL is not installed (pip install --no-deps nixl-cu12): " + "; ".join(errors)
    )


def nixl_available() -> bool:
    """Whether NIXL's Python API imports here."""
    try:
        nixl_api()
    except ImportError:
        return False
    return True


class Agent:
    """A NIXL agent with the UCX backend; every call to ``nixl`` is made under ``lock``."""

    def __init__(self, name: str) -> None:
        os.environ.setdefault("UCX_MODULES", UCX_MODULES)
        api = nixl_api()
        logging.getLogger("nixl").setLevel(logging.WARNING)  # it logs each agent at INFO
        self.name = name
        self.lock = threading.Lock()
        config = api.nixl_agent_config(enable_prog_thread=True, backends=[])
        with _ENV_LOCK:  # one agent made at a time: the config class is swapped meanwhile
            bind = api.nixlBind
            plain = bind.nixlAgentConfig
            bind.nixlAgentConfig = _config_class(plain, PROGRESS_TIMEOUT)
            try:
                self.nixl: Any = api.nixl_agent(name, config)
            finally:
                bind.nixlAgentConfig = plain
        mode = os.environ.get("KVBRIDGE_NIXL_ERROR_HANDLING", ERROR_HANDLING)
        self.remote_completion_late = not _shared_memory_only(_transports())
        """Whether UCX may complete a write before its bytes landed (a network transport:
        UCX's put completes when its source may be reused); over shared memory alone
        (``cma``) the bytes are in the peer's memory when it completes."""
        with _ucx_environment(_ucx_settings()):
            self.nixl.create_backend("UCX", {"ucx_error_handling_mode": mode})

    def metadata(self) -> bytes:
        with self.lock:
            return bytes(self.nixl.get_agent_metadata())


def _config_class(plain: Any, delay: int) -> Any:
    """NIXL's agent config class, except that the progress thread's poll timeout its Python
    API sets (to 0) is ``delay`` instead."""

    class Config(plain):  # type: ignore[misc]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's name
            return int(plain.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _: int) -> None:  # noqa: N802
            plain.pthrDelay.__set__(self, delay)

    return Config


def _ucx_settings() -> dict[str, str]:
    """The UCX settings the agent's context is made with: ``UCX_TLS`` from
    ``KVBRIDGE_NIXL_UCX_TLS`` where set, and ``UCX_SEGMENTS`` where TCP may be used and
    the environment sets none of its own (UCX warns of a setting of a transport unused)."""
    tls = os.environ.get("KVBRIDGE_NIXL_UCX_TLS")
    settings = {} if tls is None else {"UCX_TLS": tls}
    if _uses_tcp(_transports()):
        settings.update({k: v for k, v in UCX_SEGMENTS.items() if k not in os.environ})
    return settings


def _transports() -> str:
    """The ``UCX_TLS`` the agent's UCX runs with (``all`` where none is set)."""
    return os.environ.get("KVBRIDGE_NIXL_UCX_TLS") or os.environ.get("UCX_TLS") or "all"


_SHARED_MEMORY = frozenset({"sm", "shm", "self", "posix", "sysv", "cma", "knem", "xpmem"})
"""UCX's transports within one host's memory (``UCX_TLS`` names)."""


def _shared_memory_only(tls: str) -> bool:
    """Whether ``UCX_TLS=tls`` allows shared-memory transports only."""
    return not tls.startswith("^") and set(tls.split(",")) <= _SHARED_MEMORY


def _uses_tcp(tls: str) -> bool:
    """Whether UCX may use TCP with ``UCX_TLS=tls`` (a list, or ``^`` and the excluded)."""
    if tls.startswith("^"):
        return "tcp" not in tls[1:].split(",")
    return any(name in ("all", "tcp") for name in tls.split(","))


@contextlib.contextmanager
def _ucx_environment(settings: dict[str, str]) -> Iterator[None]:
    """``settings`` in the environment while NIXL's UCX context is made (UCX reads them
    then, and NIXL takes no UCX settings of its own), as it was before afterwards: the
    ``nixl`` transport's UCX apart from the ``ucx`` one's."""
    if not settings:
        yield
        return
    with _ENV_LOCK:
        before = {name: os.environ.get(name) for name in settings}
        os.environ.update(settings)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value


class Progress:
    """The thread that polls the agent: ``poll()`` returns whether it found work (then it
    is called again soon). While ``expecting()`` is false (no transfer tracked, no peer
    linked: nothing can arrive) it sleeps until ``wake``. Started by ``start``, stopped and
    joined by ``close``."""

    def __init__(self, name: str, poll: Callable[[], bool], expecting: Callable[[], bool]) -> None:
        self._poll = poll
        self._expecting = expecting
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Work was posted: poll now."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        last_work = time.monotonic()
        while not self._stop.is_set():
            try:
                busy = self._poll()
            except Exception:  # a bug here must not end progress for every peer
                _log.exception("nixl: progress failed")
                busy = False
            now = time.monotonic()
            if busy:
                last_work = now
            quiet = now - last_work
            if quiet < _BUSY_S:
                time.sleep(_BUSY_SLEEP_S)  # the GIL is free for the threads that post and wait
            elif not self._expecting():  # nothing can arrive until work is posted or linked
                self._wake.wait()
                self._wake.clear()
            else:
                self._wake.wait(_WARM_SLEEP_S if quiet < _WARM_S else _IDLE_SLEEP_S)
                self._wake.clear()
