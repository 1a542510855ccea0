"""Warm-start a compiled manifest in a FRESH process and report, as JSON on stdout: errors vs
eager per size, torch's and aotc's counters, and every subprocess command run while loading and
running (a C++ compile would show up there as a compiler call on a .cpp file).

    python warm_start.py MANIFEST STORE SIZE [SIZE ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

COMMANDS: list[list[str]] = []
_real_popen_init = subprocess.Popen.__init__


def _spy(self, args, *a, **k):  # type: ignore[no-untyped-def]
    COMMANDS.append([str(x) for x in (args if isinstance(args, (list, tuple)) else [args])])
    return _real_popen_init(self, args, *a, **k)


subprocess.Popen.__init__ = _spy  # type: ignore[method-assign]


def main() -> None:
    t0 = time.perf_counter()
    import torch

    import aotc
    from aotc.model.build import make_named_inputs
    from aotc.runtime.checking import flat_tensors
    from aotc._torch.inductor_facts import counters_snapshot
    from aotc.manifest import load_manifest

    t_import = time.perf_counter() - t0
    manifest_path, store, sizes = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]]
    manifest = load_manifest(manifest_path)
    t = time.perf_counter()
    runner = aotc.load(manifest, store=store)
    t_load = time.perf_counter() - t
    # after the load, before any call (a custom op's first call imports Dynamo, eager or not)
    inductor_modules = sorted(m for m in sys.modules if m.startswith("torch._inductor"))
    errs = {}
    for n in sizes:
        x = make_named_inputs(manifest, n, seed=5)
        got, want = flat_tensors(runner(**x)), flat_tensors(runner.eager(**x))
        errs[n] = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))
    print(json.dumps({"errs": errs, "counters": counters_snapshot(), "commands": COMMANDS,
                      "inductor_modules": inductor_modules,
                      "import_s": t_import, "load_s": t_load, "phases": runner.timings.phases}))


if __name__ == "__main__":
    main()
