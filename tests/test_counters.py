"""The typed counters tests assert on: ``expect`` passes on the exact deltas and names the
counter that moved otherwise."""

from __future__ import annotations

import pytest

from aotc.counters import Counters


def test_expect_exact_deltas_and_a_clear_failure() -> None:
    c = Counters()
    with c.expect(compiles=2):
        c.compiles += 2
    with pytest.raises(AssertionError, match=r"compiles.*1 \(expected 2\)"):
        with c.expect(compiles=2):
            c.compiles += 1
    with pytest.raises(AssertionError, match=r"traces"):  # an unexpected counter moved
        with c.expect():
            c.traces += 1
    with pytest.raises(TypeError, match="no such counter: compile"):
        with c.expect(compile=1):
            pass
    c.reset()
    assert c.snapshot() == {"traces": 0, "compiles": 0, "loads": 0, "fast_loads": 0, "cache_hits": 0}
