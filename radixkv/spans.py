"""Byte ranges ``[start, end)`` of buffers in one address space, and whether they overlap.

Copies check these before the first byte moves (host copies, paged gather/scatter): overlapping
destinations, or a source inside a destination, make the result depend on the order of the copies.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence

__all__ = ["copy_conflict", "first_overlap", "merged", "overlaps_any"]


def first_overlap(spans: Iterable[tuple[int, int]]) -> tuple[int, int] | None:
    """Indices (in the given order, smaller first) of two spans that overlap, or None."""
    order = sorted((a, b, i) for i, (a, b) in enumerate(spans) if a < b)  # empty spans overlap nothing
    for (_a0, b0, i0), (a1, _b1, i1) in zip(order, order[1:]):
        if a1 < b0:
            return min(i0, i1), max(i0, i1)
    return None


def merged(spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The spans sorted and merged where they touch or overlap (for :func:`overlaps_any`)."""
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if a >= b:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def overlaps_any(span: tuple[int, int], sorted_spans: Sequence[tuple[int, int]]) -> bool:
    """Whether ``span`` overlaps one of ``sorted_spans`` (sorted, disjoint: :func:`merged`)."""
    a, b = span
    if a >= b:
        return False  # an empty span overlaps nothing (as in copy_conflict)
    k = bisect.bisect_right(sorted_spans, (a, float("inf"))) - 1
    return (k >= 0 and sorted_spans[k][1] > a) or (k + 1 < len(sorted_spans) and sorted_spans[k + 1][0] < b)


def copy_conflict(dsts: Sequence[tuple[int, int]], srcs: Sequence[tuple[int, int]]) -> str | None:
    """``"destinations"`` if two destination spans overlap, ``"source"`` if a source overlaps a
    destination, else None (sources may overlap each other). One sort and one sweep, whatever the
    number of spans (a batch copy has hundreds)."""
    spans = sorted([(a, b, True) for a, b in dsts] + [(a, b, False) for a, b in srcs])
    end_dst = end_src = -1  # the furthest end of the destinations / sources that started so far
    for a, b, is_dst in spans:
        if a >= b:
            continue  # empty spans overlap nothing
        if is_dst:
            if a < end_dst:
                return "destinations"
            if a < end_src:
                return "source"
            end_dst = max(end_dst, b)
        else:
            if a < end_dst:
                return "source"
            end_src = max(end_src, b)
    return None
