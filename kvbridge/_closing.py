"""The context-manager half of everything that has a ``close()``."""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

_T = TypeVar("_T", bound="Closing")


class Closing:
    """``with thing: ...`` closes ``thing`` on the way out (subclasses define ``close``)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
