"""kvbridge.bindings.core: what every engine adapter shares.

``_core`` (:class:`ConnectorCore`: keys from token ids, lookups, loads and saves through a
``PageLayout``, the pause after a store fault, a lazy connection), ``_backend`` (a cache
server through client connections), ``_embedded`` (the loopback server an engine runs when
no ``server`` is set), ``_identity`` (what a block's bytes mean, and its namespace),
``_pages`` (the engine's memory as pages), ``_staging`` (pages through a host staging
buffer: a GPU cache's path; ``HostCopier``, and torch's ``CudaCopier``), ``_device`` (the
order of moves against the engine's device work: ``HostDevice``, torch's ``CudaDevice``),
``_tensors``
(torch tensors as pages: CPU, CUDA; block-first or K/V-first layouts), ``_config``
(settings), ``_jobs`` (the saver thread), ``_stats`` (counters). Imports ``kvbridge.store``
and ``kvbridge.transfer``; no engine.
"""

from __future__ import annotations

from ._config import ConnectorConfig
from ._core import ConnectorCore
from ._device import CudaDevice, Device, HostDevice, device_for
from ._identity import Identity
from ._jobs import SaveJob
from ._pages import LayoutError, PagedKV, PageLayout, pages_of
from ._staging import Copier, CudaCopier, HostCopier, StagingFailed
from ._stats import ConnectorStats
from ._tensors import tensor_pages

__all__ = [
    "ConnectorConfig",
    "ConnectorCore",
    "ConnectorStats",
    "Copier",
    "CudaCopier",
    "CudaDevice",
    "Device",
    "HostCopier",
    "HostDevice",
    "Identity",
    "LayoutError",
    "PageLayout",
    "PagedKV",
    "SaveJob",
    "StagingFailed",
    "device_for",
    "pages_of",
    "tensor_pages",
]
