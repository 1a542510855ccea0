"""The side-by-side benchmark harness runs every contender and writes a valid results file (so
the benchmark cannot rot silently). Tiny model, one fresh process per contender; no timing is
asserted, only behaviour: aotc's warm start compiles and traces nothing, torch.compile's cold
start compiles."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_harness_runs_every_contender_and_writes_results(tmp_path) -> None:
    from bench import sidebyside

    out = tmp_path / "results"
    results = sidebyside.main(["--runs", "1", "--layers", "1", "--sizes", "1", "--hidden", "64",
                               "--steady", "1,16", "--steady-iters", "2", "--no-scaling", "--warm-machine",
                               "--out", str(out)])
    saved = json.loads((out / "latest.json").read_text())
    assert saved["contenders"].keys() == set(sidebyside.CONTENDERS)
    assert saved["machine"]["cores"] and saved["machine"]["torch"]
    for name, s in saved["contenders"].items():
        assert s["ttfo_median"] > 0 and s["runs"] == 1, name
        assert set(s["steady_ms"]) == {"1", "16"} and all(v > 0 for v in s["steady_ms"].values())
        assert s["peak_rss_mb"] > 0
    c = saved["contenders"]
    assert c["aotc-warm"]["counters"]["inductor_compiles"] == 0
    steps = saved["cold_compile_breakdown"]["steps"]  # the cold compile's profile, by step
    assert steps["inductor"] > 0 and "fast-path check" in steps and "Cold compile by phase" in (
        out / "latest.md").read_text()
    assert c["aotc-warm"]["counters"]["dynamo_frames"] == 0
    assert c["aotc-cold"]["counters"]["inductor_compiles"] > 0
    assert c["tc-cold"]["counters"]["inductor_compiles"] > 0
    assert c["eager"]["counters"]["inductor_compiles"] == 0
    # the fleet contender: a fresh replica pulled the entry through the (real, loopback) S3
    # server and compiled or traced nothing; it moved exactly what the build machine pushed
    assert c["aotc-remote"]["counters"]["inductor_compiles"] == 0
    assert c["aotc-remote"]["counters"]["dynamo_frames"] == 0
    remote = saved["ratios"]["remote"]
    assert remote["pulled_bytes"] == remote["pushed_bytes"] > 0 and remote["pull_s"] > 0
    assert saved["ratios"]["aotc_loader_s"] > 0
    pair = saved["steady_pair"]  # the steady-state ratio: both warm in one process, interleaved
    assert set(pair) == {"1", "16"} and all(p["ratio"] > 0 and p["tc_ms"] > 0 for p in pair.values())
    # like for like: the compile size (16) against torch.compile's static graph, 1 dynamic
    assert pair["16"]["like"] == "static" and pair["1"]["like"] == "dynamic"
    assert saved["ratios"]["aotc_steady_over_tc_steady"] == {n: p["ratio"] for n, p in pair.items()}
    assert set(saved["targets"]) == set(results["targets"]) and len(saved["targets"]) == 7
    table = (out / "latest.md").read_text()
    for label in ("eager", "torch.compile cold", "torch.compile warm", "Mega-Cache", "aotc cold",
                  "aotc warm", "pulled from the remote", "bytes moved", "not measured"):  # 32L/2L is not measured without scaling
        assert label in table, label
