"""vLLM's KV cache groups as the connector sees them (its hybrid memory allocator, HMA).

A hybrid model keeps one KV cache group per kind of layer: full attention, a sliding
window of ``w`` tokens, or a recurrent state (Mamba, gated delta-net). Every group has the
same number of layers and the same page size, and their tensors alias: engine block ``b``
is the same bytes whichever group owns it (a block id belongs to one group at a time). So
a group is, for kvbridge, a set of keys (each key names its group: :attr:`Group.tag`) over
one store of blocks of one size.

What a hit needs of each group (``docs/VLLM.md``, "Hybrid models"):

- **full attention**: every block up to the hit;
- **sliding window**: only the blocks still inside the window at the end of the hit (vLLM
  fills the earlier places with its null block): blocks ``[skipped(n), n)`` for a hit of
  ``n`` blocks, where ``skipped(n) = max(0, n * bs - w + 1) // bs``. The connector asks the
  store for every block up to the hit all the same (a stricter test: the hit is then the
  longest prefix every group can serve as a chain), pins and loads only that tail;
- **recurrent state**: vLLM 0.32/0.33 give a connector no sound way to store or load the
  state at a hit's boundary (a hit would start the model from a zeroed state), so a model
  with such a group is :attr:`KVGroups.loadable` no more: no hit, nothing saved. So is a
  model with a group of any other kind (chunked local attention, ...).

The null block is engine block 0; a transfer never names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...store import BlockKey, Lease

NULL_BLOCK = 0
"""vLLM's null block: the place of a block a group does not keep (outside its window)."""


@dataclass(frozen=True)
class Group:
    """One KV cache group: its index in vLLM's list, its kind and what names its keys."""

    index: int
    kind: str
    """``full``, ``window``, ``state`` or ``other``."""
    window: int = 0
    """Tokens of a sliding window (``window`` groups)."""
    layers: tuple[str, ...] = ()

    @property
    def tag(self) -> bytes:
        """Mixed into each key of this group: two groups never share a block."""
        return f"group={self.kind}:{self.window}:{','.join(self.layers)}".encode()

    def first_kept(self, blocks: int, block_tokens: int) -> int:
        """The first of a hit's ``blocks`` that this group keeps (0 but for a window)."""
        if self.kind != "window":
            return 0
        return max(0, blocks * block_tokens - self.window + 1) // block_tokens


@dataclass(frozen=True)
class KVGroups:
    """Every KV cache group of the engine (one for a model of one kind of layer)."""

    groups: tuple[Group, ...]

    @classmethod
    def of(cls, kv_cache_config: Any) -> KVGroups:
        """The groups of vLLM's ``KVCacheConfig``."""
        return cls(
            tuple(
                _group(i, group.kv_cache_spec, group.layer_names)
                for i, group in enumerate(kv_cache_config.kv_cache_groups)
            )
        )

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def loadable(self) -> bool:
        """Whether a hit can be loaded and a block saved: every group is of full attention
        or a sliding window, each of as many layers."""
        kinds = all(group.kind in ("full", "window") for group in self.groups)
        return kinds and len({len(group.layers) for group in self.groups}) == 1

    def tags(self) -> tuple[bytes, ...]:
        """What names each group's keys: nothing for a model of one group (its keys stay
        what they were before groups were named)."""
        return tuple(group.tag if self.hybrid else b"" for group in self.groups)

    def describe(self) -> str:
        """The groups as the namespace's layout names them (kind, window, layer count)."""
        return "+".join(f"{g.kind}{g.window or ''}x{len(g.layers)}" for g in self.groups)


class GroupedKeys(Sequence[tuple[BlockKey, ...]]):
    """A prompt's keys in every group: item ``i`` is block ``i``'s key in each group. Sliced
    like a list (what the lookup thread does), it stays grouped."""

    def __init__(self, per_group: Sequence[Sequence[BlockKey]]) -> None:
        self.per_group = tuple(tuple(keys) for keys in per_group)
        self._length = min((len(keys) for keys in self.per_group), default=0)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return GroupedKeys([keys[: self._length][index] for keys in self.per_group])
        return tuple(keys[index] for keys in self.per_group)


_FULL = ("FullAttentionSpec", "MLAAttentionSpec")


def _group(index: int, spec: Any, layer_names: Sequence[str]) -> Group:
    name = type(spec).__name__
    layers = tuple(layer_names)
    if "Mamba" in name:
        return Group(index, "state", 0, layers)
    if name == "SlidingWindowSpec":
        return Group(index, "window", int(spec.sliding_window), layers)
    return Group(index, "full" if name in _FULL else "other", 0, layers)


class GroupedStore:
    """The store as the lookup thread sees it for a hybrid model (``Lookups``' ``Store``):
    a lookup answers the blocks every group holds; a pin keeps each group's blocks of the
    hit that a load will read (a window group's tail only), all of them or none."""

    def __init__(self, core: Any, groups: KVGroups, block_tokens: int) -> None:
        self._core = core
        self._groups = groups
        self._block = block_tokens

    def lookup(self, keys: GroupedKeys) -> int:
        hit = len(keys)
        for group_keys in keys.per_group:
            hit = min(hit, self._core.lookup(group_keys[:hit])) if hit else 0
        return hit

    def mirrored(self, keys: GroupedKeys) -> int | None:
        """Leading blocks every group holds as the mirror says; ``None`` out of step."""
        hit = len(keys)
        for group_keys in keys.per_group:
            seen = self._core.mirrored(group_keys[:hit])
            if seen is None:
                return None
            hit = min(hit, seen)
        return hit

    def pin(self, keys: GroupedKeys, start: int = 0) -> Lease | None:
        """Pin blocks ``start .. start + len(keys)`` of each group that a load of a hit
        ending there reads; ``None`` (nothing held) when one group's pin fails."""
        end = start + len(keys)
        held: list[Lease] = []
        for group, group_keys in zip(self._groups.groups, keys.per_group, strict=True):
            first = max(start, group.first_kept(end, self._block))
            if first >= end:
                continue
            hold = self._core.pin(group_keys[first - start :], first)
            if hold is None:
                for one in held:
                    self._core.unpin(one)
                return None
            held.append(hold)
        # one lease for the hit; each group's pin goes back through the core
        return Lease.joined(held, self._core.unpin)

    def unpin(self, hold: Lease | None) -> None:
        if hold is not None:
            hold.release()
