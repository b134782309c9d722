"""``kvbridge proxy --route kv``: each request's prefill instance chosen by where its prompt's
prefix is cached, then by load.

Where: a ``PrefixIndex`` fed by every prefill instance's own KV events (its GPU prefix
cache; vLLM's ``--kv-events-config`` publisher connects to the endpoint the proxy binds for
it) and, optionally, by a relay of kvbridge's shared tiers (``kvbridge events --publish``),
whose blocks any instance can load. An instance's score is the prompt's leading tokens it
holds itself or can load from the shared tiers, whichever is more. Among the healthy
instances no more than ``KV_SLACK`` (``_proxy_settings``) requests busier than the least
busy, the one with the highest score takes the request (ties: the least loaded), so a
popular prefix does not pile every request on one instance.

Prompts are read as token ids (``prompt`` a list of ints, or a list of one); a text prompt,
a chat, or a batch of several prompts is routed by load alone and counted.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kvbridge._closing import Closing
from kvbridge.routing import EventFollower, PrefixIndex, Source

SHARED = "kvbridge"
"""The index's name for the shared tiers' source."""


class KvRouting(Closing):
    """The index and the thread that feeds it (started here, joined by :meth:`close`)."""

    def __init__(
        self,
        block_size: int,
        instances: Mapping[str, str],
        shared: tuple[str, str | None] | None = None,
    ) -> None:
        """``instances``: a prefill URL -> the endpoint the proxy binds for its events;
        ``shared``: the relay's endpoint and replay endpoint."""
        self.block_size = block_size
        self._index = PrefixIndex(block_size)
        self._lock = threading.Lock()
        sources = [Source(url, endpoint, bind=True) for url, endpoint in instances.items()]
        if shared is not None:
            sources.append(Source(SHARED, shared[0], replay=shared[1]))
        self._follower = EventFollower(self._index, sources, self._lock)

    @property
    def endpoints(self) -> dict[str, str]:
        """Per prefill URL, the endpoint bound for its events (``tcp://host:0`` made one)."""
        return dict(self._follower.bound)

    def scores(self, body: Mapping[str, Any]) -> dict[str, int] | None:
        """Per instance URL, the prompt's leading tokens it holds or can load; ``None`` for
        a prompt that is not token ids (routed by load alone)."""
        tokens = _token_ids(body.get("prompt"))
        if tokens is None:
            return None
        with self._lock:
            matched = self._index.matched(tokens)
        shared = matched.pop(SHARED, 0)
        return {url: max(held, shared) for url, held in matched.items()} | {"": shared}

    def close(self) -> None:
        self._follower.close()


def _token_ids(prompt: Any) -> list[int] | None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None
