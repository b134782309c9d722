"""The cache server's namespace directories on disk, and the bound they stay within.

Each namespace with a disk tier has a directory under ``disk_path`` named by a digest of its
name and its block size; its LMDB files stay within the namespace's share of
``disk_capacity`` (``disk_bound="files"``). A namespace reclaimed from memory keeps its
directory, so that its blocks are there when it is opened again, but only while the
directories together stay within the setting: at most ``max_namespaces`` of them exist,
and a new one takes the place of the least recently used directory of a namespace that is
not open. Directories left by an earlier run count too (ordered by when they were last
written); files under ``disk_path`` that are not namespace directories are not touched.
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

from ._errors import StoreFull

_DIR = re.compile(r"^[0-9a-f]{16}-[0-9]+$")
_log = logging.getLogger("kvbridge.server")


class NamespaceDirs:
    """At most ``keep`` namespace directories under ``root``, least recently used first."""

    def __init__(self, root: str | os.PathLike[str], keep: int) -> None:
        self._root = Path(root)
        self._keep = keep
        self._order: OrderedDict[Path, None] = OrderedDict(
            (path, None) for path in sorted(self._found(), key=_last_written)
        )

    def path_for(self, name: bytes, block_bytes: int) -> Path:
        digest = hashlib.sha256(name).hexdigest()[:16]
        return self._root / f"{digest}-{block_bytes}"

    def make_room(self, path: Path, live: Container[Path]) -> None:
        """Before ``path`` is opened: remove the least recently used directories not in
        ``live`` until it fits among ``keep``; :class:`StoreFull` (nothing opened) if the
        directories of open namespaces leave no room."""
        self._order.pop(path, None)
        for old in list(self._order):
            if len(self._order) < self._keep:
                break
            if old in live:
                continue
            self._remove(old)
        if len(self._order) >= self._keep:
            raise StoreFull(
                f"{len(self._order)} namespace directories under {self._root} are in use "
                f"(at most {self._keep} within disk_capacity)"
            )
        self._order[path] = None

    def used(self, path: Path) -> None:
        """``path`` was opened or closed just now: the last to be removed."""
        self._order[path] = None
        self._order.move_to_end(path)

    def _remove(self, path: Path) -> None:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("could not remove the namespace directory %s: %s", path, exc)
            return  # it still takes room: the next one is tried
        del self._order[path]
        _log.info("namespace directory %s removed (disk_capacity)", path)

    def _found(self) -> list[Path]:
        if not self._root.is_dir():
            return []
        return [p for p in self._root.iterdir() if p.is_dir() and _DIR.match(p.name)]


def _last_written(path: Path) -> float:
    try:
        return max(entry.stat().st_mtime for entry in (path, *path.iterdir()))
    except OSError:
        return 0.0
