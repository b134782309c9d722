"""``kvbridge serve``: the cache server in the foreground (and the parser of ``kvbridge stats``,
which ``_stats_cmd`` runs)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import IO, TYPE_CHECKING, Any

import zmq

from kvbridge.store import (
    DEFAULT_PORT,
    CacheServer,
    ConfigError,
    StoreError,
    load_config,
)
from kvbridge.transfer import TransferError, raise_open_files

from ._fail import fail
from ._stats_cmd import stats_command

_log = logging.getLogger("kvbridge.server")

if TYPE_CHECKING:
    from kvbridge.store.cluster import Registrar

_START_ERRORS = (StoreError, TransferError, OSError, ValueError, zmq.ZMQError)
"""What starting a server may raise for a reason the user can fix: a port in use (zmq
reports a failed bind as ``ZMQError``), a transport this machine lacks, a disk tier."""


_TRANSPORTS_HELP = (
    "comma-separated: tcp, ucx, nixl (one-sided: trusted clients only, no --tenants), "
    "auto (default tcp)"
)


def add_parsers(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="run a cache server",
        description="Run a cache server until SIGTERM or SIGINT. Settings: flags, then "
        "--config FILE (TOML), then KVBRIDGE_* variables, then defaults (host memory only, "
        f"127.0.0.1:{DEFAULT_PORT}).",
    )
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help=f"control port (default {DEFAULT_PORT})")
    serve.add_argument(
        "--data-port", type=int, help="TCP data streams' port (default 0: any free port)"
    )
    serve.add_argument("--host-capacity", help="host memory, e.g. 4GiB (default 2GiB)")
    serve.add_argument("--disk-path", help="directory of the disk tier (LMDB)")
    serve.add_argument("--disk-capacity", help="disk tier size, e.g. 100GiB")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    serve.add_argument(
        "--events-port",
        type=int,
        help="publish the namespaces' event streams on this port (docs/EVENTS.md; 0: any)",
    )
    serve.add_argument(
        "--events-hwm",
        type=int,
        help="messages queued per event subscriber at most (1000; its bytes bound them first)",
    )
    serve.add_argument(
        "--events-queue-bytes",
        help="bytes queued per event subscriber before it is dropped, e.g. 2MiB (2MiB)",
    )
    serve.add_argument(
        "--events-memory",
        help="bytes every event subscriber together may hold, e.g. 256MiB (256MiB)",
    )
    serve.add_argument("--max-namespaces", type=int, help="namespaces at once (default 4)")
    serve.add_argument("--lease-ttl", type=float, help="seconds a lease lasts (default 60)")
    serve.add_argument(
        "--max-leases-per-client",
        type=int,
        help="open leases one client session may hold (default 256)",
    )
    serve.add_argument(
        "--handoff-ttl", type=float, help="seconds a new block is held for its first read (5)"
    )
    serve.add_argument(
        "--write-only-alarm",
        type=float,
        help="seconds a namespace may store while it delivers no block before it is logged "
        "and gauged as write-only (600; 0: never)",
    )
    serve.add_argument("--transports", help=_TRANSPORTS_HELP)
    serve.add_argument(
        "--keepalive",
        type=float,
        metavar="SECONDS",
        help="an idle client's streams send a frame this often; silent for 3 of them, its "
        "session ends (default 5; 0: off)",
    )
    serve.add_argument("--policy", help="eviction policy: reuse (default), lru, fifo")
    serve.add_argument("--secret-file", help="file holding the shared secret clients must know")
    serve.add_argument(
        "--tenants",
        dest="tenants_file",
        metavar="FILE",
        help="TOML file of tenants, each with its own secret, namespace prefixes, access and "
        "shares (the shared secret then opens only the metrics)",
    )
    serve.add_argument(
        "--insecure",
        action="store_const",
        const=True,
        help="allow binding beyond loopback without a secret",
    )
    serve.add_argument(
        "--cluster", help="join the cluster of this etcd: etcd://HOST:PORT[,HOST:PORT...]"
    )
    serve.add_argument("--cluster-name", default="kvbridge", help="cluster name (kvbridge)")
    serve.add_argument("--advertise", help="HOST:PORT clients reach this server at")
    serve.add_argument("--config", help="TOML settings file")
    serve.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="server log on stderr, one line per event (default INFO)",
    )
    serve.set_defaults(run=_serve)

    stats = commands.add_parser("stats", help="print a cache server's figures")
    stats.add_argument(
        "address",
        nargs="?",
        default=f"127.0.0.1:{DEFAULT_PORT}",
        help="host:port of the server, or etcd://HOST:PORT for a whole cluster",
    )
    stats.add_argument("--secret-file", help="file holding the server's shared secret")
    stats.add_argument("--tenant", default="", help="the tenant the secret is of (--tenants)")
    stats.add_argument("--transports", default="tcp", help=_TRANSPORTS_HELP)
    stats.add_argument("--cluster-name", default="kvbridge", help="with etcd://: the cluster")
    stats.set_defaults(run=stats_command)


def _serve(args: argparse.Namespace) -> int:
    names = [
        *("host", "port", "data_port", "metrics_port", "events_port", "events_hwm"),
        *("events_queue_bytes", "events_memory"),
        *("host_capacity", "disk_path", "disk_capacity"),
        *("max_namespaces", "lease_ttl", "transports", "secret_file", "insecure", "policy"),
        *("tenants_file", "handoff_ttl", "max_leases_per_client", "keepalive"),
        "write_only_alarm",
    ]
    try:
        config = load_config({name: getattr(args, name) for name in names}, args.config)
    except (ConfigError, OSError) as exc:
        return fail("kvbridge serve", exc)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    files = raise_open_files()  # every connection is a descriptor: the hard limit, not 1,024
    try:
        server = CacheServer(config)
    except _START_ERRORS as exc:
        return fail("kvbridge serve", f"cannot start: {type(exc).__name__}: {exc}")
    _log.info("open files: %s", "unlimited" if files is None else files)
    try:
        membership = _join(args, server.address, config.host_capacity)
    except (ValueError, OSError) as exc:
        server.close()
        return fail("kvbridge serve", f"--cluster: {exc}")
    stop = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        metrics = f", metrics on :{server.metrics_port}" if server.metrics_port else ""
        metrics += f", events on :{server.events_port}" if server.events_port else ""
        disk = f", disk {config.disk_path}" if config.disk_path else ""
        print(
            f"{LISTENING}{server.address} ({config.host_capacity >> 20} MiB host{disk}{metrics})",
            flush=True,
        )
        stop.wait()
    finally:
        if membership is not None:
            membership.stop()  # leave the cluster first: clients stop sending here
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("kvbridge serve: stopped", flush=True)
    return 0


def _join(args: argparse.Namespace, address: str, capacity: int) -> Registrar | None:
    """Register in the cluster named by ``--cluster`` (etcd is imported only then)."""
    if args.cluster is None:
        return None
    from kvbridge.store.cluster import (  # noqa: PLC0415 - only with --cluster
        EtcdError,
        EtcdUnavailable,
        join,
    )

    try:
        return join(args.cluster, args.cluster_name, args.advertise or address, capacity)
    except EtcdUnavailable as exc:
        raise ConnectionError(f"cannot reach etcd: {exc}") from None
    except EtcdError as exc:  # etcd answered, but refused (its auth, a bad request)
        raise ConnectionError(f"etcd refused the registration: {exc}") from None


LISTENING = "kvbridge serve: listening on "


def read_listening(stdout: IO[str]) -> tuple[str, str]:
    """The ``host:port`` a ``kvbridge serve`` child announced, and the announcing line;
    other lines (UCX prints its warnings on stdout) are skipped."""
    for line in stdout:
        if line.startswith(LISTENING):
            return line[len(LISTENING) :].split()[0], line
    raise RuntimeError("the cache server exited before it was listening")
