"""An OCI registry as a remote (:mod:`aotc.fleet.oci`) against a real registry the tests start
(Debian's docker-registry 2.8 on 127.0.0.1, the ``oci`` fixture; skipped where it is not
installed): push, dedup across entries, signed pull-through warm start in a fresh process,
``inspect cache``, the trust policy, and a hostile registry — a layer whose bytes do not match
its digest, a manifest naming a blob that is gone, a path-traversal name — refused with
nothing half-written locally."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aotc.cache import Store
from aotc.errors import RemoteError, TrustError
from aotc.fleet.oci import OciRemote
from aotc.fleet.sync import pull_entry, push_entry
from aotc.fleet.trust import TrustPolicy, generate_key, sign_entry
from tests.conftest import copy_store, python_env, run_cli

pytestmark = pytest.mark.slow
ALLOW = TrustPolicy(allow_unsigned=True)


def _local_files(store: Store) -> list[Path]:
    return [p for d in (store.blobs_dir, store.tmp_dir) for p in d.rglob("*") if p.is_file()]


def test_urls_are_checked() -> None:
    for bad in ("oci://", "oci://host", "oci://host/UPPER", "oci://ho st/repo", "oci://h/../x"):
        with pytest.raises(RemoteError, match="expected oci://host"):
            OciRemote(bad)
    assert OciRemote("oci://127.0.0.1:5000/team/models").insecure  # loopback: plain HTTP
    assert not OciRemote("oci://registry.example.com/team/models").insecure


def test_push_dedup_signed_pull_through_and_inspect(compiled, oci, tmp_path: Path) -> None:
    _tmp, store, results = compiled
    manifest, k2, k4 = results[2][0], results[2][1].key, results[4][1].key
    signed = tmp_path / "signed"
    copy_store(store.root, signed)
    build = Store(signed)
    signer = tmp_path / "ci.key"
    public = generate_key(signer)
    for k in (k2, k4):
        sign_entry(build, k, signer)
    url = oci()
    first = push_entry(build, OciRemote(url), k2)
    second = push_entry(build, OciRemote(url), k4)
    shared = {b.digest for b in build.get(k2).blobs.values()} & {b.digest for b in build.get(k4).blobs.values()}
    assert first.moved and second.moved and shared
    assert second.bytes_moved < sum(b.stored_size for b in {b.digest: b for b in build.get(k4).blobs.values()}.values())
    again = push_entry(build, OciRemote(url), k2)
    assert not again.moved and again.bytes_moved == 0

    # a replica: empty store, the registry as its remote, the build key trusted — a fresh process
    env = {**python_env(), "AOTC_TRUST_KEYS": public}
    out = run_cli("--store", str(tmp_path / "replica"), "--remote", url, "run", str(manifest),
                  "--sizes", "1,5", "--check-eager", "--json", env=env, check=True)
    run = json.loads(out.stdout)
    assert run["key"] == k2 and run["traces"] == 0 and run["compiles"] == 0 and run["pulled_bytes"] > 0
    assert public in Store(tmp_path / "replica").signatures(k2)
    listed = json.loads(run_cli("--store", url, "inspect", "cache", "--json", env=env, check=True).stdout)
    assert {e["key"] for e in listed["entries"]} == {k2, k4} and listed["warnings"] == []
    assert not any(e["bad"] for e in listed["entries"])
    checked = run_cli("--store", url, "verify", "--json", env=env)
    assert checked.returncode == 0 and json.loads(checked.stdout)["bad_keys"] == [], checked.stdout


def test_unsigned_registry_entries_are_refused_by_default(compiled, oci, tmp_path: Path) -> None:
    _tmp, store, results = compiled
    key = results[2][1].key
    url = oci()
    push_entry(store, OciRemote(url), key)
    replica = Store(tmp_path / "r")
    with pytest.raises(TrustError, match="no trusted key is set"):
        pull_entry(OciRemote(url), replica, key)
    assert replica.keys() == [] and _local_files(replica) == []
    assert pull_entry(OciRemote(url), replica, key, ALLOW).moved


def test_a_layer_whose_bytes_do_not_match_its_digest_is_refused(compiled, oci, tmp_path: Path) -> None:
    _tmp, store, results = compiled
    key = results[2][1].key
    url = oci()
    remote = OciRemote(url)
    push_entry(store, remote, key)
    layer_digest, _size = max(remote._layers.values(), key=lambda x: x[1])  # the largest layer
    data = oci.blobs / layer_digest[7:9] / layer_digest[7:] / "data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x55  # the registry serves these bytes as they are on its disk
    data.write_bytes(bytes(raw))
    replica = Store(tmp_path / "r")
    with pytest.raises(RemoteError, match="do not hash to its digest|damaged"):
        pull_entry(OciRemote(url), replica, key, ALLOW)
    assert replica.keys() == [] and _local_files(replica) == []


def test_a_manifest_naming_a_missing_blob_is_refused(compiled, oci, tmp_path: Path) -> None:
    _tmp, store, results = compiled
    key = results[2][1].key
    url = oci()
    remote = OciRemote(url)
    push_entry(store, remote, key)
    victim = next(iter(remote._layers))
    remote.delete(remote.blob_name(victim))  # the registry drops a layer the manifest names
    replica = Store(tmp_path / "r")
    with pytest.raises(RemoteError, match="missing"):
        pull_entry(OciRemote(url), replica, key, ALLOW)
    assert replica.keys() == [] and _local_files(replica) == []


def test_path_traversal_names_are_refused(compiled, oci, tmp_path: Path) -> None:
    _tmp, store, results = compiled
    key = results[2][1].key
    url = oci()
    remote = OciRemote(url)
    push_entry(store, remote, key)
    found = remote._manifest(key)
    assert found is not None
    manifest = found[0]
    manifest["layers"][0]["annotations"]["org.aotc.digest"] = "../../../../tmp/evil"
    remote._put_manifest(manifest, key)
    replica = Store(tmp_path / "r")
    with pytest.raises(RemoteError, match="not an aotc blob"):
        pull_entry(OciRemote(url), replica, key, ALLOW)
    with pytest.raises(RemoteError, match="not an aotc object name"):
        remote.get_bytes("entries/../../x.json")
    assert replica.keys() == [] and not (Path("/tmp/evil")).exists()


def test_a_registry_has_no_leases_and_says_so_once(oci, caplog) -> None:
    from aotc.fleet.lease import conditional_writes, single_flight

    remote = OciRemote(oci())
    assert not conditional_writes(remote)
    assert single_flight(remote, "ab" * 32, "toy", lambda: None, lambda: "built", 10, 10) == "built"
    lines = [r.getMessage() for r in caplog.records if "conditional writes" in r.getMessage()]
    assert len(lines) == 1 and remote.url in lines[0]
