"""The cache server an engine runs for itself when no ``server`` is configured.

vLLM runs its scheduler and its worker in different processes (``vllm serve``), and both
must see the same store: the scheduler to look up prefixes, the worker to move the bytes.
So the worker runs a :class:`~kvbridge.store.CacheServer` on loopback with a fresh secret,
and the scheduler connects to it with what vLLM's handshake metadata carries to it.
"""

from __future__ import annotations

import secrets

from ...store import CacheServer, ServerConfig
from ._config import ConnectorConfig


def embedded_server(config: ConnectorConfig) -> CacheServer:
    """A server on 127.0.0.1 (a free port) holding ``config``'s host memory and disk; one
    namespace per model layout, no handoff holds (nothing is pushed for a peer here)."""
    return CacheServer(
        ServerConfig(
            host="127.0.0.1",
            port=0,
            host_capacity=config.host_capacity,
            disk_path=config.disk_path,
            disk_capacity=config.disk_capacity,
            max_namespaces=1,
            handoff_ttl=0.0,
            transports=(config.transports,),
            secret=secrets.token_bytes(32),
        )
    )
