"""aotc's own process-wide counters, which tests and ``aotc run`` assert on: ``traces`` (Dynamo
captures aotc ran), ``compiles`` (Inductor compilations aotc ran), ``loads`` (artifacts loaded), ``fast_loads``
(of those, through ``aotc._torch.wrapper``),
``cache_hits`` (store lookups that found an entry). torch's own counters are read beside these in
``aotc._torch.inductor_facts.counters_snapshot``."""

from __future__ import annotations

from collections import Counter

COUNTERS: Counter[str] = Counter()
