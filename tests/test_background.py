"""WorkerPool: submitters waiting for room when the pool closes are rejected, never left blocked,
and no job is stranded behind the stop markers."""

from __future__ import annotations

import threading
import time

import pytest

from radixkv.background import WorkerPool


def test_close_rejects_submitters_waiting_for_room():
    # Found by a review: close() while callers waited in a blocking queue.put left them blocked
    # forever (and a job queued after the stop markers never ran, so its handle never completed).
    pool = WorkerPool("t", n_threads=1, max_queue=1)
    release = threading.Event()
    first = pool.submit(lambda j: release.wait(5), False)  # occupies the only thread
    deadline = time.monotonic() + 5
    while first.done() is False and pool.depth == 0 and time.monotonic() < deadline:
        queued = pool.submit(lambda j: True, False, block=False)  # fills the queue once taken
        if queued is not None:
            break
        time.sleep(0.01)
    outcomes: list[object] = []

    def waiter() -> None:
        try:
            outcomes.append(pool.submit(lambda j: True, False))  # blocks: the queue is full
        except RuntimeError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    closer = threading.Thread(target=pool.close, kwargs={"flush": False, "timeout_s": 0.5})
    closer.start()
    time.sleep(0.1)
    release.set()
    closer.join(10)
    for t in threads:
        t.join(10)
    assert not closer.is_alive() and not any(t.is_alive() for t in threads)
    assert len(outcomes) == 3
    for o in outcomes:  # rejected, or queued and then run or cancelled: never pending forever
        assert isinstance(o, RuntimeError) or o.wait(5) in (True, False)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(lambda j: True, False)


def test_depth_reports_end_at_the_queue_size():
    # A submitter read the size (1) before a worker took its job, and reported it after the worker
    # reported 0: the store's radixkv_queue_depth_jobs gauge then stayed at 1 over an empty queue
    # until the next job (seen under load as a stale prefetch depth after every read finished).
    reports: list[tuple[str, int]] = []
    go, started, worker_reported = threading.Event(), threading.Event(), threading.Event()
    trap = False

    def on_depth(d: int) -> None:
        here = threading.current_thread().name
        if trap and here == "submitter" and d == 1:
            go.set()  # the worker finishes the first job and takes the second one now...
            worker_reported.wait(0.5)  # ...and reports 0 before this report lands (unless serialized)
        elif here.startswith("radixkv-"):
            worker_reported.set()
        reports.append((here, d))

    pool = WorkerPool("t", n_threads=1, max_queue=4, on_depth=on_depth)
    try:
        first = pool.submit(lambda j: (started.set(), go.wait(5)), False)
        assert started.wait(5)  # the only worker holds the first job; the queue is empty
        trap = True
        worker_reported.clear()
        t = threading.Thread(target=lambda: pool.submit(lambda j: True, False), name="submitter")
        t.start()
        t.join(10)
        assert first.wait(5) and pool.drain(5)
        assert pool.depth == 0
        assert reports[-1][1] == 0, f"the last depth report was {reports[-1]} over an empty queue"
    finally:
        go.set()
        pool.close(flush=True, timeout_s=5)


def test_threads_of_a_pool_dropped_without_close_exit():
    # Found by a soak hunt: each thread's loop was a bound method of its pool, so a pool nobody
    # closed was never collected and its idle threads blocked forever (a store dropped without
    # close() kept its 4 threads, and through the pool's depth callback its whole tier stack).
    import gc
    import weakref

    def left() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("radixkv-dropped-")]

    assert not left()
    ran: list[int] = []
    refs = []
    for _ in range(20):
        pool = WorkerPool("dropped", n_threads=2, max_queue=4)
        assert pool.submit(lambda j: ran.append(1), None).wait(5) is None
        refs.append(weakref.ref(pool))
        del pool
    deadline = time.monotonic() + 10
    while (left() or any(r() is not None for r in refs)) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert all(r() is None for r in refs), "an idle pool nobody closed is still alive"
    assert not left(), f"{len(left())} threads of 20 dropped pools still run"
    assert len(ran) == 20
