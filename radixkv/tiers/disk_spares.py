"""The disk tier's recycled files: removed chunks' files kept aside for later puts to overwrite.

Writing over page-cache pages that exist costs one copy; a new file also makes the kernel allocate
(and a removed one free) every page, so recycling halves the cost of a put into the page cache
(docs/sglang.md). Spares live in ``root/.spare`` as ``<pid>-<seq>.spare``, are reused newest first, and are
dropped oldest first when the tier needs room. Their bytes count in the tier's capacity: the tier
owns that accounting and calls these methods under its lock; this class only tracks the files.
"""

from __future__ import annotations

import collections
import os
import stat

__all__ = ["SpareFiles", "unlink_quietly"]


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class SpareFiles:
    """Spare files of one tier, oldest first, with their sizes. Not thread-safe (the tier's lock)."""

    def __init__(self, spare_dir: str, enabled: bool) -> None:
        self.dir = spare_dir
        self.enabled = enabled
        self.bytes = 0
        self._files: collections.deque[tuple[str, int]] = collections.deque()  # (path, size)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._files)

    def reset(self) -> None:
        """Start with an empty spare directory (a previous process's spares are not ours to trust).
        Recycling turns itself off if the directory cannot be listed or made. A symbolic link in its
        place is removed, never followed: emptying its target would delete files outside the root."""
        try:
            if stat.S_ISLNK(os.lstat(self.dir).st_mode):
                os.unlink(self.dir)
        except FileNotFoundError:
            pass
        except OSError:
            self.enabled = False
            return
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            names = []
        except OSError:
            self.enabled = False
            return
        for name in names:
            unlink_quietly(os.path.join(self.dir, name))
        if self.enabled:
            try:
                os.makedirs(self.dir, mode=0o700, exist_ok=True)
            except OSError:
                self.enabled = False

    def move_aside(self, path: str, size: int) -> str | None:
        """Rename a chunk file of ``size`` bytes into the spare directory; its new path, or None when
        recycling is off, the rename fails, or ``path`` is no longer that file (replaced by a
        directory, truncated or extended behind our back: not worth recycling). The caller decides
        whether it becomes a spare (:meth:`add`)."""
        if not self.enabled:
            return None
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return None
        self._seq += 1
        # The pid keeps a forked child's spares apart from its parent's (same directory, same seq).
        spare = os.path.join(self.dir, f"{os.getpid()}-{self._seq}.spare")
        try:
            os.rename(path, spare)
        except OSError:
            return None
        return spare

    def add(self, spare_path: str, size: int) -> None:
        self._files.append((spare_path, size))
        self.bytes += size

    def take_newest(self) -> tuple[str, int] | None:
        """The newest spare (for a put to overwrite), no longer counted; None if there is none."""
        if not self._files:
            return None
        spare = self._files.pop()
        self.bytes -= spare[1]
        return spare

    def drop_oldest(self) -> bool:
        """Remove the oldest spare file; False if there is none."""
        if not self._files:
            return False
        path, size = self._files.popleft()
        self.bytes -= size
        unlink_quietly(path)
        return True

    def forget_all(self) -> None:
        """Stop tracking every spare without removing its file (a forked child: they are the
        parent's)."""
        self._files.clear()
        self.bytes = 0

    def drop_all(self) -> None:
        while self.drop_oldest():
            pass

    def check_integrity(self) -> None:
        if sum(size for _p, size in self._files) != self.bytes or (self._files and not self.enabled):
            raise RuntimeError(f"spare accounting: {self.bytes} bytes recorded for {len(self._files)} "
                               f"files (recycling {'on' if self.enabled else 'off'})")
        # Each spare is a file of its own in the spare directory: take_newest hands it to one put
        # to overwrite, so a path listed twice (or a chunk file listed as a spare) would be written
        # by two puts, or its chunk's bytes overwritten under a live index entry.
        paths = [path for path, _size in self._files]
        if len(set(paths)) != len(paths):
            dup = sorted({p for p in paths if paths.count(p) > 1})
            raise RuntimeError(f"spare files listed more than once: {dup[:3]}")
        stray = [p for p in paths if os.path.dirname(p) != self.dir]
        if stray:
            raise RuntimeError(f"spare files outside the spare directory {self.dir}: {stray[:3]}")
        for path, size in self._files:
            if os.stat(path).st_size != size:
                raise RuntimeError(f"spare {path}: size {os.stat(path).st_size} != recorded {size}")
