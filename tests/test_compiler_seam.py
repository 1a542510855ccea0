"""The compiler seam's task-result format (``aotc._torch.task_result``) — one JSON form, one
durable writer, one checking reader — and the tiered store's local tier asked alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from aotc._torch.task_result import RESULT_FILE, CompiledPiece, read_result, save_result
from tests.conftest import ROOT


def _piece(result: Path, wrapper: bool = True) -> CompiledPiece:
    (result / "kernels" / "ab").mkdir(parents=True)
    (result / "artifact.bin").write_bytes(b"artifact" * 10)
    (result / "kernels" / "ab" / "k.so").write_bytes(b"\x7fELF" + b"0" * 60)
    if wrapper:
        (result / "wrapper.json").write_text('{"code": 1}')
    return CompiledPiece(result / "artifact.bin", result / "kernels", ("ab/k.so",), 8, "ikey", 1.5,
                         result / "wrapper.json" if wrapper else None, "" if wrapper else "why not",
                         phases={"codegen": 0.5}, kernels={"built": 1, "pooled": 0})


def test_one_json_form_round_trips_relative_and_absolute(tmp_path: Path) -> None:
    c = _piece(tmp_path / "result")
    assert CompiledPiece.from_json(c.to_json()) == c  # a worker's report: absolute paths
    moved = tmp_path / "elsewhere"
    rel = c.to_json(tmp_path / "result")
    assert rel["artifact"] == "artifact.bin" and rel["kernel_root"] == "kernels"
    back = CompiledPiece.from_json(rel, moved)
    assert back.artifact == moved / "artifact.bin" and back.wrapper == moved / "wrapper.json"
    assert (back.kernel_files, back.size, back.key, back.phases) == (c.kernel_files, 8, "ikey", c.phases)


@pytest.mark.parametrize("wrapper", [True, False])
def test_a_saved_result_reads_back_resumed_and_a_file_cut_short_is_refused(tmp_path: Path,
                                                                          wrapper: bool) -> None:
    result = tmp_path / "result"
    c = _piece(result, wrapper)
    save_result(c, result, "uid0", shared_from="k" * 64 if not wrapper else None)
    got = read_result(result)
    assert got.resumed and not got.shared and got.compiled_here is False
    assert (got.artifact, got.wrapper, got.kernel_files, got.wrapper_note) == \
        (c.artifact, c.wrapper, c.kernel_files, c.wrapper_note)
    (result / "kernels" / "ab" / "k.so").write_bytes(b"\x7fELF")  # a power loss mid-write
    with pytest.raises(ValueError, match="ab/k.so is not 64 bytes"):
        read_result(result)
    with pytest.raises(FileNotFoundError):
        read_result(tmp_path / "nothing")


def test_only_the_seam_writes_or_reads_a_task_record() -> None:
    """Every path that makes a finished task (a compile, a piece taken from another entry) goes
    through ``save_result``: no other module spells the record's name."""
    spelled = []
    for path in (ROOT / "aotc").rglob("*.py"):
        if path.name == "task_result.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == RESULT_FILE:
                spelled.append(str(path.relative_to(ROOT)))
    assert spelled == []


def test_the_local_tier_alone_names_the_store_on_a_miss(store) -> None:
    from aotc.cache import CacheMiss
    from aotc.fleet.tiered import TieredStore

    tiered = TieredStore(store)
    assert not tiered.has("ab" * 32)
    with pytest.raises(CacheMiss, match=f"the store {store.root} has no entry abababab"):
        tiered.get("ab" * 32)
    with pytest.raises(CacheMiss, match="compiled elsewhere"):
        tiered.get("ab" * 32, miss_hint="compiled elsewhere")
    assert tiered.pulled_bytes == 0
