"""kvbridge.store.client: :class:`StoreClient`, a cache server with the surface of a local
``TieredStore``, moving blocks zero-copy with the transfer engine (``_registration``: a
caller's buffers registered for one call); :class:`ClientPool`, the clients of a connector
or a cluster client, with one rule for a client whose server failed; :class:`KeyMirror`,
a namespace's keys kept from its event stream (read through :class:`EventSubscriber`);
``SERVER_FAULTS``, what such a failure looks like; ``pages_of_blocks``, the check of a
zero-copy call's pages (the cluster client's too). Imports the wire; never ``server``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy

if TYPE_CHECKING:
    from ._client import SERVER_FAULTS, StoreClient
    from ._mirror import KeyMirror
    from ._pool import ClientPool, Lent
    from ._registration import pages_of_blocks
    from ._subscriber import EventSubscriber, SubscriptionLost

_LAZY = {
    "StoreClient": "._client",
    "SERVER_FAULTS": "._client",
    "ClientPool": "._pool",
    "Lent": "._pool",
    "KeyMirror": "._mirror",
    "EventSubscriber": "._subscriber",
    "SubscriptionLost": "._subscriber",
    "pages_of_blocks": "._registration",
}
"""Loaded on first use: the package's modules load the transfer engine (pyzmq, threads)."""

__getattr__ = lazy(__name__, _LAZY, globals())

__all__ = [
    "SERVER_FAULTS",
    "ClientPool",
    "EventSubscriber",
    "KeyMirror",
    "Lent",
    "StoreClient",
    "SubscriptionLost",
    "pages_of_blocks",
]
