"""Telling GPU memory from host memory: the one check every layer uses."""

from __future__ import annotations


def is_device(obj: object) -> bool:
    """True for GPU arrays (anything exposing ``__cuda_array_interface__``: cupy, torch,
    numba); such memory moves only over the ucx transport."""
    return hasattr(obj, "__cuda_array_interface__")
