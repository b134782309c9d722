"""The cache server's namespace directories on disk, and the bound they stay within.

Each namespace with a disk tier has a directory under ``disk_path`` named by a digest of its
name and its block size; its LMDB files stay within the namespace's share of
``disk_capacity`` (``disk_bound="files"``). A namespace reclaimed from memory keeps its
directory, so that its blocks are there when it is opened again, but only while the
directories together stay within the setting: at most ``max_namespaces`` of them exist.

Each directory belongs to the tenant that created it (an ``owner`` file in it says which)
and counts against that tenant's quota: a tenant's new directory takes the place of its own
least recently used one, never another tenant's (unless the quotas add up to more than the
server holds: then of anyone's). Directories left by an earlier run count too, ordered by
when they were last written; at start, those past the bound or larger than today's share
(an LMDB file never shrinks) are removed. Files under ``disk_path`` that are not namespace
directories are not touched.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Container
from pathlib import Path

from ..._bounded_log import BoundedLog
from .._errors import StoreFull

OWNER_FILE = "owner"
"""The file in a namespace directory that names its tenant (UTF-8)."""
FILES_BESIDE_DATA = 16 << 10
"""Disk a namespace directory takes beside LMDB's data file: ``lock.mdb`` (8 KiB) and the
owner file (one block): the data file gets the rest of the share."""

_DIR = re.compile(r"^[0-9a-f]{16}-[0-9]+$")
_log = logging.getLogger("kvbridge.server")


class NamespaceDirs:
    """At most ``keep`` namespace directories under ``root``, least recently used first,
    each at most ``share`` bytes."""

    def __init__(
        self, root: str | os.PathLike[str], keep: int, share: int, events: BoundedLog
    ) -> None:
        self._root = Path(root)
        self._keep = keep
        self._events = events
        found = sorted(self._found(), key=_last_written)
        self._order: OrderedDict[Path, str] = OrderedDict((p, _owner(p)) for p in found)
        for path in found:  # an earlier run's, larger than today's share or past the bound
            if _size(path) > share or len(self._order) > keep:
                self._remove(path)

    def path_for(self, name: bytes, block_bytes: int) -> Path:
        digest = hashlib.sha256(name).hexdigest()[:16]
        return self._root / f"{digest}-{block_bytes}"

    def make_room(self, path: Path, live: Container[Path], owner: str, quota: int) -> None:
        """Before ``path`` is opened for ``owner``: remove its least recently used
        directories past ``quota``, then, with ``keep`` of them in all, the least recently
        used one of an earlier run's that nobody owns, or of anyone's if quotas overlap;
        :class:`StoreFull` (nothing opened) if the live ones leave no room."""
        self._order.pop(path, None)
        mine = [p for p, who in self._order.items() if who == owner]
        while len(mine) >= quota and self._remove_one(mine, live):
            mine = [p for p, who in self._order.items() if who == owner]
        if len(mine) < quota:
            self._remove_while_full(live, owner)
        if len(mine) >= quota or len(self._order) >= self._keep:
            raise StoreFull(
                f"{len(self._order)} namespace directories under {self._root} are in use "
                f"(at most {self._keep} within disk_capacity, {quota} of tenant "
                f"{owner or 'default'})"
            )
        path.mkdir(parents=True, exist_ok=True)
        (path / OWNER_FILE).write_text(owner)
        self._order[path] = owner

    def used(self, path: Path) -> None:
        """``path`` was opened or closed just now: the last of its owner's to be removed."""
        if path in self._order:
            self._order.move_to_end(path)

    def _remove_while_full(self, live: Container[Path], owner: str) -> None:
        while len(self._order) >= self._keep:
            others = [p for p, who in self._order.items() if who not in ("", owner)]
            first = [p for p, who in self._order.items() if who in ("", owner)]
            if not self._remove_one(first, live) and not self._remove_one(others, live):
                return

    def _remove_one(self, candidates: list[Path], live: Container[Path]) -> bool:
        # Least recently used first; any() stops at the first removed.
        return any(path not in live and self._remove(path) for path in candidates)

    def _remove(self, path: Path) -> bool:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("could not remove the namespace directory %s: %s", path, exc)
            return False  # it still takes room: the next one is tried
        del self._order[path]
        self._events.refused(
            "directory_removed", logging.INFO, "namespace directory %s removed", path
        )
        return True

    def _found(self) -> list[Path]:
        if not self._root.is_dir():
            return []
        return [p for p in self._root.iterdir() if p.is_dir() and _DIR.match(p.name)]


def _owner(path: Path) -> str:
    try:
        return (path / OWNER_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""  # an earlier run's without tenants: nobody's


def _size(path: Path) -> int:
    """Bytes the file system allocated to the directory's files."""
    total = 0
    for entry in path.iterdir():
        try:
            total += entry.stat().st_blocks * 512
        except OSError:
            continue
    return total


def _last_written(path: Path) -> float:
    try:
        return max(entry.stat().st_mtime for entry in (path, *path.iterdir()))
    except OSError:
        return 0.0
