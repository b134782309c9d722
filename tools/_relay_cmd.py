"""``kvbridge events HOST:PORT --namespace N --block-bytes B --block-tokens T --publish
tcp://HOST:PORT``: the namespace's stream republished for KV-aware routers (Dynamo's KV
indexer, llm-d's), until SIGINT or SIGTERM (``kvbridge.routing.Relay``; the format:
``docs/EVENTS.md``, "For routers").

It prints one JSON line once its sockets are bound (``{"publish", "replay", "topic"}``), and
one when it stops (what it relayed). The relay's sockets carry the namespace's token ids,
which are its prompts: bind them where only the router reaches them.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from typing import Any

import zmq

from kvbridge.routing import DEFAULT_MEDIA, Relay, Shape
from kvbridge.store import ConfigError, StoreClient, StoreError, read_secret
from kvbridge.transfer import TransferError

from ._fail import fail

_STATS_S = 10.0


def add_arguments(events: Any) -> None:
    relay = events.add_argument_group("republishing for routers (--publish)")
    relay.add_argument(
        "--publish", metavar="ENDPOINT", help="a ZMQ endpoint to bind a PUB socket at"
    )
    relay.add_argument("--replay", metavar="ENDPOINT", help="a ZMQ endpoint for replays")
    relay.add_argument(
        "--block-tokens", type=int, default=0, help="tokens per block (the engine's block size)"
    )
    relay.add_argument(
        "--topic", help="the topic frame (default: kv@kvbridge@NAMESPACE, llm-d's form)"
    )
    relay.add_argument(
        "--layout",
        choices=["array", "map"],
        default="array",
        help="events as arrays (llm-d, Dynamo) or maps tagged 'type' (vLLM >= 0.32, Dynamo)",
    )
    relay.add_argument(
        "--shared",
        action="store_true",
        help="the topic is another publisher's too (an llm-d pod's): never AllBlocksCleared",
    )
    relay.add_argument(
        "--medium",
        action="append",
        default=[],
        metavar="KVBRIDGE=ROUTER",
        help="rename a medium (default CPU=CPU, STORAGE=DISK, GPU=GPU); repeatable",
    )


def run(args: argparse.Namespace) -> int:
    """``kvbridge events --publish``: relay until a signal; its exit status."""
    try:
        shape = Shape(args.layout, _media(args.medium))
        secret = read_secret(args.secret_file) if args.secret_file else None
        if args.block_tokens <= 0:
            raise ConfigError("--publish needs --block-tokens (the engine's block size)")
        client = _client(args, secret)
        kept = client.block_tokens
        client.close()
        if not kept:
            raise ConfigError(
                f"namespace {args.namespace} keeps no token ids of {args.block_tokens} a block "
                "(another opener chose first): routers cannot index it"
            )
        topic = (args.topic or f"kv@kvbridge@{args.namespace}").encode()
        relay = Relay(
            lambda: _client(args, secret),
            publish=args.publish,
            replay=args.replay,
            topic=topic,
            shape=shape,
            shared=args.shared,
        )
    except (ConfigError, OSError, StoreError, TransferError, ValueError, zmq.ZMQError) as exc:
        return fail("kvbridge events", exc, 1)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        started = {"publish": relay.endpoint, "replay": relay.replay_endpoint}
        print(json.dumps({**started, "topic": topic.decode()}), flush=True)
        while not stop.wait(_STATS_S):
            print(json.dumps({"stats": vars(relay.stats), "blocks": relay.blocks}), flush=True)
        return 0
    finally:
        relay.close()
        print(json.dumps({"stopped": vars(relay.stats), "blocks": relay.blocks}), flush=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _client(args: argparse.Namespace, secret: bytes | None) -> StoreClient:
    return StoreClient(
        args.address,
        block_bytes=args.block_bytes,
        namespace=args.namespace,
        secret=secret,
        tenant=args.tenant,
        timeout=10.0,
        block_tokens=args.block_tokens,
    )


def _media(renames: list[str]) -> dict[str, str]:
    media = dict(DEFAULT_MEDIA)
    for rename in renames:
        ours, _, theirs = rename.partition("=")
        if not ours or not theirs:
            raise ConfigError(f"--medium {rename!r}: KVBRIDGE=ROUTER, e.g. STORAGE=DISK")
        media[ours] = theirs
    return media
