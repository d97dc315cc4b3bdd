"""The radix tree's invariants, checked from scratch (tests call this after every operation sequence).

Recounts children, residency, bytes and chunks per tier from the node columns and compares them with
what :class:`~radixkv.tree.RadixTree` maintains incrementally; then asks each tier's policy to check
itself against the tier's residency. O(tree size): a test and debugging tool, never on a hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.tree import RadixTree

__all__ = ["check_tree"]

_NO_PARENT = -1


def check_tree(tree: RadixTree) -> None:
    """Verify every invariant of ``tree``; raises AssertionError naming the broken one with numbers."""
    n_slots = len(tree._key)
    for name in ("_ns", "_parent", "_depth", "_nchild", "_mask", "_tokens", "_size", "_born", "_kid", "_next",
                 "_prev", "_ids"):
        assert len(getattr(tree, name)) == n_slots, f"field {name} has the wrong length"
    wrong = [n for n, i in enumerate(tree._ids) if i != n]
    assert not wrong, f"slots {wrong[:5]} keep another id than their own"
    assert all(len(tc) == n_slots for tc in tree._tchild), "per-tier child counts wrong length"
    # The policies read these columns through tree._views, which the tree updates when a column is
    # replaced as it grows: a stale view has them read an old copy (wrong sizes, depths, residency).
    # Compared by value: the compiled build boxes a vec attribute anew at each read (no identity).
    views = tree._views
    for name in ("mask", "parent", "depth", "nchild", "tokens", "size"):
        assert getattr(views, name) == getattr(tree, "_" + name), f"the policies' view of {name} is stale"
    assert views.tchild is tree._tchild, "the policies' view of the per-tier child counts is stale"
    free = set(tree._free)
    assert len(free) == len(tree._free), "free list has duplicates"
    nchild = [0] * n_slots
    tchild = [[0] * n_slots for _ in tree.tiers]
    tier_bytes = [0] * len(tree.tiers)
    tier_chunks = [0] * len(tree.tiers)
    indexed = 0
    for ns, idx in tree._index.items():
        # An emptied namespace's dict keeps its table at its peak size: it must leave the index.
        assert idx, f"namespace {ns!r} has an empty index left after its last chunk left the tree"
        for k, n in idx.items():
            assert tree._key[n] == k and tree._ns[n] == ns, f"index entry {k!r} -> {n} is stale"
            indexed += 1
    alive = 0
    for n in range(n_slots):
        if tree._key[n] is None:
            assert n in free, f"dead node {n} not on the free list"
            continue
        assert n not in free, f"live node {n} is on the free list"
        alive += 1
        mask = tree._mask[n]
        assert mask and mask < (1 << len(tree.tiers)), f"node {n} has residency mask {mask:#x}"
        # insert's contract: a chunk has tokens and a size (policies divide by them; totals add them)
        assert tree._tokens[n] > 0, f"node {n} has {tree._tokens[n]} tokens"
        assert tree._size[n] >= 0, f"node {n} has size {tree._size[n]} bytes"
        p = tree._parent[n]
        if p == _NO_PARENT:
            assert tree._depth[n] == 1, f"root-level node {n} has depth {tree._depth[n]}"
        else:
            assert tree._key[p] is not None, f"node {n} has removed parent {p} (orphan served)"
            assert tree._ns[p] == tree._ns[n], f"node {n} and parent {p} differ in namespace"
            assert tree._depth[n] == tree._depth[p] + 1, f"node {n} depth != parent depth + 1"
            nchild[p] += 1
        for t in range(len(tree.tiers)):
            if mask >> t & 1:
                tier_bytes[t] += tree._size[n]
                tier_chunks[t] += 1
                if p != _NO_PARENT:
                    tchild[t][p] += 1
    assert alive == indexed == len(tree), f"alive={alive} indexed={indexed} len={len(tree)}"
    born = [tree._born[n] for n in range(n_slots) if tree._key[n] is not None]
    assert len(set(born)) == len(born) and all(0 < b <= tree._births for b in born), (
        f"creation serials repeat or lie past the {tree._births} nodes created"
    )
    for n in range(n_slots):
        if tree._key[n] is not None:
            assert tree._nchild[n] == nchild[n], f"node {n} child count {tree._nchild[n]} != {nchild[n]}"
            for t in range(len(tree.tiers)):
                assert tree._tchild[t][n] == tchild[t][n], f"node {n} tier {t} child count wrong"
    _check_child_lists(tree, nchild)
    assert tier_bytes == tree._tier_bytes, f"tier bytes {tree._tier_bytes} != {tier_bytes}"
    assert tier_chunks == tree._tier_chunks, f"tier chunks {tree._tier_chunks} != {tier_chunks}"
    _check_awaiting(tree)
    tree._pins.check_integrity()
    for n in tree._pins:
        assert tree._key[n] is not None, f"pin on removed node {n}"
    for t, pol in enumerate(tree._policies):
        assert len(pol) == tier_chunks[t], (
            f"policy of tier {tree.tiers[t]!r} tracks {len(pol)} nodes, tier holds {tier_chunks[t]}"
        )
        pol.check_integrity()


def _check_child_lists(tree: RadixTree, nchild: list[int]) -> None:
    """Each live node's child list (first child, next/previous sibling) holds exactly its live
    children, each once and linked both ways; namespace-root nodes are in no list."""
    kid, nxt, prv = tree._kid, tree._next, tree._prev
    for n in range(len(tree._key)):
        if tree._key[n] is None:
            continue
        if tree._parent[n] == _NO_PARENT:
            assert nxt[n] == prv[n] == _NO_PARENT, f"namespace-root node {n} is in a child list"
        c, prev, count = kid[n], _NO_PARENT, 0
        while c != _NO_PARENT:
            assert count < nchild[n], f"node {n}'s child list is longer than its {nchild[n]} children"
            assert tree._key[c] is not None, f"node {n}'s child list holds removed node {c}"
            assert tree._parent[c] == n, f"node {n}'s child list holds node {c} of parent {tree._parent[c]}"
            assert prv[c] == prev, f"node {c}: previous sibling {prv[c]} != {prev}"
            prev, c, count = c, nxt[c], count + 1
        assert count == nchild[n], f"node {n}'s child list holds {count} of its {nchild[n]} children"


def _check_awaiting(tree: RadixTree) -> None:
    """The runs awaiting a parent key: each entry names a live namespace-root node (of that
    namespace, with the key recorded for it) once, in both tables, no empty table, no parent key the
    tree holds (its insert grafts or ends every wait for it), and no more than the bound."""
    waiting = 0
    for ns, w in tree._awaiting.items():
        assert w, f"namespace {ns!r} keeps an empty awaiting table"
        idx = tree._index.get(ns, {})
        for parent_key, runs in w.items():
            assert runs, f"parent key {parent_key!r} in {ns!r} keeps an empty list of awaiting runs"
            assert parent_key not in idx, (
                f"runs {runs} still await parent key {parent_key!r}, which is in the tree"
            )
            assert len(set(runs)) == len(runs), f"runs {runs} awaiting {parent_key!r} repeat a node"
            for n in runs:
                ent = tree._awaits.get(n)
                assert ent is not None and ent[0] == ns and ent[2] == parent_key, (
                    f"node {n} awaits {parent_key!r} in {ns!r} but its entry is {ent!r}"
                )
                assert 0 <= n < len(tree._key) and tree._key[n] == ent[1] and tree._ns[n] == ns, (
                    f"node {n} awaiting {parent_key!r} is not the live chunk {ent[1]!r} of {ns!r}"
                )
                assert tree._parent[n] == _NO_PARENT, (
                    f"node {n} awaits parent key {parent_key!r} but hangs under {tree._parent[n]}"
                )
                waiting += 1
    assert waiting == len(tree._awaits) <= tree.max_awaiting_runs, (
        f"{len(tree._awaits)} awaiting nodes, {waiting} in the per-key table, "
        f"bound {tree.max_awaiting_runs}"
    )
