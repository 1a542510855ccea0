"""``python -m aotc.vllm.generate SPEC.json OUT.json``: one vLLM engine in this fresh process —
build it, greedy-decode the spec's prompts (token ids), optionally measure decode throughput —
and write what happened as JSON.

SPEC: ``{"backend": "aotc"|"default"|"eager", "model": dir, "dtype", "max_model_len",
"max_num_batched_tokens", "engine_args": {}, "prompts": [[ids…], …], "max_tokens": 16,
"decode": {"tokens": 64, "concurrency": [1, 8]}}`` (``decode`` optional).
OUT: ``{"tokens": [[ids…], …], "seconds": {"import", "engine_init", "first_output",
"generate"}, "decode_tokens_per_s": {"1": …, "8": …}}``; ``first_output`` counts from the start
of this process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

_T0 = time.perf_counter()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the engine the spec names and generate (see module doc)."""
    from aotc.vllm import engine_kwargs

    t = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    seconds: dict[str, float] = {"import": time.perf_counter() - t}
    kw = engine_kwargs(spec["backend"], spec["model"], spec.get("dtype", "float32"),
                       int(spec.get("max_model_len", 256)), spec.get("max_num_batched_tokens"),
                       spec.get("engine_args"))
    t = time.perf_counter()
    llm = LLM(**kw)
    seconds["engine_init"] = time.perf_counter() - t
    greedy = SamplingParams(max_tokens=int(spec.get("max_tokens", 16)), temperature=0.0,
                            detokenize=False)
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]], greedy,
                        use_tqdm=False)
    seconds["generate"] = time.perf_counter() - t
    seconds["first_output"] = time.perf_counter() - _T0
    result: dict[str, Any] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                              "seconds": {k: round(v, 3) for k, v in seconds.items()}}
    decode = spec.get("decode")
    if decode:
        n = int(decode.get("tokens", 64))
        fixed = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0,
                               detokenize=False)
        tps: dict[str, float] = {}
        for c in decode.get("concurrency", [1, 8]):
            prompts = [TokensPrompt(prompt_token_ids=[1 + (i % 7), 2, 3]) for i in range(int(c))]
            llm.generate(prompts, fixed, use_tqdm=False)  # warm: every batch shape seen once
            rates = []
            for _ in range(int(decode.get("repeats", 3))):  # the median of a few: 2 cores are noisy
                t = time.perf_counter()
                got = llm.generate(prompts, fixed, use_tqdm=False)
                elapsed = time.perf_counter() - t
                rates.append(sum(len(o.outputs[0].token_ids) for o in got) / elapsed)
            tps[str(c)] = round(sorted(rates)[len(rates) // 2], 1)
        result["decode_tokens_per_s"] = tps
    return result


def run_fresh(spec: dict[str, Any], env: dict[str, str] | None = None, timeout: float = 900,
              log: Path | None = None) -> dict[str, Any]:
    """Run ``spec`` in a fresh process (``env``: its whole environment) and return its result;
    the engine's output goes to ``log``. A failed engine is a ``VllmError`` with the log's tail."""
    import subprocess
    import tempfile

    from aotc.errors import VllmError

    with tempfile.TemporaryDirectory(prefix="aotc-vllm-") as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps(spec))
        log = log or Path(tmp) / "engine.log"
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "aotc.vllm.generate", str(spec_file),
                                     str(out_file)], stdout=f, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # its engine processes: one group
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired as e:
                import os
                import signal

                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise VllmError(f"the vLLM engine did not finish in {timeout:.0f}s (log: {log})") from e
        if rc != 0 or not out_file.is_file():
            tail = " | ".join(Path(log).read_text(errors="replace").strip().splitlines()[-4:])
            raise VllmError(f"the vLLM engine exited with {rc}: {tail[-800:]}")
        result: dict[str, Any] = json.loads(out_file.read_text())
        result["log"] = Path(log).read_text(errors="replace") if log.parent == Path(tmp) else str(log)
        return result


def main(argv: list[str]) -> int:
    """Read SPEC, run, write OUT; exit 0 on success."""
    if len(argv) != 2:
        print("usage: python -m aotc.vllm.generate SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    result = run(spec)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
