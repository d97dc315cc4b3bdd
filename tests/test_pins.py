"""PinTable on its own: owners, leases on an injected clock, all-or-nothing unpin."""

from __future__ import annotations

import pytest

from radixkv.errors import PinError
from radixkv.pins import PinTable


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_lease_expires_but_the_record_stays_until_unpinned():
    clock = Clock()
    pins = PinTable(clock)
    pins.pin([1, 2], "req-a", lease_s=10)
    assert pins.is_pinned(1) and pins.pinned_count() == 2
    clock.t += 10.5
    assert not pins.is_pinned(1) and pins.pinned_count() == 0
    assert 1 in pins  # expired, still recorded: the owner's late unpin is a no-op, not an error
    pins.unpin([1, 2], "req-a")
    assert len(pins) == 0


def test_renewal_and_two_owners():
    clock = Clock()
    pins = PinTable(clock)
    pins.pin([7], "a", lease_s=5)
    pins.pin([7], "b", lease_s=50)
    clock.t += 6
    assert pins.is_pinned(7)  # b's lease still runs
    pins.pin([7], "a", lease_s=5)  # renews a
    pins.unpin([7], "b")
    assert pins.is_pinned(7)
    pins.forget(7)
    assert 7 not in pins and not pins.is_pinned(7)


def test_unpin_is_all_or_nothing():
    pins = PinTable(Clock())
    pins.pin([1, 2], "a", lease_s=1)
    with pytest.raises(PinError, match="node 3 is not pinned by owner 'a'"):
        pins.unpin([1, 3], "a")
    assert 1 in pins and 2 in pins  # nothing released
    with pytest.raises(PinError, match="node 1 is not pinned by owner 'b'"):
        pins.unpin([1], "b")


@pytest.mark.parametrize("owner,lease,match", [("", 1.0, "owner"), ("a", 0, "lease_s=0"), ("a", -1, "lease_s=-1")])
def test_bad_pins_rejected(owner, lease, match):
    pins = PinTable(Clock())
    with pytest.raises(PinError, match=match):
        pins.pin([1], owner, lease_s=lease)
    assert len(pins) == 0


def test_check_integrity_catches_an_ownerless_record():
    pins = PinTable(Clock())
    pins.pin([1], "a", lease_s=1)
    pins.check_integrity()
    pins.by_node[2] = {}  # what a buggy unpin would leave behind
    with pytest.raises(AssertionError, match="node 2 has no owner"):
        pins.check_integrity()
