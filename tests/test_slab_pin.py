"""Pinning a host tier for the GPU's DMA may fail (the locked-memory limit, the machine's
memory): with ``pin="auto"`` the slab stays unpinned and says so; with ``pin=True`` it is
:class:`TierUnavailable`. A stand-in for cupy whose ``hostRegister`` fails plays the GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.store import TierUnavailable
from kvbridge.store.local import HostSlab, _slab


def _refusing_cupy() -> SimpleNamespace:
    def host_register(address: int, nbytes: int, flags: int) -> None:
        raise RuntimeError("cudaErrorMemoryAllocation: out of memory")

    runtime = SimpleNamespace(hostRegister=host_register)
    return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))


def test_auto_pinning_that_fails_leaves_the_slab_unpinned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_slab, "cupy_module", _refusing_cupy)
    slab = HostSlab(4, 4096, pin="auto")
    try:
        assert not slab.pinned
        slab.slot(3)[:] = 7  # the memory is there, unpinned
        assert int(slab.slot(3)[0]) == 7
    finally:
        slab.close()
    assert "left unpinned" in caplog.text and "out of memory" in caplog.text


def test_required_pinning_that_fails_is_tier_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_slab, "cupy_module", _refusing_cupy)
    with pytest.raises(TierUnavailable, match="pinning 16384 bytes failed"):
        HostSlab(4, 4096, pin=True)
