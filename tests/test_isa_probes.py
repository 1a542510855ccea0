"""The ISA probes and the precompiled header's early start (``aotc._torch.isa_probes``,
``aotc._torch.header_build``) and the lock around torch's process-wide state
(``aotc._torch.scoped_env.process_scope``): real Inductor, real g++."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from aotc._torch import header_build, isa_probes
from aotc._torch.inductor_facts import _config_patch
from aotc._torch.inductor_load import kernel_files


def test_a_second_probe_in_one_process_names_its_libraries_as_the_first(tmp_path: Path) -> None:
    """A probe records its outcome on Inductor's ISA instances (AVX512-BF16 …) and that flag
    enters the next probe's command, so a process that probed once used to name its probe
    libraries apart from a fresh process (and built two again in every compile's cache dir).
    The ISA state is reset around each probe: the second probe builds the same files."""
    assert isa_probes._probe_here(tmp_path / "first") is True
    assert isa_probes._probe_here(tmp_path / "second") is True
    first, second = kernel_files(tmp_path / "first"), kernel_files(tmp_path / "second")
    assert first == second
    assert isa_probes._probed_flags() == []  # left as a fresh process has it


def test_after_the_probes_naming_the_isa_compiles_nothing(tmp_path: Path) -> None:
    """What a compile does first: name the vector ISA in a cache dir seeded with the kept probe
    libraries. It must find them all (no g++ run, no new file) — on the old code two probe
    libraries were built again there."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from aotc._torch.inductor_load import in_process_isa_probes, inductor_cache_dir

    probes = isa_probes.isa_probe_files()
    seeded = tmp_path / "compile"
    isa_probes.seed_isa_probes(seeded, probes)
    before = kernel_files(seeded)
    with inductor_cache_dir(seeded), _config_patch({}), in_process_isa_probes():
        pick_vec_isa()
    assert kernel_files(seeded) == before


def test_the_predicted_isa_is_the_probed_one_and_leaves_no_state() -> None:
    """The ISA predicted from the CPU's flags (before any probe) is the one the probes name on
    this machine, flags and all; predicting leaves Inductor's ISA state as a fresh process."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    predicted = isa_probes.predicted_isa()
    assert predicted is not None  # torch 2.11-2.13 layout
    assert isa_probes._probed_flags() == []
    isa_probes.isa_probe_files()
    with _config_patch({}):
        probed = pick_vec_isa()
        assert (str(predicted), predicted.build_arch_flags()) == (str(probed), probed.build_arch_flags())


def test_a_wrong_prediction_starts_the_header_again_with_the_probed_isa(monkeypatch) -> None:
    """Where the probes name another ISA than predicted (a compiler that cannot build an
    extension), a second header build starts with their command; where they agree, one."""
    from torch._inductor.cpu_vec_isa import VecAVX2

    started: list[str] = []

    class Started:
        def join(self) -> None:
            pass

    monkeypatch.setattr(header_build, "_started", {})  # as a process that started none yet
    monkeypatch.setattr(header_build, "_start", lambda made: started.append(made[2]) or Started())
    assert header_build.start_header_build({}) is not None
    assert len(started) == 1
    started.clear()
    monkeypatch.setattr(isa_probes, "predicted_isa", lambda: VecAVX2())
    assert header_build.start_header_build({}) is not None
    assert len(started) == 2 and started[0] != started[1]
    assert "avx2" in started[0].lower() and "-mavx512f" in started[1] or not torch.cpu._is_avx512_supported()


def test_inductor_config_patches_of_two_threads_do_not_interleave() -> None:
    """``_config_patch`` restores what it saved: two threads' patches interleaved would undo each
    other's (the header's thread and a compile). The second waits for the first to end."""
    events: list[str] = []
    entered = threading.Event()

    def first() -> None:
        with _config_patch({"max_autotune": True}):
            entered.set()
            time.sleep(0.3)
            events.append("first ends")

    t = threading.Thread(target=first)
    t.start()
    entered.wait(10)
    with _config_patch({}):
        events.append("second enters")
        from torch._inductor import config

        assert config.max_autotune is False  # the first's patch is not seen, nor undone later
    t.join()
    assert events == ["first ends", "second enters"]


@pytest.mark.parametrize("flag", ["_is_avx512_bf16_supported", "_is_amx_fp16_supported"])
def test_probed_flags_are_the_instance_outcomes_only(flag: str) -> None:
    """Only outcomes set on an instance count (never a class default or a dataclass field)."""
    from torch._inductor import cpu_vec_isa as m

    isa = next(i for i in m.supported_vec_isa_list if isinstance(i, m.VecAVX512))
    isa_probes._reset_isa_state(isa_probes._isa_memos() or [])  # as a fresh process
    assert isa_probes._probed_flags() == []
    setattr(isa, flag, True)
    assert isa_probes._probed_flags() == [(isa, flag)]
    isa_probes._reset_isa_state([])
    assert isa_probes._probed_flags() == [] and getattr(isa, flag) is False  # the class default


def test_no_cpu_header_for_another_device_or_own_options(monkeypatch) -> None:
    """The CPU kernels' header is for CPU compiles with Inductor's config as aotc sets it: a CUDA
    compile, or options of the caller's own (they may change the kernels' command), start none;
    the probes still run (every compile seeds them)."""
    started: list[str] = []
    monkeypatch.setattr(header_build, "_start", lambda made: started.append(made[2]))
    assert header_build.start_header_build({}, "cuda:0") is None
    assert header_build.start_header_build({"cpp.simdlen": 8}, "cpu") is None
    assert started == [] and isa_probes.isa_probe_files() is not None


def test_one_header_build_per_command_in_a_process(monkeypatch) -> None:
    """Every graph a server's backend compiles asks for the header: the first call starts its
    build, a later one (same command) starts none and hands back the first's thread."""
    built: list[str] = []
    monkeypatch.setattr(header_build, "_started", {})
    monkeypatch.setattr(header_build, "_run", lambda build, header, cmd_line, command: built.append(cmd_line))
    first = header_build.start_header_build({})
    second = header_build.start_header_build({})
    assert first is not None and second is first
    first.join(10)
    assert len(built) == 1
