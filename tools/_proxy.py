"""``kvbridge proxy``: an OpenAI-compatible front for prefill/decode disaggregation.

Each completion (``/v1/completions``, ``/v1/chat/completions``) goes first to a prefill
instance with ``max_tokens=1`` (it computes the prompt, and its kvbridge connector saves the
prompt's blocks), then to a decode instance with the ``kv_transfer_params`` the prefill's
answer carried (its connector waits for those blocks and loads them); the decode's answer
streams back as it comes. A prefill that fails costs time only: the request goes to decode
without parameters, and decode computes the prompt itself.

With several instances per role, each request goes to the least-loaded healthy one; an
instance leaves the rotation while it fails its health check (``GET /health``). The proxy
answers ``/v1/models``, ``/health`` and ``/metrics`` too. The parts: ``_proxy_settings``
(flags' limits), ``_proxy_upstreams`` + ``_proxy_health`` (instances, routing, health),
``_proxy_forward`` (the two hops), ``_proxy_metrics``, ``_proxy_clients`` (client
connections: deadlines and a cap), ``_proxy_log`` (a log bounded in rate that never
blocks), ``_proxy_app`` (routes, server).
HTTP: aiohttp (client and server, streaming), the ``proxy`` extra; this module imports it
only to run, so the ``kvbridge`` command works without it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvbridge.transfer import raise_open_files

from ._fail import fail
from ._proxy_settings import (
    DEFAULT_CONNECTIONS_PER_INSTANCE,
    DEFAULT_HEAD_TIMEOUT,
    DEFAULT_HEALTH_INTERVAL,
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_BODY,
    DEFAULT_PREFILL_TIMEOUT,
    ProxySettings,
    SettingError,
    client_room,
    files_reserve,
    soft_open_files,
    upstream_url,
    upstream_urls,
)

if TYPE_CHECKING:
    from aiohttp import web

    from ._proxy_kv import KvRouting

_log = logging.getLogger("kvbridge.proxy")

_PREFIX = "kvbridge proxy"
_FLAGS = {
    "max_body": "--max-body-size",
    "connections_per_instance": "--connections-per-instance",
    "prefill_timeout": "--prefill-timeout",
    "health_interval": "--health-interval",
    "health_timeout": "--health-timeout",
    "head_timeout": "--head-timeout",
    "idle_timeout": "--idle-timeout",
    "max_clients": "--max-client-connections",
}
_CLIENT_FILES = 4096
"""Client connections the proxy makes room for when it raises its open-files limit (beyond
``files_reserve``: upstream connections, health checks, its own)."""


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "proxy",
        help="OpenAI-compatible front for prefill and decode vLLM instances",
        description="Send each completion to a prefill instance (max_tokens=1), then to a "
        "decode instance with the prefill's kv_transfer_params; stream the decode's answer. "
        "Each role may have several instances: a request goes to the least-loaded healthy one.",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}",
            action="append",
            required=True,
            metavar="URL",
            help=f"a {role} instance, http://host:port (repeat for several)",
        )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    _add_routing(parser)
    _add_limits(parser)
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.set_defaults(run=run)


def _add_routing(parser: argparse.ArgumentParser) -> None:
    routing = parser.add_argument_group("choosing the prefill instance (--route kv)")
    routing.add_argument(
        "--route",
        choices=("least-loaded", "kv"),
        default="least-loaded",
        help="least-loaded (the default), or kv: where the prompt's prefix is cached first",
    )
    routing.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT",
        help="a prefill instance's KV events: the proxy binds ENDPOINT (tcp://host:port), the "
        "instance's --kv-events-config names it as its endpoint; one per prefill instance",
    )
    routing.add_argument(
        "--kvbridge-events",
        metavar="ENDPOINT[,REPLAY]",
        help="the shared tiers' events: a `kvbridge events --publish` relay's endpoints "
        "(only where the prefill instances load from kvbridge: kv_both)",
    )
    routing.add_argument(
        "--block-size", type=int, default=0, help="the instances' block size, in tokens"
    )


def _add_limits(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-body-size",
        default=f"{DEFAULT_MAX_BODY >> 20}MiB",
        metavar="SIZE",
        help="larger request bodies are refused with 413 (default %(default)s)",
    )
    parser.add_argument(
        "--connections-per-instance",
        type=int,
        default=DEFAULT_CONNECTIONS_PER_INSTANCE,
        metavar="N",
        help="upstream connections to one instance at most (default %(default)s)",
    )
    parser.add_argument(
        "--max-client-connections",
        type=int,
        default=None,
        metavar="N",
        help="client connections at most; past it the quietest waiting one is closed "
        "(default: what the open-files limit leaves after the upstream connections)",
    )
    seconds: list[tuple[str, float, str]] = [
        ("--prefill-timeout", DEFAULT_PREFILL_TIMEOUT, "a prefill longer than this falls back"),
        ("--health-interval", DEFAULT_HEALTH_INTERVAL, "between health checks of an instance"),
        ("--health-timeout", DEFAULT_HEALTH_TIMEOUT, "a health check longer than this fails"),
        (
            "--head-timeout",
            DEFAULT_HEAD_TIMEOUT,
            "a client's request head must be whole within this, and its body never pause longer",
        ),
        (
            "--idle-timeout",
            DEFAULT_IDLE_TIMEOUT,
            "an idle keep-alive client connection is closed after this long",
        ),
    ]
    for flag, default, text in seconds:
        parser.add_argument(
            flag, type=float, default=default, metavar="SECONDS", help=f"{text} (%(default)s)"
        )


def run(args: argparse.Namespace) -> int:
    try:
        settings, prefill, decode = _checked(args)
    except ValueError as exc:
        return fail(_PREFIX, exc)
    try:
        from ._proxy_app import make_app, serve  # noqa: PLC0415  (aiohttp: the optional extra)
    except ImportError:
        return fail(_PREFIX, "needs aiohttp: pip install 'kvbridge[proxy]'")
    from ._proxy_log import ProxyLog  # noqa: PLC0415

    with ProxyLog(getattr(logging, args.log_level.upper())):
        settings = _fitted(settings, len(prefill) + len(decode))
        try:
            kv = _kv_routing(args, prefill)
        except (ValueError, OSError) as exc:  # a bad flag, or an endpoint it cannot bind
            return fail(_PREFIX, exc)
        try:
            app = make_app(prefill, decode, settings, kv)
            asyncio.run(serve(app, args.host, args.port, _announce))
        except OSError as exc:
            return fail(_PREFIX, f"cannot listen on {args.host}:{args.port}: {exc}")
        finally:
            if kv is not None:
                kv.close()
    return 0


def _kv_routing(args: argparse.Namespace, prefill: list[str]) -> KvRouting | None:
    """``--route kv``'s index and its event sources, from the flags (``ValueError`` names a
    missing or bad one); ``None`` for ``--route least-loaded``."""
    if args.route != "kv":
        return None
    if args.block_size <= 0:
        raise ValueError("--route kv needs --block-size (the instances' block size, in tokens)")
    endpoints: dict[str, str] = {}
    for given in args.kv_events:
        named, _, endpoint = given.partition("=")
        url = upstream_url(named)
        if url not in prefill or not endpoint.startswith("tcp://"):
            raise ValueError(f"--kv-events {given!r}: a --prefill URL=tcp://host:port")
        endpoints[url] = endpoint
    missing = [url for url in prefill if url not in endpoints]
    if missing:
        raise ValueError(f"--route kv: no --kv-events for {', '.join(missing)}")
    shared = None
    if args.kvbridge_events:
        publish, _, replay = args.kvbridge_events.partition(",")
        shared = (publish, replay or None)
    from ._proxy_kv import KvRouting  # noqa: PLC0415  (--route kv only)

    return KvRouting(args.block_size, endpoints, shared)


def _fitted(settings: ProxySettings, instances: int) -> ProxySettings:
    """``settings`` with the client connections cap the open-files limit (raised first)
    leaves room for; a ``--max-client-connections`` that does not fit is lowered, saying so."""
    upstream = instances * settings.connections_per_instance
    files = _raise_open_files(files_reserve(upstream, instances) + _CLIENT_FILES, upstream)
    room = client_room(files, upstream, instances)
    if settings.max_clients is not None and settings.max_clients > room:
        _log.warning(
            "--max-client-connections %d does not fit in the open-files limit: %d instead",
            settings.max_clients,
            room,
        )
    cap = room if settings.max_clients is None else min(room, settings.max_clients)
    return dataclasses.replace(settings, max_clients=cap)


def make_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    settings: ProxySettings | None = None,
    kv: KvRouting | None = None,
) -> web.Application:
    """The proxy as an aiohttp application (``_proxy_app.make_app``, loaded on first use)."""
    from ._proxy_app import make_app as make  # noqa: PLC0415

    return make(prefill, decode, settings, kv)


def _checked(args: argparse.Namespace) -> tuple[ProxySettings, list[str], list[str]]:
    """The settings and instance URLs the flags give; ``ValueError`` names a bad one."""
    from kvbridge.store import parse_size  # noqa: PLC0415

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    try:
        max_body = parse_size(args.max_body_size)
    except ValueError as exc:
        raise ValueError(f"--max-body-size: {exc}") from None
    try:
        settings = ProxySettings(
            max_body=max_body,
            connections_per_instance=args.connections_per_instance,
            prefill_timeout=args.prefill_timeout,
            health_interval=args.health_interval,
            health_timeout=args.health_timeout,
            head_timeout=args.head_timeout,
            idle_timeout=args.idle_timeout,
            max_clients=args.max_client_connections,
        )
    except SettingError as exc:
        raise ValueError(f"{_FLAGS[exc.name]} {exc.problem}") from None
    return settings, upstream_urls("prefill", args.prefill), upstream_urls("decode", args.decode)


def _announce(url: str) -> None:
    print(f"kvbridge proxy listening on {url}", flush=True)


def _raise_open_files(wanted: int, connections: int) -> int:
    """Raise the soft open-files limit to ``wanted`` (room for every upstream connection,
    as vLLM raises its own, and for clients); warn when the hard limit is lower. The soft
    limit, as it is now."""
    limit = raise_open_files(wanted)
    if limit is None:
        return soft_open_files()
    if limit < wanted:
        _log.warning(
            "open files are limited to %d; %d upstream connections and clients may not fit",
            limit,
            connections,
        )
    return limit
