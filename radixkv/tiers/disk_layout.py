"""Where the disk tier's files live: chunk paths, directories, the startup scan's walk.

Layout: ``root/<namespace>/<h[0:2]>/<key>.kv`` with ``h`` the xxh3_64 hex of the key (256 directories
per namespace, made once: a deeper fan-out made nearly every put of a fresh cache pay a ``mkdir``).
Temp files are ``.<key>.<pid>.<thread>.<rand>.tmp`` beside their chunk; ``root/.spare`` holds
recycled files (:mod:`radixkv.tiers.disk_spares`). Directories are created 0700, files 0600.

The tier touches only names of this layout: chunk files (``<key>.kv``) and its temp files in
two-hex-digit directories of namespace directories (and of the older layout's one more level), and
at the root ``.lock``, ``.spare``, ``.retired.<ns>.<rand>`` and its probes
(``.probe.<pid>.<rand>.tmp``, ``.clock.<pid>.<thread>.<rand>.tmp``). A root that holds other
entries (a misconfigured ``/`` or a data disk's mount point) keeps them: no walk descends into a
directory of another shape, and nothing else is removed.

This module knows names and directories only: no index, no capacity, no locking (the tier calls it
under its own lock where that matters).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import re
import secrets
import shutil
import stat
import threading
import time
from typing import BinaryIO, Iterator

import xxhash

from radixkv.errors import ConfigError, InputError
from radixkv.keys import KEY_RE
from radixkv.tiers.framing import HEADER_BYTES, decode_header

__all__ = ["DiskLayout", "check_ident", "SPARE_DIR"]

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
SPARE_DIR = ".spare"  # recycled files (not an identifier: never walked as a namespace)
LOCK_FILE = ".lock"  # the root's owner lock (not an identifier: never walked)
# A directory level the layout makes below a namespace (``<h[0:2]>``; the older layout one more).
_HASH_DIR_RE = re.compile(r"[0-9a-f]{2}")
RETIRED_PREFIX = ".retired."  # emptied namespaces' directories being removed (never walked either)
# The names the tier makes, and only those, are the ones it removes or reads as its own:
_CHUNK_FILE_RE = re.compile(rf"({KEY_RE.pattern}){re.escape(_SUFFIX)}")  # <key>.kv
# temp_path's ``.<key>.<pid>.<thread>.<rand>.tmp`` (an earlier release's rand was hex too)
_TEMP_FILE_RE = re.compile(rf"\.{KEY_RE.pattern}\.[0-9]+\.[0-9]+\.[0-9A-Za-z]+{re.escape(_TMP_SUFFIX)}")
# prepare_root's and filesystem_now's probes at the root (removed at once unless the process died)
_ROOT_TEMP_RE = re.compile(rf"\.(?:probe\.[0-9]+|clock\.[0-9]+\.[0-9]+)\.[0-9a-f]+{re.escape(_TMP_SUFFIX)}")
_RETIRED_RE = re.compile(rf"{re.escape(RETIRED_PREFIX)}{KEY_RE.pattern}\.[0-9a-f]+")  # detach_ns_dirs


def check_ident(namespace: object, keys: object) -> None:
    """Raise InputError unless ``namespace`` and every key are safe file-name components."""
    if not isinstance(namespace, str) or not KEY_RE.fullmatch(namespace):
        raise InputError(f"namespace={namespace!r} must be 1-128 chars of [A-Za-z0-9_-] (Namespace.digest)")
    if isinstance(keys, (str, bytes)):
        raise InputError(f"keys={keys!r} must be a sequence of str keys, not a single str")
    for k in keys:  # type: ignore[union-attr]
        if not isinstance(k, str) or not KEY_RE.fullmatch(k):
            raise InputError(f"key {k!r} must be 1-128 chars of [A-Za-z0-9_-] (a hex chunk key)")


def fsync_dir(d: str) -> None:
    """Make ``d``'s entries (a rename into it, a directory made in it) durable; OSError if not."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Roots this process (or, in a fork child, the process it was forked from) holds the lock of, with
# that process's id: a child tells its parent's lock from another process's (see lock_root).
_LOCKED_ROOTS: dict[str, int] = {}


class DiskLayout:
    """Paths and directories of one tier root. ``path(ns, key)`` is the chunk's committed file."""

    def __init__(self, root: str, tier_name: str, sync_dirs: bool = False) -> None:
        self.root = os.path.abspath(root)
        # fsync mode: a directory this process makes is synced into its parent, so that a crash
        # cannot lose the directory (and every file committed into it) after puts reported done.
        self._sync_dirs = sync_dirs
        self.spare_dir = os.path.join(self.root, SPARE_DIR)
        self._prefix = os.path.join(self.root, "")  # root with one trailing separator
        self._tier_name = tier_name
        self._root_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the root once prepared
        self._dirs: set[str] = set()  # directories known to exist (made or seen by this process)

    def path(self, ns: str, key: str) -> str:
        h = xxhash.xxh3_64_hexdigest(key.encode("ascii"))
        return f"{self._prefix}{ns}{os.sep}{h[:2]}{os.sep}{key}{_SUFFIX}"

    def temp_path(self, path: str) -> str:
        """A fresh temp name beside ``path`` (its directory is made if missing)."""
        d, base = os.path.split(path)
        self.ensure_dir(d)
        tag = f"{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"
        return os.path.join(d, f".{base[: -len(_SUFFIX)]}.{tag}{_TMP_SUFFIX}")

    # ----------------------------------------------------------------------------- directories

    def make_ns_dirs(self, ns: str) -> None:
        """Make a namespace's 256 directories at its first put in this process: otherwise the first
        few hundred puts each pay a ``mkdir`` (a journaled metadata write), measured at 0.1-0.4 ms."""
        for i in range(256):
            try:
                self.ensure_dir(f"{self._prefix}{ns}{os.sep}{i:02x}")
            except OSError:
                return  # a put will retry (and fail cleanly) on its own directory

    def detach_ns_dirs(self, ns: str) -> str | None:
        """Move a namespace's directory out of the namespaces (one ``rename``, cheap under the tier's
        lock, where 257 ``rmdir`` s can take a loaded journal half a second) and forget its
        directories: a later put of the namespace makes fresh ones. Returns the moved path, for
        :meth:`remove_detached` outside the lock; None if there was none to move."""
        self.forget_ns_dirs(ns)
        base = f"{self._prefix}{ns}"
        dest = f"{self._prefix}{RETIRED_PREFIX}{ns}.{secrets.token_hex(4)}"
        try:
            os.rename(base, dest)
        except OSError:
            return None
        return dest

    def forget_ns_dirs(self, ns: str) -> None:
        """Forget that a namespace's directories exist (they stay): the next put of it checks them
        again with ``mkdir``. Keeps :attr:`_dirs` to the namespaces in use, not every one ever written."""
        base = f"{self._prefix}{ns}"
        for i in range(256):
            self._dirs.discard(f"{base}{os.sep}{i:02x}")
        self._dirs.discard(base)

    def remove_detached(self, path: str | None = None) -> int:
        """Remove a tree :meth:`detach_ns_dirs` moved aside (None: every one left under the root,
        e.g. by a process killed before it removed them). Returns how many trees were removed."""
        if path is not None:
            paths = [path]
        else:
            try:
                paths = [os.path.join(self.root, n) for n in os.listdir(self.root)
                         if _RETIRED_RE.fullmatch(n)]
            except OSError:
                return 0
        removed = 0
        for p in paths:
            try:
                shutil.rmtree(p)
                removed += 1
            except OSError:
                pass
        return removed

    def ensure_dir(self, d: str) -> None:
        if d not in self._dirs:
            self._mkdirs(d)

    def forget_dir(self, path: str) -> None:
        """The directory of ``path`` was removed behind our back: make it again on next use."""
        self._dirs.discard(os.path.dirname(path))

    def _mkdirs(self, d: str) -> None:
        """Create ``d`` (0700) and any missing parents below the root: one mkdir when the parent exists."""
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except FileNotFoundError:
            parent = os.path.dirname(d)
            if len(parent) <= len(self.root):
                raise  # the root itself is gone: a failed put, not a silent re-creation
            self._mkdirs(parent)
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
        if self._sync_dirs:
            fsync_dir(os.path.dirname(d))
        self._dirs.add(d)

    def prepare_root(self) -> None:
        """Make the root (0700) if missing, prove it writable, and check that no other user can
        change what is in it (:meth:`_check_private`); ConfigError naming the fix if not."""
        root = self.root
        owner: int | None = None  # who the files this process makes here belong to
        try:
            if not os.path.isdir(root):
                self._make_root()
            probe = os.path.join(root, f".probe.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                owner = os.fstat(fd).st_uid
                os.write(fd, b"\0")
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise ConfigError(
                    f"disk tier {self._tier_name!r}: directory {root!r} is not writable "
                    f"({errno.errorcode.get(e.errno, e.errno)}: {e.strerror}); pass a writable directory "
                    "path (file:///path) the process owns"
                ) from None
            # writable but full: a fault, not a config error
            logger.warning("radixkv: disk tier %r: %s is full (%s); puts fail until space frees",
                           self._tier_name, root, errno.errorcode.get(e.errno))
        self._check_private(os.geteuid() if owner is None else owner)
        try:
            st = os.stat(root)
            self._root_id = (st.st_dev, st.st_ino)
        except OSError:
            self._root_id = None

    def _make_root(self) -> None:
        """Create the root and each missing parent, every one 0700 (``os.makedirs`` applies its mode
        to the last directory only: the parents got 0777 less the umask), each synced into its
        parent in fsync mode. A directory another process makes meanwhile is left as it is."""
        missing = []
        d = self.root
        while not os.path.isdir(d):
            missing.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                continue  # made meanwhile (or a file: the probe below names the error)
            os.chmod(d, 0o700)  # the umask may have taken more than group and others' bits
            if self._sync_dirs:
                fsync_dir(os.path.dirname(d))

    def root_replaced(self) -> bool:
        """Whether the root directory is gone or is another directory than the one this tier opened
        (removed, then made again, e.g. by a second tier, which then holds the root lock): one stat."""
        if self._root_id is None:
            return False
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # cannot tell (EIO, EACCES): the put finds out
        return (st.st_dev, st.st_ino) != self._root_id

    def _check_private(self, owner: int) -> None:
        """Refuse a root that another user owns or may write (group or others): that user could
        replace chunk files with frames of their own (the checksums are no signature: wrong bytes
        served as hits) or put links in place of directories, through which puts write and deletes
        remove files outside the root. ``owner``: the owner this process's files get here (its
        user, or the one an NFS ``root_squash`` or an id-mapped mount maps it to), so a root the
        tier made itself always passes. Only the root is checked, not its parents (docs/tiers.md)."""
        root = self.root
        try:
            st = os.stat(root)
        except OSError as e:
            raise ConfigError(f"disk tier {self._tier_name!r}: cannot stat directory {root!r} "
                              f"({e.strerror}); pass a directory path (file:///path) the process owns") from None
        if st.st_uid != owner:
            raise ConfigError(
                f"disk tier {self._tier_name!r}: directory {root!r} belongs to uid {st.st_uid}, but this "
                f"process's files belong to uid {owner}: its owner could replace chunk files with forged "
                f"ones or plant links that make puts and deletes act outside it; chown it to uid {owner}, "
                "or pass a directory that does not exist yet (the tier creates it, 0700)"
            )
        if st.st_mode & 0o022:
            who = "group and others" if st.st_mode & 0o020 and st.st_mode & 0o002 else (
                "its group" if st.st_mode & 0o020 else "others")
            raise ConfigError(
                f"disk tier {self._tier_name!r}: directory {root!r} is writable by {who} (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): another user could replace chunk files with forged "
                f"ones or plant links that make puts and deletes act outside it; run chmod go-w {root}, "
                "or pass a directory that does not exist yet (the tier creates it, 0700)"
            )

    def lock_root(self, shared: bool) -> BinaryIO | None:
        """Take the root's owner lock (``flock`` on ``root/.lock``): exclusive for a private tier,
        which indexes, evicts and recycles every file under the root as its own, shared for a tier in
        shared mode. So a second private tier on the same root (in this process or another) is a
        ConfigError instead of two tiers evicting, recycling and overwriting each other's files, and
        a private tier cannot open a root that shared tiers use, nor the reverse. Release it with
        :func:`release_root` (a killed process releases it). A forked child drops its copy of the
        parent's lock (:meth:`DiskTier._after_fork_in_child`), so a helper child does not keep a
        dead parent's root locked; a child may open a root its parent process locked afresh (the
        fork pattern of docs/store.md), unlocked while the parent's lock protects it. A filesystem
        without ``flock`` (ENOLCK, EOPNOTSUPP) leaves the root unlocked (returns None), as before."""
        path = os.path.join(self.root, LOCK_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            f = os.fdopen(fd, "r+b")  # held open for the tier's lifetime
        except OSError as e:
            logger.warning("radixkv: disk tier %r: cannot open %s (%s); the root is not locked",
                           self._tier_name, path, e.strerror)
            return None
        try:
            fcntl.flock(f.fileno(), (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            holder = _LOCKED_ROOTS.get(self.root)
            if holder is not None and holder != os.getpid():
                # Locked by the process this one was forked from (its table came with the fork).
                logger.debug("radixkv: disk tier %r: %s is locked by parent process %d; opened under "
                             "its lock", self._tier_name, self.root, holder)
                return None
            mine, theirs = ("shared", "a private") if shared else ("private", "another (private or shared)")
            raise ConfigError(
                f"disk tier {self._tier_name!r}: directory {self.root!r} is in use by {theirs} disk tier "
                f"(in this process or another), so this {mine} tier cannot own it; give each private "
                "tier its own directory, or set shared=True on every tier that shares one"
            ) from None
        except OSError as e:
            f.close()
            logger.warning("radixkv: disk tier %r: %s cannot be locked (%s); the root is not locked",
                           self._tier_name, self.root, e.strerror)
            return None
        _LOCKED_ROOTS[self.root] = os.getpid()
        return f

    def release_root(self, f: BinaryIO) -> None:
        """Release the lock :meth:`lock_root` returned: explicitly, since a forked child may still
        share the open file (closing ours alone would keep the root locked while that child lives)."""
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        except OSError:
            pass
        f.close()
        if _LOCKED_ROOTS.get(self.root) == os.getpid():
            del _LOCKED_ROOTS[self.root]

    # ----------------------------------------------------------------------------- scan

    def walk(self, namespace: str | None, foreign_dirs: list[str] | None = None,
             errors: list[OSError] | None = None,
             unknown: list[str] | None = None) -> Iterator[tuple[str, str, str]]:
        """Yield (namespace, key, path) of the chunk-named files (``<key>.kv``) in the layout's
        directories: ``root/<ns>/<hh>/`` and the older layout's ``root/<ns>/<hh>/<hh>/`` (``hh`` two
        hex digits), nothing else. The scan and ``clear`` delete what the walk yields (a private
        tier's scan the invalid ones), so it never descends into a directory of another shape (a
        root that also holds a user's files keeps them) nor through a symbolic link (a namespace
        directory that is one is not walked: its target lies outside the root).
        ``foreign_dirs``, if given, collects the older layout's ``<hh>/<hh>`` directories, parents
        before children. ``errors``, if given, collects the directories that could not be listed
        (EMFILE, EIO): their files were not yielded (a missing namespace directory is no error).
        ``unknown``, if given, collects the paths (relative to the root) of entries the layout does
        not make: at the root, anything but namespace directories and the tier's own dot-names; in a
        namespace directory, anything but two-hex-digit directories; in those, anything but chunk
        and temp files (and the older layout's level). A private start warns of them."""
        for ns, dirpath, depth, files in self._layout_dirs(namespace, errors, unknown):
            if foreign_dirs is not None and depth == 2:
                foreign_dirs.append(dirpath)
            for f in files:
                m = _CHUNK_FILE_RE.fullmatch(f)
                if m is not None:
                    yield ns, m.group(1), os.path.join(dirpath, f)
                elif unknown is not None and not _TEMP_FILE_RE.fullmatch(f):
                    unknown.append(os.path.relpath(os.path.join(dirpath, f), self.root))

    def _layout_dirs(self, namespace: str | None, errors: list[OSError] | None,
                     unknown: list[str] | None = None) -> Iterator[tuple[str, str, int, list[str]]]:
        """``(namespace, path, depth, names of its entries that are not directories)`` of each
        directory of the layout's shape under the root (or under one namespace): depth 1 is
        ``<ns>/<hh>``, depth 2 the older layout's ``<ns>/<hh>/<hh>``. Links are never followed."""

        def unlisted(e: OSError) -> None:
            if errors is not None and not isinstance(e, FileNotFoundError):
                errors.append(e)

        def other(path: str) -> None:
            if unknown is not None:
                unknown.append(os.path.relpath(path, self.root))

        def listing(path: str) -> tuple[list[str], list[str]] | None:
            """(directories, other entries) of ``path``, links among the others; None if unlisted."""
            dirs: list[str] = []
            rest: list[str] = []
            try:
                with os.scandir(path) as it:
                    for entry in it:
                        try:
                            is_dir = entry.is_dir(follow_symlinks=False)
                        except OSError:
                            is_dir = False
                        (dirs if is_dir else rest).append(entry.name)
            except OSError as e:
                unlisted(e)
                return None
            dirs.sort()
            rest.sort()
            return dirs, rest

        if namespace is not None:
            ns_names = [namespace]
        else:
            top = listing(self.root)
            if top is None:
                return
            ns_names = top[0]
            if unknown is not None:
                for name in top[1]:  # files, links (a link named as a namespace too) and the like
                    if name != LOCK_FILE and not _ROOT_TEMP_RE.fullmatch(name):
                        other(os.path.join(self.root, name))
                for name in top[0]:
                    if not KEY_RE.fullmatch(name) and name != SPARE_DIR and not _RETIRED_RE.fullmatch(name):
                        other(os.path.join(self.root, name))
        for ns in ns_names:
            top_dir = os.path.join(self.root, ns)
            if not KEY_RE.fullmatch(ns) or os.path.islink(top_dir):
                continue
            level1 = listing(top_dir)
            if level1 is None:
                continue
            for name in level1[1]:
                other(os.path.join(top_dir, name))
            for h1 in level1[0]:
                d1 = os.path.join(top_dir, h1)
                if not _HASH_DIR_RE.fullmatch(h1):
                    other(d1)  # not a directory this layout makes: not walked
                    continue
                level2 = listing(d1)
                if level2 is None:
                    continue
                yield ns, d1, 1, level2[1]
                for h2 in level2[0]:
                    d2 = os.path.join(d1, h2)
                    if not _HASH_DIR_RE.fullmatch(h2):
                        other(d2)
                        continue
                    level3 = listing(d2)
                    if level3 is None:
                        continue
                    for name in level3[0]:
                        other(os.path.join(d2, name))
                    yield ns, d2, 2, level3[1]

    def namespace_dirs(self) -> list[tuple[float, str]]:
        """``(mtime, namespace)`` of every namespace directory under the root (links excluded)."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        out = []
        for ns in names:
            if not KEY_RE.fullmatch(ns):
                continue
            try:
                st = os.lstat(os.path.join(self.root, ns))
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                out.append((st.st_mtime, ns))
        return out

    def holds_only_layout_dirs(self, ns: str) -> bool:
        """Whether namespace directory ``ns`` holds nothing but empty directories of the layout's
        shape (two hex digits, at any depth): no file, no other name. Only such a directory without
        a valid file is an emptied namespace a start may retire (``rmtree``): a private root may also
        hold directories that are no namespace of this tier (a user's, named as a namespace could
        be), whose files must never be removed. False if it cannot be read."""

        def unreadable(exc: OSError) -> None:
            raise exc

        try:
            for _dirpath, dirs, files in os.walk(os.path.join(self.root, ns), onerror=unreadable):
                if files or not all(_HASH_DIR_RE.fullmatch(d) for d in dirs):
                    return False
        except OSError:
            return False
        return True

    @staticmethod
    def remove_empty_dirs(paths: list[str]) -> int:
        """``rmdir`` each of ``paths`` that is empty, children before parents (``paths`` lists parents
        first, as :meth:`walk` collects them); a directory holding anything stays. Returns how many."""
        removed = 0
        for path in reversed(paths):
            try:
                os.rmdir(path)
                removed += 1
            except OSError:
                pass
        return removed

    def replace_namespace_link(self, ns: str) -> bool:
        """Remove a symbolic link where namespace ``ns``'s directory belongs (a private tier, before
        its first put of ``ns`` in this process): puts would write through it, out of the root, and
        :meth:`walk` never follows it. Only the namespace a put is about to use: a link at the root
        that no put names (``bin -> usr/bin`` under a misconfigured ``/``) is not the tier's.
        Returns whether one was removed."""
        path = f"{self._prefix}{ns}"
        try:
            if not stat.S_ISLNK(os.lstat(path).st_mode):
                return False
            os.unlink(path)
        except OSError:
            return False
        self.forget_ns_dirs(ns)
        return True

    def remove_stale_temps(self, older_than_s: float) -> int:
        """Remove the tier's temp files (crashed writers') older than ``older_than_s``: the names
        :meth:`temp_path` makes, in the layout's directories (:meth:`_layout_dirs`), and the probes
        at the root; a file of any other name is not the tier's and stays. Returns how many. Ages are
        measured on the clock that stamped the files (:meth:`filesystem_now`), not this host's."""
        now = self.filesystem_now() if older_than_s > -math.inf else math.inf
        try:
            at_root = [os.path.join(self.root, f) for f in os.listdir(self.root) if _ROOT_TEMP_RE.fullmatch(f)]
        except OSError:
            at_root = []
        paths = at_root + [os.path.join(d, f) for _ns, d, _depth, files in self._layout_dirs(None, None)
                           for f in files if _TEMP_FILE_RE.fullmatch(f)]
        removed = 0
        for p in paths:
            try:
                st = os.lstat(p)
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime > older_than_s:
                    os.unlink(p)
                    removed += 1
            except OSError:
                pass
        return removed

    def filesystem_now(self) -> float:
        """The current time on the clock that stamps the root's file times: the mtime of a byte
        written to a probe file there (removed at once; named as a temp file, so a later scan removes
        one a crash left). A network filesystem stamps writes with its server's clock: compared with
        this host's clock, a host ahead of the server by more than ``stale_temp_s`` took other
        hosts' live temp files for crashed writers' and removed them mid-write (their puts failed),
        and one behind it kept crashed writers' files that much longer. On a local filesystem this
        is ``time.time()``, which it falls back to if the probe cannot be written."""
        tag = f"{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"
        probe = os.path.join(self.root, f".clock.{tag}{_TMP_SUFFIX}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            return time.time()
        try:
            os.write(fd, b"\0")  # a write, as the temp files had: stamped by whoever stamps theirs
            return os.fstat(fd).st_mtime
        except OSError:
            return time.time()
        finally:
            os.close(fd)
            try:
                os.unlink(probe)
            except OSError:
                pass

    def read_entry(self, ns: str, key: str, path: str) -> tuple[float, int, int] | None:
        """``(mtime, frame bytes, payload bytes)`` of a committed file whose name, place, header
        identity and size agree; None for anything else (the payload checksum is checked on read)."""
        if not KEY_RE.fullmatch(key) or path != self.path(ns, key):
            return None
        try:
            # O_NONBLOCK: a FIFO named like a chunk must not hang the start-up scan.
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            header = decode_header(os.pread(fd, HEADER_BYTES + len(ns) + len(key), 0))
        except OSError:
            return None
        finally:
            os.close(fd)
        if header is None or (header.namespace, header.key) != (ns, key) or st.st_size != header.frame_bytes:
            return None
        return st.st_mtime, header.frame_bytes, header.payload_bytes
