"""`LayerPipeline`: overlap per-layer KV transfers with per-layer compute (side stream + events).

Loads run ahead of compute: ``start_loads(jobs)`` issues layers ``0..lookahead`` on the side stream;
``wait_layer(i)`` issues what the look-ahead now allows and makes the compute stream wait for layer
``i``'s event (the host does not block). Saves follow compute: ``save_layer(i, job)`` makes the side
stream wait for the compute stream's work enqueued so far, then issues the job. ``wait_all()``
blocks the host until every issued job has finished.

On CPU (or any non-CUDA device) the same calls run each job synchronously at the moment it would be
issued on GPU, in the same order, so the protocol is testable without a GPU.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

from radixkv.errors import InputError

__all__ = ["LayerPipeline"]


def _add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``, which Python 3.10 (requires-python >= 3.10) lacks: there the note goes
    to ``__notes__`` directly (kept for callers and tests, not printed), never an AttributeError that
    would replace the first error and skip the rest of ``wait_all``."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", ()), note]


Job = Callable[[], object]


class LayerPipeline:
    """Layer-wise transfer pipeline for one device. Not thread-safe: drive it from the model thread.

    Jobs launch their copies on the *current* stream (e.g. `gather_chunks`/`scatter_chunks`); the
    pipeline makes that the side stream. The caller keeps every tensor a job touches alive until
    `wait_layer` / `wait_all` has returned for it (the side stream may still be reading it before
    that).
    """

    def __init__(self, device: torch.device | str, *, lookahead_layers: int = 1) -> None:
        # bool is an int: True would read as a look-ahead of one layer
        if isinstance(lookahead_layers, bool) or not isinstance(lookahead_layers, int) or lookahead_layers < 0:
            raise InputError(f"lookahead_layers must be an int >= 0; got {lookahead_layers!r}")
        self.device = torch.device(device)
        self.lookahead_layers = lookahead_layers
        self.is_async = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.is_async else None
        self._load_jobs: list[Job | None] = []
        self._load_events: list[object] = []  # one per issued load layer (None on CPU / no job)
        self._waited: set[int] = set()
        self._save_events: list[object] = []
        self.loads_issued_total = 0
        self.saves_issued_total = 0

    # --- loads ----------------------------------------------------------------------------------

    def start_loads(self, jobs: Sequence[Job | None]) -> None:
        """Begin a batch of per-layer loads: ``jobs[i]()`` issues layer ``i``'s transfer (or None).

        The side stream first waits for all work already enqueued on the compute stream (the target
        pages may have been in use). Issues layers ``0..lookahead_layers`` now.
        """
        if self.loads_pending:
            raise InputError(
                f"start_loads called while {len(self._load_jobs) - len(self._load_events)} layers "
                "of "
                "the previous batch are unissued; call wait_layer for every layer or wait_all first"
            )
        jobs = list(jobs)
        for i, job in enumerate(jobs):
            if job is not None and not callable(job):
                raise InputError(
                    f"jobs[{i}] is a {type(job).__name__}, expected a callable or None"
                )
        self._load_jobs, self._load_events, self._waited = jobs, [], set()
        if self.is_async and jobs:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._issue_loads_through(min(self.lookahead_layers, len(jobs) - 1))

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait until layer ``layer`` of the current batch has loaded.

        Also issues layers up to ``layer + lookahead_layers``. Without a batch (no loads this step)
        this returns at once; a layer outside the batch is an `InputError`.
        """
        if not self._load_jobs:
            return
        layer = _layer_index(layer)
        if not 0 <= layer < len(self._load_jobs):
            raise InputError(
                f"layer {layer!r} outside the load batch 0..{len(self._load_jobs) - 1}"
            )
        # Wait for this layer before issuing the look-ahead: a look-ahead job that raises must not
        # leave the compute stream without its wait for a layer that did load.
        self._issue_loads_through(layer)
        event = self._load_events[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._waited.add(layer)
        self._issue_loads_through(min(layer + self.lookahead_layers, len(self._load_jobs) - 1))

    @property
    def loads_pending(self) -> bool:
        """True while some layer of the current load batch has not been issued yet."""
        return len(self._load_events) < len(self._load_jobs)

    def _issue_loads_through(self, last_layer: int) -> None:
        while len(self._load_events) <= last_layer:
            job = self._load_jobs[len(self._load_events)]
            # Count the layer as issued before running it: a job that raises is not retried by a
            # later wait (the caller reports the failed load); its error propagates from this call.
            self._load_events.append(None)
            if job is not None:
                self.loads_issued_total += 1
                self._load_events[-1] = self._issue(job)

    # --- saves ----------------------------------------------------------------------------------

    def save_layer(self, layer: int, job: Job) -> None:
        """Issue ``job`` (saving layer ``layer``) after the compute stream's work so far."""
        if not callable(job):
            raise InputError(
                f"job for layer {layer!r} is a {type(job).__name__}, expected a callable"
            )
        if self.is_async:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._save_events.append(self._issue(job))
        self.saves_issued_total += 1

    # --- common ---------------------------------------------------------------------------------

    def _issue(self, job: Job) -> object:
        if not self.is_async:
            job()
            return None
        with torch.cuda.stream(self._stream):
            job()
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def wait_all(self) -> None:
        """Issue every unissued load, then block the host until all issued jobs have finished.

        A load job that raises does not stop the others: every layer is still issued and the host
        still waits for the side stream, then the first error is raised (later ones as notes). The
        batch is released: a later `wait_layer` returns at once until the next `start_loads`.
        """
        error: Exception | None = None
        while self.loads_pending:
            try:
                self._issue_loads_through(len(self._load_jobs) - 1)
            except Exception as exc:  # the failed layer counts as issued: the loop moves on
                if error is None:
                    error = exc
                else:
                    _add_note(error, f"another load job also failed: {exc!r}")
        if self.is_async:
            self._stream.synchronize()
        self._save_events = []
        # Every job has run and the host has waited for the stream: let go of the batch now (its
        # jobs hold the pinned staging buffers and page ids), not at the next start_loads.
        self._load_jobs, self._load_events, self._waited = [], [], set()
        if error is not None:
            raise error

    def check_integrity(self) -> None:
        """Issued loads never exceed the batch, waited layers were issued, CPU holds no events."""
        if len(self._load_events) > len(self._load_jobs):
            raise RuntimeError(
                f"{len(self._load_events)} load layers issued of {len(self._load_jobs)}"
            )
        if not self._waited <= set(range(len(self._load_events))):
            raise RuntimeError(f"waited layers {sorted(self._waited)} include unissued layers")
        events = [e for e in self._load_events + self._save_events if e is not None]
        if events and not self.is_async:
            raise RuntimeError("a synchronous (CPU) pipeline recorded CUDA events")
        if self.loads_issued_total < 0 or self.saves_issued_total < 0:
            raise RuntimeError("negative job counters")


def _layer_index(layer: object) -> int:
    """``layer`` as an int: any integer type (a numpy index too), never a bool or a float."""
    if isinstance(layer, bool):
        raise InputError(f"layer must be an integer layer index, not the bool {layer!r}")
    try:
        return operator.index(layer)  # type: ignore[arg-type]
    except TypeError:
        raise InputError(
            f"layer must be an integer layer index; got {layer!r} of type {type(layer).__name__}"
        ) from None
