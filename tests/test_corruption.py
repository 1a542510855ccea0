"""Suite 2 — store corruption through the real CLI: for every kind of part of a compiled entry
(a blob flipped / truncated / deleted, a kernel library replaced, the program record replaced by
a valid zstd frame of other content, garbage index rows, the index file truncated) a fresh
`aotc run` process refuses with a CorruptedCacheError (one line, exit 1, never an output),
`aotc verify` reports it, `aotc verify --repair` evicts it and the store verifies clean after."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from pathlib import Path
from typing import Callable

import pytest
import zstandard
from click.testing import CliRunner

from aotc.cache import Store
from aotc.cli import cli
from aotc.records.program import PROGRAM_ROLE, Program
from tests.conftest import AOTC_CLI, PYTHON, copy_store, python_env

pytestmark = pytest.mark.slow

Damage = Callable[[Store, str, Program], str]  # (store, key, program) -> what was damaged


def _blob(store: Store, key: str, role: str) -> Path:
    return store.blob_path(store.get(key, record=False).blobs[role].digest)


def _wrapper_role(program: Program) -> str:
    return next(a.wrapper_role for a in program.artifacts if a.wrapper_role)


def _kernel_roles(program: Program) -> list[str]:
    return sorted(program.kernel_roles.values())


def flip_wrapper_record(store: Store, key: str, program: Program) -> str:
    role = _wrapper_role(program)
    path = _blob(store, key, role)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return role


def truncate_kernel_library(store: Store, key: str, program: Program) -> str:
    role = _kernel_roles(program)[0]
    path = _blob(store, key, role)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return role


def delete_wrapper_record(store: Store, key: str, program: Program) -> str:
    role = _wrapper_role(program)
    _blob(store, key, role).unlink()
    return role


def replace_kernel_library(store: Store, key: str, program: Program) -> str:
    """Another kernel library's bytes, validly compressed: loads fine, computes the wrong thing.
    (Kernels built by one compiler run share one library: the other is one of other bytes.)"""
    entry = store.get(key, record=False)
    roles = _kernel_roles(program)
    first = roles[0]
    second = next(r for r in roles if entry.blobs[r].digest != entry.blobs[first].digest)
    other = store.read_blob(entry, second)
    _blob(store, key, first).write_bytes(zstandard.ZstdCompressor().compress(other))
    return first


def replace_program_record(store: Store, key: str, program: Program) -> str:
    """The program of ANOTHER entry (4 layers): a valid record, only its digest is wrong."""
    other_key = next(k for k in store.keys() if store.get(k, record=False).name == "toy-4")
    other = store.read_blob(store.get(other_key, record=False), PROGRAM_ROLE)
    _blob(store, key, PROGRAM_ROLE).write_bytes(zstandard.ZstdCompressor().compress(other))
    return PROGRAM_ROLE


def flip_inductor_artifact(store: Store, key: str, program: Program) -> str:
    role = program.artifacts[0].role
    path = _blob(store, key, role)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    return role


def _sql(store: Store, statement: str, *params: str) -> None:
    conn = sqlite3.connect(store.index_path)
    conn.execute(statement, params)
    conn.commit()
    conn.close()


def garbage_entry_row(store: Store, key: str, program: Program) -> str:
    _sql(store, "UPDATE entries SET factors = '{\"manifest\": [' WHERE key = ?", key)
    return "entry row"


def garbage_blob_ref(store: Store, key: str, program: Program) -> str:
    _sql(store, "UPDATE entry_blobs SET digest = '../../../../etc/passwd' WHERE key = ? AND role = ?",
         key, PROGRAM_ROLE)
    return "blob ref row"


def truncate_index_file(store: Store, key: str, program: Program) -> str:
    store.close()
    path = store.index_path
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    return "index file"


KINDS: list[tuple[Damage, dict[str, str]]] = [
    (flip_wrapper_record, {}),
    (truncate_kernel_library, {}),
    (delete_wrapper_record, {}),
    (replace_kernel_library, {}),
    (replace_program_record, {}),
    (flip_inductor_artifact, {"AOTC_LOADER": "inductor"}),  # the path that unpickles it
    (garbage_entry_row, {}),
    (garbage_blob_ref, {}),
    (truncate_index_file, {}),
]
_survived: list[str] = []


def _verify(root: Path, *extra: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, ["--store", str(root), "verify", "--json", *extra])


@pytest.mark.parametrize("damage,env_extra", KINDS, ids=[k[0].__name__ for k in KINDS])
def test_aotc_run_refuses_verify_reports_repair_evicts(compiled, tmp_path, damage, env_extra) -> None:
    _tmp, store, results = compiled
    manifest, key = results[2][0], results[2][1].key
    root = tmp_path / "store"
    copy_store(store.root, root)
    # a warm start meets the damage when it extracts the blob: the first one after it (a load
    # that finds a sound unpacked copy uses that, checked: tests/test_unpacked.py)
    shutil.rmtree(root / "store-v1" / "unpacked", ignore_errors=True)
    damaged = Store(root)
    program = Program.from_json(damaged.read_blob(damaged.get(key, record=False), PROGRAM_ROLE))
    refs = {k: {b.digest for b in damaged.get(k, record=False).blobs.values()}
            for k in damaged.keys()}
    roles = dict(damaged.get(key, record=False).blobs)
    what = damage(damaged, key, program)
    digest = roles[what].digest if what in roles and damage is not garbage_blob_ref else None
    # every entry sharing a damaged blob (kernels are deduplicated across models) is bad too
    expect_kept = set() if damage is truncate_index_file else \
        {k for k in refs if k != key and (digest is None or digest not in refs[k])}
    damaged.close()

    env = {**python_env(), **env_extra}
    run = subprocess.run([*AOTC_CLI, "--store", str(root), "run", str(manifest),
                          "--sizes", "3", "--json"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 1, (run.returncode, run.stdout[-500:], run.stderr[-2000:])
    assert run.stdout == ""  # no output at all, let alone a wrong one
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "is corrupt" in lines[0] and "Traceback" not in run.stderr, lines
    assert "aotc verify --repair" in lines[0]
    if damage in (flip_wrapper_record, garbage_entry_row):  # marked bad now: still says why
        again = subprocess.run(run.args, capture_output=True, text=True, env=env, timeout=300)
        assert again.returncode == 1 and "is corrupt" in again.stderr, again.stderr[-500:]

    found = _verify(root)
    assert found.exit_code == 1, found.output
    report = json.loads(found.output)
    assert not report["ok"] and report["problems"]
    if damage is truncate_index_file:
        assert report["index_problem"] and report["problems"][0]["kind"] == "index-corrupt"
    else:
        assert key in report["bad_keys"]

    repaired = _verify(root, "--repair")
    assert repaired.exit_code == 0, repaired.output
    after = _verify(root)
    assert after.exit_code == 0 and json.loads(after.output)["ok"], after.output
    remaining = Store(root)
    assert key not in remaining.keys()  # evicted: the next `aotc run` is a clean miss
    assert set(remaining.keys()) == expect_kept  # entries not sharing the damage are untouched
    remaining.close()
    _survived.append(f"{damage.__name__} ({what})")
    print(f"corruption suite: {len(_survived)}/{len(KINDS)} kinds refused, reported, repaired "
          f"so far: {_survived[-1]}")
