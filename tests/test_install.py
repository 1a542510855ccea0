"""aotc as users install it: the wheel and the sdist built from a copy of this checkout, the wheel
installed into a clean venv (torch and the other dependencies seen from the project's venv, no
network), and run from there in fresh processes — `aotc compile` / `aotc run`, the backend and
`aotc.precompile` → `aotc.precompiled` — with keys equal to the checkout's: a store filled by one
install hits from the other (tests/helpers/key_probe.py is the probe)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HELPERS, PYTHON, ROOT, python_env, run_cli, tiny_manifest
from tests.test_layout import MODULES

pytestmark = pytest.mark.slow

SOURCES = ("aotc", "cache", "cli", "setup.py", "pyproject.toml", "README.md")


def _module_paths() -> set[str]:
    """Every module of aotc as a path inside the installed package (``aotc/cache/store.py``)."""
    out = set()
    for name, (path, _) in MODULES.items():
        out.add(name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py"))
    return out


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """The wheel and the sdist, built (no network, no build isolation) from a copy of the
    checkout's sources, so nothing is written into the checkout."""
    tmp = tmp_path_factory.mktemp("dist")
    src, out = tmp / "src", tmp / "out"
    src.mkdir()
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / name)
    env = python_env()
    subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(src)], check=True, env=env, timeout=300, capture_output=True)
    subprocess.run([PYTHON, "-c", "import sys; from setuptools import build_meta as b; b.build_sdist(sys.argv[1])",
                    str(out)], check=True, env=env, cwd=src, timeout=300, capture_output=True)
    wheel, = out.glob("aotc-*.whl")
    sdist, = out.glob("aotc-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "tmp": tmp}


def _install(wheel: Path, venv: Path) -> Path:
    """A clean venv at ``venv`` holding only ``wheel``; the project's venv supplies the rest."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([PYTHON, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, timeout=300, capture_output=True)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # a path line, not a site dir: the project's editable aotc (a .pth finder there) stays unseen
    Path(purelib, "zz_project_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return py


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> dict[str, Any]:
    """The wheel installed into a clean venv, and a store built from it in a fresh process."""
    tmp = tmp_path_factory.mktemp("installed")
    py = _install(dist["wheel"], tmp / "somewhere" / "else" / "venv")
    work = tmp / "work"  # not the checkout: nothing importable from the cwd
    work.mkdir()
    manifest = tiny_manifest(work, "wheel-tiny")
    env = wheel_env(work)
    res = subprocess.run([str(py), str(HELPERS / "key_probe.py"), str(work / "store"), str(manifest), "none",
                          "--build"], capture_output=True, text=True, env=env, cwd=work, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"python": py, "work": work, "manifest": manifest, "store": work / "store", "env": env}


def wheel_env(work: Path) -> dict[str, str]:
    """The environment of a process of the installed wheel: nothing of the checkout on its path."""
    env = python_env()
    env.pop("PYTHONPATH", None)
    env.update(TMPDIR=str(work), HOME=str(work))
    return env


def _run(py: Path, args: list[str], inst: dict[str, Any]) -> dict[str, Any]:
    res = subprocess.run([str(py), *args], capture_output=True, text=True, env=inst["env"], cwd=inst["work"],
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_wheel_holds_every_module(dist) -> None:
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = {n for n in z.namelist() if n.endswith(".py")}
    assert sorted(_module_paths() - names) == [], "modules missing from the wheel"
    assert sorted(n for n in names - _module_paths()) == [], "files in the wheel that are no module of aotc"


def test_the_sdist_holds_every_module_and_builds_the_same_wheel(dist, tmp_path) -> None:
    with tarfile.open(dist["sdist"]) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if m.name.endswith(".py")}
    on_disk = {str(path.relative_to(ROOT)) for path, _ in MODULES.values()}
    assert sorted(on_disk - members) == [], "modules missing from the sdist"
    with tarfile.open(dist["sdist"]) as t:
        t.extractall(tmp_path, filter="data")
    unpacked, = tmp_path.glob("aotc-*")
    subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp_path / "w"), str(unpacked)], check=True, env=python_env(), timeout=300,
                   capture_output=True)
    again, = (tmp_path / "w").glob("*.whl")

    def contents(whl: Path) -> dict[str, bytes]:
        with zipfile.ZipFile(whl) as z:
            return {n: z.read(n) for n in z.namelist() if n.startswith("aotc/")}

    assert contents(again) == contents(dist["wheel"])  # same files, same bytes: the same key


def test_the_wheel_compiles_and_serves_every_front_door(installed) -> None:
    """Built by the wheel (the fixture: `aotc.compile`, the backend, `aotc.precompile`); served
    by it in a fresh process: eager's results, no compile, the precompiled call not traced."""
    got = _run(installed["python"], [str(HELPERS / "key_probe.py"), str(installed["store"]),
                                     str(installed["manifest"]), "none", "--serve"], installed)
    assert "somewhere/else/venv" in got["aotc_file"], got["aotc_file"]
    assert max(got["manifest_err"], got["backend_err"], got["precompiled_err"]) < 1e-4, got
    assert got["backend_hit"] and got["precompiled_served"] == 1 and got["precompiled_traced"] == 0, got
    assert got["counters"]["compiles"] == 0 and got["counters"]["inductor_compiles"] == 0, got["counters"]


def test_the_wheels_cli_compiles_and_runs(installed) -> None:
    aotc_cli = installed["python"].parent / "aotc"
    store, manifest = installed["work"] / "cli-store", installed["manifest"]
    for args in (["compile", str(manifest)], ["run", str(manifest), "--sizes", "1,7", "--check-eager"],
                 ["precompile", "--help"]):
        res = subprocess.run([str(aotc_cli), "--store", str(store), *args], capture_output=True, text=True,
                             env=installed["env"], cwd=installed["work"], timeout=600)
        assert res.returncode == 0, (args, res.stderr[-2000:])


def test_a_store_the_wheel_filled_hits_from_the_checkout(installed) -> None:
    """One key for both installs, every front door: the checkout finds what the wheel stored."""
    env = python_env()
    res = subprocess.run([PYTHON, str(HELPERS / "key_probe.py"), str(installed["store"]), str(installed["manifest"]),
                          "none"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert os.path.realpath(got["aotc_file"]) == str(ROOT / "aotc" / "__init__.py")
    assert {d: got[d]["hit"] for d in ("manifest", "backend", "precompiled")} == \
        {"manifest": True, "backend": True, "precompiled": True}, got


def test_the_checkouts_cli_finds_the_wheels_entry(installed) -> None:
    res = run_cli("--store", str(installed["store"]), "run", str(installed["manifest"]), "--sizes", "3")
    assert res.returncode == 0, res.stderr[-2000:]


def test_torch_finds_the_wheels_backend_by_name(installed) -> None:
    # torch.compile(model, backend="aotc") resolves the name through the entry point: the wheel's
    code = ("import json, sys, torch._dynamo; fn = torch._dynamo.lookup_backend('aotc'); "
            "print(json.dumps({'fn': fn.__module__, 'entry': sys.modules['aotc.backend.entry'].__file__}))")
    got = _run(installed["python"], ["-c", code], installed)
    assert got["fn"] == "aotc.backend.serve", got
    assert Path(got["entry"]).is_relative_to(installed["python"].parent.parent), got
