"""A precompiled function across machines (a real S3-compatible server, fresh processes): built and
signed on one, pushed; another machine with an empty store pulls it through and serves with no
trace under a policy trusting the builder's key; a machine trusting another key refuses it at the
lookup — nothing of it is pulled, so nothing is unpickled — and traces instead (still the right
answer)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, python_env

pytestmark = pytest.mark.slow

_CHILD = '''import json, sys, torch, aotc
from tests.fixtures.precompile_models import Scaled
from aotc._torch.inductor_facts import counters_snapshot
m, x = Scaled(), torch.ones(2, 16)
with torch.no_grad():
    p = aotc.precompile(m, [(x,)]) if sys.argv[1] == "build" else aotc.precompiled(m, precompile_missing=False)
    err = float((p(x) - m(x)).abs().max())
c = counters_snapshot()
print(json.dumps({"key": p.key, "served": p.served, "traced": p.traced, "err": err,
                  "graphs": c["graphs_captured"]}))
'''


def _child(tmp: Path, mode: str, env: dict[str, str]) -> dict:
    script = tmp / "child.py"
    script.write_text(_CHILD)
    res = subprocess.run([PYTHON, str(script), mode], capture_output=True, text=True,
                         env={**python_env(), **env}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "stderr": res.stderr}


def test_pulled_through_and_served_with_no_trace_only_under_a_trusting_policy(s3, tmp_path: Path) -> None:
    from aotc.fleet.trust import generate_key

    remote = f"s3://{s3()}/aotc"
    builder, stranger = generate_key(tmp_path / "ci.key"), generate_key(tmp_path / "other.key")
    base = {"AOTC_REMOTE": remote, "AOTC_LOG": "info"}
    built = _child(tmp_path, "build", {**base, "AOTC_STORE": str(tmp_path / "ci"),
                                       "AOTC_SIGNING_KEY": str(tmp_path / "ci.key")})
    assert built["key"] and built["served"] == 1
    replica = _child(tmp_path, "load", {**base, "AOTC_STORE": str(tmp_path / "replica"), "AOTC_TRUST_KEYS": builder})
    assert replica["key"] == built["key"] and replica["served"] == 1 and replica["traced"] == 0, replica
    assert replica["graphs"] == 0 and replica["err"] < 1e-5, replica
    refused = _child(tmp_path, "load", {**base, "AOTC_STORE": str(tmp_path / "wary"), "AOTC_TRUST_KEYS": stranger,
                                        "AOTC_SIGNING_KEY": str(tmp_path / "other.key")})
    assert refused["key"] is None and refused["served"] == 0 and refused["traced"] == 1, refused
    assert refused["err"] < 1e-5 and "TrustError" in refused["stderr"], refused["stderr"][-2000:]
    from aotc.cache import Store

    pulled = [r for r in Store(tmp_path / "wary").entry_rows() if '"precompiled"' in r["metadata"]]
    assert pulled == []
