"""The remote store against a real S3-compatible server (moto's standalone server on 127.0.0.1,
started by the ``s3`` fixture): push, pull, pull-through warm start in a fresh process, zero-byte
re-push, damaged remote bytes refused, concurrent and interrupted pushers, trust, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from aotc.cache import Store
from aotc.cli import cli
from aotc.fleet.remote import RemoteError, S3Remote
from aotc.fleet.remote_scan import scan_remote, verify_remote
from aotc.fleet.sync import pull_entry, push_entry
from aotc.fleet.trust import TrustPolicy
from tests.conftest import AOTC_CLI, PYTHON, aotc_warnings, copy_store, python_env, run_cli

pytestmark = pytest.mark.slow
ALLOW = TrustPolicy(allow_unsigned=True)  # the explicit opt-out: these tests are not about trust


@pytest.fixture(autouse=True)
def _unsigned_allowed(monkeypatch) -> None:
    """Entries crossing machines need a trusted signature by default; the tests here are about
    transport, so they opt out (AOTC_ALLOW_UNSIGNED=1) — but the trust tests, which clear it."""
    monkeypatch.setenv("AOTC_ALLOW_UNSIGNED", "1")


def _aotc(*args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
    """``aotc ARGS`` in a fresh process."""
    res = run_cli(*args, timeout=timeout, check=check)
    return res


def _digests(store: Store, key: str) -> set[str]:
    return {b.digest for b in store.get(key, record=False).blobs.values()}


def _local_files(store: Store) -> list[Path]:
    return [p for d in (store.blobs_dir, store.tmp_dir) for p in d.rglob("*") if p.is_file()]


def test_push_then_pull_through_warm_start_in_a_fresh_process(compiled, s3, tmp_path: Path) -> None:
    _tmp, store, results = compiled
    manifest, key = results[2][0], results[2][1].key
    url = f"s3://{s3()}/team/models"
    pushed = json.loads(_aotc("--store", str(store.root), "push", key[:12], "--to", url, "--json").stdout)
    (entry,) = pushed["entries"]
    assert entry["moved"] and entry["blobs_moved"] == entry["blobs"] == len(_digests(store, key))
    assert pushed["bytes_moved"] > 0

    # A replica: empty local store, the remote configured. Its first start pulls, verified.
    replica = tmp_path / "replica"
    run = ["--store", str(replica), "--remote", url, "run", str(manifest), "--sizes", "1,3,7",
           "--check-eager", "--json"]
    first = json.loads(_aotc(*run).stdout)
    assert first["key"] == key and first["traces"] == 0 and first["compiles"] == 0
    assert first["pulled_bytes"] == pushed["bytes_moved"]
    assert "pull" in first["phases"] and first["max_abs_err"] < 1e-4
    assert all(s["ok"] for s in first["sizes"].values())
    second = json.loads(_aotc(*run).stdout)  # the local copy now: nothing moves
    assert second["pulled_bytes"] == 0 and "pull" not in second["phases"]
    assert Store(replica).keys() == [key]

    # `aotc pull` by manifest into another empty store; then by key prefix: already there.
    other = tmp_path / "other"
    pulled = json.loads(_aotc("--store", str(other), "pull", str(manifest), "--from", url,
                              "--json").stdout)
    assert pulled["key"] == key and pulled["moved"] and pulled["bytes_moved"] == pushed["bytes_moved"]
    again = json.loads(_aotc("--store", str(other), "pull", key[:10], "--from", url, "--json").stdout)
    assert not again["moved"] and again["bytes_moved"] == 0
    listed = json.loads(_aotc("--store", url, "inspect", "cache", "--json").stdout)
    assert [e["key"] for e in listed["entries"]] == [key] and listed["warnings"] == []


def test_repush_uploads_nothing_and_shared_blobs_go_once(compiled, s3) -> None:
    _tmp, store, results = compiled
    k2, k4 = results[2][1].key, results[4][1].key
    remote = S3Remote(f"s3://{s3()}", s3.endpoint)
    first = push_entry(store, remote, k2)
    assert first.moved and first.blobs_moved == len(_digests(store, k2))
    again = push_entry(store, remote, k2)
    assert (again.moved, again.blobs_moved, again.bytes_moved) == (False, 0, 0)
    second = push_entry(store, remote, k4)  # only the blobs the remote lacks
    assert second.blobs_moved == len(_digests(store, k4) - _digests(store, k2))
    # A record lost (say, deleted by hand): pushing again writes it, every blob is a HEAD hit.
    remote.delete(remote.entry_name(k4))
    redo = push_entry(store, remote, k4)
    assert redo.moved and redo.bytes_moved == 0
    assert {e.key for e in scan_remote(remote).entries} == {k2, k4}


def test_damaged_remote_blob_is_refused_then_repaired(compiled, s3, tmp_path: Path) -> None:
    _tmp, store, results = compiled
    manifest, key = results[2][0], results[2][1].key
    bucket = s3()
    url = f"s3://{bucket}/p"
    remote = S3Remote(url, s3.endpoint)
    push_entry(store, remote, key)
    entry = store.get(key, record=False)
    victim = max(entry.blobs.values(), key=lambda b: b.size).digest  # a kernel library
    name = remote.root + remote.blob_name(victim)
    raw = bytearray(s3.client.get_object(Bucket=bucket, Key=name)["Body"].read())
    raw[len(raw) // 2] ^= 0x55
    s3.client.put_object(Bucket=bucket, Key=name, Body=bytes(raw))

    replica = Store(tmp_path / "replica")
    with pytest.raises(RemoteError, match=f"blob {victim[:16]}.*damaged.*nothing was pulled"):
        pull_entry(remote, replica, key, ALLOW)
    assert replica.keys() == [] and _local_files(replica) == []
    # The warm-start path refuses it the same way: one line, exit 1, nothing on stdout.
    res = CliRunner().invoke(cli, ["--store", str(tmp_path / "r2"), "--remote", url, "run",
                                   str(manifest), "--sizes", "1"])
    assert res.exit_code == 1 and "damaged" in res.output and isinstance(res.exception, SystemExit)
    assert Store(tmp_path / "r2").keys() == []

    res = CliRunner().invoke(cli, ["--store", url, "verify"])
    assert res.exit_code == 1 and victim[:16] in res.output
    res = CliRunner().invoke(cli, ["--store", url, "verify", "--repair", "--json"])
    report = json.loads(res.output)
    assert res.exit_code == 0 and report["bad_keys"] == [key]
    assert remote.head(remote.blob_name(victim)) is None and remote.head(remote.entry_name(key)) is None
    fixed = push_entry(store, remote, key)  # a good store pushes it again: only that blob moves
    assert fixed.blobs_moved == 1
    assert verify_remote(remote).ok
    assert pull_entry(remote, replica, key, ALLOW).moved and replica.keys() == [key]


def _watch_records(remote: S3Remote, procs: list[subprocess.Popen]) -> int:
    """While ``procs`` run: every record visible must name only blobs already on the server.
    Returns how many times a record was seen."""
    seen = 0
    while any(p.poll() is None for p in procs):
        for obj in remote.list("entries/"):
            raw = remote.get_bytes(obj.name)
            if raw is None:
                continue
            seen += 1
            for b in json.loads(raw)["blobs"].values():
                assert remote.head(remote.blob_name(b["digest"])) is not None, "record before blob"
        time.sleep(0.02)
    return seen


def test_two_concurrent_pushers_of_one_key(compiled, s3, tmp_path: Path) -> None:
    """Two build machines push the same key at once — two different builds of it (the second's
    program blob differs), each signed by the CI key. Exactly one record wins; every blob it
    names is on the server whenever it is visible; the signatures there verify against it."""
    from aotc.fleet.trust import generate_key, sign_entry

    _tmp, store, results = compiled
    key = results[4][1].key
    signer = tmp_path / "ci.key"
    public = generate_key(signer)
    roots = [tmp_path / "build-a", tmp_path / "build-b"]
    for root in roots:
        copy_store(store.root, root)
    b = Store(roots[1])
    held = b.get(key, record=False)
    blobs = {r: b.read_blob(held, r) for r in held.blobs}
    blobs["program"] = blobs["program"] + b" "  # another build: same key, other bytes
    b.put(key, held.name, blobs, factors=held.factors, metadata=held.metadata)
    for root in roots:
        sign_entry(Store(root), key, signer)
    url = f"s3://{s3()}/shared"
    remote = S3Remote(url, s3.endpoint)
    procs = [subprocess.Popen([*AOTC_CLI, "--store", str(root), "push", key,
                               "--to", url, "--json"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=python_env())
             for root in roots]
    seen = _watch_records(remote, procs)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _o, e in outs]
    pushed = [json.loads(o)["entries"][0] for o, _e in outs]
    print(f"record seen {seen} times while both pushed; moved: {[p['moved'] for p in pushed]}")
    assert sorted(p["moved"] for p in pushed) == [False, True]
    loser = next(p for p in pushed if not p["moved"])
    assert "another build" in loser["note"]
    assert [o.name for o in remote.list("entries/")] == [f"entries/{key}.json"]
    assert verify_remote(remote).ok
    replica = Store(tmp_path / "replica")
    assert pull_entry(remote, replica, key, trusted=TrustPolicy(frozenset({public}))).moved
    winner = roots[[p["moved"] for p in pushed].index(True)]
    assert _digests(replica, key) == _digests(Store(winner), key)


def test_interrupted_push_never_publishes_a_partial_entry(compiled, s3) -> None:
    _tmp, store, results = compiled
    key = results["hf"][1].key
    url = f"s3://{s3()}"
    remote = S3Remote(url, s3.endpoint)
    proc = subprocess.Popen([*AOTC_CLI, "--store", str(store.root), "push", key,
                             "--to", url, "-q"], env=python_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not any(True for _ in remote.list("blobs/")) and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    blobs_before = {o.name for o in remote.list("blobs/")}
    records = [o.name for o in remote.list("entries/")]
    total = len(_digests(store, key))
    print(f"push killed with {len(blobs_before)} of {total} blobs uploaded, record "
          f"{'written' if records else 'not written'}")
    if records:  # it finished before the kill landed: then everything is there
        assert len(blobs_before) == total
    else:
        assert 0 < len(blobs_before) <= total
    resumed = push_entry(store, remote, key)
    assert resumed.blobs_moved == (0 if records else total - len(blobs_before))
    assert verify_remote(remote).ok and [e.key for e in scan_remote(remote).entries] == [key]


def test_trust_policy_applies_to_pulls(compiled, s3, tmp_path: Path, monkeypatch) -> None:
    from aotc.fleet.trust import TrustError, generate_key, sign_entry

    monkeypatch.delenv("AOTC_ALLOW_UNSIGNED")

    _tmp, store, results = compiled
    k2, k4 = results[2][1].key, results[4][1].key
    signer = tmp_path / "signer.key"
    public = generate_key(signer)
    signed_store = tmp_path / "signed"
    copy_store(store.root, signed_store)
    local = Store(signed_store)
    sign_entry(local, k2, signer)
    remote = S3Remote(f"s3://{s3()}", s3.endpoint)
    push_entry(local, remote, k2)
    push_entry(local, remote, k4)  # unsigned

    replica = Store(tmp_path / "replica")
    assert pull_entry(remote, replica, k2, trusted=TrustPolicy(frozenset({public}))).moved
    assert replica.signatures(k2) == local.signatures(k2)
    with pytest.raises(TrustError):
        pull_entry(remote, replica, k4, trusted=TrustPolicy(frozenset({public})))
    assert replica.keys() == [k2]
    # Secure by default: with no key at all, an unsigned entry from a remote is refused, the
    # fix named; the explicit opt-out lets it in (and stores no signature).
    with pytest.raises(TrustError, match="no trusted key is set.*AOTC_ALLOW_UNSIGNED=1"):
        pull_entry(remote, replica, k4)
    assert replica.keys() == [k2]
    # A forged signature object beside a remote entry is refused, never stored — even with the
    # opt-out (it accepts unsigned entries, not tampered ones).
    remote.put(remote.signature_name(k4, public), b"00" * 64)
    for policy in (TrustPolicy(frozenset({public})), ALLOW):
        with pytest.raises(TrustError, match="does not match its contents"):
            pull_entry(remote, replica, k4, trusted=policy)
    remote.delete(remote.signature_name(k4, public))
    assert pull_entry(remote, replica, k4, ALLOW).moved and replica.signatures(k4) == {}


def test_damaged_remote_record_and_cli_errors(compiled, s3, tmp_path: Path) -> None:
    _tmp, store, results = compiled
    key = results[2][1].key
    bucket = s3()
    url = f"s3://{bucket}"
    remote = S3Remote(url, s3.endpoint)
    push_entry(store, remote, key)
    s3.client.put_object(Bucket=bucket, Key=remote.root + remote.entry_name(key), Body=b"{not json")
    local = str(tmp_path / "local")
    runner = CliRunner()

    def err(*args: str) -> str:
        res = runner.invoke(cli, list(args))
        assert res.exit_code != 0 and isinstance(res.exception, SystemExit), res.output
        assert len(res.output.strip().splitlines()) == 1, res.output
        return res.output

    assert "record of" in err("--store", local, "pull", key, "--from", url) \
        and "damaged" in err("--store", local, "pull", key, "--from", url)
    res = runner.invoke(cli, ["--store", url, "inspect", "cache"])
    assert res.exit_code == 0 and "[BAD]" in res.output
    fixed = push_entry(store, remote, key)  # a damaged record is replaced by a push
    assert fixed.moved and pull_entry(remote, Store(local), key, ALLOW).moved

    # Junk beside an entry never blocks it: an oversized "signature" object is ignored.
    remote.put(f"signatures/{key}/" + "ab" * 32, b"0" * 5000)
    assert pull_entry(remote, Store(tmp_path / "l2"), key, ALLOW).moved
    # A blob padded past the size its record gives (zstd skippable frames decompress to the
    # same bytes) is refused before it is read in full.
    victim = next(iter(_digests(store, key)))
    name = remote.root + remote.blob_name(victim)
    raw = s3.client.get_object(Bucket=bucket, Key=name)["Body"].read()
    skippable = (0x184D2A50).to_bytes(4, "little") + (1 << 20).to_bytes(4, "little") + bytes(1 << 20)
    s3.client.put_object(Bucket=bucket, Key=name, Body=raw + skippable)
    assert "damaged" in err("--store", str(tmp_path / "l3"), "pull", key, "--from", url, "-q")
    assert Store(tmp_path / "l3").keys() == []
    res = runner.invoke(cli, ["--store", url, "verify", "--json"])
    assert res.exit_code == 1 and json.loads(res.output)["bad_keys"] == [key]
    # A record far larger than any aotc writes: listed as damaged, removed by repair.
    s3.client.put_object(Bucket=bucket, Key=remote.root + remote.entry_name("cd" * 32),
                         Body=b" " * ((16 << 20) + 1))
    res = runner.invoke(cli, ["--store", url, "inspect", "cache", "--json"])
    assert res.exit_code == 0 and any(e["bad"] for e in json.loads(res.output)["entries"])
    res = runner.invoke(cli, ["--store", url, "verify", "--repair", "--json"])
    assert res.exit_code == 0 and set(json.loads(res.output)["bad_keys"]) == {key, "cd" * 32}
    assert [o.name for o in remote.list("entries/")] == []

    assert "needs a remote store" in err("--store", local, "push")
    assert "no valid bucket" in err("--store", local, "push", "--to", "s3://")
    assert "does not exist" in err("--store", local, "pull", key, "--from", "s3://no-such-bucket")
    assert "cannot reach" in err("--endpoint-url", "http://127.0.0.1:9", "--store", local,
                                 "pull", key, "--from", url)
    assert "works on a local store" in err("--store", url, "gc")
    assert "no stored entries match" in err("--store", local, "pull", "ab" * 32, "--from", url)


def test_compile_with_a_remote_store_publishes(compiled, s3) -> None:
    """``--store s3://…`` with ``AOTC_STORE`` a directory: compile (a hit here) then push."""
    _tmp, store, results = compiled
    manifest, key = results[2][0], results[2][1].key
    url = f"s3://{s3()}/ci"
    res = CliRunner(env={"AOTC_STORE": str(store.root)}).invoke(
        cli, ["--store", url, "compile", str(manifest), "--json", "-q"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["key"] == key and out["push"]["blobs_moved"] == len(_digests(store, key))
    assert [e.key for e in scan_remote(S3Remote(url, s3.endpoint)).entries] == [key]


def test_a_remote_aotc_store_is_not_a_directory(monkeypatch, tmp_path: Path) -> None:
    """``AOTC_STORE=s3://…``: the Python API and the CLI treat it as the remote, cached by the
    default directory — never as a local path named ``s3:``."""
    from aotc.cli.common import AppContext
    from aotc.settings import Settings
    from aotc.lookup.stores import split_store

    env = {"AOTC_STORE": "s3://bucket/prefix", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert Settings.from_env(env).default_store_path() == tmp_path / "xdg" / "aotc"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AOTC_REMOTE", raising=False)
    settings = Settings.from_env()  # read once, at the entry point
    store, remote = split_store(None, None, settings)
    assert store is None and remote.url == "s3://bucket/prefix"
    app = AppContext(None, settings=settings)
    assert app.store_is_remote and app.store_path == tmp_path / "xdg" / "aotc"
    assert app.remote().url == "s3://bucket/prefix"


def test_secure_by_default_across_machines(compiled, s3, tmp_path: Path, monkeypatch) -> None:
    """An unsigned entry from a remote: a warm start refuses it in one line naming the fix; the
    opt-out loads it (said once); AOTC_SIGNING_KEY makes `push` sign, and a replica trusting
    that key loads it with no opt-out."""
    from aotc.fleet.trust import generate_key

    monkeypatch.delenv("AOTC_ALLOW_UNSIGNED")
    _tmp, store, results = compiled
    manifest, key = results[2][0], results[2][1].key
    url = f"s3://{s3()}/plain"
    push_entry(store, S3Remote(url, s3.endpoint), key)
    run = ["--store", str(tmp_path / "r1"), "--remote", url, "run", str(manifest), "--sizes", "3"]
    refused = run_cli(*run)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert "none signed by a trusted key" in refused.stderr and "AOTC_ALLOW_UNSIGNED=1" in refused.stderr
    assert Store(tmp_path / "r1").keys() == []  # nothing pulled
    allowed = run_cli(*run, "--allow-unsigned", "--json")
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["pulled_bytes"] > 0
    said = [ln for ln in allowed.stderr.splitlines() if "AOTC_ALLOW_UNSIGNED" in ln]
    assert len(said) == 1 and url in said[0]

    signer = tmp_path / "ci.key"
    public = generate_key(signer)
    signed_url = f"s3://{s3()}/signed"
    env = {**python_env(), "AOTC_SIGNING_KEY": str(signer)}
    run_cli("--store", str(store.root), "push", key, "--to", signed_url, env=env, check=True)
    replica = ["--store", str(tmp_path / "r2"), "--remote", signed_url, "run", str(manifest),
               "--sizes", "3", "--json"]
    loaded = run_cli(*replica, env={**python_env(), "AOTC_TRUST_KEYS": public}, check=True)
    assert json.loads(loaded.stdout)["key"] == key and "AOTC_ALLOW_UNSIGNED" not in loaded.stderr
    assert public in Store(tmp_path / "r2").signatures(key)


def test_a_backend_replica_without_keys_compiles_locally_instead(s3, tmp_path: Path, monkeypatch,
                                                               caplog) -> None:
    """A graph pushed unsigned by one process; a fresh replica with no keys refuses the remote
    entry with one warning line and compiles the graph itself — the server never dies of it."""
    import torch

    import aotc

    monkeypatch.delenv("AOTC_ALLOW_UNSIGNED")
    url = f"s3://{s3()}/graphs"

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x) * 3 + 1

    x = torch.randn(5, 8)
    built = torch.compile(fn, backend=aotc.backend(store=str(tmp_path / "builder"), remote=url))
    assert torch.allclose(built(x), fn(x))
    torch._dynamo.reset()
    caplog.clear()
    replica = torch.compile(fn, backend=aotc.backend(store=str(tmp_path / "replica"), remote=url))
    assert torch.allclose(replica(x), fn(x))
    torch._dynamo.reset()
    lines = [ln for ln in aotc_warnings(caplog) if "no trusted key is set" in ln]
    assert len(lines) == 1 and url in lines[0] and "here" in lines[0]  # one line: refused, built here
    assert len(Store(tmp_path / "replica").keys()) == 1  # compiled and stored here, unsigned


def test_remotes_are_built_from_settings_never_from_the_environment(s3, monkeypatch) -> None:
    """``AOTC_S3_ENDPOINT`` / ``AOTC_REMOTE`` are read once at an entry point into ``Settings``;
    ``make_remote`` / ``open_remote`` take them from there, and ``S3Remote`` from its arguments
    (the ``s3`` fixture has set AOTC_S3_ENDPOINT: the constructor ignores it)."""
    from aotc.fleet.remote import make_remote, open_remote
    from aotc.fleet.remote_api import Remote
    from aotc.settings import Settings

    assert S3Remote("s3://b/p").endpoint_url is None  # boto3's own configuration decides
    made = make_remote("s3://b/p", Settings(s3_endpoint=s3.endpoint))
    assert isinstance(made, S3Remote) and isinstance(made, Remote) and made.endpoint_url == s3.endpoint
    assert make_remote("s3://b/p", Settings(s3_endpoint=s3.endpoint), "http://other:1").endpoint_url == "http://other:1"
    monkeypatch.setenv("AOTC_REMOTE", "s3://from-env/x")
    assert open_remote(None, Settings()) is None  # the settings', not the environment's
    opened = open_remote(None, Settings(remote="s3://b/q", s3_endpoint=s3.endpoint))
    assert opened is not None and opened.url == "s3://b/q"
    bucket = s3()
    remote = make_remote(f"s3://{bucket}/p", Settings.from_env())  # what an entry point does
    assert remote.put("x", b"1") and remote.get_bytes("x") == b"1"
    with pytest.raises(RemoteError, match="not a remote store URL"):
        make_remote("/some/dir", Settings())
