"""A lease: blocks kept where they are until it is released, whichever store lent it.

Every store lends the same :class:`Lease` (the store contract, ``_contract``): a local
:class:`~kvbridge.store.TieredStore` for its pins, a :class:`~kvbridge.store.StoreClient`
for a cache server's read leases, a :class:`~kvbridge.store.ClusterClient` for the leases
it took on the members. Release it, or leave its ``with`` block.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from .._closing import Closing
from ._keys import BlockKey


class Lease(Closing):
    """A pin on some blocks; release it (or leave the ``with`` block) when done.

    Releasing twice, or after the deadline, is harmless.
    """

    def __init__(
        self,
        release: Callable[[Lease], None],
        clock: Callable[[], float],
        lease_id: int,
        keys: tuple[BlockKey, ...],
        deadline: float,
    ) -> None:
        self._release = release
        self._clock = clock
        self.id = lease_id
        self.keys = keys
        self.deadline = deadline
        self.released = False

    @classmethod
    def joined(
        cls, leases: Sequence[Lease], give_back: Callable[[Lease], None] | None = None
    ) -> Lease:
        """One lease over several (a pin that took a lease per request, member or group):
        releasing it gives each back (``give_back``, default :meth:`release`); it expires
        with the first of them."""
        held = list(leases)

        def release(_: Lease) -> None:
            for lease in held:
                if give_back is None:
                    lease.release()
                else:
                    give_back(lease)

        keys = tuple(key for lease in held for key in lease.keys)
        deadline = min((lease.deadline for lease in held), default=math.inf)
        clock = held[0]._clock if held else time.monotonic
        return cls(release, clock, 0, keys, deadline)

    @property
    def expired(self) -> bool:
        return self._clock() >= self.deadline

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release(self)

    close = release  # ``with store.pin(keys): ...`` releases on the way out (Closing)
