"""Malformed manifest FILES through the real CLI (tests/data/bad_manifests/).

Every file must be refused by ``aotc --store TMP compile FILE`` with exit code 2 and exactly one
``Error:`` line that contains the text its ``# expect: <substring>`` first line names (binary and
empty files, which cannot hold a comment, are listed in ``NO_COMMENT``); no traceback, and nothing
stored. They fail at manifest validation or model building, never reach compilation, so the whole
module is fast. ``test_summary`` prints ``bad manifests: N tried, N refused cleanly``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from aotc.cache import Store
from aotc.cli import cli
from tests.conftest import AOTC_CLI, python_env

DATA = Path(__file__).resolve().parent / "data" / "bad_manifests"
EXPECT = b"# expect: "

# Files that cannot carry a "# expect:" comment line: what their error must contain.
NO_COMMENT = {
    "07-empty.yaml": "the file is empty",
    "09-binary.bin": "not UTF-8 text",
    "10-nul-bytes.yaml": "invalid YAML",
}

# Also run through a real interpreter (``python -m aotc.cli``), progress on: the YAML bomb and the
# deep nesting guard against hangs and RecursionError, the factory case exercises model building.
SUBPROCESS = ("11-yaml-bomb.yaml", "13-yaml-deep-nesting.yaml",
              "52-factory-module-unimportable.yaml")

PROGRESS_LINE = re.compile(r"^\[\s*\d+\.\d+s\] ")  # aotc.progress phase lines ("[  0.0s] build: ...")

CASES = sorted(p.name for p in DATA.iterdir() if p.is_file())


def expected(name: str) -> str:
    if name in NO_COMMENT:
        return NO_COMMENT[name]
    first = (DATA / name).read_bytes().split(b"\n", 1)[0]
    assert first.startswith(EXPECT), f"{name}: the first line must be '# expect: <substring>'"
    want = first[len(EXPECT):].decode("utf-8").strip()
    assert want, f"{name}: empty '# expect:'"
    return want


def assert_nothing_stored(store_dir: Path) -> None:
    if not store_dir.exists():
        return  # a manifest error is raised before the store is opened
    store = Store(store_dir)
    try:
        assert store.keys() == []
    finally:
        store.close()


# torch's own log lines (glog style: "W1202 12:08:02.483000 PID file.py:140] …"), such as the
# CUDA build of torch 2.11 saying it found no CUDA runtime on a CPU machine: not aotc's output
_TORCH_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")


def assert_one_error_line(name: str, text: str) -> None:
    lines = [ln for ln in text.splitlines() if not _TORCH_LOG.match(ln)]
    assert len(lines) == 1, f"{name}: expected one line, got {len(lines)}:\n{text}"
    line = lines[0]
    assert line.startswith("Error: "), f"{name}: {line!r}"
    want = expected(name)
    assert want in line, f"{name}: {want!r} not in {line!r}"


def refuse_in_process(name: str, tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    # -q: no progress lines, so the whole output must be the one error line.
    result = CliRunner().invoke(cli, ["--store", str(store_dir), "compile", "-q", str(DATA / name)],
                                env={"AOTC_STORE": None})
    # CliRunner swallows uncaught exceptions into result.exception: a clean refusal is SystemExit.
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{name}: uncaught {type(result.exception).__name__}: {result.exception}")
    assert "Traceback" not in result.output, f"{name}:\n{result.output}"
    assert result.exit_code == 2, f"{name}: exit {result.exit_code}:\n{result.output}"
    assert result.stdout == "", f"{name}: stdout {result.stdout!r}"
    assert result.output == result.stderr  # click >= 8.2 mixes stderr into output
    assert_one_error_line(name, result.output)
    assert_nothing_stored(store_dir)


def test_enough_cases() -> None:
    assert len(CASES) >= 32, CASES
    assert set(NO_COMMENT) <= set(CASES) and set(SUBPROCESS) <= set(CASES)
    for name in CASES:
        expected(name)


@pytest.mark.parametrize("name", CASES)
def test_bad_manifest_cli(name: str, tmp_path: Path) -> None:
    refuse_in_process(name, tmp_path)


@pytest.mark.parametrize("name", SUBPROCESS)
def test_bad_manifest_subprocess(name: str, tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    proc = subprocess.run(
        [*AOTC_CLI, "--store", str(store_dir), "compile", str(DATA / name)],
        capture_output=True, text=True, env=python_env(), cwd=tmp_path, timeout=120)
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both, f"{name}:\n{both}"
    assert proc.returncode == 2, f"{name}: exit {proc.returncode}:\n{both}"
    assert proc.stdout == "", f"{name}: stdout {proc.stdout!r}"
    # Progress is on here: phase lines may come first (e.g. "build"); then one error line.
    assert_one_error_line(name, "\n".join(ln for ln in proc.stderr.splitlines()
                                          if not PROGRESS_LINE.match(ln)))
    assert proc.stderr.splitlines()[-1].startswith("Error: ")
    assert_nothing_stored(store_dir)
