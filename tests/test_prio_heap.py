"""PrioHeap against a plain reference: a dict of keys whose minimum is taken by ``min``."""

from __future__ import annotations

import math
import random

import pytest

from radixkv.prio_heap import PrioHeap


def _key(ref: dict[int, tuple[float, int]], n: int) -> tuple[float, int, int]:
    prio, depth = ref[n]
    return (prio, -depth, n)


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_match_a_sorted_reference(seed):
    r = random.Random(seed)
    cap = r.choice([1, 2, 7, 64, 300])
    h, ref = PrioHeap(), {}  # ref: node -> (prio, depth) of the nodes in the heap
    last: dict[int, tuple[float, int]] = {}  # node -> (prio, depth) as last pushed
    h.grow(cap)
    # Few distinct priorities and depths: ties on both are common, so the tie-breaks are exercised.
    prios = [-math.inf, -1.5, 0.0, 0.0, 1.0, 2.5, 1e15] if seed % 2 else [float(r.randrange(4)) for _ in range(3)]
    for step in range(3000):
        x = r.random()
        n = r.randrange(cap)
        if x < 0.45:
            p, d = r.choice(prios), r.randrange(1, 5)
            h.push(n, p, d)
            ref[n] = last[n] = (p, d)
        elif x < 0.65:
            got = h.pop()
            want = min(ref, key=lambda m: _key(ref, m)) if ref else -1
            assert got == want
            ref.pop(want, None)
        elif x < 0.8:
            assert h.remove(n) == (n in ref)
            ref.pop(n, None)
        elif x < 0.9:
            h.restore(n) if n in last else None
            if n in last:
                ref[n] = last[n]
        elif x < 0.93:
            h.clear()
            ref.clear()
        elif x < 0.95:
            cap += r.randrange(0, 5)
            h.grow(cap)
        assert len(h) == len(ref)
        assert h.top() == (min(ref, key=lambda m: _key(ref, m)) if ref else -1)
        assert sorted(h.nodes()) == sorted(ref)
        for m in ref:
            assert h.contains(m) and (h.prio_of(m), h.depth_of(m)) == ref[m]
        if step % 50 == 0:
            h.check_integrity()
    h.check_integrity()
    order = []
    while len(h):
        order.append(h.pop())
    assert order == sorted(ref, key=lambda m: _key(ref, m))
    assert h.pop() == -1 and h.top() == -1


@pytest.mark.parametrize("seed", range(8))
def test_the_hole_a_pop_leaves_is_filled_by_whatever_comes_next(seed):
    # A pop leaves the root's slot empty until the next operation: a new node's push or restore goes
    # into it, anything else fills it first. Only operations that do not fill it on their own run
    # between the pops here (no top() or nodes() after each step, as the test above makes), so every
    # operation meets a hole now and then; the popped sequence must be the reference's.
    r = random.Random(seed)
    cap = r.choice([1, 3, 40, 500])
    h, ref, last = PrioHeap(), {}, {}
    h.grow(cap)
    prios = [float(r.randrange(6)) for _ in range(4)] + [1e15, -1e15]
    holes = 0
    for step in range(4000):
        x = r.random()
        n = r.randrange(cap)
        if x < 0.35:
            got = h.pop()
            holes += h._hole
            assert got == (min(ref, key=lambda m: _key(ref, m)) if ref else -1)
            ref.pop(got, None)
        elif x < 0.75:
            p, d = r.choice(prios), r.randrange(1, 5)
            h.push(n, p, d)
            ref[n] = last[n] = (p, d)
        elif x < 0.85:
            if n in last:
                h.restore(n)
                ref[n] = last[n]
        elif x < 0.95:
            assert h.remove(n) == (n in ref)
            ref.pop(n, None)
        elif x < 0.96:
            h.clear()
            ref.clear()
        else:
            assert h.contains(n) == (n in ref)
        assert len(h) == len(ref)
        if step % 97 == 0:
            h.check_integrity()  # fills a hole, as any other operation would
    assert holes > 100
    assert sorted(h.nodes()) == sorted(ref)
    h.check_integrity()


def test_grow_keeps_the_heap_and_accepts_new_ids():
    h = PrioHeap()
    h.grow(3)
    h.push(2, 1.0, 1)
    h.push(0, 1.0, 2)  # same priority, deeper: first
    h.grow(10)
    h.grow(5)  # never shrinks
    assert h.capacity == 10
    h.push(9, 0.5, 1)
    assert [h.pop(), h.pop(), h.pop()] == [9, 0, 2]
    h.check_integrity()


def test_check_integrity_catches_a_broken_position():
    h = PrioHeap()
    h.grow(4)
    for n in range(4):
        h.push(n, float(n), 1)
    h._pos[3] = 0
    with pytest.raises(AssertionError, match="position"):
        h.check_integrity()


def test_check_integrity_catches_a_slot_key_that_is_not_its_nodes():
    h = PrioHeap()
    h.grow(4)
    for n in range(4):
        h.push(n, float(n), 1)
    h._prio[2] = 7.0  # the node's own key changed, its slot's copy did not
    with pytest.raises(AssertionError, match="keys 2 as"):
        h.check_integrity()
