"""aotc's precompiled header for the batched kernels, how a batch is built with it, and the ISA
probes built beside it while Dynamo traces (aotc._torch.kernel_header, batch_build,
isa_probes.probe_builds): real g++ runs, real compiles.

The header is a cost moved onto an idle core; what must hold: a batch built with it (or racing
it) serves the same numbers, the key does not depend on it, nothing of it outlives the compile,
and the probes built ahead are the very libraries Inductor's own probe would build.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from aotc._torch import batch_build, isa_probes, kernel_header
from aotc._torch.kernel_header import HEAD, OUT, SRC

TEMPLATE = (f"g++ {SRC} -D X -O3 -march=native -shared -fPIC -Wall -std=c++20 -I/inc "
            f"-o {OUT} -ltorch -lgomp -L/lib")


def test_the_header_is_built_by_the_kernels_command_as_a_header_and_nothing_linked() -> None:
    argv = kernel_header._header_argv(TEMPLATE, Path("/d/head.h"), Path("/d/head.h.gch"))
    assert argv == ["g++", "-x", "c++-header", "/d/head.h", "-D", "X", "-O3", "-march=native", "-fPIC", "-Wall",
                    "-std=c++20", "-I/inc", "-o", "/d/head.h.gch"]
    assert kernel_header._header_argv(TEMPLATE.replace(SRC, "a.cpp"), Path("h"), Path("o")) is None


def test_a_batch_takes_the_header_only_when_nothing_before_its_prefix_could_change_it() -> None:
    body = ["namespace aotc_k0 {", "}"]
    assert batch_build._usable("\n".join([HEAD[0], HEAD[1], "#include <cstring>", HEAD[2], "#include <sstream>",
                                            *body]))
    assert not batch_build._usable("\n".join([HEAD[0], HEAD[1], *body]))  # no cpp_prefix.h
    assert not batch_build._usable("\n".join([HEAD[0], "#define likely(x) x", HEAD[1], HEAD[2], *body]))
    assert not batch_build._usable("\n".join([HEAD[0], HEAD[2], *body]))  # no Python.h


@pytest.fixture
def machine_tmp(tmp_path, monkeypatch):
    """A machine of its own: tempfile's dir (where aotc keeps headers and probes) and g++'s."""
    from aotc.lookup.toolchain import fingerprint

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setitem(kernel_header._state, "machine", fingerprint("cpu"))  # (keep_headers, undone)
    yield tmp_path
    kernel_header.cancel()


def _template() -> str:
    from aotc.backend.config import DEFAULT_INDUCTOR

    template = kernel_header.kernel_command_template(isa_probes.predicted_isa(), dict(DEFAULT_INDUCTOR))
    assert template is not None and SRC in template and OUT in template
    return template


@pytest.mark.slow
def test_a_cancelled_build_leaves_no_process_and_no_file(machine_tmp) -> None:
    template = _template()
    job = kernel_header.start(template)
    assert job is not None
    while not kernel_header._background and not job.done.is_set():
        job.done.wait(0.01)
    running = list(kernel_header._background)
    kernel_header.cancel()
    assert job.done.is_set() and not job.ok
    assert all(p.returncode is not None for p in running) and not kernel_header._background
    assert not (job.dir / "head.h.gch").exists()
    assert [p.name for p in job.dir.iterdir()] and not [p for p in job.dir.iterdir() if "partial" in p.name]
    assert not [p for p in machine_tmp.iterdir() if p.is_file()], "g++'s temporary files were left behind"


def _compile_tiny(tmp: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A tiny attention model through the backend, cold, in its own store: (got, want)."""
    import torch.nn.functional as F

    import aotc

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(torch.tanh(x) * 2).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.relu(self.out(y.transpose(1, 2).reshape(1, -1, 16))).sigmoid() + x

    torch.manual_seed(0)
    model, x = Attn().eval(), torch.randn(1, 5, 16)
    backend = aotc.backend(store=str(tmp / "store"), fallback="error")
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        want = model(x)
    torch._dynamo.reset()
    return got, want


@pytest.mark.slow
def test_kernels_built_with_the_header_or_racing_it_serve_the_same_numbers(machine_tmp, monkeypatch) -> None:
    template = _template()
    # racing: the header's build just started when the batch is built
    kernel_header.start(template)
    got, want = _compile_tiny(machine_tmp / "race")
    # raced, or built already if the compile reached its batch later than the header ended; never
    # "plain" (that would say the predicted command is not the one the kernels are built with)
    assert batch_build.last_build() in ("raced: with the header", "raced: without the header", "header")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # built: the batch includes it first
    job = kernel_header.start(template)  # None: built already (it won the race)
    if job is not None:
        job.done.wait(600)
        assert job.ok, "the header did not build"
    assert (kernel_header.header_dir(template) / "head.h.gch").is_file()
    got, want = _compile_tiny(machine_tmp / "built")
    # its kernels in parts, one compiler run per core (this machine has two)
    assert batch_build.last_build() == ("header, in parts" if _cores() > 1 else "header")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the header is used: g++ says so (-H marks a precompiled header it loads with "!")
    head = kernel_header.header_dir(template) / "head.h"
    src = machine_tmp / "k.cpp"
    src.write_text(f'#include "{head}"\n' + "\n".join(HEAD) + '\nextern "C" int k() { return 1; }\n')
    cmd = template.replace(SRC, str(src)).replace(OUT, str(machine_tmp / "k.so"))
    res = subprocess.run([*shlex.split(cmd), "-H"], capture_output=True, text=True, cwd=machine_tmp)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"! {head}.gch" in res.stderr, "g++ parsed the header's text instead of loading it"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def test_a_batch_is_parted_by_cores_balanced_by_source_length(monkeypatch) -> None:
    import os

    from aotc._torch.kernel_batch import _parts, sharing_cores

    sources = {"a": "x" * 900, "b": "x" * 500, "c": "x" * 450, "d": "x" * 100}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert _parts(list(sources), sources) == [["a", "d"], ["b", "c"]]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert _parts(list(sources), sources) == [["a"], ["b"], ["c"], ["d"]]  # at most one part a kernel
    assert len(_parts([f"k{i}" for i in range(9)], {f"k{i}": "x" for i in range(9)})) == 4  # at most 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert _parts(list(sources), sources) == [["a", "b", "c", "d"]]  # one core: one run
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with sharing_cores(2):  # two compiles building at once (aotc compile's workers): a core each
        assert _parts(list(sources), sources) == [["a", "b", "c", "d"]]
    assert len(_parts(list(sources), sources)) == 2


def _tiny_library_command(tmp: Path, name: str) -> tuple[str, Path]:
    src, lib = tmp / f"{name}.cpp", tmp / f"{name}.so"
    src.write_text(f'extern "C" int {name}() {{ return 1; }}\n')
    return f"g++ -shared -fPIC {src} -o {lib}", lib


@pytest.mark.parametrize("header_seconds", [100.0, 1e-9])
def test_a_plain_build_young_enough_is_killed_for_the_parts_when_the_header_ends(tmp_path, header_seconds) -> None:
    # the header just ended (it took header_seconds); the plain batch build (here: one that
    # would run for a minute) started a moment ago. A long header: the plain build has a long
    # way to go, it is killed and the parts are built with the header. A short one: the plain
    # build is near its end — it races the whole batch with the header, as before
    job = kernel_header._Job(tmp_path / "hdr")
    job.ok, job.seconds = True, header_seconds
    job.done.set()
    parts = [_tiny_library_command(tmp_path, n) for n in ("p0", "p1")]
    whole, whole_lib = _tiny_library_command(tmp_path, "whole")
    kept: list[str] = []
    t = time.perf_counter()
    in_parts = batch_build._race("sleep 60", whole, job, tmp_path, lambda: kept.append("whole"),
                                   [c for c, _ in parts])
    assert time.perf_counter() - t < 30, "the plain build was waited for"
    if header_seconds > 1:
        assert in_parts and batch_build.last_build() == "raced: the header, in parts"
        assert all(lib.is_file() for _, lib in parts) and not kept
    else:
        assert not in_parts and batch_build.last_build() == "raced: with the header"
        assert kept == ["whole"] and whole_lib.is_file()
    assert not subprocess.run(["pgrep", "-f", "^sleep 60$"], capture_output=True).stdout, "a build outlived the race"


def test_a_part_that_fails_sends_the_race_back_to_the_plain_build(tmp_path) -> None:
    job = kernel_header._Job(tmp_path / "hdr")
    job.ok, job.seconds = True, 100.0
    job.done.set()
    good, _ = _tiny_library_command(tmp_path, "p0")
    plain, plain_lib = _tiny_library_command(tmp_path, "plain")
    assert not batch_build._race(plain, "false", job, tmp_path, lambda: None, [good, "false"])
    assert batch_build.last_build() == "raced: without the header" and plain_lib.is_file()


@pytest.mark.slow
def test_probes_built_ahead_are_the_libraries_inductors_own_probe_builds(machine_tmp, monkeypatch) -> None:
    # Inductor's own probe, in a directory of its own
    own = machine_tmp / "own"
    assert isa_probes._probe_here(own)
    theirs = sorted(p.relative_to(own).as_posix() for p in own.rglob("*.so"))
    assert theirs, "Inductor's probe built nothing here"
    # ahead: recorded, built by the background thread, then only loaded
    monkeypatch.setattr(isa_probes, "_probe", {})
    made = isa_probes.probe_builds()
    assert made is not None
    builds, done = made
    kernel_header.start(None, builds, done)
    assert done.wait(600)
    from torch._inductor.cpp_builder import CppBuilder

    ran: list[object] = []
    original = CppBuilder.build
    monkeypatch.setattr(CppBuilder, "build", lambda self: ran.append(self) or original(self))
    files = isa_probes.isa_probe_files()
    assert ran == [], "the probe compiled although its libraries were built ahead"
    assert sorted(files) == theirs
    assert isa_probes.probe_builds() is None  # probed: nothing more to build


def test_dynamo_calls_around_each_compile_and_again_after_a_reset() -> None:
    from aotc._torch import dynamo

    calls: list[str] = []

    def start() -> None:
        calls.append("start")

    def end() -> None:
        calls.append("end")
        raise RuntimeError("dropped: a compile never fails for it")

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) + 1

    try:
        assert dynamo.around_compiles(start, end) and dynamo.around_compiles(start, end)  # registered once
        torch._dynamo.reset()  # clears torch's callbacks: registered again below
        assert dynamo.around_compiles(start, end)
        torch.compile(f, backend="eager")(torch.randn(3))
        assert calls == ["start", "end"]
    finally:
        handler = torch._dynamo.callback_handler
        made = dynamo._around.pop((start, end))
        handler.remove_start_callback(made[0])
        handler.remove_end_callback(made[1])


def test_nothing_is_speculated_for_a_store_that_served_this_toolchain(tmp_path, monkeypatch) -> None:
    # a warm start runs no compiler, not even ahead: a store with this toolchain's memo skips it;
    # otherwise the header is keyed by the toolchain's fingerprint (the lookup's, handed down)
    from aotc.backend import serve
    from aotc.lookup.toolchain import fingerprint
    from aotc.settings import Settings

    machine = fingerprint("cpu")
    monkeypatch.setenv("AOTC_STORE", str(tmp_path / "store"))
    monkeypatch.setattr(serve, "_STORES", set())
    assert serve._speculation_machine(Settings.from_env()) == machine
    memo = tmp_path / "store" / "store-v1" / "toolchain" / f"{machine}.json"
    memo.parent.mkdir(parents=True)
    memo.write_text("{}")
    assert serve._speculation_machine(Settings.from_env()) is None
    # a backend's own store counts too
    monkeypatch.setenv("AOTC_STORE", str(tmp_path / "other"))
    assert serve._speculation_machine(Settings.from_env()) == machine
    serve.backend(store=str(tmp_path / "store"))
    assert serve._speculation_machine(Settings.from_env()) is None


def test_a_process_handed_no_toolchain_builds_no_header(monkeypatch) -> None:
    monkeypatch.delitem(kernel_header._state, "machine", raising=False)
    assert kernel_header.header_dir(TEMPLATE) is None
    assert kernel_header.start(TEMPLATE) is None  # nothing to build, nothing before it
    monkeypatch.setitem(kernel_header._state, "machine", "a")
    one = kernel_header.header_dir(TEMPLATE)
    monkeypatch.setitem(kernel_header._state, "machine", "b")
    assert one is not None and kernel_header.header_dir(TEMPLATE) not in (None, one)  # per toolchain


def test_background_runs_stay_in_the_callers_session_so_nice_holds(tmp_path) -> None:
    # a session of its own is a scheduling autogroup of its own: the kernel shares the CPU
    # between autogroups before it reads nice values, and a nice-19 header build took half a
    # core from the caller's threads. A process group of its own (still killed whole) instead
    p = kernel_header.popen(["sleep", "30"], tmp_path, background=True)
    assert p is not None
    try:
        assert os.getsid(p.pid) == os.getsid(0), "the background run has a session of its own"
        assert os.getpgid(p.pid) == p.pid != os.getpgid(0)
        deadline = time.monotonic() + 10  # until `nice` has set it and run sleep
        while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[16] != "19":
            assert time.monotonic() < deadline, "not at the lowest priority"
            time.sleep(0.01)
    finally:
        kernel_header.kill(p)
    assert p.returncode is not None


_LOOKUP_CHILD = """
import json, sys, torch, torch._dynamo
from aotc._torch import kernel_header
import aotc.backend.serve  # an import alone starts nothing
before = bool(kernel_header._jobs) or bool(kernel_header._threads)
torch._dynamo.lookup_backend("aotc")  # what torch.compile(model, backend="aotc") does first
print(json.dumps({"before": before, "jobs": len(kernel_header._jobs), "threads": len(kernel_header._threads)}))
"""


@pytest.mark.slow
def test_torchs_lookup_of_the_backend_starts_the_header_a_plain_import_does_not(tmp_path) -> None:
    # the entry point torch loads for backend="aotc" is imported at the torch.compile call, ahead
    # of Dynamo's start callback (at the 0.5B bench model the eager prefill runs in between)
    import importlib.metadata
    import json

    from tests.conftest import PYTHON, python_env

    (ep,) = [e for e in importlib.metadata.entry_points(group="torch_dynamo_backends") if e.name == "aotc"]
    assert ep.value == "aotc.backend.entry:aotc_backend"
    if torch.cuda.is_available():
        pytest.skip("nothing is speculated on a machine with CUDA")
    for d in ("store", "tmp", "ind"):
        (tmp_path / d).mkdir()
    env = {**python_env(), "AOTC_STORE": str(tmp_path / "store"), "TMPDIR": str(tmp_path / "tmp"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
    res = subprocess.run([PYTHON, "-c", _LOOKUP_CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"before": False, "jobs": 1, "threads": 1}, got
    assert not [p for p in (tmp_path / "tmp").rglob("*.partial")], "a partial header left behind at exit"


def test_the_parts_runs_are_used_to_collect_the_compiles_garbage(tmp_path) -> None:
    # the compilers take the cores: the compile's garbage is collected meanwhile, not after the
    # call in the caller's time (aotc.gc_pause.collect_in_wait)
    import gc

    from aotc import gc_pause

    parts = [_tiny_library_command(tmp_path, n) for n in ("p0", "p1")]
    with gc_pause.gc_paused():
        for _ in range(gc_pause.WORTH_COLLECTING + 10_000):
            d: dict[str, object] = {}
            d["self"] = d
        assert batch_build._build_parts([c for c, _ in parts], tmp_path)
        assert gc.get_count()[0] < 1000, "the parts' wait collected nothing"
    assert all(lib.is_file() for _, lib in parts)
