"""Control-socket addresses: ``host:port``, IPv6 as ``[::1]:port``.

:meth:`TransferEngine.dial <kvbridge.transfer.TransferEngine.dial>` takes an address in that
form (or the same behind ``tcp://``). Anything else is refused at once with
:class:`BadAddress`, before a socket exists: a forgotten port (``"127.0.0.1"``) used to
become a zmq endpoint that never connects, and the dial hung instead of failing.
"""

from __future__ import annotations

import ipaddress
import re

from ._errors import LocalProtocolError

_SCHEME = "tcp://"
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$"
)
"""RFC 1123 host names (plus ``_``, which some internal DNS zones use)."""
_DOTTED = re.compile(r"^[0-9.]+$")
_PORT = re.compile(r"^[0-9]{1,5}$")


class BadAddress(LocalProtocolError):
    """An address is not ``host:port`` (IPv6 as ``[::1]:port``) with a port in 1..65535;
    nothing was connected."""


def parse_address(address: object) -> tuple[str, int]:
    """Return ``(host, port)`` of ``address`` (``host:port``, ``[ipv6]:port``, optionally
    behind ``tcp://``); an IPv6 host comes back without its brackets.

    Raises :class:`BadAddress` naming the address and what is wrong with it.
    """
    if not isinstance(address, str):
        raise BadAddress(f"an address is a 'host:port' string, got {type(address).__name__}")
    rest = address.removeprefix(_SCHEME)
    if "://" in rest:
        raise _bad(address, "only tcp:// endpoints can be dialled")
    if rest.startswith("["):
        host_part, sep, port_text = rest[1:].partition("]:")
        if not sep:
            raise _bad(address, "an IPv6 host is written [addr]:port")
        host = _ipv6(address, host_part)
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep:
            raise _bad(address, "no port")
        host = _host(address, host)
    return host, _port(address, port_text)


def tcp_endpoint(address: object) -> str:
    """The zmq endpoint (``tcp://host:port``, IPv6 in brackets) for a checked ``address``."""
    host, port = parse_address(address)
    return f"{_SCHEME}[{host}]:{port}" if ":" in host else f"{_SCHEME}{host}:{port}"


def _bad(address: str, why: str) -> BadAddress:
    return BadAddress(
        f"bad address {address!r}: {why} (expected host:port, IPv6 as [::1]:port, port 1..65535)"
    )


def _ipv6(address: str, host: str) -> str:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise _bad(address, f"{host!r} is not an IPv6 address") from None
    return host


def _host(address: str, host: str) -> str:
    if not host:
        raise _bad(address, "no host")
    if ":" in host:
        raise _bad(address, "an IPv6 host needs brackets")
    if _DOTTED.match(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise _bad(address, f"{host!r} is not an IPv4 address") from None
    elif not _HOSTNAME.match(host):
        raise _bad(address, f"{host!r} is not a host name")
    return host


def _port(address: str, text: str) -> int:
    if not _PORT.match(text) or not 1 <= int(text) <= 65535:
        raise _bad(address, f"port {text!r} is not in 1..65535")
    return int(text)
