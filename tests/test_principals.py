"""Principals at the engine level: an engine that answers several, each with its own
secret; what a handshake proves is what a request handler sees (``Caller.principal``), and
a principal's sessions are bounded without touching another's."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from attack import guess_auth

from kvbridge.transfer import (
    DEFAULT_PRINCIPAL,
    AuthenticationError,
    Caller,
    LocalProtocolError,
    Principal,
    TransferEngine,
)


@pytest.fixture
def server() -> Iterator[TransferEngine]:
    principals = [
        Principal("alpha", b"alpha secret", max_sessions=2),
        Principal("beta", b"beta secret"),
    ]
    with TransferEngine("server", principals=principals) as engine:

        def whoami(caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
            return {"principal": caller.principal}

        engine.set_request_handler(whoami)
        yield engine


def _client(principal: str, secret: bytes | None) -> TransferEngine:
    return TransferEngine(f"client-{principal}", secret=secret, principal=principal, timeout=5)


def test_a_request_carries_the_principal_its_session_proved(server: TransferEngine) -> None:
    for name, secret in (("alpha", b"alpha secret"), ("beta", b"beta secret")):
        with _client(name, secret) as client:
            assert client.dial(server.address).call({}) == {"principal": name}


@pytest.mark.parametrize(
    ("principal", "secret"),
    [
        ("alpha", b"beta secret"),
        ("beta", b"alpha secret"),
        ("gamma", b"alpha secret"),
        (DEFAULT_PRINCIPAL, b"alpha secret"),
        ("alpha", None),
    ],
)
def test_a_principal_needs_its_own_secret(
    server: TransferEngine, principal: str, secret: bytes | None
) -> None:
    with _client(principal, secret) as client, pytest.raises(AuthenticationError):
        client.dial(server.address)


def test_an_unknown_principal_looks_like_a_wrong_secret(server: TransferEngine) -> None:
    unknown, wrong = guess_auth(server.address, principal="gamma"), guess_auth(server.address)
    assert unknown["ok"] is wrong["ok"] is False
    assert (unknown["code"], unknown["error"]) == (wrong["code"], wrong["error"])


def test_a_principals_sessions_are_bounded_and_others_are_not(server: TransferEngine) -> None:
    clients = [_client("alpha", b"alpha secret") for _ in range(3)]
    try:
        peers = [clients[0].dial(server.address), clients[1].dial(server.address)]
        with pytest.raises(AuthenticationError, match="sessions"):
            clients[2].dial(server.address)  # alpha's third session with streams
        with _client("beta", b"beta secret") as beta:
            assert beta.dial(server.address).call({}) == {"principal": "beta"}
        peers[0].close()  # its session ends with its streams: alpha has room again
        assert clients[2].dial(server.address).call({}) == {"principal": "alpha"}
    finally:
        for client in clients:
            client.close()


def test_refusals_are_counted_and_logged_at_a_bounded_rate(
    server: TransferEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvbridge.transfer"):
        for _ in range(50):
            assert guess_auth(server.address)["ok"] is False
    assert server.stats()["refused"]["authentication"] == 50
    lines = [r for r in caplog.records if "authentication refused" in r.getMessage()]
    assert len(lines) == 1


@pytest.mark.parametrize("name", ["a b", "x" * 65, "-lead", "é", "a\x00"])
def test_a_principal_name_is_checked(name: str) -> None:
    with pytest.raises(LocalProtocolError):
        Principal(name, b"secret")
    with pytest.raises(LocalProtocolError):
        TransferEngine("client", secret=b"s", principal=name)


def test_an_engine_without_a_secret_answers_only_the_default_principal() -> None:
    with TransferEngine("open") as server, _client("alpha", None) as client:
        with pytest.raises(AuthenticationError):
            client.dial(server.address)
        with _client(DEFAULT_PRINCIPAL, None) as anyone:
            anyone.dial(server.address)
