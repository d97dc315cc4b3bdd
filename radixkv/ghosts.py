"""Ghost histories: bounded FIFOs of chunks that left a tier, for the policies that remember them.

s3fifo readmits a chunk whose key is in its ghost FIFO to its main queue; agedref restores a returning
chunk's aged reference count; oddsref credits the class of the request that created it. Each keeps a
:class:`GhostHistory`: the chunks' names in arrival order, each with a float and an integer of the
policy's (agedref: the score and the last touch; oddsref: a class number; s3fifo: nothing), bounded by
the caller (:meth:`GhostHistory.trim`, :meth:`GhostHistory.pop_oldest`).

Naming. A chunk is ``(namespace, key)``: the same key may be cached in two namespaces. Building that
tuple for every eviction and insert was a large part of these policies' cost, so a chunk of the first
namespace a history sees (the only one in a simulation, and in most stores) is named by its key
alone, and one of any other namespace by the tuple: a ``str`` never equals a ``tuple``, so the two
kinds never collide and the naming stays one to one.

Layout. Each entry lives in a slot; the slots' names, values and FIFO links (a doubly linked list,
oldest to newest) are columns, and freed slots are reused. Same semantics as the ``OrderedDict`` it
replaces (a put of a name already held updates its values in place, keeping its position), without
an ordered-dict node, a value tuple and a float allocated per entry.

Index. Names are found through an open-addressing hash table of its own, not a dict: one ``vec`` of
positions, each the low 31 bits of a name's hash and its slot packed in one 64-bit number (-1:
empty), probed linearly from the hash's home position, at most half full, with backward-shift
deletion (no tombstones). A history holds up to 32x a tier's chunks and turns over
once per eviction, so its index lives outside the CPU caches: a dict probe reads its index array and
then its entries (two cache misses, more for an absent name past deleted entries, and a rebuild
now and then to clear those), where a linear probe of adjacent positions reads one cache line (8
bytes a position: a history of 60k names indexes in 1 MiB), and
forgetting the oldest entry needs no name comparison (its hash is kept by slot). Hashes are
Python's ``hash``: in-process only, never persisted.
"""

from __future__ import annotations

from typing import Final, final

from librt.vecs import append, pop, vec
from mypy_extensions import i64

__all__ = ["GhostHistory"]

# An index position packs the low 31 bits of a name's hash above its slot (below 2**32): never
# negative, so -1 marks an empty position. Final: C constants when compiled.
_LOW: Final = (1 << 31) - 1
_SLOT: Final = (1 << 32) - 1


@final
class GhostHistory:
    """Chunks that left a tier, oldest first, each with a float and an integer (see the module
    docstring). ``last_score`` / ``last_aux``: the values of the entry the last successful
    :meth:`take` removed."""

    def __init__(self) -> None:
        self._ns0: str | None = None  # the first namespace seen: its chunks are named by key alone
        self._names: list[object] = []  # by slot: its name (None: a free slot)
        self._hash: vec[i64] = vec[i64]()  # by slot: its name's hash
        self._score: vec[float] = vec[float]()  # by slot
        self._aux: vec[i64] = vec[i64]()  # by slot
        self._newer: vec[i64] = vec[i64]()  # by slot: the next newer entry (-1: none)
        self._older: vec[i64] = vec[i64]()  # by slot: the next older entry (-1: none)
        self._oldest: i64 = -1
        self._newest: i64 = -1
        self._free: vec[i64] = vec[i64]()  # free slots
        self._n: i64 = 0  # entries
        # The index: _cap positions (a power of two), at most half of them used; each is
        # (hash & _LOW) << 32 | slot, or -1 if empty (see _find).
        self._cap: i64 = 16
        self._tab: vec[i64] = vec[i64]([-1] * 16)
        self.last_score = 0.0
        self.last_aux: i64 = 0

    def __len__(self) -> int:
        return int(self._n)

    def _name(self, ns: str | None, key: str | None) -> object:
        ns0 = self._ns0
        if ns0 is None and ns is not None:
            self._ns0 = ns0 = ns
        if ns == ns0 and ns is not None and key is not None:
            return key
        return (ns, key)  # also a None key: a bare None would read as a free slot in _names

    def _find(self, name: object, h: i64) -> i64:
        """The index position holding ``name`` (hash ``h``), or -1."""
        tab, mask, names = self._tab, self._cap - 1, self._names
        low = h & _LOW
        i = low & mask
        while True:
            v = tab[i]
            if v < 0:
                return -1
            if v >> 32 == low:  # the low 31 bits of the hash agree: compare the names
                held = names[v & _SLOT]
                # `is` first: a trace's keys, and the tree's, are one object per key (no comparison)
                if held is name or held == name:
                    return i
            i = (i + 1) & mask

    def _place(self, h: i64, s: i64) -> None:
        # Slot s (hash h, not in the index) into the first empty position from h's home.
        tab, mask = self._tab, self._cap - 1
        low = h & _LOW
        i = low & mask
        while tab[i] >= 0:
            i = (i + 1) & mask
        tab[i] = low << 32 | s

    def _unplace(self, i: i64) -> None:
        # Empty index position i, shifting back the entries after it that probed past it (so every
        # entry stays reachable from its home without a run of empty positions in between).
        tab, mask = self._tab, self._cap - 1
        while True:
            tab[i] = -1
            j = i
            while True:
                j = (j + 1) & mask
                v = tab[j]
                if v < 0:
                    return
                home = (v >> 32) & mask
                # j's entry stays if its home lies cyclically in (i, j]
                if (i < j and i < home <= j) or (i > j and (home > i or home <= j)):
                    continue
                tab[i] = v
                i = j
                break

    def _grow_index(self) -> None:
        # Twice the positions; every held slot placed again.
        cap = self._cap * 2
        self._cap = cap
        self._tab = vec[i64]([-1] * cap)
        hashes = self._hash
        s = self._oldest
        while s >= 0:
            self._place(hashes[s], s)
            s = self._newer[s]

    def contains(self, ns: str | None, key: str | None) -> bool:
        name = self._name(ns, key)
        return self._find(name, hash(name)) >= 0

    def put(self, ns: str | None, key: str | None, score: float = 0.0, aux: i64 = 0) -> None:
        """Remember chunk ``key`` of ``ns`` as the newest entry, with ``score`` and ``aux``; if it is
        held already, its values change and its place does not."""
        name = self._name(ns, key)
        h: i64 = hash(name)
        i = self._find(name, h)
        if i >= 0:
            s = self._tab[i] & _SLOT
        else:
            if 2 * (self._n + 1) > self._cap:
                self._grow_index()
            if len(self._free):
                self._free, s = pop(self._free)
                self._names[s] = name
                self._hash[s] = h
            else:
                s = len(self._names)
                self._names.append(name)
                self._hash = append(self._hash, h)
                self._score = append(self._score, 0.0)
                self._aux = append(self._aux, 0)
                self._newer = append(self._newer, -1)
                self._older = append(self._older, -1)
            self._place(h, s)
            self._n += 1
            # link at the newest end
            o = self._newest
            self._older[s] = o
            self._newer[s] = -1
            if o >= 0:
                self._newer[o] = s
            else:
                self._oldest = s
            self._newest = s
        self._score[s] = score
        self._aux[s] = aux

    def take(self, ns: str | None, key: str | None) -> bool:
        """Forget chunk ``key`` of ``ns``; True (its values in ``last_score`` / ``last_aux``) if it
        was held."""
        name = self._name(ns, key)
        i = self._find(name, hash(name))
        if i < 0:
            return False
        s = self._tab[i] & _SLOT
        self._unplace(i)
        self.last_score = self._score[s]
        self.last_aux = self._aux[s]
        self._release(s)
        return True

    def pop_oldest(self) -> None:
        """Forget the oldest entry (no-op if empty)."""
        s = self._oldest
        if s >= 0:
            # Its position, found by slot from its hash's home: no name comparison.
            tab, mask = self._tab, self._cap - 1
            i = self._hash[s] & _LOW & mask
            while (tab[i] & _SLOT) != s:  # never an empty position: s is placed at or after its home
                i = (i + 1) & mask
            self._unplace(i)
            self._release(s)

    def trim(self, bound: float) -> None:
        """Forget the oldest entries until at most ``bound`` are left."""
        while float(self._n) > bound:
            self.pop_oldest()

    def _release(self, s: i64) -> None:
        # Unlink slot s (its index position already emptied) and free it.
        newer, older = self._newer, self._older
        nw, od = newer[s], older[s]
        if nw >= 0:
            older[nw] = od
        else:
            self._newest = od
        if od >= 0:
            newer[od] = nw
        else:
            self._oldest = nw
        newer[s] = older[s] = -1
        self._names[s] = None
        self._free = append(self._free, s)
        self._n -= 1

    def names(self) -> list[object]:
        """The entries' names, oldest first (a key, or ``(namespace, key)``; see the module
        docstring): for tests and inspection."""
        out: list[object] = []
        s = self._oldest
        while s >= 0 and len(out) <= len(self._names):
            out.append(self._names[s])
            s = self._newer[s]
        return out

    def aux_values(self) -> list[int]:
        """The entries' integers, oldest first (for checks and inspection)."""
        out: list[int] = []
        s = self._oldest
        while s >= 0 and len(out) <= len(self._names):
            out.append(int(self._aux[s]))
            s = self._newer[s]
        return out

    def check_integrity(self) -> None:
        n_slots = len(self._names)
        cols = (len(self._hash), len(self._score), len(self._aux), len(self._newer), len(self._older))
        assert all(c == n_slots for c in cols), f"ghosts: {n_slots} slots, columns of {cols}"
        walked = self.names()
        assert len(walked) == self._n, f"ghosts: {len(walked)} entries linked oldest to newest, {self._n} counted"
        ns0 = self._ns0
        held = 0
        for s, name in enumerate(self._names):
            if name is not None:
                held += 1
                assert self._hash[s] == hash(name), f"ghosts: slot {s} keeps {self._hash[s]} as the hash of {name!r}"
                at = self._find(name, self._hash[s])
                assert at >= 0 and (self._tab[at] & _SLOT) == s, f"ghosts: slot {s} holds {name!r}, indexed at {at}"
                # One name per chunk (see _name): a key alone in the first namespace, a pair otherwise
                # (a pair of the first namespace is never looked up: its chunk would be missed).
                if isinstance(name, tuple):
                    ok = name[0] != ns0 or ns0 is None or name[1] is None
                else:
                    ok = ns0 is not None
                assert ok, f"ghosts: slot {s} names {name!r}, not as _name does (first namespace {ns0!r})"
        assert held == self._n, f"ghosts: {held} named slots, {self._n} counted"
        cap, tab = self._cap, self._tab
        assert cap >= 16 and cap & (cap - 1) == 0 and len(tab) == cap, f"ghosts: index of {cap} positions, {len(tab)} numbers"
        assert 2 * self._n <= cap, f"ghosts: {self._n} entries in an index of {cap} positions (over half full)"
        placed = [int(tab[i] & _SLOT) for i in range(cap) if tab[i] >= 0]
        assert sorted(placed) == sorted(s for s, name in enumerate(self._names) if name is not None), (
            "ghosts: the index places other slots than the held ones"
        )
        free = sorted(int(s) for s in self._free)
        assert free == [s for s, name in enumerate(self._names) if name is None], "ghosts: free slots drifted"
        # The backward links too: _release unlinks through them, so a wrong one breaks the list at
        # the next take or pop_oldest (the forward walk alone never reads them). The forward walk
        # ends: it was counted above.
        older, s, prev = self._older, self._oldest, -1
        while s >= 0:
            assert older[s] == prev, f"ghosts: slot {s} links {older[s]} as older, {prev} precedes it"
            prev, s = s, self._newer[s]
        assert prev == self._newest, f"ghosts: the newest end is slot {self._newest}, the list's is {prev}"
