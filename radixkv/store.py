"""The hierarchical store: the radix tree over an ordered list of tiers (memory -> disk -> Redis).

Contract (what engines and adapters rely on)::

    ok = store.put(ns, keys, payloads, parent_key=None)   # list[bool]: a leading run of True
    n  = store.lookup(ns, keys)                            # leading run present in any tier
    k  = store.adopt(ns, keys, parent_key=None)            # chunks a disk/Redis tier held, now known
    n  = store.get(ns, keys, buffers)                      # buffers[:n] hold verified bytes
    h  = store.prefetch(ns, keys, buffers)                 # h.wait(timeout_s) -> n, h.cancel(), h.done()
    store.delete(ns, keys); store.clear(namespace=None); store.stats(); store.check_integrity()
    store.close()

* **put**: new chunks land in the top tier. With ``write_through`` a background job copies them to
  every lower tier; with ``write_back`` they reach a lower tier only when evicted from the one above
  (and at a flushing :meth:`close`, which persists what only memory holds: :mod:`radixkv.writeback`).
  Chunks are ``keys`` of one chain (continuing ``parent_key``); only a leading run can be stored, so
  the result is True up to the first chunk that could not be (tier full of pinned chunks, medium
  down) and False after it. A chain longer than the top tier goes in runs that push the earlier
  runs down, so with a lower tier it is stored whole. A chain whose ``parent_key`` the tree lacks
  is not stored, unless ``root_if_missing``: then it hangs at the namespace root and awaits that key
  (a later put or adoption creating it grafts the run under it: ``RadixTree.insert``).
* **eviction** (to make room for a write) demotes a chunk to the next tier unless that tier already
  holds it; from the last tier it drops, leaf first (the tree's candidates never orphan anything).
* **get**: one tree lookup finds the longest prefix held by any tier; the chunks are pinned and read
  in one batch per tier (fastest tier holding each); a failed read clears that residency and falls
  back to a lower tier, else the run stops there. Chunks served from a lower tier are promoted to the
  top tier in the background once hit ``promote_after_hits`` times (``promote_on_hit``).
* **adoption** (``probe_tiers``): when the tree's match ends early, ``lookup``/``get``/``prefetch``
  ask the persistent/shared tiers (never memory) about the next keys and insert the leading run
  they hold into the tree (:meth:`HierarchicalStore.adopt`, :mod:`radixkv.adoption`): chunks
  written before a restart or by another process sharing the tier become hits, read and verified
  like any other.
* **threads**: one lock around tree calls; tier I/O outside it; background work on bounded queues;
  :meth:`close` flushes (or cancels) and joins every thread it started.

Payloads and buffers are 1-D contiguous ``torch.uint8`` CPU tensors of the namespace's chunk size
(fixed by its first put). Wrong types or sizes raise :class:`~radixkv.errors.InputError`; a tier that
cannot hold one chunk raises :class:`~radixkv.errors.CapacityError` at the first put.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from typing import Any, Callable, Sequence, TypeVar, cast

from radixkv import adoption, writeback
from radixkv import store_checks as checks
from radixkv import store_jobs as jobs
from radixkv.background import Job, WorkerPool
from radixkv.config import StoreConfig
from radixkv.errors import ConfigError, InputError
from radixkv.keys import Namespace
from radixkv.metrics import StoreMetrics
from radixkv.tiers.base import ChunkBytes, byte_parts_all, check_buffers_disjoint, chunk_nbytes
from radixkv.tiers.memory import MemoryTier
from radixkv.transfer import Calls, ChunkRef, TierStack
from radixkv.tree import RadixTree

__all__ = ["HierarchicalStore", "PrefetchHandle", "open_tier"]

logger = logging.getLogger(__name__)


def open_tier(tc: Any) -> Any:
    """Build the tier a :class:`~radixkv.config.TierConfig` names (via :func:`radixkv.tiers.registry.make_tier`)."""
    from radixkv.tiers.registry import make_tier

    kwargs = dict(tc.options)
    if tc.capacity_bytes:
        kwargs["capacity_bytes"] = tc.capacity_bytes
    return make_tier(tc.url, name=tc.name, **kwargs)


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _call(method: _Method) -> _Method:
    """Count the call as running (``TierStack.calls``) while it runs: check_integrity holds a store
    with no call running and no background job to zero reservations, pins and intents. Typed as
    the method it wraps, so type checkers still see each public call's signature (not ``Any``)."""

    @functools.wraps(method)
    def run(self: HierarchicalStore, *args: Any, **kwargs: Any) -> Any:
        with self._stack.calls:
            return method(self, *args, **kwargs)

    return cast(_Method, run)


class PrefetchHandle:
    """A background read: :meth:`wait` -> chunks read (leading run), :meth:`cancel`, :meth:`done`.
    After a cancel, :meth:`wait` returns 0 unless the read had already finished."""

    def __init__(
        self, job: Job[int] | None, on_cancel: Any = None, result: int = 0, calls: Calls | None = None
    ) -> None:
        self._job, self._on_cancel, self._result = job, on_cancel, result
        self._calls = calls

    def wait(self, timeout_s: float | None = None) -> int:
        return self._result if self._job is None else self._job.wait(timeout_s)

    def cancel(self) -> bool:
        if self._job is None:
            return False
        # Counted as a store call (TierStack.calls): a cancel that wins the job runs its unpin here,
        # after the reader thread may already have counted the cancelled job done. Uncounted, a
        # check_integrity in between found the store idle and the read's get-* pins leaked.
        with self._calls if self._calls is not None else contextlib.nullcontext():
            if self._job.cancel():
                if self._on_cancel is not None:
                    self._on_cancel()
                return True
            return False

    def done(self) -> bool:
        return self._job is None or self._job.done()


class HierarchicalStore:
    """The tree plus tiers, fastest first. Thread-safe. See the module docstring for the contract.

    ``tiers`` may pass already-open tier objects (one per ``config.tiers`` entry, same names) instead
    of opening them from the URLs; the store closes them either way.
    """

    def __init__(self, config: StoreConfig, tiers: Sequence[Any] | None = None) -> None:
        if not isinstance(config, StoreConfig):
            raise ConfigError(
                f"config={config!r} must be a StoreConfig (see StoreConfig.from_yaml/from_env)"
            )
        self.config = config
        names = config.tier_names
        # The tree first: a bad policy option then fails before any tier (and its threads) opens.
        tree = RadixTree(
            tiers=names,
            policy={tc.name: config.policy_of(tc) for tc in config.tiers},
            policy_options={tc.name: config.policy_options_of(tc) for tc in config.tiers},
        )
        opened: list[Any] = []
        try:
            if tiers is None:
                for tc in config.tiers:
                    opened.append(open_tier(tc))
            else:
                opened = list(tiers)
                if [t.name for t in opened] != list(config.tier_names):
                    raise ConfigError(
                        f"tier objects are named {[t.name for t in opened]} but the config "
                        f"names {list(config.tier_names)}; pass one per config tier, in order"
                    )
        except BaseException:
            if tiers is None:
                for t in opened:
                    t.close()
            raise
        try:
            self._start(config, names, tree, opened)
        except BaseException:
            # Out of threads (a pool's or the metrics server's did not start) or memory: give back
            # what started, or the tiers' threads, buffers and connections outlived the failed call
            # (and a pool's threads kept waiting until the garbage collector found it).
            self._abandon(opened if tiers is None else [])
            raise

    def _start(self, config: StoreConfig, names: Sequence[str], tree: RadixTree, opened: list[Any]) -> None:
        # No callback below refers back to the store: a closed, dropped store (an engine detaching
        # its backend) is freed at once with its memory tier's buffer, not at the next cycle
        # collection.
        tiers_now = tuple(opened)
        self.metrics = metrics = StoreMetrics(names, tiers=lambda: tiers_now, prometheus=config.metrics)
        self._stack = TierStack(opened, tree, self.metrics, config.lease_s)
        self._ns_bytes: dict[str, int] = {}
        # Chunks a tier already held when the store opened it (a disk tier's restart scan): not in
        # the tree, evicted by the tier itself as it fills. check_integrity allows for them.
        self._foreign_chunks = [int(t.stats().extra.get("chunks", 0)) for t in opened]
        self._closed = False
        # A second close() (an engine's shutdown path and an exit hook) waits for the first one to
        # end: it returned at once, while the first still flushed write_back chunks with the tiers
        # open, and a caller exiting after it lost chunks only memory held. (Re-entered on the
        # closing thread, from a signal handler, it returns: waiting there would never end.)
        self._close_lock = threading.Lock()
        self._close_done = threading.Event()
        self._closer: int | None = None
        self._writer = WorkerPool(
            "write",
            config.io_threads,
            config.queue_depth,
            on_depth=lambda d: metrics.queue_depth("write", d),
            exit_timeout_s=config.close_timeout_s,
        )
        self._reader = WorkerPool(
            "prefetch",
            config.prefetch_threads,
            config.queue_depth,
            on_depth=lambda d: metrics.queue_depth("prefetch", d),
            exit_timeout_s=config.close_timeout_s,
        )
        self._promoter = jobs.Promoter(self._stack, self._writer, config.promote_after_hits)
        for q in ("write", "prefetch"):
            self.metrics.queue_depth(q, 0)
        self._metrics_server = self.metrics.serve(config.metrics_port, config.metrics_addr)
        # A store dropped without close() gives its port back when it is collected: the server's
        # thread holds the registry (and through its tier collector the tiers), not the store.
        # Not at exit: the daemon thread ends with the process.
        self._stop_serving: weakref.finalize | None = None
        if self._metrics_server is not None:
            self._stop_serving = weakref.finalize(
                self, StoreMetrics.stop_serving, self._metrics_server
            )
            self._stop_serving.atexit = False

    def _abandon(self, tiers: Sequence[Any]) -> None:
        """Undo a construction that failed after its tiers opened: stop the pools (and the metrics
        server) that started, close ``tiers`` (those the store opened itself)."""
        for pool in (getattr(self, "_reader", None), getattr(self, "_writer", None)):
            if pool is not None:
                pool.close(flush=False, timeout_s=self.config.close_timeout_s)
        stop = getattr(self, "_stop_serving", None)
        if stop is not None:
            stop()
        for tier in reversed(tiers):
            try:
                tier.close()
            except Exception:  # the construction's own error is the one to report
                logger.exception("radixkv: closing tier %r of a store that failed to start", tier.name)

    # ------------------------------------------------------------------ properties
    @property
    def tiers(self) -> list[Any]:
        return list(self._stack.tiers)

    @property
    def tree(self) -> RadixTree:
        """The tree (read it only under :attr:`lock`)."""
        return self._stack.tree

    @property
    def lock(self) -> threading.Condition:
        return self._stack.cond

    # ------------------------------------------------------------------ put
    @_call
    def put(
        self,
        ns: Namespace,
        keys: Sequence[str],
        payloads: Sequence[ChunkBytes],
        parent_key: str | None = None,
        root_if_missing: bool = False,
    ) -> list[bool]:
        """Store one chain of chunks in the top tier (see the module docstring); returns per-key
        success, always a leading run of True. Keys already in the top tier are not rewritten.

        A ``parent_key`` the tree does not hold stores nothing (all False), unless
        ``root_if_missing``: then the chain is stored as without ``parent_key`` (at the namespace
        root, or where its first key is) and, at the root, awaits ``parent_key``: the put (or
        adoption) that later creates that key grafts it under it, so the two are one chain for
        eviction (the tree bounds how many runs wait: ``RadixTree.insert``).

        A chain longer than the top tier takes goes in runs, each hanging from the last chunk
        stored: a run makes room by evicting the chain's earlier runs like any other chunks (demoted
        with ``write_back``; with ``write_through`` their copies below stay), so with a lower tier
        the whole chain is stored (SGLang backs up 128 pages per batch: ~1 GiB for an 8B model at
        page 64, more than many memory tiers)."""
        with self.metrics.timed("put"):
            return self._put_runs(ns, keys, payloads, parent_key, root_if_missing)

    def _put_runs(
        self,
        ns: Namespace,
        keys: Sequence[str],
        payloads: Sequence[ChunkBytes],
        parent_key: str | None,
        root_if_missing: bool,
    ) -> list[bool]:
        run = sum(self._put_run(ns, keys, payloads, parent_key, root_if_missing))
        got = run
        while run < len(keys) and len(self._stack.tiers) > 1:
            if not got:
                # Nothing went in: the chunks the put pins (the chain's own the top tier holds, which
                # must not leave it while the put runs) may be all the room there is. A chain the
                # store holds below stays stored; the put goes on after it.
                held = self._held_run(ns.digest, keys[run:], keys[run - 1] if run else parent_key)
                if not held:  # a top tier full of other pinned chunks, a fault, a missing parent
                    break
                run += held
                if run == len(keys):
                    break
            got = sum(self._put_run(ns, keys[run:], payloads[run:], keys[run - 1], False))
            run += got
        return [i < run for i in range(len(keys))]

    def _held_run(self, nsd: str, keys: Sequence[str], parent_key: str | None) -> int:
        """How many leading ``keys`` (checked by the put's first run) the tree holds (in any tier),
        under ``parent_key``: 0 when the tree lacks it (a put under a missing parent stores
        nothing, whatever the tiers hold)."""
        with self._stack.cond:
            tree, n = self._stack.tree, 0
            if parent_key is not None and tree.lookup(nsd, parent_key) is None:
                return 0
            while n < len(keys) and tree.lookup(nsd, keys[n]) is not None:
                n += 1
        return n

    def _put_run(
        self,
        ns: Namespace,
        keys: Sequence[str],
        payloads: Sequence[ChunkBytes],
        parent_key: str | None,
        root_if_missing: bool,
    ) -> list[bool]:
        """:meth:`put` of what the top tier can take now: a leading run of True."""
        self._check_open()
        nsd = self._check_chain(ns, keys, parent_key)
        checks.check_list(payloads, "payloads")
        if len(payloads) != len(keys):
            raise InputError(
                f"{len(keys)} keys but {len(payloads)} payloads; pass one payload per key"
            )
        s = self._stack
        with s.cond:
            if s.is_borrowed_locked(0, nsd):
                raise InputError(
                    f"namespace {ns} is borrowed from tier {s.names[0]!r} (store.borrow): another "
                    "process writes it there and this store only reads it; put it from the owner"
                )
            if s.clearing_locked(nsd):  # its namespace is being cleared: nothing would stay
                return [False] * len(keys)
        size = self._check_tensors(ns, payloads, "payloads")
        if not keys:
            return []
        owner = s.owner("put")
        pinned: list[ChunkRef] = []  # held for the put: its own chunks in the top tier
        anchor: ChunkRef | None = None  # the chunk it hangs from
        with s.cond:
            if parent_key is not None:
                pid = s.tree.lookup(nsd, parent_key)
                if pid is None and not root_if_missing:  # the chain's prefix is gone: nothing
                    return [False] * len(keys)  # here is reachable
                # Making room for this chain must not *drop* the chunk it hangs from (a demotion
                # keeps it reachable), in whichever tier it is when room-making reaches it: a
                # chunk in memory now may be demoted to the last tier by this very put.
                if pid is not None:
                    anchor = s.ref_locked(pid)
                    s.anchor_locked(anchor, owner)
            have = [_has(s.tree, nsd, k, 0) for k in keys]
            # Nor may it evict the chain's own chunks the top tier already holds (the oldest leaf
            # there may be this chain's first chunk): the run would then start with a hole.
            held = [s.ref_locked(n) for k, h in zip(keys, have)
                    if h and (n := s.tree.lookup(nsd, k)) is not None]
            pinned += s.pin_locked(held, owner)
        todo = [i for i, h in enumerate(have) if not h]
        charges = [s.charge(0, size)] * len(todo)
        try:
            granted = s.reserve(0, charges, wait_for_transfers=True)
        except BaseException:
            with s.cond:
                s.unpin_locked(pinned, owner)
                s.unanchor_locked(anchor, owner)
            raise
        wrote = todo[:granted]
        wkeys = [keys[i] for i in wrote]
        with s.cond:
            s.begin_write_locked(0, nsd, wkeys)
            clears = (s.clears[None], s.clears[nsd])
        try:
            ok_w = s.put_refit(0, nsd, wkeys, [payloads[i] for i in wrote], charges[:granted],
                               wait_for_transfers=True, clears=clears)
        except BaseException:
            with s.cond:
                s.end_write_locked(0, nsd, wkeys)
                s.release_locked(0, sum(charges[:granted]))
                s.unpin_locked(pinned, owner)
                s.unanchor_locked(anchor, owner)
                lost = s.take_lost_writes_locked(0, nsd, wkeys)
                due = s.mark_deleting_locked(
                    s.settle_writes_locked(0, nsd, wkeys) + [(0, nsd, k) for k in lost]
                )
            s.delete_entries(due)
            raise
        written = dict(zip(wrote, ok_w))
        with s.cond:
            s.end_write_locked(0, nsd, wkeys)
            lost = s.take_lost_writes_locked(0, nsd, wkeys)  # the tier evicted them meanwhile
            written = {i: o and keys[i] not in lost for i, o in written.items()}
            # what we wrote may be gone (a clear overtook us, or is clearing the tiers now)
            cleared = (s.clears[None], s.clears[nsd]) != clears or s.clearing_locked(nsd)
            # A clear of the namespace that ended before this put's write began forgot the chunk
            # size _check_tensors fixed (store.clear pops it): what the put inserts now fixes it
            # again, unless a put of another size fixed that meanwhile (then nothing is stored).
            # Before, the chunks went in with no size on record, and a later put of the
            # namespace could fix another one: its first chain then read back as an InputError.
            cleared = cleared or self._ns_bytes.setdefault(nsd, size) != size
            if cleared:
                leaked_by_clear = [(0, nsd, keys[i]) for i, o in written.items() if o]
                written = {}
            run = 0  # chunks already in the top tier count only if still there now
            while run < len(keys) and (
                written.get(run, False) or _has(s.tree, nsd, keys[run], 0)
            ):
                run += 1
            r, error = None, None
            if run:
                try:
                    r = s.tree.insert(
                        nsd,
                        list(keys[:run]),
                        tier=s.names[0],
                        chunk_tokens=ns.chunk_tokens,
                        size_bytes=size,
                        parent_key=parent_key,
                        root_if_missing=root_if_missing,
                    )
                except InputError as e:  # keys contradict the tree: undo, then re-raise
                    run, error = 0, e
            if r is not None and not r.node_ids:
                run = 0  # the parent vanished between our check and the insert
            s.release_locked(0, sum(charges[:granted]))
            s.unpin_locked(pinned, owner)
            s.unanchor_locked(anchor, owner)
            refs: list[ChunkRef] = []
            if run and self.config.write_policy == "write_through" and len(s.tiers) > 1:
                full = (1 << len(s.tiers)) - 1
                new_ids = r.node_ids  # type: ignore[union-attr]
                refs = s.refs_locked([n for n in new_ids if s.tree.node_tier_mask(n) != full])
                refs = s.pin_locked(refs, owner)
                s.transfers_inflight += bool(refs)
            leaked = s.mark_deleting_locked(
                [(0, nsd, keys[i]) for i, o in written.items() if o and i >= run]
                + (leaked_by_clear if cleared else [])
                + s.settle_writes_locked(0, nsd, wkeys)
                + [(0, nsd, k) for k in lost]
            )
        s.delete_entries(leaked)
        if error is not None:
            raise error
        if refs:
            self._submit_write(lambda job: jobs.write_through(s, refs, owner), refs, owner)
        elif run and self._closed and self.config.write_policy == "write_back" and len(s.tiers) > 1:
            # close() began while this put ran: its write_back persist step may have listed the
            # memory-only chunks before these went in, so they would be lost with the process.
            # Not acknowledged, as a write_through put's copy refused by the closing store is not.
            raise RuntimeError("the store is closed; create a new HierarchicalStore")
        return [i < run for i in range(len(keys))]

    def _submit_write(self, fn: Any, refs: list[ChunkRef], owner: str) -> None:
        # Blocks while the queue is full (backpressure on writers). A job cancelled before it ran (a
        # non-flushing close) releases its pins and transfer count. The pool refuses jobs only once
        # close() began: running the copy inline then would read tiers close() is closing (a
        # "tier 'mem' is closed" error escaped to the caller); release and say the store closed.
        try:
            self._writer.submit(fn, 0, block=True, name=owner,
                                on_cancel=lambda: jobs.cancel_write_through(self._stack, refs, owner))
        except RuntimeError:
            jobs.release(self._stack, refs, owner)
            raise RuntimeError("the store is closed; create a new HierarchicalStore") from None

    # ------------------------------------------------------------------ lookup / get / prefetch
    @_call
    def lookup(
        self,
        ns: Namespace,
        keys: Sequence[str],
        parent_key: str | None = None,
        chunk_bytes: int | None = None,
        probe: bool | None = None,
        record: bool = True,
    ) -> int:
        """Leading run of ``keys`` present in any tier: one tree lookup (recency untouched), then, if
        it ends early and probing is on, the adoption of what the disk/Redis tiers hold
        (:meth:`adopt`; ``parent_key`` and ``chunk_bytes`` as there). ``probe`` overrides
        ``config.probe_tiers`` for this call. The result counts in the lookup metrics (hit: the
        run, miss: the rest) unless ``record`` is False (see :meth:`record_lookup`)."""
        self._check_open()
        nsd = self._check_chain(ns, keys, parent_key)
        if self.config.probe_tiers if probe is None else probe:
            n = adoption.adopt(self, ns, nsd, keys, parent_key, chunk_bytes)[0]
        else:
            with self._stack.cond:
                n = self._stack.tree.match(nsd, keys, touch=False).hit_chunks
        if record:
            self.record_lookup(ns, n, len(keys))
        return n

    def record_lookup(self, ns: Namespace, hit_chunks: int, asked_chunks: int) -> None:
        """Count one lookup in the metrics, for a caller that composes it of several
        ``lookup(..., record=False)`` calls (a run continued across calls); ``0 <= hit_chunks <=
        asked_chunks``, else an ``InputError`` (a counter must never go down)."""
        checks.check_count("asked_chunks", asked_chunks)
        checks.check_count("hit_chunks", hit_chunks)
        if hit_chunks > asked_chunks:
            raise InputError(f"hit_chunks={hit_chunks} exceeds asked_chunks={asked_chunks}; a lookup "
                             "hits at most the chunks it asked for")
        miss = asked_chunks - hit_chunks
        self.metrics.lookups(hit_chunks, miss, ns.tokens_in(hit_chunks), ns.tokens_in(miss))

    def record_misses(self, ns: Namespace, chunks: int) -> None:
        """Count ``chunks`` asked for and read by no tier (a miss in every tier), for a caller that
        continues a read across ``get(..., count_misses=False)`` calls. ``chunks`` >= 0."""
        checks.check_count("chunks", chunks)
        if not chunks:
            return
        for name in self._stack.names:
            self.metrics.misses(name, chunks, ns.tokens_in(chunks))

    @_call
    def adopt(
        self,
        ns: Namespace,
        keys: Sequence[str],
        parent_key: str | None = None,
        chunk_bytes: int | None = None,
    ) -> int:
        """Add to the tree the chunks after its hit on ``keys`` that a persistent or shared tier
        holds although this store never recorded them (a disk directory from before a restart or
        shared with other processes, a shared Redis); returns how many chunks were added.

        The tiers are probed outside the lock (memory tiers never: they are process-local); the
        leading run found continues the tree's hit, or starts at ``parent_key`` (when the tree holds
        it) or at the namespace root (awaiting ``parent_key``, as a ``put`` with
        ``root_if_missing``), and becomes resident in the tier(s) holding it (the longest
        run wins, the fastest tier on a tie). Reads then verify the bytes as always: a chunk that
        fails its checksum is a miss and loses its residency. ``chunk_bytes`` is the payload size of
        the namespace's chunks; it is needed only before the first put/get of the namespace in this
        store (then nothing can be adopted without it: 0). Rules: :mod:`radixkv.adoption`."""
        self._check_open()
        nsd = self._check_chain(ns, keys, parent_key)
        return adoption.adopt(self, ns, nsd, keys, parent_key, chunk_bytes)[1]

    @_call
    def get(
        self,
        ns: Namespace,
        keys: Sequence[str],
        buffers: Sequence[ChunkBytes],
        parent_key: str | None = None,
        count_misses: bool = True,
    ) -> int:
        """Fill ``buffers[:n]`` with the verified bytes of the leading run of ``keys`` any tier can
        deliver; returns ``n``. ``buffers[n:]`` hold unspecified bytes. Chunks the tree does not
        know are adopted first when probing is on (``parent_key`` as in :meth:`adopt`). With
        ``count_misses`` False the unread rest is not counted as misses (the caller continues the
        run and counts what stays unread with :meth:`record_misses`)."""
        self._check_open()
        refs, masks, owner, clears = self._match_and_pin(ns, keys, buffers, parent_key)
        return self._read(ns, refs, masks, owner, buffers, None, count_misses, clears)

    @_call
    def prefetch(
        self,
        ns: Namespace,
        keys: Sequence[str],
        buffers: Sequence[ChunkBytes],
        parent_key: str | None = None,
    ) -> PrefetchHandle:
        """Start :meth:`get` in the background. The chunks present now (adopted ones included) are
        pinned until the read ends (or the handle is cancelled), so they cannot be evicted in
        between."""
        self._check_open()
        # Here, not only in the tiers' reads (get's run on its own thread, so it raises there): a
        # prefetch's read runs on a worker thread, where the error reached only a caller that
        # waits (one that polls done() or drops the handle never saw it).
        checks.check_list(buffers, "buffers")
        check_buffers_disjoint(byte_parts_all(buffers, "buffers"))
        refs, masks, owner, clears = self._match_and_pin(ns, keys, buffers, parent_key)
        if not refs:  # nothing to read: counted as get counts it (every chunk a miss in every tier)
            with self.metrics.timed("prefetch"):
                jobs.account(self._stack, ns, [], [], 0, len(buffers))
            return PrefetchHandle(None)
        try:
            job = self._reader.submit(
                lambda j: self._read(ns, refs, masks, owner, buffers, j, True, clears), 0, block=True,
                name=owner, on_cancel=lambda: self._unpin(refs, owner),  # cancelled before it ran
            )
        except RuntimeError:  # close() overtook us
            self._unpin(refs, owner)
            raise RuntimeError("the store is closed; create a new HierarchicalStore") from None
        return PrefetchHandle(job, calls=self._stack.calls)

    def _match_and_pin(
        self,
        ns: Namespace,
        keys: Sequence[str],
        buffers: Sequence[ChunkBytes],
        parent_key: str | None,
    ) -> tuple[list[ChunkRef], list[int], str, tuple[int, int]]:
        nsd = self._check_chain(ns, keys, parent_key)
        checks.check_list(buffers, "buffers")
        if len(buffers) != len(keys):
            raise InputError(
                f"{len(keys)} keys but {len(buffers)} buffers; pass one buffer per key"
            )
        size = self._check_tensors(ns, buffers, "buffers", register=False)
        s = self._stack
        owner = s.owner("get")
        probe = bool(keys) and self.config.probe_tiers
        while True:  # at most twice: a partial hit adopts what the tiers hold, then matches again
            with s.cond:
                m = s.tree.match(nsd, keys, touch=True)
                if not probe or m.hit_chunks == len(keys):
                    ids = m.node_ids
                    refs = s.refs_locked(ids)
                    masks = list(m.tier_masks)
                    if refs:
                        s.tree.pin(ids, owner, s.lease_s)
                    return refs, masks, owner, (s.clears[None], s.clears[nsd])
            probe = False  # the buffers size the chunks of a namespace never put here
            adoption.adopt(self, ns, nsd, keys, parent_key, size or chunk_nbytes(buffers[0]))

    def _read(
        self,
        ns: Namespace,
        refs: list[ChunkRef],
        masks: list[int],
        owner: str,
        buffers: Sequence[ChunkBytes],
        job: Job[int] | None,
        count_misses: bool = True,
        clears: tuple[int, int] | None = None,
    ) -> int:
        s = self._stack
        try:
            cancelled = (lambda: job.cancel_requested) if job is not None else (lambda: False)
            with self.metrics.timed("get" if job is None else "prefetch"):
                n, served = s.read_run(refs, masks, buffers, cancelled)
            if job is not None and job.cancel_requested:
                return 0
            jobs.account(s, ns, refs, served, n, len(buffers) if count_misses else n)
            if self.config.promote_on_hit and len(s.tiers) > 1:
                self._promoter.promote(refs[:n], served[:n], buffers, clears)
            return n
        finally:
            self._unpin(refs, owner)

    # ------------------------------------------------------------------ delete / clear
    def borrow(self, ns: Namespace, tiers: Sequence[str] | None = None) -> list[str]:
        """Declare that another process owns ``ns``'s bytes in the shared ``tiers`` (default: every
        shared tier of this store: Redis, a disk tier with ``shared=True``). This store still reads
        and adopts them, but every implicit removal (making room, a failed read, a tier's own
        eviction, :meth:`reconcile`) only *forgets* them: they leave its tree and stop counting
        against its capacity, and their bytes stay for the owner, which evicts them itself. Nor does
        it write the namespace there: copies into those tiers are skipped, and a :meth:`put` into a
        borrowed top tier is an InputError. For readers of a namespace one other process writes, as
        SGLang's MLA non-writer ranks read what the storage-writer rank stores: without this, a
        reader making room in its own books would delete the writer's chunks from the shared tier.
        Explicit :meth:`delete` and :meth:`clear` still delete. Returns the names of the tiers
        borrowed from; idempotent. Borrow before this store puts the namespace there (engines
        borrow at start): chunks it wrote there earlier are then only forgotten when evicted, and
        their bytes stay, tracked by no store."""
        self._check_open()
        if not isinstance(ns, Namespace):
            raise InputError(f"ns={ns!r} must be a radixkv Namespace")
        s = self._stack
        shared = [name for name, tier in zip(s.names, s.tiers) if getattr(tier, "shared", False)]
        if tiers is None:
            names = shared
        else:
            if isinstance(tiers, str):
                raise InputError(f"tiers={tiers!r} must be a list of tier names, not one str")
            names = list(dict.fromkeys(tiers))
            for name in names:
                if name not in s.names:
                    raise InputError(f"tier {name!r} is not one of this store's tiers {list(s.names)}")
                if name not in shared:
                    raise InputError(
                        f"tier {name!r} is not shared with other processes, so no other process owns "
                        f"its bytes; borrow from the shared tiers {shared} (a disk tier is shared "
                        "with options shared=true)"
                    )
        with s.cond:
            for name in names:
                s.borrow_locked(s.names.index(name), ns.digest)
        for name in names:
            # A shared disk tier then never counts or evicts the owner's files in its own budget.
            tier_borrow = getattr(s.tiers[s.names.index(name)], "borrow", None)
            if tier_borrow is not None:
                tier_borrow(ns.digest)
        return names

    @_call
    def delete(self, ns: Namespace, keys: Sequence[str]) -> int:
        """Remove the chunks from every tier (descendants the store tracks, now unreachable, go with
        them); returns how many of ``keys`` the store tracked. Keys it does not track are deleted
        from the tiers too: a persistent tier may hold them (from before a restart, or put by another
        process sharing it), and a later lookup would otherwise adopt them back. Only the keys given:
        the store cannot name an untracked descendant, which a later put of its parent would adopt
        back, so invalidating a chain's bytes takes its whole tail (``keys[i:]``) or ``clear(ns)``."""
        self._check_open()
        nsd = self._check_chain(ns, keys)
        s = self._stack
        entries: list[tuple[int, str, str]] = []
        with s.cond:  # nothing is inserted inside this section, so removed ids are not reused here
            ids = [n for k in keys if (n := s.tree.lookup(nsd, k)) is not None]
            found = len(ids)
            # Untracked copies too, of untracked keys and of tracked ones in the tiers the tree does
            # not place them in (a disk file or Redis value from before a restart, beside the copy a
            # later put made in memory): a later probe would otherwise adopt them back. Only tiers
            # adoption probes can hold them: a memory tier is process-local, and what it holds
            # untracked is a put in flight (which its own cleanup deletes if it fails).
            entries += [(t, nsd, k) for t, tier in enumerate(s.tiers) if not isinstance(tier, MemoryTier)
                        for k in keys]
            for t in range(len(s.tiers)):
                held = [n for n in ids if _alive(s.tree, n) and s.tree.node_tier_mask(n) & (1 << t)]
                entries += [(t, nsd, s.tree.node_key(n)) for n in held]
                entries += s.clear_locked(held, t)
            # A barrier, as clear() is: a copy between tiers that began before (a write-through
            # of the old bytes inside a disk write) could commit after the delete's own deletes and
            # after a put of the key's new bytes, which it then overwrote there (wrong bytes once
            # memory released the key). The tree no longer holds the chunks, so no copy of them
            # begins now.
            s.wait_copies_before_delete_locked(nsd, entries)
            entries = s.mark_deleting_locked(entries)
        s.delete_entries(entries)
        return found

    @_call
    def clear(self, namespace: Namespace | str | None = None) -> None:
        """Drop every chunk (of one namespace) from the tree and every tier."""
        self._check_open()
        nsd = checks.namespace_digest(namespace)
        s = self._stack
        with s.cond:
            s.clears[nsd] += 1
            s.clearing[nsd] += 1
            s.spoil_namespace_locked(nsd)
            held = [s.used_locked(t) - s.reserved[t] for t in range(len(s.tiers))]
            s.tree.clear(namespace=nsd)
            # The tiers hold the namespace's bytes until their clear below ends: keep them counted,
            # or other namespaces' writers get room a tier lacks, and a disk tier then evicts on its
            # own (LRU, out of the tree's order; even a chunk another writer committed but has not
            # made resident yet, which the tree then places on a disk that deleted it).
            held = [h - (s.used_locked(t) - s.reserved[t]) for t, h in enumerate(held)]
            for t, h in enumerate(held):
                s.reserved[t] += h
        # The tiers are cleared outside the lock (a Redis SCAN over a large keyspace takes seconds;
        # other namespaces' calls go on). Meanwhile puts and adoptions of this namespace stand
        # aside, and a put that overlapped the clear reports False and deletes what it wrote.
        try:
            # A copy between tiers that began before this clear holds bytes read before it: let it
            # land (and find its chunks gone) before the tiers are wiped, so no pre-clear bytes
            # survive under a key a later put of the namespace would trust. (Inside the try: a
            # Ctrl-C during this wait, as long as a slow copy, left the namespace "clearing" and
            # its bytes reserved for good, so every later put of it failed.)
            with s.cond:
                s.wait_copies_locked(nsd)
            for t in s.tiers:
                try:
                    t.clear(nsd)
                except Exception as e:  # a tier must fail quietly; the others are still cleared
                    logger.warning("radixkv: clearing tier %r failed: %s: %s", t.name, type(e).__name__, e)
        finally:
            with s.cond:
                for t, h in enumerate(held):
                    s.release_locked(t, h)
                s.clearing[nsd] -= 1
                if not s.clearing[nsd]:
                    del s.clearing[nsd]  # a Counter keeps a key at 0: one per namespace cleared
                # Kept for good, per namespace ever cleared (~0.2 KB): a put, read or adoption in
                # flight holds the count it saw, and a namespace without one reads as 0, so a pruned
                # count could read as the value a call saw before this clear.
                s.clears[nsd] += 1  # puts that started during the clear see it at their end
                if nsd is None:
                    self._ns_bytes.clear()
                else:
                    self._ns_bytes.pop(nsd, None)

    # ------------------------------------------------------------------ stats / integrity / close
    def stats(self) -> dict[str, Any]:
        """Plain numbers: per tier (capacity, usage, tree residency, the tier's own counters), the
        tree's counters, the store's counters and queue depths."""
        return checks.store_stats(self)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued background writes (write-through, promotions) finished."""
        return self._writer.drain(timeout_s)

    def check_integrity(self, deep: bool = True) -> None:
        """Raise AssertionError/RuntimeError with numbers if an invariant is broken: the tree's own,
        each tier's own, no tier over capacity, and (``deep``, when no transfer is in flight) every
        chunk the tree places in a tier is there and a tier counting chunks holds no untracked ones.
        With no call running and no background job queued or running, also that every operation
        gave back its reservations, claims, pins, anchors and intents (docs/store.md, Integrity).
        Deep checks cost one ``contains`` per chunk: meant for tests and small stores."""
        checks.check_store(self, deep)

    @_call
    def reconcile(self) -> int:
        """Ask every tier whether it still holds each chunk the tree places there and forget the
        residencies it lost (a restarted Redis, files removed by hand); returns how many. One
        ``contains`` per chunk: for tests, tools and small stores (reads find such losses lazily).
        Safe beside other threads' calls: a chunk written again after its tier answered is kept."""
        self._check_open()
        return checks.reconcile_store(self)

    @_call
    def close(self, flush: bool | None = None) -> None:
        """Finish background work (``flush``, default ``config.flush_on_close``) or cancel what has
        not started, join every store thread, close the tiers. Idempotent. A flushing close of a
        ``write_back`` store first copies what only memory tiers hold to a persistent tier below."""
        if flush is not None and not isinstance(flush, bool):  # "no" would be truthy: a flush
            raise InputError(f"flush={flush!r} must be True, False or None (the config's flush_on_close)")
        timeout = self.config.close_timeout_s
        with self._close_lock:
            second = self._closed
            self._closed = True  # first: callers racing close() get "the store is closed", not a tier's error
            if not second:
                self._closer = threading.get_ident()
        if second:
            if self._closer != threading.get_ident() and not self._close_done.wait(3 * timeout + 10):
                logger.warning("radixkv: close() gave up waiting for another thread's close() to end")
            return
        try:
            self._close(flush, timeout)
        finally:
            self._close_done.set()

    def _close(self, flush: bool | None, timeout: float) -> None:
        # Reads already running fail once the tiers close: that must not count as lost chunks
        # (forgetting them deletes their bytes from the persistent tiers).
        self._stack.closing = True
        flush = self.config.flush_on_close if flush is None else flush
        self._reader.close(flush=False, timeout_s=timeout)
        self._writer.close(flush=flush, timeout_s=timeout)
        if len(self._stack.tiers) > 1 and (flush or self.config.write_policy == "write_back"):
            try:
                self._persist_at_close(flush, time.monotonic() + timeout)
            except Exception:  # closing must still close the tiers
                logger.exception("radixkv: persisting a %s store at close failed", self.config.write_policy)
        self._retry_deletes_at_close(time.monotonic() + timeout)
        if self._stop_serving is not None:
            self._stop_serving()  # runs once
        # Slowest first: work close() stopped waiting for that then fails on a closed memory tier
        # (a refused put makes room by evicting) finds the persistent tiers below already closed,
        # and a closed tier deletes nothing.
        for tier in reversed(self._stack.tiers):
            try:
                tier.close()
            except Exception:  # closing must not leave the other tiers open
                pass

    def _retry_deletes_at_close(self, deadline: float) -> None:
        """Deletes a tier missed (its server was down) are retried by later puts; at close once more,
        or the next process (or another sharing the tier) would adopt the deleted bytes. What still
        fails is logged: those keys stay on the medium until their TTL, an overwrite or a clear."""
        s = self._stack
        for name, failed in zip(s.names, s.retry_deletes_at_close(deadline)):
            if failed:
                logger.warning("radixkv: %d deletes tier %r missed while unreachable could not run at "
                               "close; those chunks stay on it until their TTL, an overwrite or a clear",
                               failed, name)

    def _persist_at_close(self, flush: bool, deadline: float) -> None:
        """At a flushing close, what only memory tiers hold is copied to the first tier below that
        outlives the process. write_back writes a chunk down only when it is evicted; write_through
        copies every put down, but a copy that failed (a disk full for a moment, a Redis blip) is not
        retried and its chunk would die with the process: those alone (a chunk a lower tier evicted
        by its own policy stays evicted, or copying it back would evict that tier's newer ones)."""
        s = self._stack
        if flush:
            only = None
            if self.config.write_policy != "write_back":
                with s.cond:
                    only = set(s.failed_copies)
                if not only:
                    return
            r = writeback.persist_volatile(s, deadline, only=only)
            if r.left_chunks:
                logger.warning("radixkv: closing a %s store: %d chunks held only in memory were not "
                               "written to a persistent tier (%d were)", self.config.write_policy,
                               r.left_chunks, r.written_chunks)
            return
        with s.cond:
            only_top = s.tree.chunks_only_in(s.names[0])
        if only_top:
            logger.warning("radixkv: closing a write_back store with flush=False: %d chunks held only "
                           "in tier %r are not written to the tiers below", only_top, s.names[0])

    def __enter__(self) -> HierarchicalStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ validation
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the store is closed; create a new HierarchicalStore")

    def _check_chain(self, ns: Namespace, keys: Sequence[str], parent_key: str | None = None) -> str:
        return checks.check_chain(self, ns, keys, parent_key)

    def _check_tensors(
        self, ns: Namespace, tensors: Sequence[ChunkBytes], what: str, register: bool = True
    ) -> int:
        return checks.check_tensors(self, ns, tensors, what, register)

    def _unpin(self, refs: list[ChunkRef], owner: str) -> None:
        with self._stack.cond:
            self._stack.unpin_locked(refs, owner)


def _has(tree: RadixTree, nsd: str, key: str, t: int) -> bool:
    n = tree.lookup(nsd, key)
    return n is not None and bool(tree.node_tier_mask(n) & (1 << t))


def _alive(tree: RadixTree, n: int) -> bool:
    try:
        tree.node_key(n)
        return True
    except InputError:
        return False
