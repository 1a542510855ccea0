"""One ``torch.compile`` start on the toy model in a fresh interpreter (run by
bench/vllm_serving.py): ``python bench/child_backend.py eager|inductor|aotc``. The caches come
from the environment (``TORCHINDUCTOR_CACHE_DIR``, ``AOTC_STORE``). Prints one JSON line with the
seconds from the interpreter's start to the first output of a 7-token call."""

from __future__ import annotations

import time

T0 = time.perf_counter()

import json  # noqa: E402
import sys  # noqa: E402


def main() -> None:
    import torch

    from aotc.models.toy_llama import build

    mode = sys.argv[1]
    torch.manual_seed(0)
    model = build(layers=8, hidden=256, heads=4, vocab=1024).eval()
    ids, pos = torch.randint(0, 1024, (7,)), torch.arange(7)
    fn = model
    if mode != "eager":
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        fn = torch.compile(model, backend=mode)
    with torch.no_grad():
        out = fn(ids, pos)
        first = time.perf_counter() - T0
        err = float((out - model(ids, pos)).abs().max())
    print(json.dumps({"first_output": round(first, 3), "max_abs_err": err}))


if __name__ == "__main__":
    main()
