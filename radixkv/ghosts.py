"""Ghost histories: bounded FIFOs of chunks that left a tier, for the policies that remember them.

s3fifo readmits a chunk whose key is in its ghost FIFO to its main queue; agedref restores a returning
chunk's aged reference count; oddsref credits the class of the request that created it. Each keeps a
:class:`GhostHistory`: the chunks' names in arrival order, each with a float and an integer of the
policy's (agedref: the score and the last touch; oddsref: a packed class; s3fifo: nothing), bounded by
the caller (:meth:`GhostHistory.trim`, :meth:`GhostHistory.pop_oldest`).

Naming. A chunk is ``(namespace, key)``: the same key may be cached in two namespaces. Building that
tuple for every eviction and insert was a large part of these policies' cost, so a chunk of the first
namespace a history sees (the only one in a simulation, and in most stores) is named by its key
alone, and one of any other namespace by the tuple: a ``str`` never equals a ``tuple``, so the two
kinds never collide and the naming stays one to one.

Layout. A dict maps each name to a slot; the slots' values and the FIFO's links (a doubly linked list,
oldest to newest) are ``vec`` columns, and freed slots are reused. Same semantics as the
``OrderedDict`` it replaces (a put of a name already held updates its values in place, keeping its
position), without an ordered-dict node, a value tuple and a float allocated per entry.
"""

from __future__ import annotations

from typing import final

from librt.vecs import append, pop, vec
from mypy_extensions import i64

__all__ = ["GhostHistory"]


@final
class GhostHistory:
    """Chunks that left a tier, oldest first, each with a float and an integer (see the module
    docstring). ``last_score`` / ``last_aux``: the values of the entry the last successful
    :meth:`take` removed."""

    def __init__(self) -> None:
        self._ns0: str | None = None  # the first namespace seen: its chunks are named by key alone
        self._slot: dict[object, int] = {}  # name -> slot
        self._names: list[object] = []  # by slot: its name (None: a free slot)
        self._score: vec[float] = vec[float]()  # by slot
        self._aux: vec[i64] = vec[i64]()  # by slot
        self._newer: vec[i64] = vec[i64]()  # by slot: the next newer entry (-1: none)
        self._older: vec[i64] = vec[i64]()  # by slot: the next older entry (-1: none)
        self._oldest: i64 = -1
        self._newest: i64 = -1
        self._free: vec[i64] = vec[i64]()  # free slots
        self.last_score = 0.0
        self.last_aux: i64 = 0

    def __len__(self) -> int:
        return len(self._slot)

    def _name(self, ns: str | None, key: str | None) -> object:
        ns0 = self._ns0
        if ns0 is None and ns is not None:
            self._ns0 = ns0 = ns
        if ns == ns0 and ns is not None and key is not None:
            return key
        return (ns, key)  # also a None key: a bare None would read as a free slot in _names

    def contains(self, ns: str | None, key: str | None) -> bool:
        return self._name(ns, key) in self._slot

    def put(self, ns: str | None, key: str | None, score: float = 0.0, aux: i64 = 0) -> None:
        """Remember chunk ``key`` of ``ns`` as the newest entry, with ``score`` and ``aux``; if it is
        held already, its values change and its place does not."""
        name = self._name(ns, key)
        # One probe of the dict, not a get and a store: the slot a new entry would take (the last
        # free one, else a new one) is offered to setdefault, and taken only if the name was new.
        free = self._free
        offer: i64 = free[len(free) - 1] if len(free) else len(self._names)
        s: i64 = self._slot.setdefault(name, offer)
        if s == offer:
            if len(free):
                self._free, _ = pop(free)
                self._names[s] = name
            else:
                self._names.append(name)
                self._score = append(self._score, 0.0)
                self._aux = append(self._aux, 0)
                self._newer = append(self._newer, -1)
                self._older = append(self._older, -1)
            # link at the newest end
            h = self._newest
            self._older[s] = h
            self._newer[s] = -1
            if h >= 0:
                self._newer[h] = s
            else:
                self._oldest = s
            self._newest = s
        self._score[s] = score
        self._aux[s] = aux

    def take(self, ns: str | None, key: str | None) -> bool:
        """Forget chunk ``key`` of ``ns``; True (its values in ``last_score`` / ``last_aux``) if it
        was held."""
        name = self._name(ns, key)
        slot = self._slot
        # get, then del on a hit: most takes miss, and a get is one native probe where pop(name, -1)
        # is a method call when compiled
        s = slot.get(name, -1)
        if s < 0:
            return False
        del slot[name]
        self.last_score = self._score[s]
        self.last_aux = self._aux[s]
        self._release(s)
        return True

    def pop_oldest(self) -> None:
        """Forget the oldest entry (no-op if empty)."""
        s = self._oldest
        if s >= 0:
            del self._slot[self._names[s]]
            self._release(s)

    def trim(self, bound: float) -> None:
        """Forget the oldest entries until at most ``bound`` are left."""
        while float(len(self._slot)) > bound:  # as floats: native when compiled (int > float is not)
            self.pop_oldest()

    def _release(self, s: i64) -> None:
        # Unlink slot s (its name already left the dict) and free it.
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
        cols = (len(self._score), len(self._aux), len(self._newer), len(self._older))
        assert all(c == n_slots for c in cols), f"ghosts: {n_slots} slots, columns of {cols}"
        walked = self.names()
        assert len(walked) == len(self._slot), (
            f"ghosts: {len(walked)} entries linked oldest to newest, {len(self._slot)} named"
        )
        ns0 = self._ns0
        for s, name in enumerate(self._names):
            if name is not None:
                assert self._slot.get(name) == s, f"ghosts: slot {s} holds {name!r}, named at {self._slot.get(name)}"
                # One name per chunk (see _name): a key alone in the first namespace, a pair otherwise
                # (a pair of the first namespace is never looked up: its chunk would be missed).
                if isinstance(name, tuple):
                    ok = name[0] != ns0 or ns0 is None or name[1] is None
                else:
                    ok = ns0 is not None
                assert ok, f"ghosts: slot {s} names {name!r}, not as _name does (first namespace {ns0!r})"
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
