"""``python tests/helpers/backend_run.py MODEL [key-only]``: in a fresh process, ``torch.compile``
MODEL (``toy``, ``toy-wide`` or a transformers model dir) with ``backend="aotc"``, the token dim
marked dynamic (found through
torch's entry point; settings from the environment), call it at several sizes, compare with
eager, and print one JSON line: errors, aotc's and torch's counters, the backend's report.
``key-only``: print the graph's backend key without compiling (a backend that only keys)."""

from __future__ import annotations

import json
import sys

import torch


def build(what: str) -> tuple[torch.nn.Module, bool]:
    if what.startswith("toy"):
        from aotc.models.toy_llama import build as toy

        torch.manual_seed(0)
        hidden = 384 if what == "toy-wide" else 256
        return toy(layers=2, hidden=hidden, heads=4, vocab=1024).eval(), False
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(what).eval(), True


def main() -> None:
    what = sys.argv[1]
    key_only = len(sys.argv) > 2 and sys.argv[2] == "key-only"
    model, hf = build(what)

    vocab = model.config.vocab_size if hf else 1024

    def call(m, n, mark=False):
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, vocab, (1, n) if hf else (n,), generator=g)
        pos = torch.arange(n).unsqueeze(0) + 5 if hf else torch.arange(n)
        if mark:  # the token dim dynamic from the first call: one graph serves every size
            torch._dynamo.mark_dynamic(ids, ids.dim() - 1)
            torch._dynamo.mark_dynamic(pos, pos.dim() - 1)
        if hf:
            return m(input_ids=ids, position_ids=pos).logits
        return m(ids, pos)

    if key_only:
        from aotc.backend.serve import backend_key

        keys = []

        def keyer(gm, ex):
            keys.append(backend_key(gm, ex)[0])
            return gm.forward

        with torch.no_grad():
            x = torch.randint(0, 1024, (7,))
            torch._dynamo.mark_dynamic(x, 0)
            p = torch.arange(7)
            torch._dynamo.mark_dynamic(p, 0)
            torch.compile(model, backend=keyer)(x, p)
        print(json.dumps({"keys": keys}))
        return
    from aotc._torch.inductor_facts import counters_snapshot

    compiled = torch.compile(model, backend="aotc")
    errs = {}
    with torch.no_grad():
        for i, n in enumerate((7, 9, 16, 33)):
            errs[str(n)] = float((call(compiled, n, mark=i == 0) - call(model, n)).abs().max())
    print(json.dumps({"errors": errs, "counters": counters_snapshot()}))


if __name__ == "__main__":
    main()
