"""A KV-aware router as Dynamo's indexer and llm-d's read a publisher, for the relay's
tests: a SUB socket to the publisher and a DEALER to its replay socket; messages applied in
number order (a number at or below the last applied is dropped, as Dynamo does); a number
ahead asks for a replay from the one expected; events decoded in llm-d's positional
layout (or maps); blocks kept by hash with their parent, tokens and medium, as the
routers' trees keep them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class Block:
    parent: int | None
    tokens: tuple[int, ...]
    medium: str


class RouterModel:
    def __init__(self, endpoint: str, replay: str | None, block_size: int) -> None:
        context: zmq.Context[Any] = zmq.Context.instance()
        self._sub: zmq.Socket[bytes] = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay is not None:
            self._replay = context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay)
        self._block_size = block_size
        self.blocks: dict[int, Block] = {}
        self.last: int | None = None
        self.topics: set[bytes] = set()
        self.replays = 0
        self.cleared = 0
        self._dropping = 0

    def poll(self, seconds: float = 0.1) -> None:
        """Apply what arrived within ``seconds`` (a gap: its replay first)."""
        if not self._sub.poll(int(seconds * 1000)):
            return
        while self._sub.poll(0):
            topic, seq_bytes, payload = self._sub.recv_multipart()
            if self._dropping:  # lost on the way, as a full queue loses them
                self._dropping -= 1
                continue
            self.topics.add(topic)
            seq = int.from_bytes(seq_bytes, "big")
            expected = 0 if self.last is None else self.last + 1
            if seq > expected and self._replay is not None:
                self._replay_from(expected)
            self._apply(seq, payload)

    def drop_next(self, count: int) -> None:
        """Lose the next ``count`` messages (the router then replays what it missed)."""
        self._dropping = count

    def matched(self, tokens: list[int]) -> int:
        """Tokens of ``tokens`` whose blocks the router holds as a chain from the root,
        counted a whole block at a time (what ``/query`` answers)."""
        by_tokens = {(b.parent, b.tokens): h for h, b in self.blocks.items()}
        parent: int | None = None
        size = self._block_size
        for n in range(len(tokens) // size):
            found = by_tokens.get((parent, tuple(tokens[n * size : (n + 1) * size])))
            if found is None:
                return n * size
            parent = found
        return len(tokens) // size * size

    def close(self) -> None:
        self._sub.close()
        if self._replay is not None:
            self._replay.close()

    def _replay_from(self, start: int) -> None:
        assert self._replay is not None
        self.replays += 1
        self._replay.send_multipart([b"", start.to_bytes(8, "big")])
        while self._replay.poll(5000):
            frames = self._replay.recv_multipart()
            _, _, seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                return
            self._apply(int.from_bytes(seq_bytes, "big"), payload)
        raise AssertionError("a replay without its end marker")

    def _apply(self, seq: int, payload: bytes) -> None:
        if self.last is not None and seq <= self.last:
            return
        self.last = seq
        _, events, _ = msgpack.unpackb(payload, raw=False)
        for event in events:
            self._event(event if isinstance(event, list) else _positional(event))

    def _event(self, event: list[Any]) -> None:
        kind = event[0]
        if kind == "AllBlocksCleared":
            self.cleared += 1
            self.blocks.clear()
        elif kind == "BlockRemoved":
            for h in event[1]:
                self.blocks.pop(h, None)
        else:
            _, hashes, parent, tokens, size, _, medium, _ = event[:8]
            assert size == self._block_size and len(tokens) == size * len(hashes)
            assert all(type(h) is int and 0 <= h < 1 << 64 for h in hashes)
            for n, h in enumerate(hashes):
                self.blocks[h] = Block(parent, tuple(tokens[n * size : (n + 1) * size]), medium)
                parent = h


def _positional(event: dict[str, Any]) -> list[Any]:
    kind = event["type"]
    if kind == "AllBlocksCleared":
        return [kind]
    if kind == "BlockRemoved":
        return [kind, event["block_hashes"], event["medium"]]
    names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
    return [kind, *(event[n] for n in names), event["medium"], event["lora_name"]]
