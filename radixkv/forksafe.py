"""Thread pools that survive ``fork``: a child process recreates them on first use.

A forked child inherits the parent's objects but none of its threads. A ``ThreadPoolExecutor`` built
before the fork still believes its workers exist, so in the child every ``submit`` queues work that
no thread ever runs, and a caller waiting on it hangs forever (measured: a disk or memory tier used
before ``os.fork()`` hung in the child on its first batched call). Engines fork worker processes
(Python's default start method on Linux), so a tier must not depend on where it was built.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

__all__ = ["ForkSafeExecutor", "SignalSafeCondition", "hold_across_fork", "run_shared"]

T = TypeVar("T")


class SignalSafeCondition(threading.Condition):
    """A ``threading.Condition`` whose ``with`` takes and gives back the lock in the lock's own C
    methods, with no Python frame around them.

    ``Condition.__enter__`` and ``__exit__`` are Python functions, and a signal handler runs in the
    main thread between bytecodes: a ``KeyboardInterrupt`` (Ctrl-C) or an engine's ``SystemExit`` on
    SIGTERM raised on the return from ``__enter__``, the lock already taken but the ``with`` block not
    yet begun, left the lock held for good (every later call and background job blocked on it); one
    raised on entering ``__exit__`` never released it. The ``with`` statement looks both up before
    it calls ``__enter__``, so the properties' own frames run before the lock is taken."""

    @property
    def __enter__(self) -> Callable[[], bool]:  # type: ignore[override]
        return self._lock.__enter__  # type: ignore[attr-defined, no-any-return]

    @property
    def __exit__(self) -> Callable[..., None]:  # type: ignore[override]
        return self._lock.__exit__  # type: ignore[attr-defined, no-any-return]


class ForkSafeExecutor:
    """A ``ThreadPoolExecutor`` (started lazily) that a forked child replaces with a fresh one.

    The parent's pool is dropped in the child without shutting it down: its threads do not exist
    there, and its locks may have been copied mid-use."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._shut = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` on a pool thread; its Future. When the pool cannot start the
        thread it needs (``RuntimeError: can't start new thread``: a process at its thread limit),
        the call runs on the calling thread instead and the Future returned is already done: the
        work happens exactly once either way. RuntimeError once :meth:`shutdown` ran.

        Why not let the pool's error through: ``ThreadPoolExecutor.submit`` queues the call *before*
        starting a thread for it, so when the start fails it raises with the call still queued, and
        the first thread started later runs it, long after its caller gave up on it: a read into a
        buffer the caller was told is a miss (and reuses), a write through a file descriptor number
        the caller closed (by then another file's, or a socket's), a copy into a freed slot."""
        pool = self._executor()
        call = _Once(fn, args, kwargs)
        try:
            pool.submit(call.run)
        except Exception:  # RuntimeError (thread limit) or MemoryError (no room for its stack)
            if not call.claim():
                return call.future  # a pool thread took it meanwhile: it runs there
            with self._lock:
                shut = self._shut or pool is not self._pool
            if shut:  # the pool shut down (a racing close): nothing will run, as before
                raise
            call.run_claimed()  # no thread to run it (the pool still queues a husk that does nothing)
        return call.future

    def shutdown(self, wait: bool = True) -> None:
        """Stop this process's pool (a no-op for one inherited across fork); later submits raise."""
        self._fork_check()
        with self._lock:
            self._shut = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait)

    def _executor(self) -> ThreadPoolExecutor:
        self._fork_check()
        pool = self._pool
        if pool is not None:
            return pool
        with self._lock:
            if self._shut:
                raise RuntimeError(f"thread pool {self._prefix!r} is shut down")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix=self._prefix)
            return self._pool

    def _fork_check(self) -> None:
        pid = os.getpid()
        if pid != self._pid:  # a forked child: forget the parent's pool (and its possibly held lock)
            # The pool first: another child thread that sees the new pid must not find the parent's.
            self._pool = None
            self._lock = threading.Lock()
            self._pid = pid


class _Once:
    """One call that runs at most once: in whichever of a pool thread (``run``) and the submitter
    (``claim`` then ``run_claimed``) takes it first; the other finds nothing to do. A claimed call
    drops its function and arguments, so a husk left in a pool's queue holds no payload."""

    __slots__ = ("_call", "_claimed", "_lock", "future")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = (fn, args, kwargs)
        self._lock = threading.Lock()
        self.future: Future = Future()
        self.future.set_running_or_notify_cancel()

    def claim(self) -> bool:
        with self._lock:
            if self._call is None:
                return False
            self._claimed, self._call = self._call, None
            return True

    def run(self) -> None:
        if self.claim():
            self.run_claimed()

    def run_claimed(self) -> None:
        fn, args, kwargs = self._claimed
        del self._claimed
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            self.future.set_exception(e)
        else:
            self.future.set_result(result)


# Objects whose lock os.fork() must not copy mid-use: object -> (lock attribute, child callback).
_held_owners: weakref.WeakKeyDictionary[Any, tuple[str, Callable[[], None] | None]] = weakref.WeakKeyDictionary()
_held_registry = threading.Lock()
_held_now: list[Any] = []


def hold_across_fork(owner: Any, lock_attr: str = "_lock", in_child: Callable[[Any], None] | None = None) -> None:
    """Make ``os.fork()`` wait until no thread is inside ``owner``'s critical sections.

    A child inherits a lock in whatever state it had at the fork: one held by another thread is held
    forever there (that thread does not exist in the child), and the state it guarded may be half
    updated. So every registered lock (a leaf lock: its holder never waits for another one) is taken
    just before the fork and released in both processes after it; ``in_child(owner)`` then runs in the
    child, still under the lock, to drop what belonged to the parent's threads. Registration holds
    ``owner`` weakly."""
    with _held_registry:
        _held_owners[owner] = (lock_attr, in_child)


def _before_fork() -> None:
    _held_registry.acquire()
    # Newest first: a store's lock before its tiers' (a thread holding the store's lock may call a
    # tier; a tier never waits for its store).
    for owner, (attr, _cb) in reversed(list(_held_owners.items())):
        lock = getattr(owner, attr)
        lock.acquire()
        _held_now.append((owner, lock))


_forked = False  # set in a forked child (see forked())


def forked() -> bool:
    """Whether this process is a fork child of a process that imported radixkv. torch's OpenMP pool
    does not survive a fork, so a torch parallel kernel may hang here (a large ``zero_``)."""
    return _forked


def _after_fork(child: bool) -> None:
    global _forked
    if child:
        _forked = True
    try:
        for owner, lock in reversed(_held_now):
            entry = _held_owners.get(owner)
            try:
                if child and entry is not None and entry[1] is not None:
                    entry[1](owner)
            finally:
                lock.release()
    finally:
        _held_now.clear()
        _held_registry.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=lambda: _after_fork(False),
                        after_in_child=lambda: _after_fork(True))


def run_shared(pool: ForkSafeExecutor | None, threads: int, n: int, fn: Callable[[int], T]) -> list[T]:
    """``[fn(i) for i in range(n)]``, computed on up to ``threads`` threads: the calling thread and
    ``threads - 1`` tasks on ``pool``. Each takes the next index from a shared counter: one hand-off
    per thread, not per item, and a thread the scheduler parks (a loaded machine) leaves its share to
    the others. Returns once every item is done; re-raises the first exception."""
    k = min(threads, n) if pool is not None else 1
    if k <= 1:
        return [fn(i) for i in range(n)]
    out: list[Any] = [None] * n
    counter = itertools.count()

    def work() -> None:
        for i in counter:  # next() on a count is atomic under the GIL
            if i >= n:
                return
            out[i] = fn(i)

    futures = []
    try:
        # Submitted inside the try: if a later submit fails (the pool was just shut down), the
        # finally still waits for the helpers already running, so none writes after we return.
        for _ in range(k - 1):
            futures.append(pool.submit(work))  # type: ignore[union-attr]
        work()
    finally:
        for f in futures:
            f.result()  # every item done (and no helper still running) before returning
    return out
