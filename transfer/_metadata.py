"""Engine metadata: what a peer needs to reach an engine and its regions (msgpack, versioned)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from ._errors import LocalProtocolError
from ._regions import RegionInfo

METADATA_VERSION = 1


@dataclass(frozen=True)
class EngineInfo:
    name: str
    control: str
    transports: dict[str, dict[str, Any]]
    regions: dict[int, RegionInfo]

    def encode(self) -> bytes:
        body = {
            "kvbridge": METADATA_VERSION,
            "name": self.name,
            "control": self.control,
            "transports": self.transports,
            "regions": [info.to_wire() for info in self.regions.values()],
        }
        return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]

    @classmethod
    def decode(cls, data: bytes) -> EngineInfo:
        """Parse metadata; anything malformed is a :class:`LocalProtocolError`."""
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=True)
            if not isinstance(body, dict):
                raise ValueError("not a map")
            if body.get("kvbridge") != METADATA_VERSION:
                raise ValueError(f"metadata version {body.get('kvbridge')!r} is not supported")
            transports = body["transports"]
            if not isinstance(transports, dict) or not all(
                isinstance(v, dict) for v in transports.values()
            ):
                raise ValueError("bad transports")
            regions = [RegionInfo.from_wire(item) for item in body["regions"]]
            return cls(
                name=str(body["name"]),
                control=str(body["control"]),
                transports={str(k): v for k, v in transports.items()},
                regions={info.id: info for info in regions},
            )
        except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
            raise LocalProtocolError(f"not kvbridge engine metadata: {exc}") from None
        except Exception as exc:  # msgpack's own decode errors
            raise LocalProtocolError(f"not kvbridge engine metadata: {exc}") from None
