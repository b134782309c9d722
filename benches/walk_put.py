"""The walk of one put: the functions of ``store/server`` and ``store/local`` that one put of
four blocks runs on the server (a ``StoreClient`` against a ``CacheServer`` in this process),
by file. Not a timing: ``python benches/walk_put.py`` from the root of a checkout (run it in
two checkouts to compare them). Comprehensions and closures count as their function."""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from types import FrameType
from typing import Any

import numpy as np

from kvbridge.store import CacheServer, ServerConfig, StoreClient, prefix_hashes

BB = 4096
ROOT = os.path.realpath(os.getcwd())
_calls: Counter[tuple[str, str]] = Counter()
_counting = threading.Event()


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event != "call" or not _counting.is_set():
        return
    path = os.path.relpath(os.path.realpath(frame.f_code.co_filename), ROOT)
    name: str = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)  # 3.11 has it
    if path.startswith(("store/server/", "store/local/")) and "<" not in name:
        _calls[(path, name)] += 1


def walk() -> dict[str, list[str]]:
    """The functions one put runs, by file."""
    sys.setprofile(_profile)
    threading.setprofile(_profile)  # every thread started from here: the server's too
    try:
        with (
            CacheServer(ServerConfig(port=0, host_capacity=64 * BB)) as server,
            StoreClient(server.address, block_bytes=BB, namespace="walk") as client,
        ):
            ks = prefix_hashes(range(16 * 8), 16)
            client.put(ks[:4], np.ones((4, BB), np.uint8))  # warm: connections, regions
            _counting.set()
            client.put(ks[4:], np.ones((4, BB), np.uint8))
            _counting.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    files: dict[str, list[str]] = {}
    for path, name in sorted(_calls):
        files.setdefault(path, []).append(name)
    return files


def main() -> None:
    files = walk()
    functions = [name for names in files.values() for name in names]
    classes = {name.split(".")[0] for name in functions if "." in name}
    print(f"{len(functions)} functions of {len(classes)} classes in {len(files)} files")
    for path, names in files.items():
        print(f"  {path}: {', '.join(names)}")


if __name__ == "__main__":
    main()
