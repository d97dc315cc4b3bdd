"""radixkv.spans: overlap checks of byte ranges (used by the host copier and the paged kernels)."""

from __future__ import annotations

from radixkv.spans import first_overlap, merged, overlaps_any


def test_first_overlap_reports_the_pair_in_given_order():
    assert first_overlap([(0, 10), (10, 20), (30, 40)]) is None  # touching is not overlapping
    assert first_overlap([(30, 40), (0, 10), (35, 36)]) == (0, 2)
    assert first_overlap([(5, 6), (5, 6)]) == (0, 1)
    assert first_overlap([]) is None


def test_merged_and_overlaps_any():
    m = merged([(30, 40), (0, 10), (5, 12), (12, 14)])
    assert m == ((0, 14), (30, 40))
    assert overlaps_any((13, 20), m) and overlaps_any((25, 31), m) and overlaps_any((-5, 1), m)
    assert not overlaps_any((14, 30), m) and not overlaps_any((40, 50), m) and not overlaps_any((1, 2), ())
