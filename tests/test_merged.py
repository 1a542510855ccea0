"""A split CPU graph's merged program (aotc.backend.merged): compiled whole in a forked child
after the pieces serve, stored beside them, served instead of them by a later start. Real
forks, real compiles, a fresh process for the later start. Merging is off by default (AOTC_MERGE);
these tests turn it on per backend (``merge=True``)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import PYTHON, python_env

# a fresh process: the toy (2 layers, aotc::attention) through aotc.backend at two sizes
_LATER_START = """
import json, sys, torch, aotc
from aotc.models.toy_llama import build
torch.manual_seed(0)
m = build(layers=2, hidden=64, heads=4, vocab=128).eval()
be = aotc.backend(store=sys.argv[1], merge=sys.argv[2] == "1", fallback="error",
                  remote=sys.argv[3] if len(sys.argv) > 3 else None)
f = torch.compile(m, backend=be)
err = 0.0
with torch.no_grad():
    for n in (8, 5):
        ids, pos = torch.arange(n) % 128, torch.arange(n)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        err = max(err, (f(ids, pos) - m(ids, pos)).abs().max().item())
from aotc.counters import COUNTERS
from torch._dynamo.utils import counters
ind = counters["inductor"]
compiles = COUNTERS.compiles + ind.get("fxgraph_cache_miss", 0) + ind.get("fxgraph_cache_bypass", 0)
print(json.dumps({"last": be.last, "err": err, "compiles": compiles}))
"""


def _toy() -> torch.nn.Module:
    from aotc.models.toy_llama import build

    torch.manual_seed(0)
    return build(layers=2, hidden=64, heads=4, vocab=128).eval()


def _call(backend, n: int = 8) -> torch.Tensor:
    torch._dynamo.reset()  # a new trace: the backend is called again (a hit now)
    f = torch.compile(_toy(), backend=backend)
    ids, pos = torch.arange(n) % 128, torch.arange(n)
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    with torch.no_grad():
        return f(ids, pos)


def _later_start(store: Path, merge: bool, remote: str | None = None) -> dict:
    env = {**python_env(), "AOTC_ALLOW_UNSIGNED": "1"}  # (pulled entries are unsigned here)
    out = subprocess.run([PYTHON, "-c", _LATER_START, str(store), "1" if merge else "0",
                          *([remote] if remote else [])],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


@pytest.fixture(scope="module")
def merged_store(tmp_path_factory):
    """A store where the toy's graph was compiled in pieces with merge=False, then met again with
    merge=True (a hit with no merged program: the case of a store from before): (store, the
    pieces' key, the merged key, what the second call did)."""
    import aotc
    from aotc.backend.merged import merged_key

    store = tmp_path_factory.mktemp("merged") / "store"
    first = aotc.backend(store=str(store), merge=False, fallback="error")
    _call(first)
    assert first.last["hit"] is False and first.last["pieces"] > 1
    assert aotc.wait_for_merges(0)  # merge=False: no child was started
    second = aotc.backend(store=str(store), merge=True, fallback="error")
    t = time.perf_counter()
    _call(second)
    started_in = time.perf_counter() - t
    assert aotc.wait_for_merges(300)
    from aotc.cache import Store

    s = Store(store)
    (pieces,) = [e for e in map(s.get, s.keys()) if e.metadata["pieces"] > 1]
    s.close()
    yield store, pieces.key, merged_key(pieces.factors), {"last": second.last, "seconds": started_in}


@pytest.mark.slow
def test_a_hit_without_a_merged_program_compiles_one_in_the_background(merged_store) -> None:
    from aotc.cache import Store

    store, pieces_key, key, second = merged_store
    assert second["last"]["hit"] is True and "merged" not in second["last"]  # the pieces served it
    s = Store(store)
    entry = s.get(key)
    assert s.get(pieces_key).metadata["mergeable"] is True
    assert entry.metadata["pieces"] == 1 and entry.metadata["numerics"]["sizes"]
    assert entry.metadata["mergeable"] is False  # nothing split: nothing more to merge
    s.close()
    assert entry.factors["backend"]["splitting_ops"] == []


@pytest.mark.slow
def test_a_later_start_serves_the_merged_program_and_compiles_nothing(merged_store) -> None:
    store, pieces_key, key, _ = merged_store
    res = _later_start(store, merge=True)
    assert res["last"]["hit"] is True and res["last"]["key"] == pieces_key
    assert res["last"]["merged"] == key and res["compiles"] == 0 and res["err"] < 1e-4


@pytest.mark.slow
def test_merge_off_serves_the_pieces(merged_store) -> None:
    store, pieces_key, _, _ = merged_store
    res = _later_start(store, merge=False)
    assert res["last"]["hit"] is True and "merged" not in res["last"] and res["err"] < 1e-4


@pytest.mark.slow
def test_a_saved_record_loads_the_merged_program(merged_store) -> None:
    from aotc.backend.compiled import load_graph_program
    from aotc.context import Context

    store, pieces_key, _, _ = merged_store
    on = Context.from_env({"AOTC_MERGE": "1"}, store=str(store))
    assert len(load_graph_program(pieces_key, on).program.pieces) == 1
    off = Context.from_env({}, store=str(store))  # the default
    assert len(load_graph_program(pieces_key, off).program.pieces) > 1


@pytest.mark.slow
def test_a_damaged_merged_program_is_skipped_and_the_pieces_serve(merged_store, tmp_path: Path) -> None:
    import shutil

    from aotc.cache import Store

    store, pieces_key, key, _ = merged_store
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    s = Store(copy)
    path = s.blob_path(s.get(key).blobs["program"].digest)
    s.close()
    path.chmod(0o644)
    path.write_bytes(b"not zstd")
    res = _later_start(copy, merge=True)
    assert res["last"]["hit"] is True and "merged" not in res["last"] and res["err"] < 1e-4
    assert f"merged program {key[:16]}" in res["stderr"] and "the pieces serve" in res["stderr"]


@pytest.mark.slow
def test_the_merged_program_is_pushed_and_a_new_node_pulls_it_with_the_pieces(s3, tmp_path: Path) -> None:
    """The exec'd ingest pushes what it stores to the remote; a node with an empty local store
    pulls the pieces and, with them, the merged program, and serves that."""
    import aotc
    from aotc.backend.merged import merged_key
    from aotc.cache import Store

    remote = f"s3://{s3()}/fleet"
    first = aotc.backend(store=str(tmp_path / "a"), remote=remote, merge=True, fallback="error")
    _call(first)
    assert first.last["hit"] is False and first.last["pushed"] is True
    assert aotc.wait_for_merges(300)
    local = Store(tmp_path / "a")
    key = merged_key(local.get(first.last["key"]).factors)
    assert local.has(key)
    local.close()
    res = _later_start(tmp_path / "b", merge=True, remote=remote)
    assert res["last"]["pulled"] is True and res["last"]["merged"] == key, res["stderr"][-2000:]
    assert res["compiles"] == 0 and res["err"] < 1e-4


@pytest.mark.slow
def test_the_merge_child_does_not_hold_the_caller_and_a_failure_is_remembered(tmp_path: Path) -> None:
    """A real fork: the caller is back at once; the child's output goes to its log, not to the
    caller's stdout/stderr; a second asker starts none while it runs; its failure is remembered
    by the exec'd ingest; a spent lock file (MAX_ATTEMPTS) starts none."""
    code = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from aotc.backend import merge_child
from aotc.backend.given_up import failure_version
from aotc.errors import NumericMismatchError
job = merge_child.MergeJob(label="test graph", key="k" * 64, name="t", store_root=sys.argv[1],
                           tmp_dir=sys.argv[1] + "/store-v1/tmp", remote_url=None,
                           version=failure_version(None))
def build(staging):
    print("from the child", flush=True)
    time.sleep(1.5)
    raise NumericMismatchError("merged program differs from the graph run eagerly")
t = time.perf_counter()
pid = merge_child.start(job, build)
print("started", pid is not None, round(time.perf_counter() - t, 2), flush=True)
print("second", merge_child.start(job, build), flush=True)
print("running", not merge_child.wait_for_merges(0.1), flush=True)
"""
    from aotc.backend.given_up import GivenUpBefore, raise_if_given_up
    from aotc.cache import Store

    root = tmp_path / "store"
    Store(root).close()
    t = time.perf_counter()
    out = subprocess.run([PYTHON, "-c", code, str(root)], capture_output=True, text=True,
                         env=python_env(), timeout=120)
    # the caller's pipes closed when it exited, not when its child did (1.5 s later)
    assert out.returncode == 0 and time.perf_counter() - t < 10, out.stderr[-2000:]
    started, second, running = out.stdout.strip().splitlines()
    assert started.startswith("started True") and float(started.split()[2]) < 1.0
    assert second == "second None" and running == "running True"
    assert "from the child" not in out.stdout
    lock = root / "store-v1" / "tmp" / f"merge-{'k' * 32}.lock"
    deadline = time.monotonic() + 60
    store = Store(root)
    while True:  # the ingest (a fresh interpreter the child became) remembers the failure
        try:
            raise_if_given_up(store, "k" * 64)
        except GivenUpBefore as e:
            assert "differs" in str(e) and "known to repeat" in str(e)  # remembered with its class
            break
        assert time.monotonic() < deadline, lock.with_suffix(".log").read_text()[-2000:]
        time.sleep(0.2)
    store.close()
    assert lock.read_text() == "1" and not list(lock.parent.glob(f"merge-{'k' * 32}-*"))  # staging gone
    lock.write_text("2")  # MAX_ATTEMPTS spent (children killed): none starts until gc removes it
    from aotc.backend import merge_child

    job = merge_child.MergeJob("t", "k" * 64, "t", str(root), str(lock.parent), None, "v")
    assert merge_child.start(job, lambda staging: None) is None


def test_merge_is_a_setting_and_an_argument() -> None:
    import aotc
    from aotc.backend.config import BackendConfig
    from aotc.settings import Settings

    assert Settings.from_env({}).merge is False and Settings.from_env({"AOTC_MERGE": "1"}).merge is True
    assert BackendConfig().merges(Settings.from_env({})) is False  # opt-in: the child outlives its caller
    assert BackendConfig().merges(Settings.from_env({"AOTC_MERGE": "1"})) is True
    assert aotc.backend(merge=True).config.merges(Settings.from_env({"AOTC_MERGE": "0"})) is True
