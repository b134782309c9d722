"""The raw TCP baseline's server: per connection, ``P`` + payload -> one byte; ``G`` ->
payload. ``python _echo_server.py PAYLOAD_BYTES``; prints its port; runs until stdin closes."""

from __future__ import annotations

import socket
import sys
import threading


def _serve(conn: socket.socket, size: int) -> None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            op = conn.recv(1)
            if not op:
                return
            if op == b"P":
                got = 0
                while got < size:
                    n = conn.recv_into(view[got:])
                    if not n:
                        return
                    got += n
                conn.sendall(b"k")
            else:
                conn.sendall(view)


def main() -> None:
    size = int(sys.argv[1])
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_serve, args=(conn, size), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    sys.stdin.read()
    listener.close()


if __name__ == "__main__":
    main()
