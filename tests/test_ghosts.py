"""GhostHistory against the OrderedDict of ``(namespace, key) -> (score, aux)`` it replaces."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from radixkv.ghosts import GhostHistory


@pytest.mark.parametrize("seed", range(10))
def test_random_operations_match_an_ordered_dict(seed):
    r = random.Random(seed)
    g, ref = GhostHistory(), OrderedDict()
    # Few keys and namespaces: the same key recurs in several namespaces, and puts of held names.
    names = [(ns, f"k{i}") for ns in ("a", "b", "c")[: r.randint(1, 3)] for i in range(r.randint(1, 40))]
    for step in range(4000):
        x = r.random()
        ns, key = r.choice(names)
        if x < 0.45:
            score, aux = r.random(), r.randrange(1 << 40)
            g.put(ns, key, score, aux)
            ref[(ns, key)] = (score, aux)  # a held name keeps its place, as in the history
        elif x < 0.7:
            held = (ns, key) in ref
            assert g.contains(ns, key) == held
            assert g.take(ns, key) == held
            if held:
                assert (g.last_score, g.last_aux) == ref.pop((ns, key))
        elif x < 0.8:
            g.pop_oldest()
            if ref:
                ref.popitem(last=False)
        elif x < 0.85:
            bound = r.choice([0, 1, 5, 20, 7.5])
            g.trim(bound)
            while len(ref) > bound:
                ref.popitem(last=False)
        assert len(g) == len(ref)
        if step % 40 == 0:
            g.check_integrity()
            # oldest first, in the order of the reference (a bare key is of the first namespace seen)
            assert [n if isinstance(n, tuple) else (g._ns0, n) for n in g.names()] == list(ref)
    g.check_integrity()


def test_the_first_namespace_is_named_by_key_alone_and_others_by_the_pair():
    g = GhostHistory()
    g.put("b", "k", 1.0, 1)
    g.put("a", "k", 2.0, 2)  # the same key in another namespace: a separate entry
    assert g.names() == ["k", ("a", "k")]
    assert g.take("a", "k") and g.last_score == 2.0
    assert not g.contains("a", "k") and g.contains("b", "k")
    g.check_integrity()


def test_check_integrity_catches_a_broken_link():
    g = GhostHistory()
    for i in range(4):
        g.put("ns", f"k{i}")
    g._newer[1] = 3  # skips k2
    with pytest.raises(AssertionError, match="linked oldest to newest"):
        g.check_integrity()


@pytest.mark.parametrize("corrupt", ["older link", "newest at a free slot"])
def test_check_integrity_catches_a_broken_backward_link_or_newest_end(corrupt):
    # take and pop_oldest unlink through the older links and the newest end, which the forward walk
    # from the oldest never read: either could be wrong with the check passing, and the next take
    # then broke the list.
    g = GhostHistory()
    for i in range(5):
        g.put("ns", f"k{i}")
    assert g.take("ns", "k2")  # slot 2 is free
    if corrupt == "older link":
        g._older[3] = 0  # k3's older neighbour is k1
    else:
        g._newest = 2
    with pytest.raises(AssertionError, match="older|newest end"):
        g.check_integrity()


def test_a_none_key_is_an_entry_of_its_own():
    # A chunk of the first namespace is named by its key; a None key named so was the marker of a
    # free slot: names() listed None and check_integrity reported drifted free slots.
    g = GhostHistory()
    g.put("ns", "k", 1.0, 1)
    g.put("ns", None, 2.0, 2)
    g.check_integrity()
    assert g.names() == ["k", ("ns", None)]
    assert g.take("ns", None) and (g.last_score, g.last_aux) == (2.0, 2)
    g.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_many_names_grow_and_churn_the_index_like_an_ordered_dict(seed):
    # Thousands of names: the index grows from 16 positions several times, and FIFO trimming at a
    # bound keeps deleting from runs of colliding positions (backward shifts, wrapping at the end).
    r = random.Random(seed)
    g, ref = GhostHistory(), OrderedDict()
    bound = r.choice([50, 300, 2000])
    for step in range(20000):
        key = f"{r.randrange(6000)}"
        ns = "a" if r.random() < 0.9 else "b"
        x = r.random()
        if x < 0.6:
            g.put(ns, key, float(step), step)
            ref[(ns, key)] = (float(step), step)
            if len(ref) > bound:
                g.pop_oldest()
                ref.popitem(last=False)
        else:
            held = (ns, key) in ref
            assert g.take(ns, key) == held
            if held:
                assert (g.last_score, g.last_aux) == ref.pop((ns, key))
        assert len(g) == len(ref)
        if step % 2500 == 0:
            g.check_integrity()
    g.check_integrity()
    assert [n if isinstance(n, tuple) else (g._ns0, n) for n in g.names()] == list(ref)
    assert all(g.contains(ns, key) for ns, key in ref)


def test_check_integrity_catches_an_entry_the_index_lost():
    g = GhostHistory()
    for i in range(10):
        g.put("ns", f"k{i}")
    tab = g._tab
    at = next(i for i in range(len(tab)) if (tab[i] & 0xFFFFFFFF) == 4)
    tab[at] = -1  # slot 4 (k4) unreachable: take("ns", "k4") would miss
    with pytest.raises(AssertionError, match="indexed at|other slots"):
        g.check_integrity()
