"""A model whose build changes process-wide settings: torchao's ``quantize_`` turns Inductor
options on (coordinate descent tuning, the int-mm-with-mul fusion), so the manifest door's compile
runs under them. The key names the settings the compile ran under — read once the model is built
— so that every process that has the model as the manifest builds it finds the one entry: a
server with its own quantized model, ``aotc.load`` building it, a compile and a load in one
process, ``aotc explain`` and a second ``aotc compile``. (Before: the key was read before the
build — it said the options were off — and a server with its own model missed, told to run the
compile that then said "up to date".) The factory here sets the options as torchao does, so the
test needs no torchao; tests/test_wrapper.py serves torchao's own int8 model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import AOTC_CLI, PYTHON, python_env

pytestmark = pytest.mark.slow

MANIFEST = {"name": "tuned-llama",
            "model": {"factory": "tests.fixtures.more_client_models:tuned_llama", "output": "logits"},
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": [1, "tokens"], "high": 256}],
            "max_tokens": 64, "splitting_ops": ["aten::scaled_dot_product_attention"]}

SERVE = """
import json, sys, torch, aotc
from aotc.cache import CacheMiss
from aotc.manifest import load_manifest
from aotc.model.build import make_named_inputs
manifest, store, how = sys.argv[1:4]
out = {}
if how == "servers-own-model":
    # first a model built without the settings (saved quantized weights, say): a miss naming them
    from tests.fixtures.more_client_models import tiny_llama, tuned_llama
    try:
        aotc.load(manifest, store=store, model=tiny_llama(layers=1))
    except CacheMiss as e:
        out["miss"] = str(e)
    # then the server builds (quantizes) its model itself, as the factory does
    runners = [aotc.load(manifest, store=store, model=tuned_llama())]
else:  # aotc.load builds the model; then a compile (a hit: up to date) and a load in one process
    runners = [aotc.load(manifest, store=store)]
    compiled = aotc.compile(manifest, store=store)
    assert compiled.hit and compiled.compiles == 0, compiled
    runners.append(aotc.load(manifest, store=store))
kw = make_named_inputs(load_manifest(manifest), 5, seed=5)
for runner in runners:
    with torch.no_grad():
        got, want = runner(**kw), runner.eager(**kw)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
out["keys"] = [r.key for r in runners]
print(json.dumps(out))
"""


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    res = subprocess.run([*AOTC_CLI, *args], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    return res


def test_a_build_that_turns_inductor_options_on_is_keyed_with_them_and_found_by_every_process(
        tmp_path: Path, s3) -> None:
    path = tmp_path / "tuned.yaml"
    path.write_text(yaml.safe_dump(MANIFEST))
    store = tmp_path / "store"
    env = {**python_env(), "AOTC_STORE": str(store), "AOTC_LEASE_WAIT": "30"}
    key = json.loads(_cli("compile", str(path), "--json", env=env).stdout)["key"]
    from aotc.cache import Store
    from aotc.cache.scan import scan

    # one miss for each key looked up (before the build, after it), not one more for each re-check
    # of the store under the node's lease
    assert scan(Store(store)).misses == 2

    values = Store(store).get(key).factors["inductor"]["values"]
    assert values["coordinate_descent_tuning"] is True and values["force_fuse_int_mm_with_mul"] is True, \
        "the key must name the settings the compile ran under"
    for how in ("servers-own-model", "built-by-load"):
        res = subprocess.run([PYTHON, "-c", SERVE, str(path), str(store), how], capture_output=True,
                             text=True, env=env, timeout=600)
        assert res.returncode == 0, (how, res.stderr[-3000:])
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert set(out["keys"]) == {key}, how
        if how == "servers-own-model":  # a miss that names each setting
            assert "other process-wide settings" in out["miss"], out
            assert "coordinate_descent_tuning: true -> false" in out["miss"], out
    # the server with a model built without the settings missed once; `aotc.load` building the
    # model found the entry on its second look and counted no miss for its first
    assert scan(Store(store)).misses == 3
    res = _cli("--store", str(store), "explain", str(path), env=env)
    assert ": hit, key " + key[:16] in res.stdout, res.stdout
    # a second compile (now with a signing key): found once the model is built, and signed, as
    # an entry stored before the key was set is on any hit
    from aotc.fleet.trust import generate_key

    public = generate_key(tmp_path / "signer")
    res = _cli("compile", str(path), env={**env, "AOTC_SIGNING_KEY": str(tmp_path / "signer")})
    assert "up to date" in res.stdout, res.stdout
    assert Store(store).signatures(key), "the entry found once the model was built was not signed"
    assert scan(Store(store)).misses == 3  # up to date: no miss counted (its first look was one)
    # a new node with only the remote, trusting the build's key: its first look (the settings as
    # its process has them) finds nothing there; the model built, the key it moved to is pulled
    # through — nothing compiled, one miss counted (the local tier's, which the remote served)
    url = f"s3://{s3()}/fleet"
    _cli("--store", str(store), "push", key, "--to", url, env=env)
    node = tmp_path / "node-store"
    node_env = {**env, "AOTC_STORE": str(node), "AOTC_REMOTE": url, "AOTC_TRUST_KEYS": public}
    res = subprocess.run([PYTHON, "-c", SERVE, str(path), str(node), "built-by-load"], capture_output=True,
                         text=True, env=node_env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert set(json.loads(res.stdout.strip().splitlines()[-1])["keys"]) == {key}
    assert Store(node).keys() == [key] and scan(Store(node)).misses == 1
    # `aotc pull MANIFEST` on another new node: its first ask finds nothing, the model built, the
    # moved key is pulled
    puller = tmp_path / "pull-store"
    _cli("--store", str(puller), "pull", str(path), "--from", url, "--trust", public, env=env)
    assert Store(puller).keys() == [key]
    # a manifest that patches the options its build turns on: the build moves the settings read,
    # not the key — compiled under the lease it holds, not through the moved path (which leased
    # that key again: a wait until the lease wait ran out); its pieces are the first entry's
    patched = tmp_path / "patched.yaml"
    patched.write_text(yaml.safe_dump({**MANIFEST, "inductor": {"coordinate_descent_tuning": True,
                                                                "force_fuse_int_mm_with_mul": True}}))
    misses = scan(Store(store)).misses
    res = _cli("compile", str(patched), "--json", env=env)
    assert json.loads(res.stdout)["hit"] is False and "changed process-wide settings" not in res.stderr
    assert scan(Store(store)).misses == misses + 1  # a compile is one miss
    # another manifest of the same name whose closest entry differs in the settings and more: the
    # model is built before the lease, the moved key leased and compiled with that one build (not
    # through the nested path, which says "changed process-wide settings")
    longer = tmp_path / "longer.yaml"
    longer.write_text(yaml.safe_dump({**MANIFEST, "max_tokens": 48}))
    res = _cli("compile", str(longer), "--json", env=env)
    out = json.loads(res.stdout)
    assert out["hit"] is False and out["traces"] == 1 and "changed process-wide settings" not in res.stderr
    assert scan(Store(store)).misses == misses + 2
    assert Store(store).get(out["key"]).factors["inductor"]["values"]["coordinate_descent_tuning"] is True
