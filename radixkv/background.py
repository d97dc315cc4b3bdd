"""Bounded background work: a small pool of named threads draining one bounded queue.

The store runs write-through copies, promotions and prefetches here. Every submission returns a
:class:`Job` handle (``wait``, ``cancel``, ``done``). The queue is bounded: a submitter either blocks
for room (backpressure) or gets ``None`` back and decides what to do (skip a promotion, run inline).
:meth:`WorkerPool.close` either flushes (runs everything queued) or cancels what has not started,
then joins every thread, so a closed pool leaves no thread behind. A pool dropped without
:meth:`WorkerPool.close` is collected like any object (its threads hold it only while they run a
job); its threads then run what was queued and exit within ``_ORPHAN_POLL_S`` seconds.

At interpreter exit (an engine that never closes its store: ``sys.exit``, the end of ``main``) an
``atexit`` hook waits until every job submitted to a pool of this process (closed, open or dropped)
has run or been cancelled, up to the longest ``exit_timeout_s`` of those pools: a pool thread still
inside a job when the interpreter finalizes is ended by a forced unwind as it re-takes the GIL, and
when that unwind passes through C++ frames (torch's calls release the GIL) the whole process aborts
(``terminate called without an active exception``, exit status 134, a core dump). Nothing is
cancelled, so an engine's own exit hook that runs after this one can still close its store and flush.
"""

from __future__ import annotations

import logging
import os
import atexit
import queue
import threading
import time
import weakref
from typing import Any, Callable, Generic, TypeVar

from radixkv.forksafe import SignalSafeCondition

__all__ = ["Job", "WorkerPool"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_PENDING, _RUNNING, _DONE, _CANCELLED = "pending", "running", "done", "cancelled"
_SUBMIT_POLL_S = 0.05  # how often a submit waiting for room checks whether the pool closed
# How often an idle thread checks whether its pool was dropped without close(). A poll, not a
# weakref callback: a callback runs inside the garbage collector, in whatever thread triggered it,
# possibly while that thread holds the queue's lock (queue.Queue is not reentrant).
_ORPHAN_POLL_S = 1.0


class _Outstanding:
    """Jobs submitted to this process's pools and not yet run to their end or cancelled, over every
    pool (closed, open, or dropped with jobs queued); the exit hook waits for none to be left."""

    def __init__(self) -> None:
        self.cond = SignalSafeCondition()
        self.jobs = 0
        self.exit_wait_s = 0.0  # the longest exit_timeout_s of the pools created here

    def add(self, n: int) -> None:
        with self.cond:
            self.jobs += n
            if self.jobs == 0:
                self.cond.notify_all()


_outstanding = _Outstanding()


def _forget_outstanding_in_child() -> None:
    # A forked child runs none of the parent's jobs (its pools start over), and may have copied the
    # lock mid-use.
    global _outstanding
    wait_s = _outstanding.exit_wait_s
    _outstanding = _Outstanding()
    _outstanding.exit_wait_s = wait_s


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_outstanding_in_child)


def _wait_at_exit() -> None:
    """The ``atexit`` hook (see the module docstring): wait until no job is queued or running in any
    pool of this process, at most the longest ``exit_timeout_s`` of its pools. Registered when this
    module is first imported; atexit runs hooks in reverse, so an engine's hook registered later (which
    may close its store) runs before this one, and one registered earlier runs after it."""
    o = _outstanding
    with o.cond:
        if not o.cond.wait_for(lambda: o.jobs == 0, o.exit_wait_s):
            log.warning("radixkv: the interpreter exits with %d background jobs of stores never closed "
                        "still queued or running after %.1f s (close_timeout_s); close() stores "
                        "before exiting", o.jobs, o.exit_wait_s)


atexit.register(_wait_at_exit)


class Job(Generic[T]):
    """Handle of one background call ``fn(job)``.

    ``fn`` may poll :attr:`cancel_requested` between steps and stop early. :meth:`wait` returns
    ``fn``'s result, or ``cancel_result`` when the job was cancelled before it ran; an exception
    raised by ``fn`` is re-raised by :meth:`wait`.
    """

    __slots__ = (
        "_fn",
        "_state",
        "_result",
        "_error",
        "_done",
        "_lock",
        "_cancel",
        "_on_cancel",
        "name",
    )

    def __init__(
        self,
        fn: Callable[[Job[T]], T],
        cancel_result: T,
        name: str = "",
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self._fn = fn
        self._on_cancel = on_cancel  # runs once if the job is cancelled before it ran
        self._state = _PENDING
        self._result: T = cancel_result
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self.name = name

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> bool:
        """Ask the job to stop. True if it had not started (it will never run); a running job sees
        :attr:`cancel_requested` and may stop early; a finished job is unaffected (False)."""
        self._cancel.set()
        with self._lock:
            if self._state != _PENDING:
                return False
            self._state = _CANCELLED
            on_cancel, self._on_cancel, self._fn = self._on_cancel, None, None  # type: ignore[assignment]
        try:
            if on_cancel is not None:  # release what the submitter took for the job (pins, counts)
                on_cancel()
        finally:
            self._done.set()
        return True

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> T:
        """Block until the job finished or was cancelled; TimeoutError after ``timeout_s``."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"background job {self.name!r} still running after {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._result

    def _run(self) -> None:
        with self._lock:
            if self._state != _PENDING:
                return
            self._state = _RUNNING
        try:
            self._result = self._fn(self)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits, and logged
            self._error = e
            log.warning("background job %r failed: %r", self.name, e, exc_info=True)
        finally:
            with self._lock:
                self._state = _DONE
            self._done.set()
            self._fn = None  # type: ignore[assignment]  # drop references to payloads early
            self._on_cancel = None


class _Queue(queue.Queue):  # type: ignore[type-arg]
    """``queue.Queue`` whose conditions are :class:`SignalSafeCondition`: ``submit`` puts from the
    caller's thread, and an interrupt there must not leave the queue's lock held (the pool's threads
    and every later submit would block on it for good)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.not_empty = SignalSafeCondition(self.mutex)
        self.not_full = SignalSafeCondition(self.mutex)
        self.all_tasks_done = SignalSafeCondition(self.mutex)


class WorkerPool:
    """``n_threads`` daemon threads named ``radixkv-<name>-<i>`` over a queue of ``max_queue`` jobs."""

    def __init__(
        self,
        name: str,
        n_threads: int,
        max_queue: int,
        on_depth: Callable[[int], None] | None = None,
        exit_timeout_s: float = 30.0,
    ) -> None:
        self.name = name
        self._n_threads = n_threads
        with _outstanding.cond:  # how long interpreter exit waits for this pool's jobs (_wait_at_exit)
            _outstanding.exit_wait_s = max(_outstanding.exit_wait_s, exit_timeout_s)
        self._on_depth = on_depth
        self._closed = False
        # Jobs the parent had queued or running when this process forked (summed over forks): none
        # of them runs or ends here, so what they took is never given back in this process.
        self.inherited_jobs = 0
        self._start(max_queue)

    def _start(self, max_queue: int) -> None:
        """Start the threads over a fresh queue (at construction, and in a forked child). A thread
        that cannot start (the process is at its thread limit) stops those already started and
        raises: a pool never runs short of the threads it was sized for, and a child retries on
        its next call."""
        self._queue: queue.Queue[Job[Any] | None] = _Queue(maxsize=max_queue)
        self._close_lock = threading.Lock()
        self._swept = False  # close() cancelled what was queued after its threads stopped
        self._inflight = 0
        self._idle = SignalSafeCondition()  # submit() takes it in the caller's (main) thread
        self._depth_lock = threading.Lock()  # see _report_depth
        # The threads hold the pool weakly (a bound method would keep it, and through on_depth
        # the store's metrics and tiers, alive for as long as they wait).
        self._threads = [
            threading.Thread(target=_serve, args=(weakref.ref(self), self._queue),
                             name=f"radixkv-{self.name}-{i}", daemon=True)
            for i in range(self._n_threads)
        ]
        if not self._closed:
            started = 0
            try:
                for t in self._threads:
                    t.start()
                    started += 1
            except BaseException:
                for _ in range(started):  # one stop marker each; they take them as they come
                    self._queue.put(None)
                for t in self._threads[:started]:
                    t.join()
                raise
        self._pid = os.getpid()

    def _fork_check(self) -> None:
        """In a forked child, start over: the parent's threads do not exist here, its queued jobs are
        the parent's to run, and its locks may have been copied mid-use."""
        if os.getpid() != self._pid:
            self.inherited_jobs += self._inflight
            self._start(self._queue.maxsize)

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def submit(
        self,
        fn: Callable[[Job[T]], T],
        cancel_result: T,
        *,
        block: bool = True,
        timeout_s: float | None = None,
        name: str = "",
        on_cancel: Callable[[], None] | None = None,
    ) -> Job[T] | None:
        """Queue ``fn``; None if the queue stayed full (``block=False`` or ``timeout_s`` elapsed).
        RuntimeError after :meth:`close`."""
        self._fork_check()
        if self._closed:
            raise RuntimeError(f"worker pool {self.name!r} is closed; create a new store")
        job: Job[T] = Job(fn, cancel_result, name, on_cancel)
        with self._idle:
            self._inflight += 1
        _outstanding.add(1)
        # Wait for room in slices, so a close() while we wait rejects us instead of leaving us
        # blocked forever behind a queue no thread serves any more.
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = _SUBMIT_POLL_S if deadline is None else min(_SUBMIT_POLL_S, deadline - time.monotonic())
            try:
                self._queue.put(job, block=block and wait_s > 0, timeout=max(wait_s, 0.0) if block else None)
                break
            except queue.Full:
                if self._closed:
                    self._finish_one()
                    raise RuntimeError(f"worker pool {self.name!r} closed while waiting for room; "
                                       "create a new store") from None
                if not block or (deadline is not None and time.monotonic() >= deadline):
                    self._finish_one()
                    return None
        if self._closed:
            # close() may have ended (threads joined, queue swept) between our closed check and our
            # put: nothing would ever run or cancel the job, and its wait() would never return.
            with self._close_lock:
                if self._swept:
                    for _ in range(self._cancel_queued()):
                        self._queue.put_nowait(None)
        self._report_depth()
        return job

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted job has finished; False on timeout."""
        self._fork_check()
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout_s)

    def close(self, flush: bool, timeout_s: float) -> bool:
        """Stop the pool: run (``flush``) or cancel what is queued, then join the threads.

        Returns True if everything finished within ``timeout_s``; on timeout, remaining queued jobs
        are cancelled and running ones are asked to stop before joining. Idempotent.
        """
        self._fork_check()
        with self._close_lock:
            if self._closed:
                return True
            self._closed = True
        ok = True
        if flush:
            ok = self.drain(timeout_s)
        if not flush or not ok:
            self._cancel_queued()
        # One stop marker per thread; a thread exits after the jobs queued before its marker.
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout_s)
            ok = ok and not t.is_alive()
        # A submit that found room after the stop markers queued a job no thread will run: cancel it,
        # so its handle completes (as cancelled) instead of waiting forever. Stop markers a thread
        # still stuck in a job has not reached yet go back.
        with self._close_lock:  # a submit that puts after this sweep sweeps again (see submit)
            markers = self._cancel_queued()
            for _ in range(markers):
                self._queue.put_nowait(None)
            self._swept = True
        self._report_depth()
        return ok

    def threads_alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    # ------------------------------------------------------------------ internals
    def _cancel_queued(self) -> int:
        """Cancel every queued job; returns how many stop markers were taken out with them."""
        markers = 0
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return markers
            if job is None:
                markers += 1
            else:
                job.cancel()
                self._finish_one()

    def _finish_one(self) -> None:
        with self._idle:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.notify_all()
        _outstanding.add(-1)

    def _report_depth(self) -> None:
        # The size is read and reported under one lock, so the last report always carries the size
        # after the latest put or take: a submitter that read 1 before a worker took its job could
        # otherwise report after the worker's 0, and the queue-depth gauge stayed at 1, the queue
        # empty, until the next job.
        if self._on_depth is not None:
            with self._depth_lock:
                self._on_depth(self._queue.qsize())


def _serve(pool_ref: weakref.ref[WorkerPool], jobs: queue.Queue[Job[Any] | None]) -> None:
    """One pool thread: run jobs until a stop marker, or until the pool is gone (dropped without
    close()) and its queue is empty. It holds the pool only while it runs a job."""
    while True:
        try:
            job = jobs.get(timeout=_ORPHAN_POLL_S)
        except queue.Empty:
            if pool_ref() is None:
                return
            continue
        if job is None:
            return
        pool = pool_ref()
        # The job is let go before it is counted done: what it holds (a copy's tensors) is freed in
        # this thread, inside torch's C++ code. Counted done first, the exit hook could let the
        # interpreter finalize meanwhile, and the forced unwind of this thread there aborted the
        # process ("terminate called without an active exception").
        if pool is None:  # dropped with jobs queued: run them, as close(flush=True) would
            try:
                job._run()
            finally:
                del job
                _outstanding.add(-1)
            continue
        pool._report_depth()
        try:
            job._run()
        finally:
            del job
            pool._finish_one()
            del pool  # not held while waiting for the next job
