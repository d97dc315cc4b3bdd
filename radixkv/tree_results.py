"""What the tree's operations return: small typed result objects (and the tree's counters).

:class:`MatchResult` and :class:`InsertResult` compute per-chunk details lazily from the tree that made
them, so a caller that needs only the hit length pays for nothing else; both are valid until the tree
changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixkv.errors import InputError

if TYPE_CHECKING:
    from radixkv.tree import RadixTree

__all__ = ["DropResult", "InsertResult", "MatchResult", "TreeStats"]


class DropResult:
    """Nodes that left the tree (no tier holds them any more) and the orphans dropped with them.
    Immutable, compared and hashed by its two tuples, like the frozen dataclass it was: written out
    because that dataclass's ``__init__`` ran as Python even in the compiled build (each field set
    through ``object.__setattr__``), once per ``evict`` call: ~2 % of a replay's instructions."""

    __slots__ = ("_removed", "_orphaned")

    def __init__(self, removed_node_ids: tuple[int, ...] = (), orphaned_node_ids: tuple[int, ...] = ()) -> None:
        self._removed = removed_node_ids
        self._orphaned = orphaned_node_ids

    @property
    def removed_node_ids(self) -> tuple[int, ...]:
        return self._removed

    @property
    def orphaned_node_ids(self) -> tuple[int, ...]:
        return self._orphaned

    @property
    def dropped_chunks(self) -> int:
        return len(self._removed) + len(self._orphaned)

    def __eq__(self, other: object) -> bool:
        if type(other) is not DropResult:
            return NotImplemented
        return self._removed == other._removed and self._orphaned == other._orphaned

    def __hash__(self) -> int:
        return hash((self._removed, self._orphaned))

    def __repr__(self) -> str:
        return f"DropResult(removed_node_ids={self._removed!r}, orphaned_node_ids={self._orphaned!r})"

    def __reduce__(self) -> tuple[type[DropResult], tuple[tuple[int, ...], tuple[int, ...]]]:
        # copy, deepcopy and pickle rebuild it from its fields through __init__ (the compiled
        # build's own pickling support would set the private attributes afterwards).
        return DropResult, (self._removed, self._orphaned)


class InsertResult:
    """Ids of every key of the insert, root->leaf (existing ones touched, missing ones created).
    The ids of the chunks that were already present are looked up lazily, so a caller that needs only
    the new ones pays nothing for a long matched prefix. Valid until the tree changes."""

    __slots__ = ("new_node_ids", "_match", "_ids")

    def __init__(self, match: MatchResult | None = None, new_node_ids: tuple[int, ...] = ()) -> None:
        self.new_node_ids = new_node_ids
        self._match = match
        self._ids: tuple[int, ...] | None = None if match is not None and match.hit_chunks else new_node_ids

    @property
    def node_ids(self) -> tuple[int, ...]:
        if self._ids is None:
            self._ids = tuple(self._match.node_ids) + self.new_node_ids  # type: ignore[union-attr]
        return self._ids

    @property
    def present_chunks(self) -> int:
        """Leading keys that were already in the tree (any tier) before this insert: the hit a
        ``match(..., touch=False)`` right before it would have reported."""
        return self._match.hit_chunks if self._match is not None else 0

    @property
    def inserted_chunks(self) -> int:
        return self.present_chunks + len(self.new_node_ids)

    def __repr__(self) -> str:
        return f"InsertResult(inserted_chunks={self.inserted_chunks}, new={len(self.new_node_ids)})"


class MatchResult:
    """The longest prefix of a key chain present in any tier. Per-chunk details are computed lazily,
    so a caller that needs only ``hit_chunks`` pays for nothing else. Valid until the tree changes."""

    __slots__ = ("hit_chunks", "_tree", "_ids", "_keys", "_index", "_masks", "_last")

    def __init__(
        self, tree: RadixTree, keys: list[str], index: dict[str, int], hit_chunks: int,
        last: int | None = None,
    ):
        self.hit_chunks = hit_chunks
        self._last = last
        self._tree = tree
        self._keys = keys
        self._index = index
        # None until asked for. (Left unset instead, as before, a first read raised and caught an
        # AttributeError: ~5,000 instructions compiled, 17 % of an opt replay at 50 %, which reads
        # every request's ids; the two stores here cost a few.)
        self._ids: list[int] | None = None
        self._masks: list[int] | None = None

    @property
    def node_ids(self) -> list[int]:
        """Node ids of the hit chunks, root->leaf."""
        ids = self._ids
        if ids is None:
            ids = []
            index, keys = self._index, self._keys
            try:
                for i in range(self.hit_chunks):
                    ids.append(index[keys[i]])
            except KeyError as e:
                # The fast match trusts a list that looks like one chain (its depth span and last
                # link agree); keys that are not one (never a real hash chain) can pass that check
                # while a key in between is absent.
                raise InputError(
                    f"keys are not one chain: key {e.args[0]!r} is not in the tree although the keys "
                    "around it are; pass one chain of chunk keys (match(..., verify=True) walks it "
                    "link by link)"
                ) from None
            self._ids = ids
        return ids

    @property
    def last_node_id(self) -> int | None:
        if self._last is None and self.hit_chunks:
            self._last = self._index[self._keys[self.hit_chunks - 1]]
        return self._last

    @property
    def tier_masks(self) -> list[int]:
        """Residency bitmask per hit chunk (bit i set = resident in ``tree.tiers[i]``)."""
        masks = self._masks
        if masks is None:
            column = self._tree._mask
            masks = [column[n] for n in self.node_ids]
            self._masks = masks
        return masks

    def tier_of(self, i: int) -> str:
        """Name of the fastest (first-listed) tier holding hit chunk ``i``."""
        mask = self.tier_masks[i]
        return self._tree.tiers[(mask & -mask).bit_length() - 1]

    def hit_chunks_in(self, tier: str) -> int:
        """Leading run of hit chunks resident in ``tier``."""
        bit = 1 << self._tree.tier_index(tier)
        n = 0
        for mask in self.tier_masks:
            if not mask & bit:
                break
            n += 1
        return n

    def __repr__(self) -> str:
        return f"MatchResult(hit_chunks={self.hit_chunks})"


@dataclass(slots=True)
class TreeStats:
    inserted_chunks: int = 0
    removed_chunks: int = 0
    orphan_drops: int = 0
    extra: dict[str, int] = field(default_factory=dict)
