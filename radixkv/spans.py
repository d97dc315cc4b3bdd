"""Byte ranges ``[start, end)`` of buffers in one address space, and whether they overlap.

Copies check these before the first byte moves (host copies, paged gather/scatter): overlapping
destinations, or a source inside a destination, make the result depend on the order of the copies.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence

__all__ = ["first_overlap", "merged", "overlaps_any"]


def first_overlap(spans: Iterable[tuple[int, int]]) -> tuple[int, int] | None:
    """Indices (in the given order, smaller first) of two spans that overlap, or None."""
    order = sorted((a, b, i) for i, (a, b) in enumerate(spans))
    for (_a0, b0, i0), (a1, _b1, i1) in zip(order, order[1:]):
        if a1 < b0:
            return min(i0, i1), max(i0, i1)
    return None


def merged(spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The spans sorted and merged where they touch or overlap (for :func:`overlaps_any`)."""
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def overlaps_any(span: tuple[int, int], sorted_spans: Sequence[tuple[int, int]]) -> bool:
    """Whether ``span`` overlaps one of ``sorted_spans`` (sorted, disjoint: :func:`merged`)."""
    a, b = span
    k = bisect.bisect_right(sorted_spans, (a, float("inf"))) - 1
    return (k >= 0 and sorted_spans[k][1] > a) or (k + 1 < len(sorted_spans) and sorted_spans[k + 1][0] < b)
