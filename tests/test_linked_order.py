"""LinkedList / Links against a plain reference: one Python list per linked list, oldest first."""

from __future__ import annotations

import random

import pytest

from radixkv.linked_order import OUT, LinkedList, Links


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_match_python_lists(seed):
    rng = random.Random(seed)
    links = Links()
    lists = [LinkedList(links), LinkedList(links)]  # two lists through one pair of columns (s3fifo)
    ref: list[list[int]] = [[], []]
    where: dict[int, int] = {}  # node -> the list it is in
    n_slots = 0
    for step in range(3000):
        if step % 200 == 0:
            n_slots += rng.randint(0, 40)
            links.grow(n_slots)
        if not n_slots:
            continue
        n = rng.randrange(n_slots)
        op = rng.random()
        if op < 0.1:  # a batch, as a policy's insert hands over (linked ones and repeats skipped)
            q = rng.randrange(2)
            batch = [rng.randrange(n_slots) for _ in range(rng.randint(0, 6))]
            added = 0
            for m in batch:
                if m not in where:
                    where[m] = q
                    ref[q].append(m)
                    added += 1
            assert lists[q].append_new(batch) == added
        elif n in where:
            if op < 0.6:
                q = where.pop(n)
                lists[q].unlink(n)
                ref[q].remove(n)
        else:
            q = rng.randrange(2)
            where[n] = q
            if op < 0.7:
                lists[q].append_newest(n)
                ref[q].append(n)
            else:
                lists[q].push_oldest(n)
                ref[q].insert(0, n)
        if step % 50 == 0:
            assert links.check_integrity("links") == set(where)
            for q in range(2):
                assert lists[q].check_integrity(f"list {q}") == set(ref[q])
        for q in range(2):
            assert lists[q].count == len(ref[q])
            assert lists[q].oldest == (ref[q][0] if ref[q] else -1)
            assert lists[q].newest == (ref[q][-1] if ref[q] else -1)
    for q in range(2):
        assert lists[q].nodes() == ref[q]
    assert all(links.linked(n) == (n in where) for n in range(n_slots))


def test_grow_keeps_the_links_and_adds_unlinked_slots():
    links = Links()
    order = LinkedList(links)
    links.grow(3)
    order.append_newest(2)
    order.append_newest(0)
    links.grow(2)  # never shrinks
    links.grow(6)
    assert len(links) == 6 and order.nodes() == [2, 0]
    assert [links.linked(n) for n in range(6)] == [True, False, True, False, False, False]
    assert links.newer[5] == links.older[5] == OUT


@pytest.mark.parametrize(("fault", "match"), [
    ("older", "older link"), ("count", "counted"), ("newest", "newest end"), ("cycle", "a cycle"),
    ("one_sided", "disagree"),
])
def test_check_integrity_finds_a_broken_list(fault, match):
    links = Links()
    order = LinkedList(links)
    links.grow(8)
    for n in (4, 1, 6, 3):
        order.append_newest(n)
    if fault == "older":
        links.older[6] = 4  # skips 1
    elif fault == "count":
        order.count += 1
    elif fault == "newest":
        order.newest = 6
    elif fault == "cycle":
        links.newer[3] = 1
    else:
        links.newer[7] = -1  # linked by one column only
    with pytest.raises(AssertionError, match=match):
        links.check_integrity("links")
        order.check_integrity("order")
