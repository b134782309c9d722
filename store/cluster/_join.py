"""Where a cluster lives in etcd, and a server joining it.

A cluster named ``NAME`` keeps one record per server under ``/kvbridge/NAME/members/``,
keyed by the address clients reach the server at (``--advertise``, else its own address),
so that a server restarted on the same address takes its old place (and, by rendezvous
hashing, the same keys).
"""

from __future__ import annotations

from ._etcd import EtcdGateway
from ._membership import Member, Registrar

__all__ = ["DEFAULT_CLUSTER", "join", "members_prefix"]

DEFAULT_CLUSTER = "kvbridge"

LEASE_TTL_S = 3
"""A killed server's record outlives it by at most this (plus a keep-alive period)."""


def members_prefix(cluster: str) -> bytes:
    if not cluster or "/" in cluster:
        raise ValueError(f"a cluster name is a non-empty word without '/', not {cluster!r}")
    return f"/kvbridge/{cluster}/members/".encode()


def join(url: str, cluster: str, address: str, capacity: int) -> Registrar:
    """Register a server at ``address`` in the cluster ``cluster`` of the etcd at ``url``
    and keep it registered (``stop()`` the registrar to leave). Raises ``ValueError`` for a
    bad URL or name and ``EtcdUnavailable`` when etcd does not answer."""
    gateway = EtcdGateway.from_url(url)
    member = Member(address, address, capacity)
    Member.from_record(member.to_record())  # the record clients will read must parse
    registrar = Registrar(
        gateway, members_prefix(cluster) + address.encode(), member.to_record(), LEASE_TTL_S
    )
    registrar.start()
    return registrar
