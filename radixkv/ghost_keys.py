"""How the eviction policies' ghost histories name a chunk that left: by key, without allocating.

A ghost history (s3fifo's, agedref's, oddsref's) remembers evicted chunks by ``(namespace, key)``,
since the same key may be cached in two namespaces. Building that tuple for every eviction and every
insert was a large part of those policies' cost (an allocation, and a tuple hash per probe). Almost
every tree holds one namespace (a simulation always does, a store mostly), so a chunk of the first
namespace a history sees is named by its key alone, and one of any other namespace by the tuple: a
``str`` never equals a ``tuple``, so the two kinds never collide and the naming stays one to one.
"""

from __future__ import annotations

from typing import final

__all__ = ["GhostKeys"]


@final
class GhostKeys:
    """Names ghost-history entries (see the module docstring); one per history owner."""

    def __init__(self) -> None:
        self._ns0: str | None = None  # the first namespace seen: its chunks are named by key alone

    def of(self, ns: str | None, key: str | None) -> object:
        """The entry name of chunk ``key`` of namespace ``ns``."""
        ns0 = self._ns0
        if ns0 is None and ns is not None:
            self._ns0 = ns0 = ns
        if ns == ns0 and ns is not None:
            return key
        return (ns, key)
