"""The store commands through CliRunner and through the installed ``aotc`` executable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from aotc.cache import Store
from aotc.cli import cli
from tests.conftest import python_env


def _fill(root: Path) -> Store:
    store = Store(root)
    store.put("a" * 64, "alpha", {"x": os.urandom(300_000)}, metadata={"pieces": 5})
    store.put("b" * 64, "beta", {"x": os.urandom(300_000), "y": b"shared"})
    return store


def run(*args: str) -> "object":
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_inspect_table_and_json(tmp_path: Path) -> None:
    _fill(tmp_path)
    res = run("--store", str(tmp_path), "inspect", "cache")
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert lines[0].split()[:3] == ["NAME", "KEY", "BLOBS"]
    assert any(l.startswith("alpha") and "a" * 12 in l for l in lines)
    assert "2 entries" in res.output and "0 warnings" in res.output
    res = run("--store", str(tmp_path), "inspect", "cache", "--json")
    data = json.loads(res.output)
    assert {e["name"] for e in data["entries"]} == {"alpha", "beta"}
    assert data["size_on_disk"] > 600_000


def test_store_location_from_env(tmp_path: Path) -> None:
    _fill(tmp_path / "envstore")
    res = CliRunner(env={"AOTC_STORE": str(tmp_path / "envstore")}).invoke(
        cli, ["inspect", "cache", "--json"], catch_exceptions=False)
    assert len(json.loads(res.output)["entries"]) == 2
    res = CliRunner(env={"AOTC_STORE": None, "XDG_CACHE_HOME": str(tmp_path / "xdg")}).invoke(
        cli, ["inspect", "cache"], catch_exceptions=False)
    assert res.exit_code == 1  # the default location, empty: named, not created by a reader
    assert str(tmp_path / "xdg" / "aotc") in res.output and "no aotc store" in res.output
    assert not (tmp_path / "xdg" / "aotc").exists()


def test_verify_exit_codes_and_repair(tmp_path: Path) -> None:
    store = _fill(tmp_path)
    assert run("--store", str(tmp_path), "verify").exit_code == 0
    entry = store.get("a" * 64, record=False)
    path = store.blob_path(entry.blobs["x"].digest)
    path.write_bytes(path.read_bytes()[:100])
    res = run("--store", str(tmp_path), "verify")
    assert res.exit_code == 1
    assert "a" * 12 in res.output and "'x'" in res.output and "1 bad entries" in res.output
    res = run("--store", str(tmp_path), "verify", "--json")
    assert res.exit_code == 1 and json.loads(res.output)["bad_keys"] == ["a" * 64]
    res = run("--store", str(tmp_path), "verify", "--repair")
    assert res.exit_code == 0 and "repaired" in res.output
    assert run("--store", str(tmp_path), "verify").exit_code == 0
    assert Store(tmp_path).keys() == ["b" * 64]


def test_gc_dry_run_then_real(tmp_path: Path) -> None:
    store = _fill(tmp_path)
    res = run("--store", str(tmp_path), "gc", "--max-size", "400K", "--dry-run", "--json",
              "--min-idle", "0")
    plan = json.loads(res.output)
    assert plan["dry_run"] and len(plan["entries"]) == 1 and plan["expected_freed_size"] > 250_000
    assert len(store.keys()) == 2
    res = run("--store", str(tmp_path), "gc", "--max-size", "400K")  # both entries just written
    assert res.exit_code == 0 and "freed" in res.output and len(store.keys()) == 2
    res = run("--store", str(tmp_path), "gc", "--max-size", "400K", "--min-idle", "0")
    assert res.exit_code == 0 and "freed" in res.output
    assert len(store.keys()) == 1
    res = run("--store", str(tmp_path), "gc", "--max-size", "ten gigs")
    assert res.exit_code == 2 and "--max-size" in res.output


def test_unusable_store_path_is_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    res = run("--store", str(blocker / "sub"), "inspect", "cache")  # a reader: names the path
    assert res.exit_code == 1
    assert res.output.startswith(f"Error: no aotc store at {blocker / 'sub'}") \
        and res.output.count("\n") == 1
    from tests.conftest import tiny_manifest

    res = run("--store", str(blocker / "sub"), "compile", str(tiny_manifest(tmp_path)))  # a writer
    assert res.exit_code == 1
    assert res.output.startswith("Error: cannot create the store") and res.output.count("\n") == 1


def test_installed_console_script(tmp_path: Path) -> None:
    exe = shutil.which("aotc", path=str(Path(sys.executable).parent)) or shutil.which("aotc")
    if exe is None:
        pytest.fail("the aotc console script is not installed (run `make install`)")
    _fill(tmp_path)
    out = subprocess.run([exe, "--store", str(tmp_path), "inspect", "cache", "--json"],
                         capture_output=True, text=True, env=python_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["entries"]) == 2
    out = subprocess.run([exe, "--store", str(tmp_path), "verify"], capture_output=True, text=True,
                         env=python_env(), timeout=60)
    assert out.returncode == 0 and "clean" in out.stdout


def test_many_warnings_are_summed_up_unless_verbose(tmp_path: Path) -> None:
    """30 entries with garbage metadata: 20 warning lines and how many more; -v shows all 30."""
    store = _fill(tmp_path)
    for i in range(30):
        store.put(f"{i:064x}", f"e{i}", {"x": b"x"})
    with store.index.write() as conn:
        conn.execute("UPDATE entries SET metadata = 'not json' WHERE name LIKE 'e%'")
    store.close()
    res = CliRunner().invoke(cli, ["--store", str(tmp_path), "inspect", "cache"],
                             catch_exceptions=False)
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 21 and warnings[-1].startswith("warning: … and 10 more"), warnings[-1]
    assert "30 warnings" in res.stdout
    res = CliRunner().invoke(cli, ["--store", str(tmp_path), "inspect", "cache", "-v"],
                             catch_exceptions=False)
    assert len([ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]) == 30
