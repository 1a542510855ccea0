"""A manifest that names a vLLM model, and its compile: run the engine once, offline, with the
aotc backend, so the store (and the remote, when set) holds the program every replica loads.

    name: tiny-llama-vllm
    vllm:
      model: tiny-llama            # the model directory (relative to this file)
      dtype: float32
      max_model_len: 256
      max_num_batched_tokens: 256  # the largest batch the engine traces and profiles with
      engine_args: {}              # any other vllm.LLM keyword argument
      layouts: [default]           # the process layouts replicas start in (each stores vLLM's AOT record)
    compile_sizes: []              # the backend's static sizes (default: the dynamic artifact only)
    splitting_ops: null            # default: vLLM's attention ops (aotc.backend.config.DEFAULT_SPLITTING_OPS)
    store: null

The key is the graph's (:mod:`aotc.backend.graphkey`): vLLM builds it from the model config and
the engine arguments, so the engine has to trace once to know it — a second compile of an
unchanged manifest starts the engine, finds the entry and compiles nothing.

vLLM's own AOT record of the run (:mod:`aotc.vllm.aot_records`) is stored and pushed with the
entry, one per process layout in ``vllm.layouts`` — vLLM's hash can differ between its default
layout (``default``: an engine-core and a worker process, as ``vllm serve`` and ``vllm.LLM``
start) and one process (``in-process``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) — so a new replica
in that layout starts like a restart. Each layout is one engine start (the first compiles).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotc.errors import InputError, ManifestError
from aotc.manifest import read_manifest_yaml

__all__ = ["VllmManifest", "compile_vllm", "is_vllm_manifest", "load_vllm_manifest"]

_TOP = {"name", "vllm", "compile_sizes", "splitting_ops", "store"}
_VLLM = {"model", "dtype", "max_model_len", "max_num_batched_tokens", "engine_args", "layouts"}
# process layout -> VLLM_ENABLE_V1_MULTIPROCESSING (vLLM's hash, and so its record, differs)
LAYOUTS = {"default": "1", "in-process": "0"}


@dataclass(frozen=True)
class VllmManifest:
    """A validated vLLM manifest (paths absolute)."""

    name: str
    model: Path
    dtype: str = "float32"
    max_model_len: int = 256
    max_num_batched_tokens: int | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    compile_sizes: tuple[int, ...] = ()
    splitting_ops: tuple[str, ...] | None = None
    store: Path | None = None
    path: Path | None = None
    layouts: tuple[str, ...] = ("default",)


def is_vllm_manifest(path: str | Path) -> bool:
    """Whether the YAML file at ``path`` has a top-level ``vllm`` section."""
    try:
        data = read_manifest_yaml(path)
    except ManifestError:  # unreadable: the manifest loader says why
        return False
    return isinstance(data, dict) and "vllm" in data


def load_vllm_manifest(path: str | Path) -> VllmManifest:
    """Read and validate; a bad field is a ``ManifestError`` naming the file, the field, the fix."""
    path = Path(path).resolve()
    where = str(path)
    data = read_manifest_yaml(path)
    if not isinstance(data, dict):
        raise ManifestError(where, "", "a manifest is a mapping (name, vllm, …)")

    def bad(field_: str, why: str) -> ManifestError:
        return ManifestError(where, field_, why)

    unknown = sorted(set(data) - _TOP)
    if unknown:
        raise bad(unknown[0], f"unknown field (a vLLM manifest has {', '.join(sorted(_TOP))})")
    v = data.get("vllm")
    if not isinstance(v, dict):
        raise bad("vllm", "must be a mapping with at least `model: <model directory>`")
    unknown = sorted(set(v) - _VLLM)
    if unknown:
        raise bad(f"vllm.{unknown[0]}", f"unknown field (expected {', '.join(sorted(_VLLM))}; "
                                        "other engine arguments go in vllm.engine_args)")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise bad("name", "a non-empty name is required")
    if not isinstance(v.get("model"), str):
        raise bad("vllm.model", "the model directory (a path) is required")
    model = (path.parent / v["model"]).resolve()
    if not (model / "config.json").is_file():
        raise bad("vllm.model", f"{model} has no config.json (a model directory written with "
                                "save_pretrained, or a downloaded checkpoint)")
    ints = {}
    for k in ("max_model_len", "max_num_batched_tokens"):
        if v.get(k) is not None and (not isinstance(v[k], int) or isinstance(v[k], bool) or v[k] < 1):
            raise bad(f"vllm.{k}", f"must be a positive integer, got {v[k]!r}")
        ints[k] = v.get(k)
    if not isinstance(v.get("engine_args", {}), dict):
        raise bad("vllm.engine_args", "must be a mapping of vllm.LLM keyword arguments")
    sizes = data.get("compile_sizes") or []
    if not isinstance(sizes, list) or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise bad("compile_sizes", f"must be a list of positive integers, got {sizes!r}")
    ops = data.get("splitting_ops")
    if ops is not None and (not isinstance(ops, list) or any("::" not in str(o) for o in ops)):
        raise bad("splitting_ops", "must be a list of 'namespace::op' names, or null for the defaults")
    layouts = v.get("layouts", ["default"])
    if (not isinstance(layouts, list) or not layouts
            or any(not isinstance(x, str) or x not in LAYOUTS for x in layouts)):
        raise bad("vllm.layouts", f"must be a non-empty list of {' / '.join(LAYOUTS)}, got {layouts!r}")
    store = data.get("store")
    return VllmManifest(
        name=name, model=model, dtype=str(v.get("dtype", "float32")),
        max_model_len=int(ints["max_model_len"] or 256),
        max_num_batched_tokens=ints["max_num_batched_tokens"], engine_args=dict(v.get("engine_args") or {}),
        compile_sizes=tuple(sorted(set(sizes))), splitting_ops=None if ops is None else tuple(ops),
        store=None if store is None else (path.parent / store).resolve(), path=path,
        layouts=tuple(dict.fromkeys(layouts)))


def compile_vllm(manifest: VllmManifest, store: Any, force: bool = False,
                 remote: Any = None, signer: Any = None) -> Any:
    """Run the engine once with the aotc backend into ``store`` (a fresh vLLM cache, so Dynamo
    traces and the backend is called), publish vLLM's records, push the entries, and return a
    ``CompileResult`` for the engine's graph. ``store``: the context's ``TieredStore`` (its
    remote and signing key), or a ``Store`` with ``remote`` and ``signer``
    (:class:`aotc.fleet.trust.Signer`) given here."""
    from aotc.compile.pipeline import CompileResult
    from aotc.errors import VllmError
    from aotc.fleet.tiered import TieredStore
    from aotc.vllm.generate import run_fresh

    if force:
        raise InputError("--force is not supported for a vLLM manifest: remove the entry "
                         "(`aotc gc --max-size 0` or a new store) to compile it again")
    tiered = store if isinstance(store, TieredStore) else TieredStore(store, remote, signer=signer)
    store = tiered.local
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="aotc-vllm-compile-") as tmp:
        report = Path(tmp) / "report.jsonl"
        env = dict(os.environ)
        env.update(AOTC_STORE=str(store.root), AOTC_REPORT=str(report),
                   VLLM_CACHE_ROOT=str(Path(tmp) / "vllm-cache"),
                   TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
                   AOTC_COMPILE_SIZES=",".join(str(s) for s in manifest.compile_sizes))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["AOTC_VLLM_RECORDS"] = "0"  # trace here even when a record is stored: it is rewritten
        if manifest.splitting_ops is not None:
            env["AOTC_SPLITTING_OPS"] = ",".join(manifest.splitting_ops)
        spec = {"backend": "aotc", "model": str(manifest.model), "dtype": manifest.dtype,
                "max_model_len": manifest.max_model_len,
                "max_num_batched_tokens": manifest.max_num_batched_tokens,
                "engine_args": manifest.engine_args, "prompts": [[1, 2, 3, 4]], "max_tokens": 2}
        for layout in manifest.layouts:  # one engine start each; the first one compiles
            run_fresh(spec, {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": LAYOUTS[layout]})
        lines = [json.loads(x) for x in report.read_text().splitlines()] if report.is_file() else []
        if not lines:
            raise VllmError(f"the engine ran but never called the aotc backend (is compilation "
                            f"mode 2 honoured by this vLLM?); nothing was compiled for {manifest.name}")
        graph_keys = list(dict.fromkeys(line["key"] for line in lines))
        for key in graph_keys:  # signed (when a key is set) and pushed before the records naming them
            tiered.sign(key)
            tiered.push(key, manifest.name)
        records = _keep_records(tiered, Path(env["VLLM_CACHE_ROOT"]), manifest.name, graph_keys)
    last = lines[-1]
    entry = store.get(last["key"], record=False)
    meta = entry.metadata
    hit = all(x["hit"] for x in lines)
    return CompileResult(
        key=last["key"], name=manifest.name, hit=hit, pieces=int(meta.get("pieces", 0)),
        unique_pieces=int(meta.get("unique_pieces", 0)),
        compiles=sum(int(x.get("compiles", 0)) for x in lines), traces=len(lines),
        seconds={"engine": round(time.perf_counter() - t0, 3),
                 "backend": round(sum(x["seconds"] for x in lines), 3)},
        bytes_stored=0 if hit else entry.stored_size,
        max_abs_err=meta.get("numerics", {}).get("max_abs_err"), numerics=meta.get("numerics", {}),
        store=str(store.root), shared=sum(int(x.get("shared", 0)) for x in lines),
        vllm_records=records)


def _keep_records(tiered: Any, cache_root: Path, name: str, graph_keys: list[str]) -> list[str]:
    """Publish vLLM's AOT records the run wrote (:mod:`aotc.vllm.aot_records`); a vLLM that wrote
    none (its AOT cache off) leaves new replicas tracing, said in one line."""
    from aotc.log import logger
    from aotc.vllm.aot_records import store_records, vllm_version

    keys = store_records(tiered, cache_root, name, graph_keys, vllm_version())
    if not keys:
        logger("vllm").warning("aotc: the engine saved no AOT record (VLLM_USE_AOT_COMPILE=0?): "
                               "new replicas of %s will run Dynamo at start", name)
    return keys
