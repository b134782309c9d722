"""``kvbridge events HOST:PORT --namespace N --block-bytes B``: a namespace's event stream
as JSON lines (``docs/EVENTS.md``), for a router author or an operator to watch.

Each message is one line: ``{"seq", "ts", "events": [{"type", "block_hashes" (hex),
"medium", and for a chain saved with its token ids "parent_block_hash" (hex), "token_ids",
"block_size"}]}``; ``--snapshot`` first prints the namespace's keys (``{"snapshot": {"seq",
"keys"}}``), ``--heartbeats`` the heartbeats too. A gap in the numbers is printed as
``{"gap": {"after", "seq"}}``: the reader then needs a snapshot. The command subscribes
again when the stream falls silent (the server restarted, the namespace left it). With
``--publish`` it republishes the stream for KV-aware routers instead (``_relay_cmd``).
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from typing import Any

from kvbridge.store import (
    ConfigError,
    EventSubscriber,
    MalformedEvent,
    Message,
    StoreClient,
    StoreError,
    SubscriptionLost,
    read_secret,
)
from kvbridge.transfer import TransferError

from . import _relay_cmd
from ._fail import fail

_SILENCE_S = 3.0


def add_parser(commands: Any) -> None:
    events = commands.add_parser(
        "events",
        help="print a namespace's event stream as JSON lines",
        description="Subscribe to a namespace's event stream (kvbridge serve --events-port) "
        "and print each message as a JSON line until SIGINT, SIGTERM or --count messages. "
        "Opening the namespace creates it if it does not exist.",
    )
    events.add_argument("address", help="host:port of the cache server")
    events.add_argument("--namespace", required=True, help="the namespace's name")
    events.add_argument("--block-bytes", type=int, required=True, help="its block size")
    events.add_argument("--secret-file", help="file holding the server's (or tenant's) secret")
    events.add_argument("--tenant", default="", help="the tenant the secret is of")
    events.add_argument("--snapshot", action="store_true", help="print the keys first")
    events.add_argument("--heartbeats", action="store_true", help="print heartbeats too")
    events.add_argument("--count", type=int, help="stop after this many messages")
    _relay_cmd.add_arguments(events)
    events.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.publish is not None:
        return _relay_cmd.run(args)
    try:
        secret = read_secret(args.secret_file) if args.secret_file else None
        client = StoreClient(
            args.address,
            block_bytes=args.block_bytes,
            namespace=args.namespace,
            secret=secret,
            tenant=args.tenant,
            timeout=10.0,
        )
    except (ConfigError, OSError, StoreError, TransferError, ValueError) as exc:
        return fail("kvbridge events", exc, 1)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _print_stream(client, args, stop)
    except (StoreError, TransferError, OSError) as exc:
        return fail("kvbridge events", exc, 1)
    finally:
        client.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _print_stream(client: StoreClient, args: argparse.Namespace, stop: threading.Event) -> int:
    printed = 0
    snapshot = args.snapshot
    while not stop.is_set():
        last: int | None = None
        silent_since = time.monotonic()
        with EventSubscriber(client.subscription()) as stream:
            while not stop.is_set() and time.monotonic() - silent_since < _SILENCE_S:
                try:
                    message = stream.receive(0.25)
                except MalformedEvent as exc:
                    _emit({"malformed": str(exc)})
                    continue
                except SubscriptionLost:
                    break  # subscribe again
                if message is None:
                    continue
                silent_since = time.monotonic()
                if snapshot:
                    shot = client.snapshot()
                    _emit({"snapshot": {"seq": shot.seq, "keys": [k.hex() for k in shot.keys]}})
                    snapshot, last = False, shot.seq
                last = _show(message, last, args.heartbeats)
                printed += bool(message.events)
                if args.count is not None and printed >= args.count:
                    return 0
    return 0


def _show(message: Message, last: int | None, heartbeats: bool) -> int:
    """Print one message (and a gap before it); the last sequence number seen."""
    news = bool(message.events)
    if last is not None and message.seq > last + (1 if news else 0):
        _emit({"gap": {"after": last, "seq": message.seq}})
    if news or heartbeats:
        _emit({"seq": message.seq, "ts": message.ts, "events": [_event(e) for e in message.events]})
    return max(message.seq, last or 0)


def _event(event: dict[str, object]) -> dict[str, object]:
    """An event as JSON takes it: keys (the hashes, a chain's parent) in hex."""
    shown = dict(event)
    hashes = event.get("block_hashes")
    if isinstance(hashes, list):
        shown["block_hashes"] = [h.hex() if isinstance(h, bytes) else h for h in hashes]
    parent = event.get("parent_block_hash")
    if isinstance(parent, bytes):
        shown["parent_block_hash"] = parent.hex()
    return shown


def _emit(line: dict[str, object]) -> None:
    print(json.dumps(line), flush=True)
