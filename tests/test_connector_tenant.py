"""A connector as a tenant of a real ``kvbridge serve --tenants``: its namespaces are named
inside the tenant's prefix, a connector of another tenant with the very same identity gets
no hit and cannot reach them, and a wrong tenant or secret is a store fault (a miss), not a
crash."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from serve import ServeProcess

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity, PagedKV, pages_of
from kvbridge.store import ConfigError

PAGE = 4096
LAYERS = 2
IDENTITY = Identity(
    engine="test",
    model="m",
    dtype="float32",
    layout="cpu/2x64",
    block_tokens=16,
    block_bytes=PAGE * LAYERS,
    shard="tp0/1",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Path]]:
    folder = tmp_path_factory.mktemp("tenants")
    for name in ("a", "b"):
        (folder / f"{name}.secret").write_text(f"secret of {name}\n")
    (folder / "tenants.toml").write_text(
        '[[tenant]]\nname = "a"\nsecret_file = "a.secret"\n'
        '[[tenant]]\nname = "b"\nsecret_file = "b.secret"\n'
    )
    server = ServeProcess("--tenants", str(folder / "tenants.toml"), "--host-capacity", "64MiB")
    yield server, folder
    server.kill()


def _core(served: tuple[ServeProcess, Path], tenant: str, secret: str) -> ConnectorCore:
    server, folder = served
    config = ConnectorConfig.from_extra(
        {"server": server.address, "tenant": tenant, "secret_file": str(folder / secret)}
    )
    return ConnectorCore(config, IDENTITY)


def _kv(seed: int) -> PagedKV:
    rng = np.random.default_rng(seed)
    layers = [rng.integers(0, 256, (8, 2, PAGE // 2), dtype=np.uint8) for _ in range(LAYERS)]
    return PagedKV(tuple(pages_of(layer, f"l{i}") for i, layer in enumerate(layers)), "t")


def test_a_tenants_connector_hits_only_its_own_blocks(served: tuple[ServeProcess, Path]) -> None:
    a, again, b = (
        _core(served, "a", "a.secret"),
        _core(served, "a", "a.secret"),
        _core(served, "b", "b.secret"),
    )
    try:
        for core, seed in ((a, 1), (again, 2), (b, 3)):
            core.attach(_kv(seed))
        tokens = list(range(64))
        assert a.namespace.startswith(b"a/") and b.namespace.startswith(b"b/")
        assert a.save(a.keys(tokens), [0, 1, 2, 3])
        assert again.lookup(again.keys(tokens)) == 4  # the same tenant shares its cache
        assert b.lookup(b.keys(tokens)) == 0  # another tenant, the same identity: no hit
        assert b.stats.totals()["store_faults"] == 0
    finally:
        for core in (a, again, b):
            core.close()


def test_a_wrong_secret_or_tenant_is_a_miss(served: tuple[ServeProcess, Path]) -> None:
    for tenant, secret in (("a", "b.secret"), ("c", "a.secret")):
        core = _core(served, tenant, secret)
        try:
            core.attach(_kv(4))
            assert core.lookup(core.keys(list(range(64)))) == 0
            assert core.stats.totals()["store_faults"] == 1
        finally:
            core.close()


@pytest.mark.parametrize(
    ("extra", "match"),
    [({"tenant": "a"}, "server"), ({"server": "127.0.0.1:1", "tenant": "a b"}, "tenant")],
)
def test_a_bad_tenant_setting_is_a_config_error(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra(extra)
