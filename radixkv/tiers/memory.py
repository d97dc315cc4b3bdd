"""CPU-memory tier: one preallocated (pinned when CUDA is available) buffer cut into slab slots.

Layout::

    buffer (capacity_bytes, torch.uint8)   [unit 0][unit 1][unit 2] ... [unit n-1]   (unit_bytes each;
                                           the last one shorter if capacity_bytes is no multiple)
    slab = a run of units assigned to ONE slot size, cut into equal slots:
           [slot 0 | slot 1 | ... | slot k-1 | waste < slot_bytes]

Every byte of the buffer can hold chunks: a chunk is a :class:`CapacityError` only when it is larger
than ``capacity_bytes``.

A namespace's slot size is fixed by its first put (a later payload of another size is an
:class:`InputError` naming both sizes). An empty slab keeps its size until another size needs room;
then empty slabs return their units to the pool, so namespaces of different sizes share the buffer
over time. The buffer is the capacity: it cannot be exceeded, and a put that finds no free slot is
refused (``False``), never evicts.

Readers: :meth:`MemoryTier.get_many` copies into caller buffers. :meth:`MemoryTier.lease` returns
zero-copy views and holds a reader count on each slot: a deleted slot with readers is freed only when
the last lease is released (deferred free), so a view never shows another chunk's bytes while leased.
:meth:`MemoryTier.get_views` returns the same views *without* a reader count: they are valid only while
the caller guarantees nobody deletes the chunks (the hierarchical store's pin on the chunk).
"""

from __future__ import annotations

import ctypes
import heapq
import mmap
import re
import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

from radixkv.errors import CapacityError, ConfigError, InputError
from radixkv.forksafe import forked, hold_across_fork
from radixkv.hostcopy import HostCopier
from radixkv.keys import KEY_RE
from radixkv.tiers.base import (
    ChunkBytes,
    TierStats,
    byte_parts_all,
    check_buffers_disjoint,
    check_payload_size,
    config_or_options,
    part_spans,
    parts_nbytes,
)

__all__ = ["MemoryTier", "MemoryTierConfig", "MemoryLease"]

_MiB = 1 << 20


@dataclass(slots=True)
class MemoryTierConfig:
    """capacity_bytes: size of the one preallocated buffer (the hard bound).
    unit_bytes: allocation granule of slabs; slab_target_bytes: preferred slab size (a slab is never
    smaller than one slot). pin: page-lock the buffer; None = pin when CUDA is available.
    prefault: touch every page at construction, so the capacity is really committed (no overcommit
    surprise under load) and first puts do not pay page faults (pinned memory is always resident).
    huge_pages: back an unpinned buffer with an anonymous mapping advised ``MADV_HUGEPAGE``
    (transparent 2 MiB pages where the kernel allows them; silently 4 KiB pages otherwise): copies
    into the slots then miss the TLB 512x less often (measured: a 128 MiB batch of 512 KiB puts
    29 -> 23 ms on this machine, docs/sglang.md). Pinned buffers are CUDA allocations and keep theirs.
    Cost: the kernel assembles 2 MiB pages at first touch, so the prefault of a large buffer takes
    longer (2 GiB: 1.8-3.2 s against 1.2-1.3 s here); turn it off where startup time matters more.
    copy_threads: threads that copy one batch's bytes in or out (the calling thread included; None =
    one per CPU, at most 4). Batches under 4 MiB always copy on the calling thread
    (:class:`radixkv.hostcopy.HostCopier`: glibc memmove, 2 threads ~1.7x one on this machine)."""

    capacity_bytes: int
    name: str = "mem"
    unit_bytes: int = 2 * _MiB
    slab_target_bytes: int = 64 * _MiB
    pin: bool | None = None
    prefault: bool = True
    huge_pages: bool = True
    copy_threads: int | None = None

    def __post_init__(self) -> None:
        if self.copy_threads is not None and (
            not isinstance(self.copy_threads, int) or isinstance(self.copy_threads, bool) or self.copy_threads < 1
        ):
            raise ConfigError(f"MemoryTierConfig.copy_threads={self.copy_threads!r} must be a positive integer "
                              "(or None: one per CPU, at most 4)")
        for attr in ("capacity_bytes", "unit_bytes", "slab_target_bytes"):
            v = getattr(self, attr)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"MemoryTierConfig.{attr}={v!r} must be a positive integer (bytes)")
        # A string is not a switch: huge_pages="false" turned huge pages on (any non-empty str is
        # true), and pin="false" failed with "pin=True needs CUDA". The URL form parses them.
        for attr in ("prefault", "huge_pages"):
            v = getattr(self, attr)
            if not isinstance(v, bool):
                raise ConfigError(f"MemoryTierConfig.{attr}={v!r} must be True or False")
        if self.pin is not None and not isinstance(self.pin, bool):
            raise ConfigError(f"MemoryTierConfig.pin={self.pin!r} must be True, False or None (pin when "
                              "CUDA is available)")
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"MemoryTierConfig.name={self.name!r} must be a non-empty tier name (a str)")
        # A capacity below one unit is legal: the unit shrinks to the capacity.
        self.unit_bytes = min(self.unit_bytes, self.capacity_bytes)


@dataclass(slots=True)
class _Slab:
    first_unit: int
    n_units: int
    slot_bytes: int
    n_slots: int
    offset_bytes: int
    free: list[int]  # recycled slot indices (< fresh)
    fresh: int = 0  # slots [fresh, n_slots) were never handed out: no O(n_slots) list per slab
    views: dict[int, torch.Tensor] = field(default_factory=dict)  # slot index -> its bytes, made once
    used: int = 0  # slots published, being written, or freed-but-leased

    def has_free(self) -> bool:
        return bool(self.free) or self.fresh < self.n_slots


@dataclass(slots=True, eq=False)
class _Slot:
    slab_id: int
    index: int
    offset_bytes: int
    nbytes: int
    view: torch.Tensor  # the slot's bytes in the buffer, made once (slicing per access costs us)
    readers: int = 0
    dead: bool = False  # deleted while leased: freed when readers reaches 0


@dataclass(slots=True)
class MemoryLease:
    """Zero-copy views of leased chunks (None where absent). Release exactly once (or use ``with``)."""

    views: list[torch.Tensor | None]
    _tier: MemoryTier
    _slots: list[_Slot] = field(default_factory=list)
    _released: bool = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._tier._release(self._slots)

    def __enter__(self) -> MemoryLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# The key index of a namespace the tier holds nothing of (read only).
_NONE: dict[str, _Slot] = {}


_key_ok = KEY_RE.fullmatch
# A list of valid keys joined by "/" (a character no key has): one match over the joined keys costs
# about half of one fullmatch per key.
_KEYS_RE = re.compile(f"{KEY_RE.pattern}(?:/{KEY_RE.pattern})*")


def _check_ident(namespace: object, keys: object) -> None:
    """InputError unless ``namespace`` and every key are names the other tiers can store too
    (:data:`radixkv.keys.KEY_RE`, as the disk tier checks): a namespace or key the memory tier took
    but the disk tier refuses would fail only later, when an eviction demotes it. Called outside the
    lock; ~0.1 us a key, small against the chunk copies a batch does."""
    if not isinstance(namespace, str) or _key_ok(namespace) is None:
        raise InputError(f"namespace={namespace!r:.80} must be 1-128 chars of [A-Za-z0-9_-] (Namespace.digest)")
    if isinstance(keys, (str, bytes)):
        raise InputError(f"keys={keys!r} must be a sequence of str keys, not a single str")
    if keys.__class__ is list or keys.__class__ is tuple:
        try:
            joined = "/".join(keys)  # type: ignore[arg-type]
        except TypeError:  # a key is not a str: named below
            pass
        else:  # a key holding "/" adds one: the count tells it from two keys
            n = len(keys)  # type: ignore[arg-type]
            if _KEYS_RE.fullmatch(joined) is not None and joined.count("/") == n - 1:
                return
    try:  # the slow path: name the first bad key
        for k in keys:  # type: ignore[union-attr]
            if not isinstance(k, str) or _key_ok(k) is None:
                raise InputError(f"key {k!r:.80} must be 1-128 chars of [A-Za-z0-9_-] (a hex chunk key)")
    except TypeError:  # not iterable
        raise InputError(f"keys={keys!r:.80} must be a sequence of str keys") from None


class MemoryTier:
    """CPU-memory tier over one preallocated buffer (see the module docstring). Thread-safe."""

    def __init__(self, config: MemoryTierConfig | None = None, **kwargs: object) -> None:
        config = config_or_options(MemoryTierConfig, config, kwargs)
        self.config = config
        self.name = config.name
        self.capacity_bytes = config.capacity_bytes
        pin = torch.cuda.is_available() if config.pin is None else config.pin
        if pin and not torch.cuda.is_available():
            raise ConfigError(f"tier {self.name!r}: pin=True needs CUDA (page-locked memory is a CUDA "
                              "allocation) and none is available; use pin=None (auto) or pin=False")
        self.pinned = bool(pin)
        self._mapping: mmap.mmap | None = None
        self.huge_pages = False
        try:
            if not self.pinned and config.huge_pages:
                self._buffer = self._huge_buffer(config.capacity_bytes)
            else:
                self._buffer = torch.empty(config.capacity_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        except (RuntimeError, MemoryError, OSError, ValueError, OverflowError) as e:
            # torch says "DefaultCPUAllocator: can't allocate memory" (a RuntimeError): a capacity
            # the host cannot give is the configuration's fault, named with its fix.
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "allocate memory" in why or isinstance(e, MemoryError) or "out of memory" in why:
                why = "out of memory"
            raise ConfigError(
                f"tier {self.name!r}: cannot allocate capacity_bytes={config.capacity_bytes} "
                f"({config.capacity_bytes / (1 << 30):.1f} GiB) of {'pinned' if self.pinned else 'host'} "
                f"memory ({why[:160]}); lower capacity_bytes (?capacity= in the URL) to what the host can hold"
            ) from None
        if config.prefault and not self.pinned:
            if forked():
                # torch's parallel fill hangs in a fork child whose parent started torch's OpenMP
                # pool (a store opened in the child, as docs/store.md advises): one libc memset.
                ctypes.memset(self._buffer.data_ptr(), 0, self._buffer.numel())
            else:
                self._buffer.zero_()
        self._unit = config.unit_bytes
        # Units of unit_bytes, the last one shorter when the capacity is not a whole number of
        # units: every byte of the buffer belongs to a unit, so the whole capacity holds chunks.
        self._unit_owner: list[int] = [-1] * -(-config.capacity_bytes // self._unit)  # slab id or -1
        self._slabs: dict[int, _Slab] = {}
        self._partial: dict[int, set[int]] = {}  # slot_bytes -> slab ids with a free slot
        # The same ids as a min-heap per slot size (entries of reclaimed slabs left until they
        # surface): a put takes the lowest slab with a free slot without a min() over every partial
        # slab, which after evictions freed slots all over a large tier cost O(slabs) per chunk.
        self._partial_heap: dict[int, list[int]] = {}
        # Every unit below this one is owned by a slab: the search for free units starts here, not
        # at unit 0 (a scan over every allocated unit per new slab made filling a large tier
        # quadratic: O(units) per slab, and per refused chunk once the tier is full).
        self._free_from = 0
        self._next_slab = 0
        # Namespace -> key -> slot: clear(ns) visits that namespace's chunks only, and a namespace
        # leaves with its last chunk (an emptied dict keeps its peak table).
        self._index: dict[str, dict[str, _Slot]] = {}
        self._ns_slot_bytes: dict[str, int] = {}
        # Per namespace: chunks indexed or being written. The namespace's slot size is released when
        # it drops to 0, so a size fixed by a put that lost a race with clear() cannot outlive it.
        self._ns_live: dict[str, int] = {}
        # clear() generations (per namespace, and of clear(None)): a put that a clear overtook
        # while it copied frees its slots instead of publishing them under the cleared namespace.
        # Only puts copying compare them, and each keeps its namespace in _ns_live meanwhile: a
        # namespace's generation leaves with its last live chunk (not one kept per namespace ever
        # cleared), so none drops back to 0 under a put that read it.
        self._ns_gen: dict[str, int] = {}
        self._all_gen = 0
        # Slots reserved by puts copying now -> their namespace (a forked child frees them).
        self._writing: dict[_Slot, str] = {}
        self._dead: set[_Slot] = set()
        self._stats = TierStats()
        self._stats.extra.update(full_refusals=0, deferred_frees=0)
        self._lock = threading.Lock()
        # A fork never copies the lock (and the slab state) mid-update; the child frees the slots
        # of the parent's puts in flight (_after_fork_in_child).
        hold_across_fork(self, in_child=MemoryTier._after_fork_in_child)
        self._closed = False
        self._copier = HostCopier(config.copy_threads)
        # Slot i's bytes start at this address + its offset: copies of a chunk's parts go by address
        # (slicing a view per part would cost microseconds each). The buffer lives as long as the tier.
        self._base_ptr = self._buffer.data_ptr()
        self._end_ptr = self._base_ptr + self._buffer.nbytes

    # ----------------------------------------------------------------------------- public API

    def put_many(self, namespace: str, keys: Sequence[str], payloads: Sequence[ChunkBytes]) -> list[bool]:
        _check_ident(namespace, keys)
        if len(keys) != len(payloads):
            raise InputError(f"{len(keys)} keys but {len(payloads)} payloads; pass one payload per key")
        parts = byte_parts_all(payloads, "payloads")
        sizes = [parts_nbytes(ps) for ps in parts]
        ok = [False] * len(keys)
        todo: list[tuple[int, _Slot]] = []
        with self._lock:
            self._check_open()
            first_put = sizes and namespace not in self._ns_slot_bytes
            if first_put:
                self._ns_slot_bytes[namespace] = sizes[0]
            try:  # validate the whole batch before reserving anything
                for i, n in enumerate(sizes):
                    self._check_size(namespace, n, f"payloads[{i}]")
            except Exception:
                if first_put:
                    del self._ns_slot_bytes[namespace]
                raise
            refused: set[int] = set()  # sizes no slot was found for: nothing frees one meanwhile
            held = self._index.get(namespace, _NONE)
            for i, key in enumerate(keys):
                if key in held:
                    ok[i] = True  # keys name content: present means the same bytes
                    continue
                slot = None if sizes[i] in refused else self._alloc(sizes[i])
                if slot is None:
                    refused.add(sizes[i])
                    self._stats.extra["full_refusals"] += 1
                    self._stats.put_failures += 1
                    continue
                self._writing[slot] = namespace
                todo.append((i, slot))
            self._ns_live[namespace] = self._ns_live.get(namespace, 0) + len(todo)
            if first_put and not todo:
                self._drop_live_locked(namespace, 0)  # nothing stored: the size stays unfixed
            gen = (self._all_gen, self._ns_gen.get(namespace, 0))
        # Copy outside the lock: the slots are reserved and invisible until published below.
        try:
            spans = _spans_into_slots(self._base_ptr, todo, parts)
            # The destinations are reserved slots (disjoint by construction): a source can overlap
            # one only if it lies in this tier's buffer (a lease view). Otherwise skip the general
            # check (a sort of every span, a noticeable share of a batch's Python time).
            lo, hi = self._base_ptr, self._end_ptr
            self._copier.copy_spans(spans, checked=_outside(lo, hi, spans, 1))
        except BaseException:
            with self._lock:
                for _, slot in todo:
                    del self._writing[slot]
                    self._free(slot)
                self._drop_live_locked(namespace, len(todo))
            raise
        with self._lock:
            cleared = gen != (self._all_gen, self._ns_gen.get(namespace, 0))
            dropped = 0
            index = self._index.get(namespace)
            for i, slot in todo:
                del self._writing[slot]
                # A clear overtook us, or a concurrent put won:
                if cleared or (index is not None and keys[i] in index):
                    self._free(slot)
                    dropped += 1
                    ok[i] = not cleared
                else:
                    if index is None:
                        index = self._index[namespace] = {}
                    index[keys[i]] = slot
                    self._stats.puts += 1
                    self._stats.bytes_in += slot.nbytes
                    ok[i] = True
            self._drop_live_locked(namespace, dropped)
        return ok

    def _drop_live_locked(self, namespace: str, n: int) -> None:
        """``n`` of the namespace's chunks are gone; with none left its slot size is released."""
        live = self._ns_live.get(namespace, 0) - n
        if live > 0:
            self._ns_live[namespace] = live
        else:
            self._ns_live.pop(namespace, None)
            self._ns_slot_bytes.pop(namespace, None)
            self._ns_gen.pop(namespace, None)  # no put of it is copying: none compares it

    def get_many(self, namespace: str, keys: Sequence[str], buffers: Sequence[ChunkBytes]) -> list[bool]:
        _check_ident(namespace, keys)
        if len(keys) != len(buffers):
            raise InputError(f"{len(keys)} keys but {len(buffers)} buffers; pass one buffer per key")
        outs = byte_parts_all(buffers, "buffers")
        slots = self._acquire(namespace, keys, [parts_nbytes(o) for o in outs])
        held = [s for s in slots if s is not None]
        try:
            spans = _spans_from_slots(self._base_ptr, slots, outs)
            # The sources are slots; the destinations need checking against each other (one sort)
            # and against this tier's buffer; the general check runs only if one lies in it.
            check_buffers_disjoint(outs)
            lo, hi = self._base_ptr, self._end_ptr
            self._copier.copy_spans(spans, checked=_outside(lo, hi, spans, 0))
        finally:
            self._release(held, gets=len(keys), hits=len(held), bytes_out=sum(s.nbytes for s in held))
        return [s is not None for s in slots]

    def lease(self, namespace: str, keys: Sequence[str]) -> MemoryLease:
        """Zero-copy views of the chunks, each slot held until :meth:`MemoryLease.release`."""
        _check_ident(namespace, keys)
        return self._lease(namespace, keys, None)

    def get_views(self, namespace: str, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Zero-copy views *without* a reader count: valid only while the chunks stay pinned in the
        store (nothing may delete them); use :meth:`lease` otherwise."""
        _check_ident(namespace, keys)
        with self._lock:
            self._check_open()
            held = self._index.get(namespace, _NONE)
            slots = [held.get(k) for k in keys]
            return [None if s is None else s.view for s in slots]

    def contains_many(self, namespace: str, keys: Sequence[str]) -> int:
        _check_ident(namespace, keys)
        with self._lock:
            held = self._index.get(namespace, _NONE)
            n = 0
            for k in keys:
                if k not in held:
                    break
                n += 1
            return n

    def delete_many(self, namespace: str, keys: Sequence[str]) -> int:
        _check_ident(namespace, keys)
        with self._lock:
            self._check_open()  # like every tier: a closed one refuses changes (a persistent one must)
            n = sum(self._delete_locked(namespace, k) for k in keys)
            self._stats.deletes += n
            return n

    def clear(self, namespace: str | None = None) -> None:
        """Delete every chunk (of one namespace) and release the slot size. Puts copying meanwhile
        publish nothing (their slots are freed when they end), so no chunk of the old size returns."""
        with self._lock:
            self._check_open()
            for ns in list(self._index) if namespace is None else [namespace]:
                for key in list(self._index.get(ns, _NONE)):
                    self._delete_locked(ns, key)
            if namespace is None:
                self._all_gen += 1
                self._ns_slot_bytes.clear()
            else:
                if namespace in self._ns_live:  # puts of it are copying: they must see this clear
                    self._ns_gen[namespace] = self._ns_gen.get(namespace, 0) + 1
                self._ns_slot_bytes.pop(namespace, None)

    @property
    def shared(self) -> bool:
        """Process-local memory: never shared."""
        return False

    def usage_bytes(self) -> int:
        """Bytes of occupied slots (published, being written, or deleted but still leased)."""
        with self._lock:
            return sum(s.used * s.slot_bytes for s in self._slabs.values())

    def stats(self) -> TierStats:
        with self._lock:
            st = TierStats(**{k: getattr(self._stats, k) for k in TierStats.__slots__ if k != "extra"})
            st.extra = dict(self._stats.extra)
            st.extra["chunks"] = self._indexed_locked()
            st.extra["slabs"] = len(self._slabs)
            st.extra["slab_bytes"] = sum(self._run_bytes(s.first_unit, s.n_units) for s in self._slabs.values())
            st.extra["huge_pages"] = int(self.huge_pages)
            st.extra["leased_dead_slots"] = len(self._dead)
            return st

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._copier.close()

    def check_integrity(self) -> None:
        with self._lock:
            owned: dict[int, int] = {}
            for u, sid in enumerate(self._unit_owner):
                if sid >= 0:
                    owned[sid] = owned.get(sid, 0) + 1
            live: dict[int, int] = {}
            empty = [ns for ns, held in self._index.items() if not held]
            if empty:
                raise RuntimeError(f"empty key index kept for namespaces {sorted(empty)[:5]}")
            for ns, slot in [(ns, v) for ns, held in self._index.items() for v in held.values()]:
                if slot.dead:
                    raise RuntimeError(f"slot {slot} is in the index but marked dead")
                if self._ns_slot_bytes.get(ns) is not None and self._ns_slot_bytes[ns] != slot.nbytes:
                    raise RuntimeError(f"namespace {ns} slot size {self._ns_slot_bytes[ns]} != {slot.nbytes}")
                live[slot.slab_id] = live.get(slot.slab_id, 0) + 1
            for slot in self._dead:
                if slot.readers <= 0:
                    raise RuntimeError(f"dead slot {slot} has no readers but was not freed")
                live[slot.slab_id] = live.get(slot.slab_id, 0) + 1
            for slot in self._writing:
                live[slot.slab_id] = live.get(slot.slab_id, 0) + 1
            # Each slot handed out is one (slab, index) that is not free: two keys on one slot
            # would overwrite each other's bytes, and the counts above still agree when the slot
            # the second key had is leaked (still used, held by no one).
            taken: dict[tuple[int, int], object] = {}
            free = {sid: set(slab.free) for sid, slab in self._slabs.items()}
            indexed = [slot for held in self._index.values() for slot in held.values()]
            for slot in [*indexed, *self._dead, *self._writing]:
                where = (slot.slab_id, slot.index)
                if where in taken:
                    raise RuntimeError(f"slot {where[1]} of slab {where[0]} is held twice (by {slot} "
                                       f"and {taken[where]})")
                taken[where] = slot
                slab = self._slabs.get(slot.slab_id)
                if slab is None or not 0 <= slot.index < slab.fresh or slot.index in free[slot.slab_id]:
                    raise RuntimeError(f"slot {slot} is held but its slab does not have it handed out")
            total_used = 0
            for sid, slab in self._slabs.items():
                if owned.get(sid) != slab.n_units:
                    raise RuntimeError(f"slab {sid}: owns {owned.get(sid)} units, expected {slab.n_units}")
                if slab.n_slots * slab.slot_bytes > self._run_bytes(slab.first_unit, slab.n_units):
                    raise RuntimeError(f"slab {sid}: {slab.n_slots} slots of {slab.slot_bytes} bytes exceed "
                                       f"its {self._run_bytes(slab.first_unit, slab.n_units)} bytes")
                if len(set(slab.free)) != len(slab.free) or any(not 0 <= f < slab.fresh for f in slab.free):
                    raise RuntimeError(f"slab {sid}: corrupt free list {slab.free} (fresh from {slab.fresh})")
                if len(slab.free) + slab.used != slab.fresh or slab.fresh > slab.n_slots:
                    raise RuntimeError(f"slab {sid}: {len(slab.free)} free + {slab.used} used != {slab.fresh} "
                                       f"handed out (of {slab.n_slots})")
                in_partial = sid in self._partial.get(slab.slot_bytes, set())
                if in_partial != slab.has_free():
                    raise RuntimeError(f"slab {sid}: partial-set membership {in_partial} but has_free "
                                       f"{slab.has_free()}")
                if live.get(sid, 0) != slab.used:
                    raise RuntimeError(f"slab {sid}: {slab.used} slots used, {live.get(sid, 0)} held "
                                       "(indexed, leased-dead or being written)")
                total_used += slab.used
            if any(sid < 0 for sid in self._unit_owner[: self._free_from]):
                raise RuntimeError(f"a free unit below the first-free mark {self._free_from}")
            for size, partial in self._partial.items():
                if not partial <= set(self._partial_heap.get(size, ())):
                    raise RuntimeError(f"slot size {size}: partial slabs {sorted(partial)} missing from "
                                       f"the heap {sorted(self._partial_heap.get(size, ()))}")
            if set(owned) != set(self._slabs):
                raise RuntimeError(f"units owned by unknown slabs {set(owned) - set(self._slabs)}")
            per_ns = {ns: len(held) for ns, held in self._index.items()}
            if any(per_ns.get(ns, 0) > n for ns, n in self._ns_live.items()) or any(
                n > self._ns_live.get(ns, 0) for ns, n in per_ns.items()
            ) or sum(self._ns_live.values()) != len(indexed) + len(self._writing):
                raise RuntimeError(f"live chunks per namespace {self._ns_live} disagree with "
                                   f"{per_ns} indexed + {len(self._writing)} being written")
            if set(self._ns_gen) - set(self._ns_live):
                raise RuntimeError(f"clear generations kept for namespaces without chunks: "
                                   f"{sorted(set(self._ns_gen) - set(self._ns_live))}")
            if set(self._ns_slot_bytes) - set(self._ns_live):
                raise RuntimeError(f"slot sizes kept for namespaces without chunks: "
                                   f"{sorted(set(self._ns_slot_bytes) - set(self._ns_live))}")
            if total_used != len(indexed) + len(self._dead) + len(self._writing):
                raise RuntimeError(
                    f"{total_used} used slots != {len(indexed)} indexed + {len(self._dead)} leased-dead "
                    f"+ {len(self._writing)} being written"
                )
            used_bytes = sum(s.used * s.slot_bytes for s in self._slabs.values())
            if used_bytes > self.capacity_bytes:
                raise RuntimeError(f"usage {used_bytes} exceeds capacity {self.capacity_bytes}")

    # ----------------------------------------------------------------------------- internals

    def _after_fork_in_child(self) -> None:
        """In a forked child (lock held): the puts in flight at the fork ran on threads the child
        does not have, so they would never publish or free their slots there; free them now, and
        release the slot size of a namespace that held nothing else."""
        for slot, namespace in self._writing.items():
            self._free(slot)
            self._drop_live_locked(namespace, 1)
        self._writing.clear()

    def _huge_buffer(self, nbytes: int) -> torch.Tensor:
        """The buffer as an anonymous private mapping advised MADV_HUGEPAGE (plain torch memory if
        the platform has no such advice). The mapping lives as long as the tier."""
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        try:
            m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError, AttributeError):
            return torch.empty(nbytes, dtype=torch.uint8)
        try:
            m.madvise(advice)
            self.huge_pages = True
        except OSError:  # THP disabled ("never"): still a valid buffer of 4 KiB pages
            pass
        self._mapping = m
        return torch.frombuffer(m, dtype=torch.uint8)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"tier {self.name!r} is closed")

    def _check_size(self, namespace: str, nbytes: int, what: str) -> None:
        fixed = self._ns_slot_bytes.get(namespace)
        check_payload_size(self.name, namespace, fixed, nbytes, what)
        if nbytes > self.capacity_bytes:
            raise CapacityError(
                f"a {nbytes}-byte chunk cannot fit tier {self.name!r} of capacity {self.capacity_bytes} "
                f"bytes; raise capacity_bytes to at least {nbytes}"
            )

    def _run_bytes(self, first: int, n_units: int) -> int:
        """Bytes of the ``n_units`` units from unit ``first`` (the last unit may be short)."""
        return min((first + n_units) * self._unit, self.capacity_bytes) - first * self._unit

    def _acquire(self, namespace: str, keys: Sequence[str], sizes: list[int] | None) -> list[_Slot | None]:
        """The keys' slots (None where absent), each with one more reader. Sizes are checked first, so
        an InputError leaves no reader count behind."""
        with self._lock:
            self._check_open()
            held = self._index.get(namespace, _NONE)
            slots = [held.get(k) for k in keys]
            if sizes is not None:
                fixed = self._ns_slot_bytes.get(namespace)
                for i, slot in enumerate(slots):
                    want = slot.nbytes if slot is not None else fixed
                    if want is not None and sizes[i] != want:
                        raise InputError(
                            f"buffers[{i}] has {sizes[i]} bytes but chunks of namespace {namespace} have "
                            f"{want} bytes in tier {self.name!r}; pass buffers of the namespace's chunk size"
                        )
            for slot in slots:
                if slot is not None:
                    slot.readers += 1
            return slots

    def _lease(self, namespace: str, keys: Sequence[str], sizes: list[int] | None) -> MemoryLease:
        slots = self._acquire(namespace, keys, sizes)
        return MemoryLease(views=[None if s is None else s.view for s in slots], _tier=self,
                           _slots=[s for s in slots if s is not None])

    def _release(self, slots: list[_Slot], gets: int = 0, hits: int = 0, bytes_out: int = 0) -> None:
        with self._lock:
            self._stats.gets += gets
            self._stats.hits += hits
            self._stats.misses += gets - hits
            self._stats.bytes_out += bytes_out
            for slot in slots:
                slot.readers -= 1
                if slot.dead and slot.readers == 0:
                    self._dead.discard(slot)
                    self._free(slot)
                    self._stats.extra["deferred_frees"] += 1

    def _indexed_locked(self) -> int:
        """Chunks in the index, all namespaces."""
        return sum(len(held) for held in self._index.values())

    def _delete_locked(self, namespace: str, key: str) -> bool:
        held = self._index.get(namespace)
        slot = None if held is None else held.pop(key, None)
        if slot is None:
            return False
        if not held:
            del self._index[namespace]
        self._drop_live_locked(namespace, 1)
        if slot.readers > 0:
            slot.dead = True
            self._dead.add(slot)
        else:
            self._free(slot)
        return True

    def _alloc(self, slot_bytes: int) -> _Slot | None:
        partial = self._partial.setdefault(slot_bytes, set())
        heap = self._partial_heap.setdefault(slot_bytes, [])
        if not partial:
            sid = self._new_slab(slot_bytes)
            if sid is None:
                return None
            partial.add(sid)
            heapq.heappush(heap, sid)
        while heap[0] not in partial:  # a reclaimed slab's entry
            heapq.heappop(heap)
        sid = heap[0]  # fill low slabs first: keeps high slabs free to return to the pool
        slab = self._slabs[sid]
        if slab.free:
            idx = slab.free.pop()
        else:
            idx = slab.fresh
            slab.fresh += 1
        slab.used += 1
        if not slab.has_free():
            partial.discard(sid)
            heapq.heappop(heap)  # sid, the top
        offset = slab.offset_bytes + idx * slot_bytes
        view = slab.views.get(idx)
        if view is None:  # slicing a tensor costs microseconds: a recycled slot reuses its view
            view = slab.views[idx] = self._buffer[offset : offset + slot_bytes]
        return _Slot(sid, idx, offset, slot_bytes, view)

    def _free(self, slot: _Slot) -> None:
        slab = self._slabs[slot.slab_id]
        slab.free.append(slot.index)
        slab.used -= 1
        # An empty slab stays with its size class (put/delete cycles would otherwise rebuild it every
        # time); _new_slab reclaims empty slabs when another size class needs their units.
        partial = self._partial.setdefault(slab.slot_bytes, set())
        if slot.slab_id not in partial:
            partial.add(slot.slab_id)
            heapq.heappush(self._partial_heap.setdefault(slab.slot_bytes, []), slot.slab_id)

    def _reclaim_empty_slabs(self) -> None:
        for sid in [sid for sid, slab in self._slabs.items() if slab.used == 0]:
            slab = self._slabs.pop(sid)
            for u in range(slab.first_unit, slab.first_unit + slab.n_units):
                self._unit_owner[u] = -1
            self._partial[slab.slot_bytes].discard(sid)
            self._free_from = min(self._free_from, slab.first_unit)
        for size, partial in self._partial.items():  # drop the reclaimed slabs' heap entries, in
            self._partial_heap.setdefault(size, [])[:] = sorted(partial)  # place (_alloc holds one)

    def _new_slab(self, slot_bytes: int) -> int | None:
        min_units = -(-slot_bytes // self._unit)
        # The target is at most 1/4 of the tier, so a small tier still has room for other size
        # classes (a KV pool and a sidecar pool sharing one tier) instead of one slab taking it all.
        target_bytes = min(self.config.slab_target_bytes, self.config.capacity_bytes // 4)
        want_units = max(min_units, target_bytes // self._unit)
        # Of the slab sizes up to the target (or up to two slots, within the tier), the one whose
        # slots fill it best (among equals the largest up to the target, so a slot size that fills
        # the target keeps it, else the smallest above). A slab wastes less than one slot, and at
        # the target size that was up to half the tier: a DeepSeek-V3 chunk of 256 tokens
        # (17.2 MiB) fits 3 times in 64 MiB, so a 64 GiB tier held 3,072 chunks where its bytes
        # hold 3,819 (the simulator, which counts a byte capacity in whole chunks, overstated it by
        # 24 %), and one of 512 tokens (34.3 MiB) once. Now 3 in 52 MiB (99 %) and 2 in 70 MiB (98 %).
        # Two slots are allowed past a quarter of the tier: a tier of a few chunks (10 MiB, 3 MiB
        # chunks) otherwise got one-slot slabs of 4 MiB and held 2 chunks where its bytes hold 3.
        top = max(want_units, min(len(self._unit_owner), -(-2 * slot_bytes // self._unit)))
        want_units = max(range(min_units, top + 1),
                         key=lambda n: ((n * self._unit // slot_bytes) * slot_bytes / (n * self._unit),
                                        n if n <= want_units else -n))
        first, n_units = self._largest_run(want_units)
        if (n_units < want_units or self._run_bytes(first, n_units) < slot_bytes) and any(
            slab.used == 0 for slab in self._slabs.values()
        ):
            self._reclaim_empty_slabs()  # other size classes' empty slabs give their units back
            first, n_units = self._largest_run(want_units)
        n_slots = self._run_bytes(first, n_units) // slot_bytes
        if n_slots == 0:
            return None
        # A shorter run than wanted gives up the units its slots do not need (other sizes use them).
        n_units = min(n_units, -(-n_slots * slot_bytes // self._unit))
        sid = self._next_slab
        self._next_slab += 1
        for u in range(first, first + n_units):
            self._unit_owner[u] = sid
        self._slabs[sid] = _Slab(first, n_units, slot_bytes, n_slots, first * self._unit, free=[])
        return sid

    def _largest_run(self, cap: int) -> tuple[int, int]:
        """(first unit, length) of the first free run of ``cap`` units, else of the longest one.
        Scans from the first unit that may be free (:attr:`_free_from`), and moves that there."""
        best_first, best_len, run = 0, 0, 0
        owners = self._unit_owner
        start = self._free_from
        self._free_from = len(owners)  # no free unit at or after start, unless found below
        for u in range(start, len(owners)):
            if owners[u] >= 0:
                run = 0
                continue
            if run == 0 and u < self._free_from:
                self._free_from = u
            run += 1
            if run > best_len:
                best_first, best_len = u - run + 1, run
                if run == cap:
                    break
        return best_first, best_len


def _spans_into_slots(base: int, todo: list[tuple[int, _Slot]],
                      parts: list[Sequence[torch.Tensor]]) -> list[tuple[int, int, int]]:
    """Copy spans writing each chunk's parts, in order, into its slot."""
    spans = []
    for i, slot in todo:
        dst = base + slot.offset_bytes
        for a, n in part_spans(parts[i]):
            if n:
                spans.append((dst, a, n))
                dst += n
    return spans


def _spans_from_slots(base: int, slots: list[_Slot | None],
                      outs: list[Sequence[torch.Tensor]]) -> list[tuple[int, int, int]]:
    """Copy spans filling each held chunk's buffer parts, in order, from its slot."""
    spans = []
    for slot, parts in zip(slots, outs):
        if slot is None:
            continue
        src = base + slot.offset_bytes
        for a, n in part_spans(parts):
            if n:
                spans.append((a, src, n))
                src += n
    return spans


def _outside(lo: int, hi: int, spans: list[tuple[int, int, int]], col: int) -> bool:
    """No span's caller side (column ``col``: 0 destination, 1 source) touches [lo, hi)."""
    for sp in spans:
        a = sp[col]
        if a < hi and a + sp[2] > lo:
            return False
    return True
