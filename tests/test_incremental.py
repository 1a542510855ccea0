"""Incremental compiles: (piece, size) pairs a stored entry already holds are taken from it
(``aotc.compile.reuse``), and the store stays correct when entries share pieces. The 4-layer
model after its 2-layer sibling compiling nothing is ``test_compile.test_pieces_and_unique_compiles``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import SIZES, copy_store, python_env, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_more_size(compiled, tmp_path_factory):
    """The 2-layer manifest with one compile size added, compiled into the session store."""
    import aotc

    _tmp, store, results = compiled
    data = yaml.safe_load(Path(results[2][0]).read_text())
    data["name"] = "toy-2-one-more-size"
    data["compile_sizes"] = [*SIZES, 24]
    path = tmp_path_factory.mktemp("incremental") / "more.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, aotc.compile(path, store=store), results[2][1]


def test_adding_a_compile_size_compiles_only_that_size(compiled, one_more_size) -> None:
    from aotc._torch.inductor_facts import counters_snapshot
    from aotc.manifest import load_manifest
    from aotc.model.build import make_named_inputs

    import aotc

    _tmp, store, _results = compiled
    path, res, sibling = one_more_size
    assert not res.hit and res.key != sibling.key
    assert res.compiles == 3 and res.shared == 3 * (1 + len(SIZES))  # 3 unique pieces at size 24
    assert "24" in res.numerics["sizes"] and set(res.numerics["sizes"]) >= {str(s) for s in SIZES}
    donors = set(store.get(res.key, record=False).metadata["shared_from"])
    assert donors and donors <= {sibling.key, _results[4][1].key}  # the 2- or 4-layer entry
    before = counters_snapshot()
    runner = aotc.load(path, store=store)
    m = load_manifest(path)
    for n in (24, 5):
        inputs = make_named_inputs(m, n)
        assert (runner(**inputs) - runner.eager(**inputs)).abs().max() < 1e-4
    after = counters_snapshot()
    assert after["compiles"] == before["compiles"] and after["fast_loads"] > before["fast_loads"]


def test_verify_repair_evicts_every_entry_sharing_a_damaged_piece(compiled, one_more_size,
                                                                 tmp_path) -> None:
    from aotc.cache import Store

    _tmp, store, _results = compiled
    _path, res, sibling = one_more_size
    copy_store(store.root, tmp_path / "store")
    copy = Store(tmp_path / "store")
    mine = copy.get(res.key, record=False)
    theirs = copy.get(sibling.key, record=False)
    role = next(r for r in mine.blobs if r.startswith("artifact/") and r.endswith("/dynamic"))
    digest = mine.blobs[role].digest
    assert theirs.blobs[role].digest == digest  # one blob, two entries
    blob = copy.blob_path(digest)
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    copy.close()
    env = python_env()
    out = run_cli("--store", str(tmp_path / "store"), "verify", "--repair", "--json", env=env)
    report = json.loads(out.stdout)
    assert report["repaired"] and {res.key, sibling.key} <= set(report["bad_keys"])
    left = set(Store(tmp_path / "store").keys())
    assert res.key not in left and sibling.key not in left
    again = run_cli("--store", str(tmp_path / "store"), "verify", env=env)
    assert again.returncode == 0, again.stdout + again.stderr


def test_gc_of_one_entry_keeps_the_pieces_the_other_uses(compiled, one_more_size, tmp_path) -> None:
    from aotc.cache import Store, delete_entries

    _tmp, store, _results = compiled
    path, res, sibling = one_more_size
    copy_store(store.root, tmp_path / "store")
    copy = Store(tmp_path / "store")
    delete_entries(copy, [sibling.key])
    copy.close()
    env = python_env()
    assert run_cli("--store", str(tmp_path / "store"), "verify", env=env).returncode == 0
    run = run_cli("--store", str(tmp_path / "store"), "run", str(path), "--sizes", "1,24",
                  "--check-eager", "--json", env=env, check=True)
    assert json.loads(run.stdout)["key"] == res.key
