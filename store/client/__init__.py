"""kvbridge.store.client: :class:`StoreClient`, a cache server with the surface of a local
``TieredStore``, moving blocks zero-copy with the transfer engine (``_registration``: a
caller's buffers registered for one call). Imports the wire; never ``server``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy

if TYPE_CHECKING:
    from ._client import StoreClient

_LAZY = {
    "StoreClient": "._client",
}
"""Loaded on first use: the package's modules load the transfer engine (pyzmq, threads)."""

__getattr__ = lazy(__name__, _LAZY, globals())

__all__ = ["StoreClient"]
