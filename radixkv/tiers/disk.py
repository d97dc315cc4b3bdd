"""Disk tier: one framed file per chunk under a directory (local disk or a shared filesystem).

Layout: ``root/<namespace>/<h[0:2]>/<key>.kv`` (:mod:`radixkv.tiers.disk_layout`). Each file is
``encode_header(namespace, key, payload) + payload`` (:mod:`radixkv.tiers.framing`). Directories are
created 0700, files 0600.

Crash safety: a put writes a file nobody can see yet -- a new temp file
(``.<key>.<pid>.<thread>.<rand>.tmp``, ``O_EXCL``, same directory) or a recycled one (below) --
payload first, each block hashed while still in cache, header with the checksum last
(:func:`radixkv.tiers.disk_io.write_frame`); optionally fsyncs it (``fsync=True``; off by default:
after a power loss a committed file may be torn, which the checksum turns into a miss), then commits
with ``os.replace``. A reader reads header and payload straight into the caller's buffer with one
``preadv`` per block and verifies identity, length and checksum
(:func:`radixkv.tiers.disk_io.read_frame`): any mismatch is a miss, counted in
``checksum_failures``, and the file is removed. Restart rebuilds the index by scanning headers.

Recycling (``recycle=True``, the default unless shared): the file of a removed chunk (evicted,
deleted, cleared) is renamed into ``root/.spare`` instead of unlinked, within the capacity; a later put
overwrites the newest spare in place and renames it to its own name
(:mod:`radixkv.tiers.disk_spares`). A reader that opened a file just before it was recycled reads
bytes that fail its checks: a miss, never another chunk's bytes.

Capacity: the index counts whole frame bytes (header + payload) of the files it knows, plus bytes of
puts in flight; a put that would exceed ``capacity_bytes`` first evicts this tier's least-recently-used
files (hits and puts refresh recency). Evictions are counted in stats and their identities can be
collected with :meth:`DiskTier.drain_evicted` so a store can drop them from its tree.

Shared directories (``shared=True``): several processes may use one directory (the seed system's
"remote disk"). Writes of the same key race safely (each commits a whole file by rename; the last
rename wins, a reader sees one whole verified file). Gets and ``contains_many`` also look for files
other processes wrote, and ``contains_many`` answers from the file, not the index (another process may
have deleted one we index); capacity is enforced per process over the files *it* indexes, so give each
process a share of the directory's budget. In shared mode invalid files found by the startup scan are
skipped, not deleted (they may belong to another format version).
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import math
import time
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import xxhash

from radixkv.errors import CapacityError, ConfigError, InputError
from radixkv.forksafe import ForkSafeExecutor, hold_across_fork, run_shared
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
from radixkv.tiers.disk_io import (
    FAST_READ,
    blocks,
    preadv_all,
    pwrite_all,
    pwritev_all,
    read_chunk_fast,
    read_frame,
    write_frame,
)
from radixkv.tiers.disk_layout import DiskLayout, check_ident, fsync_dir
from radixkv.tiers.disk_spares import SpareFiles, unlink_quietly
from radixkv.tiers.framing import HEADER_BYTES, Hasher, decode_header, encode_header, payload_checksum

logger = logging.getLogger("radixkv.tiers.disk")

# A fault of the medium (disk full, I/O error, a corrupt file) is logged at once, then at most once
# per this long per tier and kind, with the count in between: a full disk fails every put, and a
# line per put buried the engine's log while saying nothing new (stats count every one).
_FAULT_LOG_EVERY_S = 60.0

__all__ = ["DiskTier", "DiskTierConfig"]

_OVERLAP_BLOCK_BYTES = 2 << 20  # read-ahead unit of the overlapped get
# Namespaces a private tier keeps (their directories, their fixed payload size) after their last
# file left: beyond this many, the oldest emptied are forgotten and their directories removed.
_EMPTY_NAMESPACES_KEPT = 16


@dataclass(slots=True)
class DiskTierConfig:
    """root: directory (created 0700 if missing; an existing one must belong to this process's user
    and not be writable by group or others, docs/tiers.md "Trust"); capacity_bytes: bound on indexed frame bytes;
    io_threads: parallel reads/writes of one batch (default: one per CPU, at most 4 -- each I/O thread
    also hashes what it moves, so threads beyond the cores only contend: on 2 cores, 4 threads made
    page-cache reads of a 128 MiB batch ~25% slower than 2); fsync: fsync each file before its commit rename,
    and its directory after it (and each directory the tier makes into its parent), so a put reported
    done survives a crash;
    shared: other processes use the same directory; stale_temp_s (shared mode only): age after which
    a leftover temp file (a crashed writer's) is removed by the startup scan, on the clock that
    stamps the directory's files (a network filesystem's server), not this host's; a directory the tier
    owns alone has no live writer at its start, so the scan removes all of them there.
    recycle: keep the files of removed chunks (evicted, deleted, cleared) aside in ``root/.spare``
    within the capacity, and let later puts overwrite them in place instead of creating new files: no
    page-cache pages are freed and allocated again per put, which halves the cost of a put into the page cache (docs/sglang.md);
    the spare files count in the capacity, are reused newest first, and are removed by ``close()``
    and by the next start. Off in shared mode (the directory is not ours alone). overlap_min_bytes: from this payload
    size on, a put hashes the payload while a helper thread writes it and a get hashes block i while a
    helper reads block i+1 (xxh3 and pread/pwrite release the GIL). Off (None) by default: it can only
    pay off with idle cores, and on the loaded 2-core machine it was measured on, the hand-offs made
    8 MiB gets ~5x slower (docs/benchmarks.md#tiers)."""

    root: str
    capacity_bytes: int
    name: str = "disk"
    io_threads: int = field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)))
    fsync: bool = False
    shared: bool = False
    stale_temp_s: float = 600.0
    overlap_min_bytes: int | None = None  # off: on a loaded 2-core VM the thread hand-offs cost more
    recycle: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)) or not isinstance(os.fspath(self.root), str):
            raise ConfigError(f"DiskTierConfig.root={self.root!r} must be a directory path (a str)")
        self.root = os.fspath(self.root)
        if not self.root:
            raise ConfigError("DiskTierConfig.root must be a directory path")
        if "\0" in self.root:  # the OS refuses it: os.stat would raise ValueError ("embedded null byte")
            raise ConfigError(f"DiskTierConfig.root={self.root!r} holds a NUL character, which no path can; "
                              "pass the directory's path without it (file:///abs/dir)")
        # A string is not a switch: shared="false" turned shared mode on (any non-empty str is true).
        for attr in ("fsync", "shared", "recycle"):
            v = getattr(self, attr)
            if not isinstance(v, bool):
                raise ConfigError(f"DiskTierConfig.{attr}={v!r} must be True or False")
        for attr in ("capacity_bytes", "io_threads"):
            v = getattr(self, attr)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"DiskTierConfig.{attr}={v!r} must be a positive integer")
        if (not isinstance(self.stale_temp_s, (int, float)) or isinstance(self.stale_temp_s, bool)
                or not self.stale_temp_s >= 0):
            raise ConfigError(f"DiskTierConfig.stale_temp_s={self.stale_temp_s!r} must be >= 0 seconds")
        if not self.name:
            raise ConfigError("DiskTierConfig.name must be a non-empty tier name")
        if self.overlap_min_bytes is not None and (
            not isinstance(self.overlap_min_bytes, int) or isinstance(self.overlap_min_bytes, bool)
            or self.overlap_min_bytes <= 0
        ):
            raise ConfigError(f"DiskTierConfig.overlap_min_bytes={self.overlap_min_bytes!r} must be a "
                              "positive number of bytes or None (off)")


def _held_bytes(frame: int, spare: tuple[str, int] | None) -> int:
    """Bytes a put reserves: its frame, or the file it overwrites if larger (truncated only at the end)."""
    return max(frame, spare[1]) if spare is not None else frame


class DiskTier:
    """Framed-file tier over a directory (see the module docstring). Thread-safe."""

    def __init__(self, config: DiskTierConfig | None = None, **kwargs: object) -> None:
        config = config_or_options(DiskTierConfig, config, kwargs)
        self.config = config
        self.name = config.name
        self.capacity_bytes = config.capacity_bytes
        self._layout = DiskLayout(config.root, config.name, sync_dirs=config.fsync)
        self.root = self._layout.root
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self._usage = 0
        self._reserved = 0
        self._ns_payload_bytes: dict[str, int] = {}
        # Namespaces whose payload size only the start-up scan saw (files of an earlier process): a
        # put of another size replaces it, a get of another size is a miss, never an error.
        self._scanned_sizes: set[str] = set()
        # Puts running per namespace: a namespace with none and no indexed chunk holds nothing of its
        # fixed size, so another size may replace it (see _release_size_locked).
        self._ns_writing: collections.Counter[str] = collections.Counter()
        self._ns_dirs: set[str] = set()  # namespaces whose 256 directories were made
        # Indexed files per namespace, and the namespaces whose count fell to 0, oldest first: past
        # _EMPTY_NAMESPACES_KEPT a private tier forgets the oldest and removes their directories, or
        # every namespace ever written (a long-lived engine draws a new one per weight update) would
        # keep 257 directories on disk and in memory after its files aged out.
        self._ns_files: collections.Counter[str] = collections.Counter()
        self._emptied: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._detached: list[str] = []  # their directories, moved aside, to remove outside the lock
        self._evicted: collections.deque[tuple[str, str]] = collections.deque(maxlen=1 << 16)
        # Recycled files; their bytes count in the capacity (usage + reserved + spares.bytes).
        self._spares = SpareFiles(self._layout.spare_dir, config.recycle and not config.shared)
        self._borrowed: set[str] = set()  # namespaces whose files another process owns (borrow)
        self._stats = TierStats()
        self._fault_logged_at: dict[str, float] = {}  # kind -> monotonic time of its last line
        self._faults_unlogged: collections.Counter[str] = collections.Counter()
        self._stats.extra.update(evictions=0, evicted_bytes=0, evictions_unreported=0, scan_indexed=0, scan_skipped=0,
                                 temp_removed=0, size_mismatches=0, adopted=0, recycled_puts=0, forgotten=0)
        self._layout.prepare_root()
        self._root_lock = self._layout.lock_root(config.shared)
        if not config.shared:
            self._spares.reset()
        # Fork-safe: a tier built before an engine forks its workers still works in the children.
        self._pool = ForkSafeExecutor(config.io_threads, thread_name_prefix=f"radixkv-{self.name}-io")
        # Helpers of the overlapped paths; only _pool's tasks submit here, so neither pool can deadlock.
        self._aux = ForkSafeExecutor(config.io_threads, thread_name_prefix=f"radixkv-{self.name}-aux")
        self._closed = False
        self._scan()
        # A fork never copies the lock (and the index) mid-update; the child drops what was the
        # parent's alone (_after_fork_in_child).
        hold_across_fork(self, in_child=DiskTier._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        """In a forked child (lock held): the parent's spare files stay the parent's (both taking
        one would write one file from two processes), and the puts in flight at the fork ran on
        threads the child does not have, so their reservations would never be returned."""
        self._spares.forget_all()
        self._reserved = 0
        self._ns_writing.clear()
        if self._root_lock is not None:
            # Drop the child's reference to the parent's lock (no unlock: that would release the
            # parent's), so the root is free once the parent ends even while this child lives.
            self._root_lock.close()
            self._root_lock = None

    # ----------------------------------------------------------------------------- public API

    def put_many(self, namespace: str, keys: Sequence[str], payloads: Sequence[ChunkBytes]) -> list[bool]:
        check_ident(namespace, keys)
        if len(keys) != len(payloads):
            raise InputError(f"{len(keys)} keys but {len(payloads)} payloads; pass one payload per key")
        views = [[memoryview(p.numpy()) for p in ps] for ps in byte_parts_all(payloads, "payloads")]
        sizes = [parts_nbytes(v) for v in views]
        with self._lock:
            self._check_open()
            if sizes and namespace in self._scanned_sizes:
                self._scanned_sizes.discard(namespace)  # this process's puts fix the size now
                if self._ns_payload_bytes.get(namespace) != sizes[0]:
                    del self._ns_payload_bytes[namespace]  # old files of the other size read as misses
            if sizes and self._ns_payload_bytes.get(namespace, sizes[0]) != sizes[0]:
                self._release_size_locked(namespace)
            first_put = sizes and namespace not in self._ns_payload_bytes
            if first_put:
                self._ns_payload_bytes[namespace] = sizes[0]
            try:  # validate the whole batch before writing anything
                for i, nbytes in enumerate(sizes):
                    self._check_size(namespace, nbytes, f"payloads[{i}]")
                    frame = HEADER_BYTES + len(namespace) + len(keys[i]) + nbytes
                    if frame > self.capacity_bytes:
                        raise CapacityError(
                            f"a {nbytes}-byte chunk ({frame} bytes framed) cannot fit tier {self.name!r} "
                            f"of capacity {self.capacity_bytes} bytes; raise capacity_bytes"
                        )
            except Exception:
                if first_put:
                    del self._ns_payload_bytes[namespace]
                raise
            fresh_ns = namespace not in self._ns_dirs
            if fresh_ns and not self.config.shared and self._layout.replace_namespace_link(namespace):
                # Under the lock, before any put of the namespace: none writes through the link.
                logger.warning("radixkv: disk tier %r: removed a symbolic link in place of namespace "
                               "directory %s (puts would have written through it, out of the root)",
                               self.name, os.path.join(self.root, namespace))
            self._ns_dirs.add(namespace)
            self._ns_writing[namespace] += 1
        try:
            if keys and self._layout.root_replaced():
                # Removed (rm -rf) and perhaps made again by another tier, which now owns the new
                # directory: this tier must not write into it (nor re-create its own under it).
                self._log_fault("put", "the tier's directory was removed or replaced; puts fail until "
                                "this tier is opened again (%s)", self.root)
                with self._lock:
                    self._stats.put_failures += len(keys)
                return [False] * len(keys)
            if fresh_ns:
                self._layout.make_ns_dirs(namespace)
            ok = self._run(lambda i: self._put_one(namespace, keys[i], views[i]), len(keys))
        finally:
            with self._lock:
                self._ns_writing[namespace] -= 1
                if not self._ns_writing[namespace]:
                    del self._ns_writing[namespace]
                self._retire_emptied_locked()  # namespaces whose last files this put evicted
            self._remove_detached()
        if len(keys) > 1:  # parallel writes publish in completion order: make recency follow the batch
            with self._lock:
                for key in keys:
                    if (namespace, key) in self._index:
                        self._index.move_to_end((namespace, key))
        return ok

    def get_many(self, namespace: str, keys: Sequence[str], buffers: Sequence[ChunkBytes]) -> list[bool]:
        check_ident(namespace, keys)
        if len(keys) != len(buffers):
            raise InputError(f"{len(keys)} keys but {len(buffers)} buffers; pass one buffer per key")
        parts = byte_parts_all(buffers, "buffers")
        check_buffers_disjoint(parts)  # else a good file could fail its checksum and be quarantined
        spans = [part_spans(ps) for ps in parts]
        sizes = [parts_nbytes(ps) for ps in parts]
        with self._lock:
            self._check_open()
            fixed = self._ns_payload_bytes.get(namespace)
            if namespace in self._scanned_sizes:
                fixed = None  # a size only old files had: another size reads them as misses
            elif fixed is not None and any(n != fixed for n in sizes):
                if self._release_size_locked(namespace):
                    fixed = None  # nothing of the old size is held: a miss, not an error
        for i, nbytes in enumerate(sizes):
            if fixed is not None and nbytes != fixed:
                raise InputError(
                    f"buffers[{i}] has {nbytes} bytes but namespace {namespace} stores {fixed}-byte "
                    f"chunks in tier {self.name!r}; pass buffers of the namespace's chunk size"
                )
        hits = self._run(lambda i: self._get_one(namespace, keys[i], parts[i], spans[i], sizes[i]), len(keys))
        with self._lock:
            self._stats.gets += len(keys)
            self._stats.hits += sum(hits)
            self._stats.misses += len(keys) - sum(hits)
            self._stats.bytes_out += sum(n for n, h in zip(sizes, hits) if h)
        return hits

    def chunk_bytes_of(self, namespace: str) -> int | None:
        """The payload size of ``namespace``'s chunks here (its first put's, or the one the startup
        scan found), None if this tier knows none (adoption: :mod:`radixkv.adoption`)."""
        with self._lock:
            return self._ns_payload_bytes.get(namespace)

    def contains_many(self, namespace: str, keys: Sequence[str]) -> int:
        check_ident(namespace, keys)
        n = 0
        for k in keys:
            with self._lock:
                present = (namespace, k) in self._index
            if self.config.shared or present:
                # The file decides, not our index: other processes add and remove files in a shared
                # directory, and anyone may remove one by hand (a stale entry kept reconcile() from
                # seeing the loss: a private tier answered from its index alone).
                if not os.path.exists(self._layout.path(namespace, k)):
                    if present:
                        self._forget_missing(namespace, k)
                    break
            else:
                break
            n += 1
        return n

    def _forget_missing(self, namespace: str, key: str) -> None:
        """Drop the index entry of a file removed behind our back (another process of a shared
        directory, or by hand). Checked again under the lock: a put of ours that committed the key
        meanwhile keeps its entry."""
        with self._lock:
            if (namespace, key) in self._index and not os.path.exists(self._layout.path(namespace, key)):
                self._usage -= self._index.pop((namespace, key))
                self._unindexed_locked(namespace)

    def delete_many(self, namespace: str, keys: Sequence[str]) -> int:
        check_ident(namespace, keys)
        n = 0
        with self._lock:
            self._check_open()  # a closed tier's files outlive it: a late caller must not remove them
            for k in keys:
                frame = self._index.pop((namespace, k), None)
                if frame is not None:
                    self._usage -= frame
                    self._unindexed_locked(namespace)
                    if self._recycle_locked(self._layout.path(namespace, k), frame):
                        n += 1
                        continue
                try:
                    os.unlink(self._layout.path(namespace, k))
                    n += 1
                except FileNotFoundError:
                    n += frame is not None
                except OSError:  # read-only, EIO, a directory: still there, so still indexed
                    self._keep_undeleted_locked((namespace, k), frame)
            self._stats.deletes += n
            self._retire_emptied_locked()
        self._remove_detached()
        return n

    def clear(self, namespace: str | None = None) -> None:
        with self._lock:
            self._check_open()  # a closed tier's files outlive it: a late caller must not remove them
            frames = {}
            for ident in [i for i in self._index if namespace is None or i[0] == namespace]:
                frames[ident] = self._index.pop(ident)
                self._usage -= frames[ident]
                self._unindexed_locked(ident[0])
            unlisted: list[OSError] = []
            for ns, key, path in self._layout.walk(namespace, errors=unlisted):
                frame = frames.pop((ns, key), None)
                if frame is not None and self._recycle_locked(path, frame):
                    continue
                self._unlink_cleared_locked(ns, key, path, frame)
            # Indexed chunks the walk did not reach (a directory it could not list: EMFILE, EIO)
            # are removed by name. Left there, untracked, they outlived the clear, and the scan
            # of a restart served the pre-clear bytes again.
            for (ns, key), frame in frames.items():
                self._unlink_cleared_locked(ns, key, self._layout.path(ns, key), frame)
            if unlisted:
                logger.warning("radixkv: disk tier %r: clear(%r) could not list %d directories (%s); "
                               "chunk files there that this process did not index are left",
                               self.name, namespace, len(unlisted), unlisted[0])
            if namespace is None:
                self._ns_payload_bytes.clear()
                self._scanned_sizes.clear()
            else:
                self._ns_payload_bytes.pop(namespace, None)
                self._scanned_sizes.discard(namespace)
            self._retire_emptied_locked()
        self._remove_detached()

    def _unlink_cleared_locked(self, ns: str, key: str, path: str, frame: int | None) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:  # cannot be removed (read-only): it is still there, so still indexed
            self._keep_undeleted_locked((ns, key), frame)

    @property
    def shared(self) -> bool:
        """Whether other processes use this directory (``shared=True``)."""
        return self.config.shared

    def borrow(self, namespace: str) -> None:
        """The namespace's files belong to another process (a store's borrowed namespace, see
        ``HierarchicalStore.borrow``): read them, but never index, count or evict them, so this
        process's budget never deletes them. Shared mode only (a private directory has no owner
        besides us)."""
        check_ident(namespace, [])
        if not self.config.shared:
            raise InputError(f"tier {self.name!r} is not shared: no other process owns its files; open it "
                             "with shared=True to borrow a namespace")
        with self._lock:
            self._borrowed.add(namespace)
            for ident in [i for i in self._index if i[0] == namespace]:
                self._usage -= self._index.pop(ident)
                self._unindexed_locked(namespace)

    def forget_many(self, namespace: str, keys: Sequence[str]) -> int:
        """Stop counting the keys' files against this process's budget and stop evicting them, but
        leave the files: another process owns them (a store's borrowed namespace, see
        ``HierarchicalStore.borrow``). Returns how many were indexed."""
        check_ident(namespace, keys)
        n = 0
        with self._lock:
            for k in keys:
                frame = self._index.pop((namespace, k), None)
                if frame is not None:
                    self._usage -= frame
                    self._unindexed_locked(namespace)
                    n += 1
            self._stats.extra["forgotten"] += n
        return n

    def drain_evicted(self) -> list[tuple[str, str]]:
        """(namespace, key) of chunks this tier evicted on its own since the last call (bounded)."""
        with self._lock:
            out = list(self._evicted)
            self._evicted.clear()
            return out

    def usage_bytes(self) -> int:
        """Frame bytes (header + payload) of indexed files plus puts in flight. Recycled spare files
        (which count in the capacity too) are ``stats().extra["spare_bytes"]``."""
        with self._lock:
            return self._usage + self._reserved

    def stats(self) -> TierStats:
        with self._lock:
            st = TierStats(**{k: getattr(self._stats, k) for k in TierStats.__slots__ if k != "extra"})
            st.extra = dict(self._stats.extra, chunks=len(self._index), spare_files=len(self._spares),
                            spare_bytes=self._spares.bytes)
            return st

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._aux.shutdown(wait=True)
        self._remove_detached()
        with self._lock:
            self._spares.drop_all()
        if self._root_lock is not None:
            self._layout.release_root(self._root_lock)  # the root may now be owned by another tier
            self._root_lock = None

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(self._index.values())
            if total != self._usage:
                raise RuntimeError(f"usage {self._usage} != {total} summed over {len(self._index)} entries")
            if self._reserved < 0 or self._usage + self._reserved + self._spares.bytes > self.capacity_bytes:
                raise RuntimeError(
                    f"usage {self._usage} + reserved {self._reserved} + spare {self._spares.bytes} exceeds "
                    f"capacity {self.capacity_bytes}"
                )
            self._spares.check_integrity()
            if any(n <= 0 for n in self._ns_writing.values()):
                raise RuntimeError(f"puts running per namespace not positive: {dict(self._ns_writing)}")
            files = collections.Counter(ns for ns, _key in self._index)
            if files != self._ns_files or any(n <= 0 for n in self._ns_files.values()):
                raise RuntimeError(f"indexed files per namespace {dict(self._ns_files)} != {dict(files)} "
                                   "counted over the index")
            if self.config.shared:
                return  # other processes add and remove files: the directory is not ours alone
            on_disk = {(ns, key): path for ns, key, path in self._layout.walk(None)}
            if set(on_disk) != set(self._index):
                missing = set(self._index) - set(on_disk)
                extra = set(on_disk) - set(self._index)
                raise RuntimeError(f"index/files mismatch: {len(missing)} indexed without file "
                                   f"(e.g. {sorted(missing)[:2]}), {len(extra)} files not indexed "
                                   f"(e.g. {sorted(extra)[:2]})")
            for ident, path in on_disk.items():
                if os.stat(path).st_size != self._index[ident]:
                    raise RuntimeError(f"{path}: size {os.stat(path).st_size} != indexed {self._index[ident]}")

    # ----------------------------------------------------------------------------- I/O

    def _put_one(self, ns: str, key: str, payload: list[memoryview]) -> bool:
        ident = (ns, key)
        nbytes = parts_nbytes(payload)
        frame = HEADER_BYTES + len(ns) + len(key) + nbytes
        path = self._layout.path(ns, key)
        with self._lock:
            if self._index.get(ident) == frame:
                # Keys name content: present means the same bytes. Shared: only if the file is still
                # there (another process may have deleted it; reporting the put done would make a
                # store place the chunk on a disk that lacks it), else it is written again.
                if not self.config.shared or os.path.exists(path):
                    self._index.move_to_end(ident)
                    return True
                self._usage -= self._index.pop(ident)
                self._unindexed_locked(ns)
            # Absent, or indexed at another payload size (a file of an earlier process's size that
            # the scan kept): such a file can only be a miss, so it is overwritten, not kept.
            ok, spare = self._reserve_locked(frame)
            if not ok:
                self._stats.put_failures += 1
                return False
        tmp = None
        committed = False
        try:
            fd = -1
            if spare is not None:  # overwrite a recycled file in place: its page-cache pages stay
                tmp, old_size = spare
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
                except OSError:
                    unlink_quietly(tmp)
                    tmp = None
            if fd < 0:
                tmp = self._layout.temp_path(path)
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                except FileNotFoundError:  # a cached directory was removed behind our back: recreate once
                    self._layout.forget_dir(path)
                    tmp = self._layout.temp_path(path)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                old_size = 0
            try:
                if self._overlap(nbytes):
                    self._write_overlapped(fd, ns, key, payload)
                else:
                    write_frame(fd, ns, key, payload)
                if old_size > frame:
                    os.ftruncate(fd, frame)
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if spare is not None:
                self._layout.ensure_dir(os.path.dirname(path))
            with self._lock:
                try:
                    os.replace(tmp, path)  # commit; under the lock so index and files agree
                except FileNotFoundError:  # the chunk's directory was removed behind our back
                    self._layout.forget_dir(path)
                    self._layout.ensure_dir(os.path.dirname(path))
                    os.replace(tmp, path)
                committed = True
                self._reserved -= _held_bytes(frame, spare)
                old = self._index.get(ident)
                if old != frame:  # new, or the rename replaced a file of another size
                    self._index[ident] = frame
                    self._usage += frame - (old or 0)
                    if old is None:
                        self._ns_files[ns] += 1
                self._stats.puts += 1
                self._stats.bytes_in += nbytes
                self._stats.extra["recycled_puts"] += spare is not None
            if self.config.fsync:
                self._sync_commit(path)
            return True
        except BaseException as e:
            # Give the reservation and the temp file back whatever failed (an OSError is a failed
            # put; anything else, e.g. an I/O helper pool shut down by a racing close(), is raised).
            with self._lock:
                if not committed:
                    self._reserved -= _held_bytes(frame, spare)
                if isinstance(e, OSError):
                    self._stats.put_failures += 1
                    self._stats.errors += 1
            if tmp is not None and not committed:
                unlink_quietly(tmp)
            if isinstance(e, OSError):  # disk full, I/O error, directory removed: not an exception
                self._log_fault("put", "writing a chunk failed (%s); the put fails, the chunk is not kept in "
                                "this tier", _describe_os_error(e))
                return False
            raise

    def _sync_commit(self, path: str) -> None:
        """fsync mode: make the commit rename durable. The file's bytes were synced before the
        rename, but the rename itself lives in the directory, which a crash could still lose. A
        failure leaves the committed chunk readable (the put stands); it is logged as a fault."""
        try:
            fsync_dir(os.path.dirname(path))
        except OSError as e:
            with self._lock:
                self._stats.errors += 1
            self._log_fault("put", "syncing a chunk's directory failed (%s); the chunk is kept but may "
                            "not survive a crash", _describe_os_error(e))

    def _overlap(self, nbytes: int) -> bool:
        threshold = self.config.overlap_min_bytes
        return threshold is not None and nbytes >= threshold

    def _write_overlapped(self, fd: int, ns: str, key: str, payload: list[memoryview]) -> None:
        """Payload written by a helper while this thread hashes it; the header (which needs the
        checksum) goes last. Safe: the temp file is invisible until the commit rename."""
        write = self._aux.submit(pwritev_all, fd, payload, HEADER_BYTES + len(ns) + len(key))
        try:
            if len(payload) == 1:
                checksum = payload_checksum(payload[0])
            else:
                hasher = Hasher()
                for part in payload:
                    hasher.update(part)
                checksum = hasher.intdigest()
            header = encode_header(ns, key, parts_nbytes(payload), checksum)
            pwrite_all(fd, memoryview(header), 0)
        finally:
            write.result()  # always wait (and re-raise its OSError) before the caller closes fd

    def _read_overlapped(self, fd: int, offset: int, out: list[memoryview]) -> int | None:
        """Read ``out`` (parts, in order) from ``offset`` while hashing: block i is hashed as block
        i+1 is read. Returns the xxh3-64 of the payload, or None if the file ended early."""
        hasher = xxhash.xxh3_64()
        cut = blocks(out, _OVERLAP_BLOCK_BYTES)
        starts = [offset]
        for block in cut[:-1]:
            starts.append(starts[-1] + parts_nbytes(block))
        pending = self._aux.submit(preadv_all, fd, cut[0], offset)
        try:
            for i, block in enumerate(cut):
                ok = pending.result()
                if i + 1 < len(cut):
                    pending = self._aux.submit(preadv_all, fd, cut[i + 1], starts[i + 1])
                if not ok:
                    return None
                for view in block:
                    hasher.update(view)
        finally:
            pending.result() if not pending.done() else None  # never leave a read into `out` running
        return hasher.intdigest()

    def _get_one(self, ns: str, key: str, parts: Sequence[torch.Tensor], spans: Sequence[tuple[int, int]],
                 nbytes: int) -> bool:
        ident = (ns, key)
        with self._lock:
            indexed = ident in self._index
            if indexed:
                self._index.move_to_end(ident)
        if not indexed and not self.config.shared:
            return False
        path = self._layout.path(ns, key)
        if FAST_READ and not self._overlap(nbytes):
            # One GIL-free C call for the common case, a verified hit; anything else ("don't know")
            # is read again below, where every fault is judged as it always was.
            size = read_chunk_fast(path, ns, key, spans, nbytes)
            if size is not None:
                if not indexed:
                    self._adopt(ident, size)
                return True
        out = [memoryview(p.numpy()) for p in parts]
        try:
            # O_NONBLOCK: a FIFO put at a chunk's path must not block the read (a miss instead).
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            if indexed:
                self._forget(ident, path)
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                if indexed:
                    self._forget(ident, path)  # no longer our file: a miss from now on
                return False
            verdict = self._read_verified(fd, ns, key, out)
            if verdict == "corrupt":
                self._quarantine(fd, path, ident, out)
            elif verdict == "ok" and not indexed:
                self._adopt(ident, os.fstat(fd).st_size)
            return verdict == "ok"
        except OSError as e:
            with self._lock:
                self._stats.errors += 1
            self._log_fault("get", "reading a chunk failed (%s); served as a miss", _describe_os_error(e))
            if isinstance(e, IsADirectoryError) and indexed:
                self._forget(ident, path)  # no longer our file: a miss from now on
            return False
        finally:
            os.close(fd)

    def _read_verified(self, fd: int, ns: str, key: str, out: list[memoryview]) -> str:
        """"ok" (out holds the verified payload), "corrupt", or "mismatch" (another size)."""
        nbytes = parts_nbytes(out)
        if self._overlap(nbytes):
            header_len = HEADER_BYTES + len(ns) + len(key)
            header = decode_header(os.pread(fd, header_len, 0))
            if header is None or header.namespace != ns or header.key != key:
                return "corrupt"
            verdict = "mismatch" if header.payload_bytes != nbytes else "ok"
            if verdict == "ok" and os.fstat(fd).st_size != header.frame_bytes:
                return "corrupt"  # truncated or extended
            if verdict == "ok":
                digest = self._read_overlapped(fd, header_len, out)
                verdict = "ok" if digest == header.checksum else "corrupt"
        else:
            verdict = read_frame(fd, ns, key, out)
        if verdict == "mismatch":
            with self._lock:
                self._stats.extra["size_mismatches"] += 1
        return verdict

    def _quarantine(self, fd: int, path: str, ident: tuple[str, str], out: list[memoryview]) -> None:
        """Drop a file that failed verification, if the file at ``path`` still fails it. A file
        replaced meanwhile (the one we opened was recycled for another chunk, and the key was
        written again) is a new, valid file: the read was a miss, the index keeps it. ``out`` (the
        caller's buffer, unspecified after a miss) is scratch space for the second read."""
        with self._lock:
            try:
                st_path, st_fd = os.stat(path), os.fstat(fd)
            except OSError:
                return  # deleted meanwhile: whoever deleted it updated the index
            if (st_path.st_dev, st_path.st_ino) != (st_fd.st_dev, st_fd.st_ino):
                return
            # The same inode need not hold the bytes we read: recycling can bring our file back to
            # this path with this key's valid frame (moved to a spare, rewritten for another key,
            # moved aside again, rewritten for this key). Files are moved aside only under this
            # lock, and rewritten only after that, so what a read sees now is what we would delete.
            if read_frame(fd, ident[0], ident[1], out) != "corrupt":
                return
            self._stats.checksum_failures += 1
            frame = self._index.pop(ident, None)
            if frame is not None:
                self._usage -= frame
                self._unindexed_locked(ident[0])
            unlink_quietly(path)
        self._log_fault("corrupt", "a chunk file failed its checksum or header check (%s); served as a "
                        "miss and removed", path)

    def _log_fault(self, kind: str, fmt: str, *args: object) -> None:
        """Warn about a fault of the medium: the first of each ``kind`` at once, then at most one line
        per ``_FAULT_LOG_EVERY_S``, saying how many came in between (stats count each one)."""
        now = time.monotonic()
        with self._lock:
            last = self._fault_logged_at.get(kind)
            if last is not None and now - last < _FAULT_LOG_EVERY_S:
                self._faults_unlogged[kind] += 1
                return
            self._fault_logged_at[kind] = now
            since = self._faults_unlogged.pop(kind, 0)
        more = f" ({since} more since the last such line)" if since else ""
        logger.warning("radixkv: disk tier %r (%s): " + fmt + "%s", self.name, self.root, *args, more)

    def _forget(self, ident: tuple[str, str], path: str) -> None:
        """Unindex a chunk whose file a read found gone or replaced by a non-file, unless a regular
        file is at the path again: a delete (or recycling) and a new put of the key may have run
        between the read's check and its open, and that put's entry must stay."""
        with self._lock:
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    return
            except OSError:
                pass
            frame = self._index.pop(ident, None)
            if frame is not None:
                self._usage -= frame
                self._unindexed_locked(ident[0])

    def _adopt(self, ident: tuple[str, str], frame: int) -> None:
        with self._lock:
            if ident[0] in self._borrowed:
                return  # another process's file: never counted, never evicted by us
            if ident not in self._index and self._usage + self._reserved + frame <= self.capacity_bytes:
                self._index[ident] = frame
                self._usage += frame
                self._ns_files[ident[0]] += 1
                self._stats.extra["adopted"] += 1

    # ----------------------------------------------------------------------------- internals

    def _run(self, fn: Callable[[int], bool], n: int) -> list[bool]:
        """``fn(i)`` for every i, on up to ``io_threads`` threads (this one included)."""
        return run_shared(self._pool, self.config.io_threads, n, fn)

    def _reserve_locked(self, frame: int) -> tuple[bool, tuple[str, int] | None]:
        """Reserve ``frame`` bytes for a put (lock held): take the newest spare file to overwrite,
        then evict until the frame fits (the first victim becomes the spare when there is none).
        The file overwritten becomes the frame (truncated if longer), so it needs room for the
        larger of the two sizes, not their sum."""
        spare = self._spares.take_newest()
        holder: list[tuple[str, int]] = []
        if not self._make_room(max(frame, spare[1]) if spare else frame, None if spare else holder):
            if spare is not None:
                self._spares.add(*spare)
            for path, _size in holder:
                unlink_quietly(path)
            return False, None
        spare = spare or (holder[0] if holder else None)
        # Hold the room made for the larger file until the put ends (_held_bytes): it keeps that size
        # on disk until the put truncates it, and other puts must not take those bytes meanwhile.
        self._reserved += _held_bytes(frame, spare)
        return True, spare

    def _make_room(self, frame: int, take_victim: list[tuple[str, int]] | None = None) -> bool:
        """Drop spare files, then evict LRU entries, until ``frame`` more bytes fit (lock held); False
        if puts in flight block it. With ``take_victim`` (an empty list) the first victim's file is
        moved aside, appended there as ``(path, size)`` for the caller to overwrite into the frame."""
        stuck = 0  # victims whose file could not be removed, back in the index (at its recent end)
        while self._usage + self._reserved + self._spares.bytes + frame > self.capacity_bytes:
            if self._spares.drop_oldest():
                continue
            if not self._index or stuck >= len(self._index):
                return False
            ident, victim = self._index.popitem(last=False)
            self._usage -= victim
            self._unindexed_locked(ident[0])
            aside = (self._spares.move_aside(self._layout.path(*ident), victim)
                     if take_victim is not None and not take_victim else None)
            if aside is not None:
                take_victim.append((aside, victim))  # type: ignore[union-attr]
                frame = max(frame, victim)  # the put overwrites this file: its bytes hold the frame
            else:
                try:
                    os.unlink(self._layout.path(*ident))
                except FileNotFoundError:
                    pass
                except OSError:
                    # Read-only, EIO: the file is still there, so it stays indexed and counted
                    # (forgotten, as before, the disk held more than its capacity, uncounted and
                    # never evicted again until a restart); the next victim is another one.
                    self._keep_undeleted_locked(ident, victim)
                    stuck += 1
                    continue
            if len(self._evicted) == self._evicted.maxlen:
                self._stats.extra["evictions_unreported"] += 1  # drain_evicted was not called in time
            self._evicted.append(ident)
            self._stats.extra["evictions"] += 1
            self._stats.extra["evicted_bytes"] += victim
        return True

    def _keep_undeleted_locked(self, ident: tuple[str, str], frame: int | None) -> None:
        """A removal failed (read-only, EIO): the file is still there, so it stays indexed."""
        self._stats.errors += 1
        if frame is not None:
            self._index[ident] = frame
            self._usage += frame
            self._ns_files[ident[0]] += 1

    def _recycle_locked(self, path: str, size: int) -> bool:
        """Move a removed chunk's file aside for a later put to overwrite (lock held, its bytes
        already out of the usage); False (nothing moved) when off or over the capacity."""
        if self._usage + self._reserved + self._spares.bytes + size > self.capacity_bytes:
            return False
        spare = self._spares.move_aside(path, size)
        if spare is None:
            return False
        self._spares.add(spare, size)
        return True

    def _unindexed_locked(self, namespace: str) -> None:
        """One indexed file of ``namespace`` left the index (lock held)."""
        n = self._ns_files[namespace] - 1
        if n > 0:
            self._ns_files[namespace] = n
        else:
            self._ns_files.pop(namespace, None)
            self._emptied[namespace] = None
            self._emptied.move_to_end(namespace)

    def _retire_emptied_locked(self) -> None:
        """Past ``_EMPTY_NAMESPACES_KEPT`` namespaces that hold no indexed file, forget the oldest
        emptied that have no put running (lock held): their fixed payload size (as
        ``_release_size_locked``) and their directories, moved aside while the lock keeps their puts
        out (a later put makes fresh ones, as for a new namespace) and removed by
        :meth:`_remove_detached` after the lock. A shared directory's namespaces hold other
        processes' files: there only this process's records of them are forgotten (its 257 known
        directories, its payload size), the directories stay. Before, a shared tier kept those
        records for every namespace it ever wrote, ~42 KB each (an engine moving to a namespace per
        weight version grew by that much per version). The namespaces kept empty spare one that
        empties and refills (a small tier, or a namespace idle for one turnover of it) a round of
        257 ``rmdir`` s and 256 ``mkdir`` s per cycle."""
        if len(self._emptied) <= _EMPTY_NAMESPACES_KEPT:
            return
        for ns in [ns for ns in self._emptied if self._ns_files[ns]]:
            del self._emptied[ns]  # refilled since it emptied
        excess = len(self._emptied) - _EMPTY_NAMESPACES_KEPT
        for ns in list(itertools.islice(self._emptied, max(0, excess))):
            if self._ns_writing[ns]:
                continue  # a put of it runs: retired by a later call if it stays empty
            del self._emptied[ns]
            self._ns_dirs.discard(ns)
            self._ns_payload_bytes.pop(ns, None)
            self._scanned_sizes.discard(ns)
            if self.config.shared:
                self._layout.forget_ns_dirs(ns)  # a later put makes (finds) them again
                continue
            moved = self._layout.detach_ns_dirs(ns)
            if moved is not None:
                self._detached.append(moved)

    def _remove_detached(self) -> None:
        """Remove the directories ``_retire_emptied_locked`` moved aside (lock not held)."""
        if not self._detached:
            return
        with self._lock:
            paths, self._detached = self._detached, []
        for path in paths:
            self._layout.remove_detached(path)

    def _release_size_locked(self, namespace: str) -> bool:
        """Forget the namespace's fixed payload size if it holds nothing of it (no indexed file, no
        put running), as ``clear`` does; True if released. A put that overlapped a store's clear of
        the namespace fixes the old size again after the tier's clear, and the store then deletes
        what it wrote: the next size must be a miss or a put, not an InputError forever. Scans the
        index: for the error path only (a size that differs from the fixed one)."""
        if self._ns_writing[namespace] or any(ns == namespace for ns, _key in self._index):
            return False
        self._ns_payload_bytes.pop(namespace, None)
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"tier {self.name!r} is closed")

    def _check_size(self, namespace: str, nbytes: int, what: str) -> None:
        fixed = self._ns_payload_bytes.get(namespace)
        check_payload_size(self.name, namespace, fixed, nbytes, what)

    def _scan(self) -> None:
        """Rebuild the index from the files' headers (payload checksums are verified on read)."""
        # A directory this process owns alone (not shared) has no live writer yet: every temp file is
        # a killed writer's, whatever its age. A shared one may have live writers: only old temps go.
        stale_s = self.config.stale_temp_s if self.config.shared else -math.inf
        self._stats.extra["temp_removed"] += self._layout.remove_stale_temps(stale_s)
        if not self.config.shared:
            self._layout.remove_detached()  # emptied namespaces a killed process had moved aside
        found: list[tuple[float, tuple[str, str], int]] = []
        foreign_dirs: list[str] | None = None if self.config.shared else []
        unknown: list[str] | None = None if self.config.shared else []
        for ns, key, path in self._layout.walk(None, foreign_dirs, None, unknown):
            entry = self._layout.read_entry(ns, key, path)
            if entry is None:
                self._stats.extra["scan_skipped"] += 1
                if not self.config.shared:
                    unlink_quietly(path)
                continue
            # Valid files of every payload size are indexed: a namespace holds two sizes after a
            # process of a new size rewrote some keys, and which one the next process uses only its
            # first put tells (_scanned_sizes; files of the other size then read as misses, are
            # overwritten by a put of their key, and age out). Keeping the first size found deleted
            # the other files in directory order, often the newest process's.
            if ns not in self._ns_payload_bytes:
                self._ns_payload_bytes[ns] = entry[2]
                self._scanned_sizes.add(ns)
            found.append((entry[0], (ns, key), entry[1]))
        found.sort()  # oldest first = least recently used first
        for _mtime, ident, frame in found:
            self._index[ident] = frame
            self._usage += frame
            self._ns_files[ident[0]] += 1
            self._stats.extra["scan_indexed"] += 1
        with self._lock:
            if self.config.shared:  # do not delete other processes' files: index the newest that fit
                while self._usage > self.capacity_bytes:
                    ident, frame = self._index.popitem(last=False)
                    self._usage -= frame
                    self._unindexed_locked(ident[0])
            else:
                self._make_room(0)
                # Namespace directories left without a valid file (emptied by an earlier process, one
                # that kept them all before namespaces were retired, or holding only files of an
                # earlier layout the loop above removed) join the emptied ones, oldest first, so the
                # same bound applies across restarts: otherwise each start's namespaces (a new one per
                # weight version or upgrade) left 257 directories behind for good. Only directories
                # of the layout's shape: one holding anything else is not this tier's to remove.
                # They go before those _make_room(0) just emptied: they are older.
                stale = [ns for _mtime, ns in sorted(self._layout.namespace_dirs())
                         if not self._ns_files[ns] and ns not in self._emptied
                         and self._layout.holds_only_layout_dirs(ns)]
                if stale:
                    just_emptied = list(self._emptied)
                    self._emptied.clear()
                    for ns in stale + just_emptied:
                        self._emptied[ns] = None
                self._retire_emptied_locked()
        if foreign_dirs:  # an earlier layout's deeper directories, emptied by the loop above
            self._layout.remove_empty_dirs(foreign_dirs)
        self._remove_detached()
        if unknown:
            # Not an error (the tier leaves them alone), but a private root is meant to be the
            # tier's alone: a root of "/" or a data disk's mount point is a misconfiguration.
            shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            logger.warning("radixkv: disk tier %r: %s holds %d entries that are not the tier's (%s); "
                           "they are left alone, but a private tier's root should be a directory of "
                           "its own: name one that does not exist yet (the tier makes it)",
                           self.name, self.root, len(unknown), shown)



def _describe_os_error(e: OSError) -> str:
    """``ENOSPC: No space left on device: '/path'`` (the errno's name first: what operators grep)."""
    name = errno.errorcode.get(e.errno or 0, type(e).__name__)
    where = f": {e.filename!r}" if e.filename else ""
    return f"{name}: {e.strerror or e}{where}"
