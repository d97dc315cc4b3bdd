"""WorkerSide.check_integrity() must catch a staged read whose books disagree with what it holds:
each test stages a real read (its lookup answered, the read held back), breaks one invariant, and
expects the check to raise. Before, the check only compared the sum of the entries' ``nbytes`` with
``_staged_bytes``: an entry counting other bytes than its buffers hold (which ``max_staging_bytes``
bounds through it), buffers of another length than its chunks, or one entry both staged and
draining (its bytes given back twice) passed whenever the total agreed."""

from __future__ import annotations

import pytest

from test_connector_scheduler import _warm_then_gate, prompt

pytestmark = pytest.mark.vllm


@pytest.fixture
def staged(tmp_path, model_dir):
    eng, toks, gated = _warm_then_gate(tmp_path, model_dir)
    eng.add("r2", toks[:64] + prompt(20, seed=7))
    eng.step()  # lookup sent; the read is held back
    w = eng.worker._worker
    assert w._staged_bytes > 0 and list(w._staged) == ["r2"]
    w.check_integrity()
    yield w, w._staged["r2"]
    gated.open()


def test_an_entry_counting_other_bytes_than_its_buffers(staged):
    w, st = staged
    extra = st.buffers[0][0].numel()
    st.nbytes += extra  # the total still agrees
    w._staged_bytes += extra
    with pytest.raises(AssertionError, match="buffer bytes but counts"):
        w.check_integrity()


def test_buffers_of_another_length_than_the_staged_chunks(staged):
    w, st = staged
    st.hit_chunks += 1
    with pytest.raises(AssertionError, match="staged chunks"):
        w.check_integrity()


def test_an_entry_both_staged_and_draining(staged):
    w, st = staged
    w._draining.append(st)  # its bytes would be given back twice
    w._staged_bytes += st.nbytes
    with pytest.raises(AssertionError, match="also draining"):
        w.check_integrity()
