"""Trust holes a review found (issue 33), each closed with a test that failed before:

1. a bad ``AOTC_SIGNING_KEY`` is noticed before any work — the CLI compile and the backend both
   stop at once and store nothing (before: 37 s of compile, then an entry stored *unsigned* that
   the next compile called "up to date");
4. ``aotc.load(key=…)`` checks that the entry was built for this machine's toolchain, as the
   backend's saved records do (before: it loaded whatever the key named).

(Holes 2 and 9 are in tests/test_store_signing.py, 3 in tests/test_inductor_key.py, 5 and 6 in
tests/test_composition.py and tests/test_wrapper.py, 7 in tests/test_backend.py, 8 in
tests/test_lease_race.py.)
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch

from tests.conftest import copy_store, python_env, run_cli, tiny_manifest


def test_a_bad_signing_key_stops_a_compile_before_any_work(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-key"
    bad.write_text("this is not an ed25519 key\n")
    manifest = tiny_manifest(tmp_path)
    env = {**python_env(), "AOTC_SIGNING_KEY": str(bad), "AOTC_STORE": str(tmp_path / "store")}
    res = run_cli("compile", str(manifest), env=env, timeout=120)
    assert res.returncode != 0
    assert "not a signing key" in res.stderr and str(bad) in res.stderr, res.stderr[-2000:]
    assert "trace" not in res.stderr.lower()  # nothing was traced, let alone compiled
    rows = _entries(tmp_path / "store")
    assert rows == []  # nothing stored, signed or not: the next compile is no "up to date"


def test_a_bad_signing_key_stops_the_backend_before_compiling(tmp_path: Path, monkeypatch) -> None:
    import aotc
    from aotc.counters import COUNTERS
    from aotc.errors import TrustError

    bad = tmp_path / "not-a-key"
    bad.write_text("garbage\n")
    monkeypatch.setenv("AOTC_SIGNING_KEY", str(bad))
    fn = torch.compile(lambda x: torch.relu(x) * 5,
                       backend=aotc.backend(store=str(tmp_path / "store"), fallback="error"))
    before = COUNTERS.compiles
    with pytest.raises(Exception) as e:
        fn(torch.ones(3))
    torch._dynamo.reset()
    assert isinstance(e.value.__cause__ or e.value, TrustError) or "not a signing key" in str(e.value)
    assert COUNTERS.compiles == before
    assert _entries(tmp_path / "store") == []


def test_load_by_key_refuses_an_entry_built_for_another_machine(compiled, tmp_path: Path) -> None:
    import aotc
    from aotc.errors import LoadError
    from aotc.manifest import load_manifest
    from aotc.model.build import build_model

    _tmp, store, results = compiled
    manifest, result = results[2][0], results[2][1]
    copy_store(store.root, tmp_path / "store")
    model = build_model(load_manifest(manifest))
    runner = aotc.load(key=result.key, model=model, store=tmp_path / "store")  # built here: loads
    assert runner.program.name == "toy-2"
    index = tmp_path / "store" / "store-v1" / "index.sqlite"
    with sqlite3.connect(index) as db:  # the same entry, as if built with another CPU and torch
        (factors,) = db.execute("SELECT factors FROM entries WHERE key = ?", (result.key,)).fetchone()
        f = json.loads(factors)
        f["toolchain"] = {**f["toolchain"], "torch": "0.0.0-elsewhere", "cpu_isa": "elsewhere"}
        db.execute("UPDATE entries SET factors = ? WHERE key = ?", (json.dumps(f), result.key))
    with pytest.raises(LoadError, match="built for another machine"):
        aotc.load(key=result.key, model=model, store=tmp_path / "store")


def test_load_takes_a_manifest_or_a_key_never_a_guess(tmp_path: Path) -> None:
    """``aotc.load`` of a key and of a manifest are two explicit paths: a 64-hex string is a
    manifest path like any other string (not told apart by its length)."""
    import aotc
    from aotc.errors import AotcError, LoadError

    with pytest.raises(LoadError, match="model="):
        aotc.load(key="ab" * 32, store=tmp_path / "s")
    with pytest.raises(LoadError, match="not both"):
        aotc.load(tmp_path / "m.yaml", key="ab" * 32, model=torch.nn.Linear(1, 1))
    with pytest.raises(AotcError, match="ab" * 32):  # a path that does not exist, said as such
        aotc.load("ab" * 32, store=tmp_path / "s")


def _entries(root: Path) -> list[str]:
    index = root / "store-v1" / "index.sqlite"
    if not index.exists():
        return []
    with sqlite3.connect(index) as db:
        return [k for (k,) in db.execute("SELECT key FROM entries")]


def test_signatures_of_another_record_are_never_added_to_held_content(tmp_path: Path) -> None:
    """A bundle (or a pull) of content this store holds already, under another record (a second
    build of one key: other timings in its metadata), brings signatures that do not cover the
    record held here: they are not added (they would read as tampered under a policy)."""
    from aotc.cache import Store
    from aotc.fleet.bundle import export_entry, import_bundle
    from aotc.fleet.trust import TrustPolicy, generate_key, payload_state, sign_entry

    from aotc.records.key import compute_key

    factors = {"graph": {"what": "a test entry"}}
    k = compute_key(factors)  # a bundle's record is checked: its key is the hash of its factors
    public = generate_key(tmp_path / "signer")
    built = Store(tmp_path / "built", create=True)
    built.put(k, "e", {"a": b"alpha"}, factors=factors, metadata={"seconds": 1.0})
    sign_entry(built, k, tmp_path / "signer")
    export_entry(built, k, tmp_path / "e.aotc")
    here = Store(tmp_path / "here", create=True)
    here.put(k, "e", {"a": b"alpha"}, factors=factors, metadata={"seconds": 2.0})  # same blobs, another record
    import_bundle(here, tmp_path / "e.aotc", TrustPolicy(frozenset({public})))
    held = here.get(k, record=False)
    assert payload_state(Store.signing_payload(held), here.signatures(k),
                         TrustPolicy(frozenset({public}))) == "unsigned"  # not "bad-signature"
