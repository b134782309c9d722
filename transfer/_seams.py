"""Where a test injects a fault (``testing.py``): ``None`` unless one is injected."""

from __future__ import annotations

from collections.abc import Callable, Sequence

received: Callable[[Sequence[memoryview]], None] | None = None
"""Called with the payload views of each data frame received (a write's), or of each piece
of one as it lands (a read's)."""
