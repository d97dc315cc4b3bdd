"""Input validation, stats and integrity checks of :class:`~radixkv.store.HierarchicalStore`.

The store's public methods delegate here in one line each; nothing in this module holds state.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Sequence

import torch

from radixkv.errors import CapacityError, InputError
from radixkv.keys import KEY_RE, Namespace
from radixkv.tiers.base import ChunkBytes, byte_parts, parts_nbytes
from radixkv.transfer import STORE_PIN_OWNER_RE

if TYPE_CHECKING:
    from radixkv.store import HierarchicalStore

_DIGEST_RE = re.compile(r"[0-9a-f]{32}")

__all__ = [
    "check_list",
    "check_count",
    "namespace_digest",
    "check_chain",
    "check_tensors",
    "register_namespace",
    "store_stats",
    "check_store",
    "reconcile_store",
]


def check_list(value: Any, what: str) -> None:
    """``value`` must be a list-like of items (one per key), not None, a str or one tensor."""
    if value is None or isinstance(value, (str, bytes, torch.Tensor)) or not hasattr(value, "__len__"):
        raise InputError(f"{what}={value!r:.80} must be a sequence (a list with one item per chunk key), "
                         f"not {type(value).__name__}")


def check_count(name: str, value: object) -> None:
    """``value`` must be a chunk count: an int >= 0 (a bool is an int: True would count as one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{name}={value!r} must be a chunk count (an int >= 0)")


def check_chain(
    store: HierarchicalStore, ns: Namespace, keys: Sequence[str], parent_key: str | None = None
) -> str:
    """The namespace digest; InputError unless ``keys`` is one chain of valid chunk keys (every tier
    must be able to store each key as it is: :data:`radixkv.keys.KEY_RE`, checked here so a bad
    key fails its own call, not a later eviction that demotes it)."""
    if not isinstance(ns, Namespace):
        raise InputError(f"ns={ns!r} must be a radixkv.keys.Namespace")
    if isinstance(keys, (str, bytes)):
        raise InputError(f"keys={keys!r:.80} must be a sequence of str chunk keys, not one str")
    check_list(keys, "keys")
    for k in keys if parent_key is None else [*keys, parent_key]:
        if not isinstance(k, str) or not KEY_RE.fullmatch(k):
            raise InputError(
                f"chunk key {k!r:.80} must be 1-128 chars of [A-Za-z0-9_-], as radixkv.keys.chunk_keys "
                "makes them (every tier stores the key as a file name or within a Redis key)"
            )
        if len(k) > store._stack.max_key_chars:
            with store._stack.cond:
                store._stack.max_key_chars = max(store._stack.max_key_chars, len(k))
    # After the type check: set() of a list key (an unhashable) raised a bare TypeError.
    if len(set(keys)) != len(keys):
        raise InputError("keys repeat a chunk key; pass one chain (each key once, root to leaf)")
    return ns.digest


def namespace_digest(namespace: Any) -> str | None:
    """``clear()``'s argument as a digest: a Namespace, its ``.digest``, or None (every namespace)."""
    if isinstance(namespace, Namespace):
        return namespace.digest
    if namespace is None or (isinstance(namespace, str) and _DIGEST_RE.fullmatch(namespace)):
        return namespace
    raise InputError(f"namespace={namespace!r} must be a radixkv.keys.Namespace, its .digest (32 hex "
                     "characters) or None (every namespace)")


def check_tensors(
    store: HierarchicalStore,
    ns: Namespace,
    tensors: Sequence[ChunkBytes],
    what: str,
    register: bool = True,
) -> int:
    nsd = ns.digest
    fixed = store._ns_bytes.get(nsd)
    for i, t in enumerate(tensors):
        if isinstance(t, (tuple, list)):  # a chunk in parts: validated part by part, sized by the total
            n = parts_nbytes(byte_parts(t, what, i))
        elif (
            not isinstance(t, torch.Tensor)
            or t.dtype != torch.uint8
            or t.dim() != 1
            or not t.is_cpu  # (device.type costs ~0.9 us per chunk)
            or not t.is_contiguous()
        ):
            desc = (
                f"dtype={t.dtype}, shape={tuple(t.shape)}, device={t.device}"
                if isinstance(t, torch.Tensor)
                else type(t).__name__
            )
            raise InputError(
                f"{what}[{i}] is {desc}; pass 1-D contiguous torch.uint8 CPU tensors "
                "(x.view(torch.uint8).flatten().contiguous()), or tuples of them (a chunk's parts)"
            )
        else:
            n = t.numel()
        if fixed is None and register:
            fixed = register_namespace(store, nsd, n, f"{what}[{i}]")
        if fixed is not None and n != fixed:
            raise InputError(
                f"{what}[{i}] has {n} bytes but namespace {ns} stores {fixed}-byte chunks; "
                "every chunk of a namespace has one size (fixed by its first put)"
            )
    return fixed if fixed is not None else 0


def register_namespace(store: HierarchicalStore, nsd: str, nbytes: int, what: str) -> int:
    if nbytes <= 0:
        raise InputError(f"{what} is empty; a chunk payload needs at least one byte")
    s = store._stack
    for t, tier in enumerate(s.tiers):
        cap = s.capacity(t)
        need = s.charge(t, nbytes)
        if cap and cap < need:
            raise CapacityError(
                f"tier {tier.name!r} has capacity_bytes={cap}, smaller than one {nbytes}-byte chunk "
                f"({need} bytes as stored); raise its capacity to at least {need} bytes"
            )
        limit = getattr(tier, "max_frame_bytes", None)  # a remote store's largest value
        if limit is not None and limit < need:
            raise CapacityError(
                f"tier {tier.name!r} stores values of at most {limit} bytes, smaller than one "
                f"{nbytes}-byte chunk ({need} bytes as stored); use smaller chunks, or raise that "
                "limit (Redis: proto-max-bulk-len on the server, max_value_bytes on the tier)"
            )
    with s.cond:
        return store._ns_bytes.setdefault(nsd, nbytes)


def store_stats(store: HierarchicalStore) -> dict[str, Any]:
    """Plain numbers: per tier (capacity, usage, tree residency, the tier's own counters), the
    tree's counters, the store's counters and queue depths."""
    s = store._stack
    out: dict[str, Any] = {"tiers": {}, "tree": {}, "store": store.metrics.snapshot()}
    with s.cond:
        for t, tier in enumerate(s.tiers):
            out["tiers"][tier.name] = {
                "capacity_bytes": s.capacity(t),  # 0 = unbounded
                "tree_chunks": s.tree.tier_chunks(tier.name),
                "tree_bytes": s.tree.tier_bytes(tier.name),
                "reserved_bytes": s.reserved[t],
            }
        st = s.tree.stats
        out["tree"] = {
            "chunks": len(s.tree),
            "inserted_chunks": st.inserted_chunks,
            "removed_chunks": st.removed_chunks,
            "orphan_drops": st.orphan_drops,
            "pinned_chunks": s.tree.pinned_count(),
        }
    for tier in s.tiers:
        out["tiers"][tier.name]["usage_bytes"] = tier.usage_bytes()
        out["tiers"][tier.name].update(tier.stats().as_dict())
    out["queues"] = {"write": store._writer.depth, "prefetch": store._reader.depth}
    # Evicted chunks of borrowed namespaces, forgotten but left on their shared tier (store.borrow).
    out["store"]["evictions_kept_for_owner"] = s.kept_on_evict
    return out


def check_store(store: HierarchicalStore, deep: bool = True) -> None:
    """Raise AssertionError/RuntimeError with numbers if an invariant is broken: the tree's own,
    each tier's own, no tier over capacity, and (``deep``, when no transfer is in flight) every
    chunk the tree places in a tier is there, and a tier counting chunks holds exactly those. With no
    store call running and no background job queued or running, also that no operation left what it
    takes while it runs (:func:`_check_idle_locked`).
    Deep checks cost one ``contains`` per chunk: meant for tests and small stores. In a tier other
    processes share (a shared disk directory, a Redis server) the deep check assumes none of them
    removed (evicted, deleted; a Redis server's own ``maxmemory`` eviction included) a chunk this
    store placed there since its last :meth:`reconcile`:
    call ``reconcile()`` first where one may have (reads find such losses anyway, as misses)."""
    s = store._stack
    with s.cond:
        s.tree.check_integrity()
        assert all(r >= 0 for r in s.reserved), f"negative reservations {s.reserved}"
        assert all(c >= 0 for c in s.claimed), f"negative eviction claims {s.claimed}"
        assert s.transfers_inflight >= 0, f"negative background copies in flight {s.transfers_inflight}"
        # The calls first: one that ends after this read queued its background job before ending,
        # and a job gives back what it holds (under this lock, held now) before it counts as done.
        # A forked child is never idle if the parent had a call or a job in flight: what those took
        # was copied into the child and nothing in the child ever gives it back.
        idle = not len(s.calls) and not any(
            pool._inflight or pool.inherited_jobs for pool in (store._writer, store._reader)
        )
        if idle:
            _check_idle_locked(store)
        quiet = not (
            any(s.reserved)
            or any(s.claimed)
            or store._writer.depth
            or s.transfers_inflight
            or s._writing
            or s._deleting
            or s._delete_barrier  # a delete() waiting for copies: the tree let go, the tier not yet
        )
        resident: dict[int, dict[str, list[str]]] = {
            t: defaultdict(list) for t in range(len(s.tiers))
        }
        if quiet:
            # Every write that a delete deferred to has settled it (intents.settle_writes_locked).
            assert not s._deferred, f"{len(s._deferred)} deferred deletes outlived their writes"
            assert not s._lost_writes, f"{len(s._lost_writes)} lost writes outlived their writers"
        if deep and quiet:
            for nsd in s.tree.namespaces():
                for key, n in s.tree.items(nsd):
                    m = s.tree.node_tier_mask(n)
                    for t in range(len(s.tiers)):
                        if m >> t & 1:
                            resident[t][nsd].append(key)
        for t, tier in enumerate(s.tiers):
            tier.check_integrity()
            cap = s.capacity(t)
            used = tier.usage_bytes()
            assert not cap or used <= cap, f"tier {tier.name!r} holds {used} bytes > capacity {cap}"
            if not (deep and quiet):
                continue
            # A tier that loses chunks by design (a TTL) or is unreachable right now cannot be held to
            # the tree's books: reads find such losses and forget them (misses, never wrong bytes).
            mark = _fault_mark(tier)
            missing = [(nsd, k) for nsd, keys in resident[t].items() for k in keys
                       if tier.contains_many(nsd, [k]) != 1]
            expires = getattr(getattr(tier, "config", None), "ttl_s", None) is not None
            if not expires and not _faulted_since(tier, mark):
                assert not missing, (
                    f"tree says {len(missing)} chunks (e.g. {missing[0][1][:16]} of namespace {missing[0][0]}) "
                    f"are in tier {tier.name!r}; the tier lacks them"
                )
            counted = tier.stats().extra.get("chunks")
            if counted is not None and not _shared(tier):
                n_tree = s.tree.tier_chunks(tier.name)
                assert n_tree <= counted <= n_tree + store._foreign_chunks[t], (
                    f"tier {tier.name!r} holds {counted} chunks, the tree places {n_tree} there "
                    f"({store._foreign_chunks[t]} were there before the store opened it)"
                )


def _check_idle_locked(store: HierarchicalStore) -> None:
    """No store call is running and no background job is queued or running: every reservation,
    eviction claim, pin the store took, put anchor, write/delete intent, copy, watch and clear an
    operation recorded must have been given back (a leaked reservation shrinks the tier for good,
    a leaked pin or anchor keeps its chunk from eviction until its lease ends), and every chunk of a
    namespace has the namespace's chunk size (fixed by its first put)."""
    s = store._stack
    names = s.names
    assert not any(s.reserved), (
        f"reservations {dict(zip(names, s.reserved))} bytes held with no store call or background "
        "job running: an operation did not release what it reserved"
    )
    assert not any(s.claimed), f"eviction claims {dict(zip(names, s.claimed))} bytes with no eviction running"
    assert not s.transfers_inflight, f"{s.transfers_inflight} background copies counted, none running"
    assert not s._writing, f"{len(s._writing)} writes in flight with no writer, e.g. {next(iter(s._writing))}"
    assert not s._deleting, f"{len(s._deleting)} deletes in flight with no deleter, e.g. {next(iter(s._deleting))}"
    assert not s._anchors, f"{len(s._anchors)} put anchors with no put running, e.g. node {next(iter(s._anchors))}"
    assert not s._copies, f"{len(s._copies)} copies between tiers registered, none running"
    assert not s._watches and not s._write_watches, (
        f"{len(s._watches)} adoption watches and {len(s._write_watches)} write watches with no call running"
    )
    clearing = {k: v for k, v in s.clearing.items() if v}
    assert not clearing, f"clears {clearing} in progress with no clear running"
    pins = s.tree._pins.by_node
    leaked = [(n, o) for n, held in pins.items() for o in held if STORE_PIN_OWNER_RE.fullmatch(o)]
    assert not leaked, (
        f"{len(leaked)} pins the store took are held with no call or job running, e.g. node "
        f"{leaked[0][0]} by {leaked[0][1]!r}"
    )
    for nsd in s.tree.namespaces():
        size = store._ns_bytes.get(nsd)
        for key, n in s.tree.items(nsd):
            got = s.tree.node_fields(n)[2]
            assert got == size, (
                f"chunk {key[:16]} of namespace {nsd} has {got} bytes, the namespace's chunks {size}"
            )


def reconcile_store(store: HierarchicalStore) -> int:
    """Ask every tier whether it still holds each chunk the tree places there, and forget the
    residencies it lost (a restarted Redis, files removed by hand); returns how many were
    forgotten. One ``contains`` per chunk: for tests, tools and small stores; normal reads
    discover such losses lazily."""
    s = store._stack
    with s.cond:
        placed = [
            (t, nsd, key, n)
            for nsd in s.tree.namespaces()
            for key, n in s.tree.items(nsd)
            for t in range(len(s.tiers))
            if s.tree.node_tier_mask(n) >> t & 1
        ]
        written = s.watch_writes_locked()
    try:
        marks = [_fault_mark(tier) for tier in s.tiers]
        lost = [x for x in placed if s.tiers[x[0]].contains_many(x[1], [x[2]]) != 1]
    except BaseException:
        with s.cond:
            s.unwatch_writes_locked(written)
        raise
    # A tier that faulted (or was in its fail-fast window) meanwhile answered "unreachable", not
    # "absent": forgetting its chunks would drop a healthy server's whole residency.
    faulted = {t for t, tier in enumerate(s.tiers) if _faulted_since(tier, marks[t])}
    with s.cond:
        s.unwatch_writes_locked(written)
        # An answer holds only for the node it was asked for, and only if nothing wrote the key into
        # that tier since: a chunk deleted and put again meanwhile (another thread) is a new node
        # whose fresh bytes the tier holds now; "lost" would delete them and drop its descendants.
        # Nor for a residency that ended meanwhile (an eviction from that tier): not a loss.
        lost = [
            (t, nsd, key)
            for t, nsd, key, n in lost
            if t not in faulted and (t, nsd, key) not in written and s.tree.lookup(nsd, key) == n
            and s.tree.node_tier_mask(n) >> t & 1
        ]
        # Deleting the lost keys too lets a private disk tier's index forget them.
        entries: list[tuple[int, str, str]] = list(lost)
        for t, nsd, key in lost:
            n = s.tree.lookup(nsd, key)
            if n is not None:
                entries += s.clear_locked([n], t)  # its orphans (their prefix is lost) leave the tree
        # In a borrowed namespace the bytes are the owner's, and in a shared tier another process
        # may have written a lost key again since contains answered: those are only forgotten.
        entries = s.mark_deleting_locked(s.lost_entries_locked(entries))
    s.delete_entries(entries)
    return len(lost)




def _fault_mark(tier: Any) -> int:
    """A tier's fault count (``fault_mark``; 0 for tiers without one)."""
    mark = getattr(tier, "fault_mark", None)
    return mark() if mark is not None else 0


def _faulted_since(tier: Any, mark: int) -> bool:
    return _fault_mark(tier) != mark


def _shared(tier: Any) -> bool:
    cfg = getattr(tier, "config", None)
    return bool(getattr(cfg, "shared", False))
