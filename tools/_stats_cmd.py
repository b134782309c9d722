"""``kvbridge stats``: one server's figures (``ADDRESS``), or every member of a cluster and
the cluster's totals (``etcd://...``); asked through an engine that only dials."""

from __future__ import annotations

import argparse
import concurrent.futures
from collections.abc import Sequence
from typing import Any

from kvbridge.store.cluster import (
    EtcdError,
    EtcdGateway,
    EtcdUnavailable,
    Member,
    members_prefix,
)
from kvbridge.transfer import TransferEngine, TransferError

from ._fail import fail

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

    def ask(member: Member) -> Figures:
        try:
            return server_stats(member.address, secret, tenant)
        except (TransferError, OSError) as exc:
            return str(exc)

    with concurrent.futures.ThreadPoolExecutor(max(1, min(16, len(members)))) as pool:
        return list(zip(members, pool.map(ask, members), strict=True))


def stats_command(args: argparse.Namespace) -> int:
    """``kvbridge stats ADDRESS`` or ``kvbridge stats etcd://...``."""
    secret = None
    if args.secret_file:
        try:
            with open(args.secret_file, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            return fail("kvbridge stats", f"--secret-file {args.secret_file}: {exc.strerror}")
        if not secret:
            return fail("kvbridge stats", f"--secret-file {args.secret_file} is empty")
    if args.address.startswith("etcd://"):
        return _cluster_stats(args.address, args.cluster_name, secret, args.tenant)
    try:
        stats = server_stats(args.address, secret, args.tenant, args.transports.split(","))
    except TransferError as exc:
        where = "" if args.address in str(exc) else f"{args.address}: "
        return fail("kvbridge stats", f"{where}{exc}", 1)
    print(format_stats(stats))
    return 0


def _cluster_stats(url: str, cluster: str, secret: bytes | None, tenant: str) -> int:
    try:
        members = cluster_members(url, cluster)
    except (ConnectionError, ValueError) as exc:
        return fail("kvbridge stats", exc, 1)
    print(format_cluster(url, cluster, gather(members, secret, tenant)))
    return 0


def server_stats(
    address: str,
    secret: bytes | None = None,
    tenant: str = "",
    transports: Sequence[str] = ("tcp",),
) -> dict[str, Any]:
    """Ask a server for its figures (opens no namespace): those its tenant may see."""
    with TransferEngine(
        "kvbridge-stats",
        serve=False,
        secret=secret,
        principal=tenant,
        transports=transports,
        timeout=5.0,
        connect_timeout=5.0,
    ) as engine:
        return engine.dial(address).call({"op": "stats"})


def format_stats(stats: dict[str, Any]) -> str:
    server = stats["server"]
    lines = [
        f"server {server['address']}  up {server['uptime_s']:.0f} s  "
        f"transports {','.join(server['transports'])}  open leases {server['open_leases']}",
        "",
    ]
    header = ("namespace", "hits", "misses", "puts", "dups", "in MiB", "out MiB", "evicted")
    rows = [header]
    for ns in stats["namespaces"]:
        rows.append(
            (
                ns["name"],
                str(ns["hits"]),
                str(ns["misses"]),
                str(ns["puts"]),
                str(ns["duplicates"]),
                f"{ns['bytes_in'] / 2**20:.1f}",
                f"{ns['bytes_out'] / 2**20:.1f}",
                str(ns["evictions"]),
            )
        )
    lines += _table(rows)
    tier_rows = [("namespace", "tier", "blocks", "capacity", "used", "evictions")]
    for ns in stats["namespaces"]:
        for tier in ns["tiers"]:
            used = tier["blocks"] / tier["capacity_blocks"] if tier["capacity_blocks"] else 0.0
            tier_rows.append(
                (
                    ns["name"],
                    tier["name"],
                    str(tier["blocks"]),
                    str(tier["capacity_blocks"]),
                    f"{used:.0%}",
                    str(tier["evictions"]),
                )
            )
    lines += ["", *_table(tier_rows)]
    served = [ns for ns in stats["namespaces"] if "served" in ns]  # an older server: none
    if served:
        lines += ["", *_table(_served_rows(served))]
    return "\n".join(lines)


def _served_rows(namespaces: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Stored versus served (``store/server/_served.py``): what lookups advertised, what
    was delivered, what was lost and why, and whether the write-only alarm is up."""
    rows: list[tuple[str, ...]] = [
        ("namespace", "lookups", "advertised", "delivered", "lost", "alarm")
    ]
    for ns in namespaces:
        account = ns["served"]
        lost = ", ".join(f"{why} {n}" for why, n in account["lost"].items() if n) or "0"
        alarm = "WRITE-ONLY" if account["write_only"] else "-"
        rows.append(
            (
                ns["name"],
                str(account["lookups"]),
                str(account["advertised"]),
                str(account["delivered"]),
                lost,
                alarm,
            )
        )
    return rows


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        rest = [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        cells = [row[0].ljust(widths[0]), *rest]
        out.append("  ".join(cells))
    return out
