"""The collector paused for one call (aotc.gc_pause): back as it was after, and what the call
made collected while it waits on compilers — never where the caller turned the collector off."""

from __future__ import annotations

import gc

from aotc import gc_pause


def _cyclic_garbage(n: int) -> None:
    for _ in range(n):
        d: dict[str, object] = {}
        d["self"] = d  # a cycle: only the collector frees it


def test_a_paused_block_that_made_enough_is_collected_in_its_wait() -> None:
    assert gc.isenabled()
    with gc_pause.gc_paused():
        assert not gc.isenabled()
        assert not gc_pause.collect_in_wait(), "collected for a block that made next to nothing"
        _cyclic_garbage(gc_pause.WORTH_COLLECTING + 10_000)
        assert gc.get_count()[0] >= gc_pause.WORTH_COLLECTING
        assert gc_pause.collect_in_wait()
        assert gc.get_count()[0] < 1000 and not gc.isenabled()
    assert gc.isenabled()
    assert not gc_pause.collect_in_wait(), "collected outside a paused block"


def test_a_caller_that_turned_the_collector_off_is_never_collected_for() -> None:
    gc.disable()
    try:
        with gc_pause.gc_paused():
            _cyclic_garbage(gc_pause.WORTH_COLLECTING + 10_000)
            assert not gc_pause.collect_in_wait()
            assert gc.get_count()[0] >= gc_pause.WORTH_COLLECTING
        assert not gc.isenabled(), "the caller's choice was undone"
    finally:
        gc.enable()
        gc.collect()
