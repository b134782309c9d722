"""``kvbridge stats etcd://...``: every member of a cluster, then the cluster's totals."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from kvbridge.store.cluster import (
    EtcdError,
    EtcdGateway,
    EtcdUnavailable,
    Member,
    members_prefix,
)
from kvbridge.transfer import TransferError

Figures = dict[str, Any] | str
"""A member's stats, or why it did not answer."""

_SUMMED = ("hits", "misses", "puts", "duplicates", "bytes_in", "bytes_out", "evictions")


def cluster_members(url: str, cluster: str) -> list[Member]:
    """The members etcd lists now (records that do not parse are left out); raises
    ``ConnectionError`` when etcd cannot be reached."""
    try:
        _, records = EtcdGateway.from_url(url).get_prefix(members_prefix(cluster))
    except (EtcdUnavailable, EtcdError) as exc:
        raise ConnectionError(f"cannot read the cluster from etcd: {exc}") from None
    members = []
    for data in records.values():
        try:
            members.append(Member.from_record(data))
        except ValueError:
            continue
    return sorted(members, key=lambda m: m.name)


def format_cluster(url: str, cluster: str, stats: list[tuple[Member, dict[str, Any] | str]]) -> str:
    """Each member's figures (or why it did not answer), then the totals of those that did."""
    from ._serve_cmds import format_stats  # noqa: PLC0415 - one formatter for both

    lines = [f"cluster {cluster!r} in {url}: {len(stats)} member(s)", ""]
    totals = dict.fromkeys(_SUMMED, 0)
    blocks = answered = 0
    for member, figures in stats:
        if isinstance(figures, str):
            lines += [f"member {member.address}: no answer ({figures})", ""]
            continue
        answered += 1
        lines += [f"member {member.address}", format_stats(figures), ""]
        for ns in figures["namespaces"]:
            for name in _SUMMED:
                totals[name] += int(ns[name])
            blocks += sum(int(t["blocks"]) for t in ns["tiers"])
    lines.append(
        f"totals of {answered} answering member(s): {blocks} blocks, "
        f"hits {totals['hits']}, misses {totals['misses']}, puts {totals['puts']}, "
        f"dups {totals['duplicates']}, in {totals['bytes_in'] / 2**20:.1f} MiB, "
        f"out {totals['bytes_out'] / 2**20:.1f} MiB, evicted {totals['evictions']}"
    )
    return "\n".join(lines)


def gather(
    members: list[Member], secret: bytes | None, tenant: str = ""
) -> list[tuple[Member, Figures]]:
    """Each member's stats, all asked at once (dead members cost one timeout together)."""
    from ._serve_cmds import server_stats  # noqa: PLC0415

    def ask(member: Member) -> Figures:
        try:
            return server_stats(member.address, secret, tenant)
        except (TransferError, OSError) as exc:
            return str(exc)

    with concurrent.futures.ThreadPoolExecutor(max(1, min(16, len(members)))) as pool:
        return list(zip(members, pool.map(ask, members), strict=True))
