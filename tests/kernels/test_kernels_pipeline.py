"""LayerPipeline protocol on CPU (synchronous, same issue order as on GPU)."""

from __future__ import annotations

import pytest
import torch
from _kernel_cases import make_case, random_page_ids, same_bits
from radixkv.kernels import LayerPipeline, alloc_chunks, gather_chunks, scatter_chunks

from radixkv.errors import InputError


def _recorder(log: list[str], name: str):
    return lambda: log.append(name)


@pytest.mark.parametrize("lookahead", [0, 1, 3])
def test_loads_are_issued_ahead_by_lookahead(lookahead: int) -> None:
    log: list[str] = []
    pipe = LayerPipeline("cpu", lookahead_layers=lookahead)
    assert not pipe.is_async
    pipe.start_loads([_recorder(log, f"load{i}") for i in range(4)])
    assert log == [f"load{i}" for i in range(min(lookahead + 1, 4))]
    for layer in range(4):
        pipe.wait_layer(layer)
        log.append(f"compute{layer}")
        pipe.check_integrity()
        issued = min(layer + lookahead + 1, 4)
        assert [x for x in log if x.startswith("load")] == [f"load{i}" for i in range(issued)]
        # a layer's load always precedes its compute
        assert log.index(f"load{layer}") < log.index(f"compute{layer}")
    assert not pipe.loads_pending and pipe.loads_issued_total == 4


def test_none_jobs_and_no_batch() -> None:
    log: list[str] = []
    pipe = LayerPipeline("cpu")
    pipe.wait_layer(5)  # no loads this step: returns at once
    pipe.start_loads([None, _recorder(log, "load1"), None])
    for layer in range(3):
        pipe.wait_layer(layer)
    assert log == ["load1"] and pipe.loads_issued_total == 1
    pipe.check_integrity()


def test_start_loads_refuses_an_unfinished_batch_and_wait_all_finishes_it() -> None:
    log: list[str] = []
    pipe = LayerPipeline("cpu", lookahead_layers=0)
    pipe.start_loads([_recorder(log, f"a{i}") for i in range(3)])
    assert pipe.loads_pending
    with pytest.raises(InputError, match="2 layers of the previous batch"):
        pipe.start_loads([_recorder(log, "b0")])
    pipe.wait_all()
    assert log == ["a0", "a1", "a2"] and not pipe.loads_pending
    pipe.start_loads([_recorder(log, "b0")])
    assert log[-1] == "b0"


def test_wait_all_lets_go_of_the_batch() -> None:
    """After wait_all the finished batch's jobs (and what they hold: staging buffers, page ids) are
    released at once, not kept until the next start_loads; a wait_layer then returns at once."""
    import gc
    import weakref

    class Held:
        pass

    held = Held()
    ref = weakref.ref(held)
    pipe = LayerPipeline("cpu", lookahead_layers=0)
    pipe.start_loads([lambda h=held: None for _ in range(3)])
    del held
    pipe.wait_layer(0)
    gc.collect()
    assert ref() is not None  # the batch is still running
    pipe.wait_all()
    gc.collect()
    assert ref() is None and not pipe.loads_pending
    pipe.wait_layer(2)  # no batch any more: returns at once
    pipe.check_integrity()


def test_saves_run_in_order() -> None:
    log: list[str] = []
    pipe = LayerPipeline("cpu")
    for layer in range(3):
        log.append(f"compute{layer}")
        pipe.save_layer(layer, _recorder(log, f"save{layer}"))
    pipe.wait_all()
    assert log == ["compute0", "save0", "compute1", "save1", "compute2", "save2"]
    assert pipe.saves_issued_total == 3
    pipe.check_integrity()


def test_argument_errors() -> None:
    with pytest.raises(InputError, match="lookahead_layers"):
        LayerPipeline("cpu", lookahead_layers=-1)
    pipe = LayerPipeline("cpu")
    with pytest.raises(InputError, match="expected a callable or None"):
        pipe.start_loads([lambda: None, 3])
    pipe.start_loads([lambda: None, lambda: None])
    with pytest.raises(InputError, match="outside the load batch 0..1"):
        pipe.wait_layer(2)
    with pytest.raises(InputError, match="expected a callable"):
        pipe.save_layer(0, None)


def test_layer_indices_of_any_integer_type_and_never_bools() -> None:
    """A numpy layer index inside the batch was refused as "outside the load batch"; a bool was
    taken as layer 0 or 1, and lookahead_layers=True as a look-ahead of 1."""
    np = pytest.importorskip("numpy")
    with pytest.raises(InputError, match="lookahead_layers must be an int >= 0; got True"):
        LayerPipeline("cpu", lookahead_layers=True)
    ran: list[int] = []
    pipe = LayerPipeline("cpu", lookahead_layers=0)
    pipe.start_loads([lambda i=i: ran.append(i) for i in range(3)])
    pipe.wait_layer(np.int64(1))
    assert ran == [0, 1]
    with pytest.raises(InputError, match="not the bool True"):
        pipe.wait_layer(True)
    with pytest.raises(InputError, match="integer layer index; got 2.0 of type float"):
        pipe.wait_layer(2.0)
    with pytest.raises(InputError, match="outside the load batch 0..2"):
        pipe.wait_layer(np.int32(3))
    pipe.wait_all()
    assert ran == [0, 1, 2]


def test_job_errors_propagate_from_the_issuing_call() -> None:
    def boom() -> None:
        raise RuntimeError("transfer failed")

    pipe = LayerPipeline("cpu", lookahead_layers=0)
    log: list[str] = []
    pipe.start_loads([lambda: None, boom, _recorder(log, "load2")])
    pipe.wait_layer(0)  # lookahead 0: layer 1 is issued only when waited for
    with pytest.raises(RuntimeError, match="transfer failed"):
        pipe.wait_layer(1)
    pipe.wait_layer(1)  # not retried
    pipe.wait_layer(2)
    assert log == ["load2"] and pipe.loads_issued_total == 3
    pipe.check_integrity()


def test_layerwise_load_and_save_with_kernels() -> None:
    """The vLLM layer-wise flow: per-layer scatter (load) then per-layer gather (save)."""
    src = make_case("vllm_lbnhc", torch.bfloat16, seed=1)
    dst = make_case("vllm_lbnhc", torch.bfloat16, seed=2)
    ids = random_page_ids(2, 3, seed=4)
    chunks = alloc_chunks(src.layout, 2, 3)
    gather_chunks(src.layout, ids, chunks)
    pipe = LayerPipeline("cpu")
    layers = src.layout.num_layers
    pipe.start_loads(
        [lambda ly=ly: scatter_chunks(dst.layout, ids, chunks, layers=ly) for ly in range(layers)]
    )
    saved = torch.zeros_like(chunks)
    for ly in range(layers):
        pipe.wait_layer(ly)
        pipe.save_layer(ly, lambda ly=ly: gather_chunks(dst.layout, ids, saved, layers=ly))
    pipe.wait_all()
    pipe.check_integrity()
    mask = (ids >= 0).repeat_interleave(src.layout.page_tokens, dim=1)  # [chunk, chunk_token]
    for c in range(2):
        assert same_bits(saved[c][:, :, mask[c]], chunks[c][:, :, mask[c]])


def test_wait_all_issues_every_layer_and_syncs_when_a_job_fails() -> None:
    """A failing load must not drop the layers after it nor leave the batch half-issued."""

    def boom() -> None:
        raise RuntimeError("transfer failed")

    def boom2() -> None:
        raise ValueError("second failure")

    log: list[str] = []
    pipe = LayerPipeline("cpu", lookahead_layers=0)
    pipe.start_loads([_recorder(log, "load0"), boom, _recorder(log, "load2"), boom2])
    with pytest.raises(RuntimeError, match="transfer failed") as info:
        pipe.wait_all()
    assert log == ["load0", "load2"]  # layer 2 still issued, in order
    assert any("second failure" in note for note in getattr(info.value, "__notes__", []))
    assert not pipe.loads_pending and pipe.loads_issued_total == 4
    pipe.check_integrity()
    pipe.start_loads([_recorder(log, "b0")])  # the next step is not refused
    assert log[-1] == "b0"


class _Py310Error(RuntimeError):
    """An exception as Python 3.10 makes them: no ``add_note`` (3.11+; radixkv requires >= 3.10)."""

    @property
    def add_note(self):
        raise AttributeError("'_Py310Error' object has no attribute 'add_note'")


def test_wait_all_with_two_failing_jobs_on_python_3_10() -> None:
    # wait_all called error.add_note unconditionally: on 3.10 the second failure raised an
    # AttributeError in place of the first error, before the later layers were issued.
    def boom() -> None:
        raise _Py310Error("transfer failed")

    def boom2() -> None:
        raise ValueError("second failure")

    log: list[str] = []
    pipe = LayerPipeline("cpu", lookahead_layers=0)
    pipe.start_loads([_recorder(log, "load0"), boom, boom2, _recorder(log, "load3")])
    with pytest.raises(_Py310Error, match="transfer failed") as info:
        pipe.wait_all()
    assert log == ["load0", "load3"] and not pipe.loads_pending and pipe.loads_issued_total == 4
    assert any("second failure" in note for note in info.value.__notes__)
    pipe.check_integrity()


class _FakeStream:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event) -> None:
        self.log.append(f"{self.name} waits {event.name}")

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name} waits stream {other.name}")

    def synchronize(self) -> None:
        self.log.append(f"sync {self.name}")


def test_wait_layer_waits_for_its_layer_before_a_failing_lookahead(monkeypatch) -> None:
    """GPU protocol with fake streams/events: when the look-ahead job of layer i+1 raises inside
    wait_layer(i), the compute stream must still wait for layer i's (successful) load."""
    import contextlib

    log: list[str] = []
    compute = _FakeStream(log, "compute")
    loading: list[str] = []

    class _Event:
        def __init__(self) -> None:
            self.name = f"event{loading[-1]}"

        def record(self, stream) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    pipe = LayerPipeline("cpu", lookahead_layers=1)
    pipe.is_async, pipe._stream = True, _FakeStream(log, "side")

    def job(i: int, fail: bool = False):
        def run() -> None:
            loading.append(str(i))
            if fail:
                raise RuntimeError(f"load {i} failed")

        return run

    pipe.start_loads([job(0), job(1), job(2, fail=True)])
    pipe.wait_layer(0)
    with pytest.raises(RuntimeError, match="load 2 failed"):
        pipe.wait_layer(1)
    assert "compute waits event1" in log
    pipe.check_integrity()
