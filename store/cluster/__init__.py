"""kvbridge.store.cluster: cache servers found in etcd, used as one store.

``_etcd`` (a standard-library etcd v3 client over its JSON gateway), ``_membership``
(a server's record under a lease; a client's live view of the members), ``_join`` (where
a cluster lives in etcd, and ``kvbridge serve --cluster``), ``_rendezvous`` (the owners of
a key), ``_client`` (:class:`ClusterClient`, its members' clients in a ``ClientPool``), ``_parts``
(how a call is split among members), ``_mirror`` (:class:`ClusterMirror`: a namespace's
keys over every member, from their event streams).
Imports ``client``; never ``server``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy

if TYPE_CHECKING:
    from ._client import ClusterClient, ClusterRegion
    from ._etcd import EtcdError, EtcdGateway, EtcdUnavailable
    from ._join import DEFAULT_CLUSTER, join, members_prefix
    from ._membership import Member, Membership, Registrar
    from ._mirror import ClusterMirror
    from ._rendezvous import Rendezvous

_LAZY = {
    "ClusterClient": "._client",
    "ClusterRegion": "._client",
    "EtcdError": "._etcd",
    "EtcdGateway": "._etcd",
    "EtcdUnavailable": "._etcd",
    "DEFAULT_CLUSTER": "._join",
    "join": "._join",
    "members_prefix": "._join",
    "Member": "._membership",
    "Membership": "._membership",
    "Registrar": "._membership",
    "ClusterMirror": "._mirror",
    "Rendezvous": "._rendezvous",
}
"""Loaded on first use: the package's modules load the transfer engine (pyzmq, threads)."""

__getattr__ = lazy(__name__, _LAZY, globals())

__all__ = [
    "DEFAULT_CLUSTER",
    "ClusterClient",
    "ClusterMirror",
    "ClusterRegion",
    "EtcdError",
    "EtcdGateway",
    "EtcdUnavailable",
    "Member",
    "Membership",
    "Registrar",
    "Rendezvous",
    "join",
    "members_prefix",
]
