"""Signed entries and the trust policy (real ed25519 via `cryptography`, real store): under a
policy the loader refuses a tampered, unsigned or untrusted-signed entry before reading any blob;
without one nothing changes; `aotc verify --signatures` reports each state."""

from __future__ import annotations

import json
import sqlite3

import pytest
from click.testing import CliRunner

import aotc
from aotc.cache import Store
from aotc.cli import cli
from aotc.fleet.trust import TrustError
from tests.conftest import copy_store

pytestmark = pytest.mark.slow


def _cli(*args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, list(args), env=env or {"AOTC_TRUST_KEYS": ""})


@pytest.fixture
def signed(compiled, tmp_path):  # type: ignore[no-untyped-def]
    """A copy of the compiled store with the toy-2 entry signed by a fresh key."""
    _tmp, store, results = compiled
    root = tmp_path / "store"
    copy_store(store.root, root)
    key_file, other_file = tmp_path / "signing.key", tmp_path / "other.key"
    public = _cli("--store", str(root), "keygen", str(key_file)).output.strip()
    other = _cli("--store", str(root), "keygen", str(other_file)).output.strip()
    k2 = results[2][1].key
    res = _cli("--store", str(root), "sign", k2[:12], "--key", str(key_file))
    assert res.exit_code == 0 and "1 entries signed" in res.output, res.output
    return root, results, k2, public, other, other_file


def test_keygen_refuses_to_overwrite(tmp_path) -> None:
    first = _cli("keygen", str(tmp_path / "k"))
    assert first.exit_code == 0 and len(first.output.strip()) == 64
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o600
    again = _cli("keygen", str(tmp_path / "k"))
    assert again.exit_code == 1 and "never overwritten" in again.output


def test_signed_entry_loads_under_policy_and_others_are_refused(signed, monkeypatch) -> None:
    root, results, k2, public, other, other_file = signed
    runner = aotc.load(results[2][0], store=root, trust=[public])  # signed by a trusted key
    assert runner.key == k2
    with pytest.raises(TrustError, match="not signed"):  # toy-4 was never signed
        aotc.load(results[4][0], store=root, trust=[public])
    with pytest.raises(TrustError, match="by no trusted key"):
        aotc.load(results[2][0], store=root, trust=[other])
    monkeypatch.setenv("AOTC_TRUST_KEYS", public)  # the policy from the environment
    with pytest.raises(TrustError, match="not signed"):
        aotc.load(results[4][0], store=root)
    monkeypatch.setenv("AOTC_TRUST_KEYS", "")
    aotc.load(results[4][0], store=root)  # no policy: unsigned entries load as before
    print("trust suite: unsigned (2 ways) and untrusted-signer entries refused: 3/3")


def test_tampered_entry_is_refused_before_any_blob_is_read(signed, monkeypatch) -> None:
    root, results, k2, public, _other, _of = signed
    store = Store(root)
    entry = store.get(k2, record=False)
    victim = next(r for r in entry.blobs if r.startswith("wrapper/") or r.startswith("artifact/"))
    donor = next(b.digest for r, b in entry.blobs.items() if r != victim and r.startswith("kernel/"))
    with sqlite3.connect(store.base / "index.sqlite") as conn:  # point a role at other bytes
        conn.execute("UPDATE entry_blobs SET digest = ? WHERE key = ? AND role = ?",
                     (donor, k2, victim))
    reads: list[str] = []  # a spy on the store's two blob readers (they still run)
    extract, read = Store.extract_blobs, Store.read_blob
    monkeypatch.setattr(Store, "extract_blobs",
                        lambda self, e, d: reads.append(e.key) or extract(self, e, d))
    monkeypatch.setattr(Store, "read_blob", lambda self, e, r: reads.append(r) or read(self, e, r))
    with pytest.raises(TrustError, match="does not match its contents"):
        aotc.load(results[2][0], store=root, trust=[public])
    assert reads == []  # refused before a single blob was read
    res = _cli("--store", str(root), "verify", "--signatures", "--trust", public, "--json")
    assert res.exit_code == 1
    states = {r["key"]: r["state"] for r in json.loads(res.output)["signatures"]}
    assert states[k2] == "bad-signature" and states[results[4][1].key] == "unsigned"
    print("trust suite: tampered entry refused before any blob read: 1/1")


def test_verify_signatures_without_policy_only_reports(signed) -> None:
    root, results, k2, public, _other, _of = signed
    res = _cli("--store", str(root), "verify", "--signatures")
    assert res.exit_code == 0, res.output
    assert f"{k2[:16]}… toy-2: untrusted-signer" in res.output and "unsigned" in res.output
    res = _cli("--store", str(root), "verify", "--signatures", "--trust", "nothex")
    assert res.exit_code == 1 and "expected 64 hex chars" in res.output


def test_can_sign_is_the_one_answer_to_whether_what_this_process_stores_passes_its_policy(tmp_path) -> None:
    """``TieredStore.can_sign``: no trusted keys required, or the signing key is one of them."""
    from aotc.fleet.tiered import TieredStore
    from aotc.fleet.trust import TrustPolicy, generate_key, load_signer

    public = generate_key(tmp_path / "k")
    other = generate_key(tmp_path / "other")
    signer = load_signer(tmp_path / "k")
    store = Store(tmp_path / "s")
    assert TieredStore(store).can_sign and TieredStore(store, signer=signer).can_sign
    trusted = TrustPolicy(keys=frozenset({public}))
    assert TieredStore(store, policy=trusted, signer=signer).can_sign
    assert not TieredStore(store, policy=trusted).can_sign
    assert not TieredStore(store, policy=TrustPolicy(keys=frozenset({other})), signer=signer).can_sign
