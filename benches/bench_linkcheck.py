"""The engine on links shaped to 1 and 10 Gbit/s (network namespaces, veth, tc tbf).

Each round writes one batch of 64 x 1 MiB blocks across the shaped veth; the baseline is
raw TCP through the same link in the same run (as many connections as the engine has
streams, ``sendall`` per block). Besides the ratio to raw TCP, the summary gives goodput as
a fraction of the configured rate. Needs root and iproute2; skips otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import _EXTRA_LINES

from kvbridge.tools import _netns
from kvbridge.tools._bench_wire import read_ready

reason = _netns.available()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"cannot make namespaces: {reason}")
BATCH_BYTES = 64 << 20


class _Shaped:
    def __init__(self, rate_gbps: float) -> None:
        self.link = _netns.ShapedLink(rate_gbps * 1e9).__enter__()
        host = self.link.addresses[1]
        self.target = subprocess.Popen(
            [
                *self.link.command(1, [sys.executable, "-m", "kvbridge.tools._bench_target"]),
                "2",
                "tcp",
                host,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.target.stdout is not None
        metadata_hex, port = read_ready(self.target.stdout)
        self.client = subprocess.Popen(
            [
                *self.link.command(0, [sys.executable, "-m", "kvbridge.tools._linkcheck_client"]),
                "--loop",
                metadata_hex,
                host,
                str(port),
                "0",
                "0",
                str(1 << 20),
                "2",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.client.stdout is not None and self.client.stdout.readline().strip() == "ready"

    def round(self, what: str) -> None:
        assert self.client.stdin is not None and self.client.stdout is not None
        self.client.stdin.write(what + "\n")
        self.client.stdin.flush()
        assert self.client.stdout.readline().strip() == "done"

    def close(self) -> None:
        for proc in (self.client, self.target):
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(60)
        self.link.close()


@pytest.fixture(params=[1.0, 10.0], ids=["1Gbit", "10Gbit"])
def shaped(request: pytest.FixtureRequest) -> Iterator[tuple[float, _Shaped]]:
    link = _Shaped(float(request.param))
    try:
        yield float(request.param), link
    finally:
        link.close()


def test_goodput_on_a_shaped_link(
    compare: Callable[..., Any], shaped: tuple[float, _Shaped]
) -> None:
    rate, link = shaped
    result = compare(
        f"engine, veth shaped to {rate:g} Gbit/s",
        lambda: link.round("engine"),
        lambda: link.round("raw"),
        baseline_name="raw TCP, same link",
        nbytes=BATCH_BYTES,
        rounds=5,
        warmup=1,
    )
    line = (
        f"{rate:g} Gbit/s link: engine {BATCH_BYTES * 8 / result.subject_s / 1e9:.2f} Gbit/s "
        f"({BATCH_BYTES * 8 / result.subject_s / 1e9 / rate:.2f}x of the rate), raw TCP "
        f"{BATCH_BYTES * 8 / result.baseline_s / 1e9 / rate:.2f}x"
    )
    _EXTRA_LINES.append(line)
    print(line)
