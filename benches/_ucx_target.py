"""The far end of the UCX benchmarks: a TransferEngine on UCX and a raw ucxx receiver.

Raw protocol: the client sends a 24-byte start message (block, count, seed) on tag 1<<40,
then ``count`` messages, message ``i`` on tag ``i``; this side posts one receive per message
at the shuffled offset the client used and answers one byte on tag 1<<41 when all landed.
Prints the engine metadata (hex) and this worker's address (hex); runs until stdin closes.
"""

from __future__ import annotations

import struct
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _transfer_target import TOTAL, shuffled_offsets

from kvbridge.transfer import TransferEngine
from kvbridge.transfer._ucx import _Worker

START = struct.Struct("<QQQ")
START_TAG, ACK_TAG = 1 << 40, 1 << 41


def main() -> None:
    buffer = np.zeros(TOTAL, np.uint8)
    raw = _Worker()
    with TransferEngine("ucx-target", transports="ucx") as engine:
        engine.register(buffer)
        print(engine.metadata().hex(), raw.address.hex(), flush=True)
        peer_address = bytes.fromhex(sys.stdin.readline().strip())
        ucx, array, worker = raw.ucx, raw.Array, raw.worker
        holder = []

        def connect():  # type: ignore[no-untyped-def]
            holder.append(
                ucx.UCXEndpoint.create_from_worker_address(
                    worker, ucx.UCXAddress.create_from_buffer(peer_address), False
                )
            )
            return [], None

        raw.call(connect).result(10)
        stop = threading.Event()

        def serve() -> None:
            start = bytearray(START.size)
            while not stop.is_set():
                try:
                    raw.call(
                        lambda: ([worker.tag_recv(array(start), ucx.UCXXTag(START_TAG))], None)
                    ).result()
                except Exception:
                    return
                block, count, seed = START.unpack(start)
                offsets = shuffled_offsets(block, count, seed).tolist()
                views = [buffer.data[o : o + block] for o in offsets]

                def post(views: list[memoryview] = views) -> Any:
                    return [
                        worker.tag_recv(array(v), ucx.UCXXTag(i)) for i, v in enumerate(views)
                    ], None

                raw.call(post).result()
                raw.call(
                    lambda: ([holder[0].tag_send(array(b"k"), ucx.UCXXTag(ACK_TAG))], None)
                ).result()

        thread = threading.Thread(target=serve)
        thread.start()
        sys.stdin.read()
        stop.set()
        # Closed on the worker thread: an endpoint dropped unclosed closes blocking, and
        # over TCP that can wait forever for a peer that is gone.
        raw.call(lambda: ([], holder.pop().close())).result(10)
    raw.close()
    thread.join()


if __name__ == "__main__":
    main()
