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


@pytest.mark.parametrize("corrupt", ["oldest end past an entry", "name outside the entries", "count"])
def test_check_integrity_catches_a_broken_ring(corrupt):
    # pop_oldest trusts the ring's ends and the count: an oldest end moved past an entry loses it
    # from the FIFO (it would never be forgotten), a name left past the newest end is overwritten
    # unindexed, and a wrong count makes pop_oldest walk past the newest end.
    g = GhostHistory()
    for i in range(5):
        g.put("ns", f"k{i}")
    assert g.take("ns", "k2")  # a hole in slot 2
    if corrupt == "oldest end past an entry":
        g._head = 1
        match = "between the ends"
    elif corrupt == "name outside the entries":
        g._names[7] = "k7"
        match = "outside the ring"
    else:
        g._n += 1
        match = "between the ends"
    with pytest.raises(AssertionError, match=match):
        g.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_holes_and_repacks_keep_the_order(seed):
    # Takes leave holes that the oldest end skips; a ring full of holes is repacked (entries moved,
    # the index rebuilt) and one that grows or, after a trim, shrinks is too. The order and the
    # values survive every repack.
    r = random.Random(seed)
    g, ref = GhostHistory(), OrderedDict()
    for step in range(6000):
        key = f"{r.randrange(400)}"
        if r.random() < 0.55:
            g.put("a", key, float(step), step)
            ref[("a", key)] = (float(step), step)
        elif r.random() < 0.9:
            held = ("a", key) in ref
            assert g.take("a", key) == held
            if held:
                assert (g.last_score, g.last_aux) == ref.pop(("a", key))
        else:
            bound = r.choice([0, 3, 50])
            g.trim(bound)
            while len(ref) > bound:
                ref.popitem(last=False)
        assert g._tail - g._head <= g._size
        if step % 500 == 0:
            g.check_integrity()
            assert [n if isinstance(n, tuple) else (g._ns0, n) for n in g.names()] == list(ref)
    g.trim(0)
    g.put("a", "x")
    for i in range(g._size):  # the ring fills once more: repacked to its few entries
        g.put("a", f"y{i}")
        g.take("a", f"y{i}")
    assert g._size == 16 and g.names() == ["x"]
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


def test_a_put_with_the_hash_its_take_saw_indexes_the_chunk_as_one_without_it():
    # agedref hashes a chunk's name once: at its lookup when it arrives (take, found or not), reused
    # by the put when it leaves. The hash must be the one put would compute, in either namespace.
    g = GhostHistory()
    for ns, key in [("a", "k1"), ("b", "k1"), ("a", "k2")]:
        assert not g.take(ns, key)
        g.put(ns, key, 1.0, 7, g.last_hash)
        g.check_integrity()
        assert g.contains(ns, key)
        assert g.take(ns, key) and g.last_aux == 7
        g.put(ns, key, 2.0, 8, g.last_hash)
    g.check_integrity()
    assert g.names() == ["k1", ("b", "k1"), "k2"]
    g.put("a", "k3", 0.0, 0, 12345)  # a hash that is not the name's: the integrity check names it
    with pytest.raises(AssertionError, match="as the hash of 'k3'"):
        g.check_integrity()
