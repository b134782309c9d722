"""kvbridge.bindings.sglang: the SGLang 0.5.23 HiCache storage backend,
:class:`KVBridgeHiCache` (imports sglang). Load it with ``--hicache-storage-backend dynamic``
and ``module_path="kvbridge.bindings.sglang"``.

``_backend`` maps SGLang's calls to the core; ``_pool`` sees SGLang's host KV pool as a
``PageLayout``; ``_hybrid`` keeps each host pool of a model (KV, and a hybrid model's
Mamba state and SWA side pools) in a namespace of its own for SGLang's v2 calls;
``_config`` reads the settings and derives the ``Identity``. The engine-agnostic work is
``bindings/core``'s. See ``docs/SGLANG.md``.
"""

from __future__ import annotations

from ._backend import KVBridgeHiCache

__all__ = ["KVBridgeHiCache"]
