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

Layout. The entries live in a ring of slots in arrival order (entry number q in slot q modulo the
ring's size); their names and values are columns. A put writes at the newest end and forgetting the
oldest reads at the other, so both touch memory the last ones touched; a take (a chunk coming back)
leaves a hole that the oldest end skips, and a full ring is repacked without its holes. Before, the
entries were a doubly linked list over reused free slots: every put and pop wrote the links and
values of a random slot and its neighbours (a free list and two link columns that the ring does
without). Same semantics as the ``OrderedDict`` it replaces (a put of a name
already held updates its values in place, keeping its position), without an ordered-dict node, a
value tuple and a float allocated per entry.

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

from librt.vecs import vec
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
    :meth:`take` removed; ``last_hash``: the hash of the last :meth:`take`'s chunk."""

    def __init__(self) -> None:
        self._ns0: str | None = None  # the first namespace seen: its chunks are named by key alone
        # The ring: _size slots (a power of two); entry number q lives in slot q & (_size - 1).
        # Numbers _head .. _tail - 1 are in arrival order; a taken entry leaves a hole (name None)
        # until the oldest end passes it or the ring is repacked (_repack).
        self._size: i64 = 16
        self._names: list[object] = [None] * 16  # by slot: its name (None: a hole, or unused)
        self._hash: vec[i64] = vec[i64]([0] * 16)  # by slot: its name's hash
        self._score: vec[float] = vec[float]([0.0] * 16)  # by slot
        self._aux: vec[i64] = vec[i64]([0] * 16)  # by slot
        self._head: i64 = 0  # number of the oldest entry (or hole)
        self._tail: i64 = 0  # number the next entry gets
        self._n: i64 = 0  # entries (holes not counted)
        # The index: _cap positions (a power of two), at most half of them used; each is
        # (hash & _LOW) << 32 | slot, or -1 if empty (see _find).
        self._cap: i64 = 16
        self._tab: vec[i64] = vec[i64]([-1] * 16)
        self.last_score = 0.0
        self.last_aux: i64 = 0
        self.last_hash: i64 = -1

    def __len__(self) -> int:
        return int(self._n)

    def _name(self, ns: str | None, key: str | None) -> object:
        ns0 = self._ns0
        if ns is ns0 and ns is not None and key is not None:  # the tree's one namespace object
            return key
        if ns0 is None and ns is not None:
            self._ns0 = ns0 = ns
        if ns == ns0 and ns is not None and key is not None:
            return key
        return (ns, key)  # also a None key: a bare None would read as a hole in _names

    def _find(self, name: object, h: i64) -> i64:
        """The index position holding ``name`` (hash ``h``); if it is not held, ``-2 - i`` for the
        empty position ``i`` where a probe for it ends (where :meth:`put` places it)."""
        tab, mask, names = self._tab, self._cap - 1, self._names
        low = h & _LOW
        i = low & mask
        while True:
            v = tab[i]
            if v < 0:
                return -2 - i
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

    def _repack(self, entries: i64) -> None:
        # No slot for the next entry, or an index that would be over half full: move the entries,
        # in order, to the front of a ring of at least 2x ``entries`` slots (holes dropped) and
        # index them again in at least twice as many positions (powers of two, at least 16). Holes
        # come only from takes and leave as the oldest end passes them, so the ring fills again
        # only after as many puts as it holds entries: O(1) per put, amortized. (With 1.25x, a
        # growing history, as in a simulation whose ghost bound exceeds the trace's blocks, was
        # repacked every 25 % of growth: 11 % of oddsref's instructions at 10 % of the Mooncake
        # trace, now 8 %; about 24 bytes more per entry: 32 a slot.) It also shrinks both after a
        # trim.
        size: i64 = 16
        while size < 2 * entries:
            size *= 2
        cap: i64 = 16
        while cap < 2 * entries:
            cap *= 2
        names: list[object] = [None] * size
        hashes, scores, auxs = vec[i64]([0] * size), vec[float]([0.0] * size), vec[i64]([0] * size)
        old_names, old_hash, old_score, old_aux = self._names, self._hash, self._score, self._aux
        old_mask = self._size - 1
        k: i64 = 0
        q = self._head
        while q < self._tail:
            s = q & old_mask
            name = old_names[s]
            if name is not None:
                names[k] = name
                hashes[k] = old_hash[s]
                scores[k] = old_score[s]
                auxs[k] = old_aux[s]
                k += 1
            q += 1
        self._names, self._hash, self._score, self._aux = names, hashes, scores, auxs
        self._size, self._head, self._tail = size, 0, k
        self._cap = cap
        self._tab = vec[i64]([-1] * cap)
        for s in range(k):
            self._place(hashes[s], s)

    def contains(self, ns: str | None, key: str | None) -> bool:
        name = self._name(ns, key)
        return self._find(name, hash(name)) >= 0

    def put(self, ns: str | None, key: str | None, score: float = 0.0, aux: i64 = 0, h: i64 = -1) -> None:
        """Remember chunk ``key`` of ``ns`` as the newest entry, with ``score`` and ``aux``; if it is
        held already, its values change and its place does not. ``h``: the hash of its name, if the
        caller has it (``last_hash`` after a :meth:`take` of the same chunk; -1, which no hash is:
        computed here)."""
        name = self._name(ns, key)
        if h == -1:
            h = hash(name)
        i = self._find(name, h)
        if i >= 0:
            s = self._tab[i] & _SLOT
        else:
            if self._tail - self._head >= self._size or 2 * (self._n + 1) > self._cap:
                # a full ring, or an index that would be over half full
                self._repack(self._n + 1)
                i = self._find(name, h)  # the index is another one now
            s = self._tail & (self._size - 1)
            self._tail += 1
            self._names[s] = name
            self._hash[s] = h
            self._tab[-2 - i] = (h & _LOW) << 32 | s  # the empty position the probe ended at
            self._n += 1
        self._score[s] = score
        self._aux[s] = aux

    def take(self, ns: str | None, key: str | None) -> bool:
        """Forget chunk ``key`` of ``ns``; True (its values in ``last_score`` / ``last_aux``) if it
        was held. Either way ``last_hash`` is the hash its name is indexed by, for a later
        :meth:`put` of the same chunk (compiled, a 64-bit hash comes back from ``hash()`` as a
        Python int, boxed half the time: a policy that looks a chunk up when it arrives and
        remembers it when it leaves hashes it once)."""
        name = self._name(ns, key)
        h: i64 = hash(name)
        self.last_hash = h
        i = self._find(name, h)
        if i < 0:
            return False
        s = self._tab[i] & _SLOT
        self._unplace(i)
        self.last_score = self._score[s]
        self.last_aux = self._aux[s]
        self._names[s] = None  # a hole, passed over by the oldest end
        self._n -= 1
        return True

    def pop_oldest(self) -> None:
        """Forget the oldest entry (no-op if empty)."""
        if self._n <= 0:
            return
        names, mask = self._names, self._size - 1
        q = self._head
        while names[q & mask] is None:  # holes left by take; an entry follows (_n > 0)
            q += 1
        s = q & mask
        self._head = q + 1
        # Its position, found by slot from its hash's home: no name comparison.
        tab, imask = self._tab, self._cap - 1
        i = self._hash[s] & _LOW & imask
        while (tab[i] & _SLOT) != s:  # never an empty position: s is placed at or after its home
            i = (i + 1) & imask
        self._unplace(i)
        names[s] = None
        self._n -= 1

    def trim(self, bound: float) -> None:
        """Forget the oldest entries until at most ``bound`` are left."""
        while float(self._n) > bound:
            self.pop_oldest()

    def _slots(self) -> list[int]:
        # The entries' slots, oldest first.
        names, mask = self._names, self._size - 1
        return [int(q & mask) for q in range(self._head, self._tail) if names[q & mask] is not None]

    def names(self) -> list[object]:
        """The entries' names, oldest first (a key, or ``(namespace, key)``; see the module
        docstring): for tests and inspection."""
        return [self._names[s] for s in self._slots()]

    def aux_values(self) -> list[int]:
        """The entries' integers, oldest first (for checks and inspection)."""
        return [int(self._aux[s]) for s in self._slots()]

    def check_integrity(self) -> None:
        size, names = self._size, self._names
        cols = (len(names), len(self._hash), len(self._score), len(self._aux))
        assert size >= 16 and size & (size - 1) == 0 and all(c == size for c in cols), (
            f"ghosts: a ring of {size} slots, columns of {cols}"
        )
        assert 0 <= self._head <= self._tail <= self._head + size, (
            f"ghosts: entries {self._head} .. {self._tail} in a ring of {size} slots"
        )
        live = self._slots()
        assert len(live) == self._n, f"ghosts: {len(live)} entries between the ends, {self._n} counted"
        held = set(live)
        outside = [s for s in range(size) if names[s] is not None and s not in held]
        assert not outside, f"ghosts: slots outside the ring's entries hold names, e.g. {outside[:5]}"
        ns0 = self._ns0
        for s in live:
            name = names[s]
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
        cap, tab = self._cap, self._tab
        assert cap >= 16 and cap & (cap - 1) == 0 and len(tab) == cap, f"ghosts: index of {cap} positions, {len(tab)} numbers"
        assert 2 * self._n <= cap, f"ghosts: {self._n} entries in an index of {cap} positions (over half full)"
        placed = [int(tab[i] & _SLOT) for i in range(cap) if tab[i] >= 0]
        assert sorted(placed) == sorted(live), "ghosts: the index places other slots than the held ones"
