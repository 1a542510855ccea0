"""Python's cyclic garbage collector paused for one call that makes hundreds of thousands of
objects (a trace, Inductor's codegen, rebuilding Dynamo's guards at load). Their allocations
cross the collector's thresholds and set off collections of the whole heap — the server's
torch, transformers and model included — that find little garbage: 0.4–0.7 s of a cold capture,
~10 % of a backend compile (toy, 8 layers: 5.06 → 4.55 s; peak RSS +10 MB), 0.24 s of a 0.42 s
precompiled load. What the block leaves cyclic is collected afterwards; nothing is paused beyond
the call (a guest in a server).

Afterwards is still the caller's time: at the 0.5B bench model a backend compile leaves ~280,000
new objects (150,000 of them Inductor's cyclic garbage), and the collections they set off once
the collector is back — young, middle, then the whole heap — take 0.67 s of the first call.
:func:`collect_in_wait` runs them earlier, where the block waits on another core anyway (the
kernels' header, :mod:`aotc._torch.batch_build`)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collect_in_wait", "gc_paused"]

# Objects a paused block must have made (net, the collector's young count) before a wait is used
# to collect them: the young collection alone is due after 700; the whole heap's is due only when
# the survivors reach a quarter of it (Python 3.11), some 150,000 in a process with torch.
WORTH_COLLECTING = 100_000

_paused = [0]  # gc_paused blocks open that turned the collector off


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off for the block, back as it was after (module doc)."""
    was = gc.isenabled()
    gc.disable()
    _paused[0] += was
    try:
        yield
    finally:
        _paused[0] -= was
        if was:
            gc.enable()


def collect_in_wait() -> bool:
    """Inside a :func:`gc_paused` block, about to wait on work elsewhere: collect the whole heap
    now if the block has made enough objects that the collector would soon after it
    (:data:`WORTH_COLLECTING`). Never where the caller turned the collector off itself. True
    when it collected."""
    if not _paused[0] or gc.get_count()[0] < WORTH_COLLECTING:
        return False
    gc.collect()
    return True
