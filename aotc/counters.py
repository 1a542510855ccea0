"""aotc's own process-wide counters, which tests and ``aotc run`` assert on (in the style of
vLLM's ``compilation/counter.py``). torch's own counters are read beside these in
``aotc._torch.inductor_facts.counters_snapshot``."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class Counters:
    """``traces``: Dynamo captures aotc ran; ``compiles``: Inductor compilations aotc ran (in this
    process or its workers); ``loads``: artifacts loaded; ``fast_loads``: of those, through
    ``aotc._torch.wrapper``; ``cache_hits``: store lookups that found an entry."""

    traces: int = 0
    compiles: int = 0
    loads: int = 0
    fast_loads: int = 0
    cache_hits: int = 0

    def reset(self) -> None:
        """Every counter back to 0."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)

    def snapshot(self) -> dict[str, int]:
        """The counts now, as a dict."""
        return dataclasses.asdict(self)

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that the block changes each named counter by exactly its delta (and the
        others not at all): ``with COUNTERS.expect(compiles=2, traces=1): …``."""
        unknown = set(deltas) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"no such counter: {', '.join(sorted(unknown))}")
        before = self.snapshot()
        yield
        after = self.snapshot()
        got = {k: after[k] - before[k] for k in after}
        want = {k: deltas.get(k, 0) for k in after}
        if got != want:
            wrong = {k: f"{got[k]} (expected {want[k]})" for k in got if got[k] != want[k]}
            raise AssertionError(f"counters changed by {wrong}")


COUNTERS = Counters()
