"""The store keeps signatures with their entries (issue 33, holes 1, 2 and 9): a signed ``put``
makes the entry and its signature visible in one transaction; a put of the content a key already
holds keeps the held record and its signatures; the events table stays bounded. Real sqlite, real
zstd, real ed25519 (``cryptography``), real threads; nothing is mocked."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Callable

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from aotc.cache import Store, plan_gc, scan, verify


def key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def signer() -> tuple[str, Callable[[bytes], tuple[str, str]]]:
    """A fresh ed25519 key: (public key hex, sign function as ``Store.put`` takes it)."""
    private = Ed25519PrivateKey.generate()
    public = private.public_key().public_bytes_raw().hex()
    return public, lambda payload: (public, private.sign(payload).hex())


def valid(public: str, signature: str, payload: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public)).verify(bytes.fromhex(signature), payload)
        return True
    except Exception:  # InvalidSignature, a malformed key or signature
        return False


def assert_signed_by(store: Store, k: str, publics: set[str]) -> None:
    sigs = store.signatures(k)
    assert set(sigs) == publics, sigs
    payload = Store.signing_payload(store.get(k, record=False))
    assert all(valid(p, s, payload) for p, s in sigs.items())


def test_a_signed_put_stores_the_entry_and_its_valid_signature_together(store: Store) -> None:
    public, sign = signer()
    seen: list[bytes] = []

    def recording(payload: bytes) -> tuple[str, str]:
        seen.append(payload)
        return sign(payload)

    entry = store.put(key("s"), "signed", {"a": b"alpha", "b": b"beta"}, factors={"f": [1, (2, 3)]},
                      metadata={"m": "x"}, sign=recording)
    assert seen == [Store.signing_payload(store.get(key("s"), record=False))]  # the stored entry's
    assert entry == store.get(key("s"), record=False)  # returned as stored
    assert_signed_by(store, key("s"), {public})


def test_a_sign_that_raises_leaves_nothing_visible(store: Store) -> None:
    def broken(payload: bytes) -> tuple[str, str]:
        raise RuntimeError("the signing key is gone")

    with pytest.raises(RuntimeError, match="signing key is gone"):
        store.put(key("n"), "never", {"a": b"never seen"}, sign=broken)
    assert store.keys() == [] and not store.has(key("n"))
    assert store.index.query("SELECT COUNT(*) AS n FROM signatures")[0]["n"] == 0
    gc = plan_gc(store)
    assert gc.orphan_blobs  # the published blob is an orphan...
    gc.execute()
    assert not list(store.blobs_dir.rglob("*/*")) and verify(store).ok  # ...and gc removes it

    # over a held entry (other content, kept by another signer): the held entry stays, signed
    public, sign = signer()
    store.put(key("n"), "held", {"a": b"held"}, sign=sign)
    with pytest.raises(RuntimeError):
        store.put(key("n"), "other", {"a": b"other content"}, sign=broken)
    assert store.get(key("n"), record=False).name == "held"
    assert_signed_by(store, key("n"), {public})


def test_a_reader_never_sees_a_signed_put_unsigned(store: Store) -> None:
    """Another connection polls while keys are put (new, re-put with the same content, replaced
    by other content): no snapshot ever holds an entry without a signature."""
    _public, sign = signer()
    done = threading.Event()
    unsigned: list[str] = []
    polls = [0]

    def poll() -> None:
        conn = sqlite3.connect(store.index_path, timeout=30, isolation_level=None)
        try:
            while not done.is_set():
                rows = conn.execute("SELECT key FROM entries WHERE key NOT IN"
                                    " (SELECT key FROM signatures)").fetchall()
                unsigned.extend(r[0] for r in rows)
                polls[0] += 1
        finally:
            conn.close()

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for i in range(40):
            k = key(f"k{i % 8}")
            store.put(k, f"n{i}", {"x": f"content {i % 3}".encode(), "y": b"shared"}, sign=sign)
    finally:
        done.set()
        reader.join()
    assert polls[0] > 0 and unsigned == []


def sign_held(store: Store, k: str, sign: Callable[[bytes], tuple[str, str]]) -> None:
    """Sign the entry held under ``k`` after its put (as ``aotc sign`` or a pull does)."""
    store.add_signature(k, *sign(Store.signing_payload(store.get(k, record=False))))


def test_a_second_put_of_the_same_content_keeps_the_held_entry_and_its_signatures(store: Store) -> None:
    first, sign_first = signer()
    blobs = {"a": b"the same bytes", "b": b"twice"}
    store.put(key("k"), "compiled", blobs, factors={"f": 1}, metadata={"seconds": 1.5})
    sign_held(store, key("k"), sign_first)
    held = store.get(key("k"), record=False)

    # a second compile of the key (other timings) or a pull of it: same blobs, unsigned put
    again = store.put(key("k"), "compiled again", dict(blobs), factors={"f": 1}, metadata={"seconds": 9.0})
    assert store.signatures(key("k")) != {}, "the held entry's signature was dropped"
    assert (again.name, again.metadata) == ("compiled", {"seconds": 1.5})  # the held record...
    assert again == store.get(key("k"), record=False)  # ...returned as stored
    assert again.created == held.created and again.last_used >= held.last_used
    assert_signed_by(store, key("k"), {first})  # still valid over the same payload


def test_a_signers_put_of_held_content_adds_its_signature_over_the_held_record(store: Store) -> None:
    first, sign_first = signer()
    second, sign_second = signer()
    blobs = {"a": b"the same bytes"}
    store.put(key("k"), "compiled", blobs, metadata={"seconds": 1.5}, sign=sign_first)
    store.put(key("k"), "pulled", dict(blobs), metadata={"other": True}, sign=sign_second)
    assert store.get(key("k"), record=False).name == "compiled"
    assert_signed_by(store, key("k"), {first, second})
    store.put(key("k"), "again", dict(blobs), sign=sign_first)  # a signer that has signed it
    assert_signed_by(store, key("k"), {first, second})


def test_a_put_of_other_content_drops_the_old_signatures(store: Store) -> None:
    first, sign_first = signer()
    second, sign_second = signer()
    store.put(key("k"), "old", {"a": b"old bytes"})
    sign_held(store, key("k"), sign_first)
    store.put(key("k"), "new", {"a": b"new bytes"})  # unsigned, other content
    assert store.get(key("k"), record=False).name == "new"
    assert store.signatures(key("k")) == {}

    store.put(key("k"), "old", {"a": b"old bytes"}, sign=sign_first)
    store.put(key("k"), "newer", {"a": b"old bytes", "extra": b"a role more"}, sign=sign_second)
    assert store.get(key("k"), record=False).name == "newer"
    assert_signed_by(store, key("k"), {second})  # only the new content's signer


def test_a_bad_entry_is_replaced_even_by_the_same_content(store: Store) -> None:
    _public, sign = signer()
    store.put(key("k"), "damaged", {"a": b"bytes"})
    sign_held(store, key("k"), sign)
    assert store.mark_bad(key("k"), "found damaged")
    fresh = store.put(key("k"), "repaired", {"a": b"bytes"})
    assert fresh.name == "repaired" and store.has(key("k"))
    assert store.signatures(key("k")) == {}


def test_many_gets_do_not_grow_the_events_table_past_its_cap(store: Store) -> None:
    from aotc.cache import events

    store.put(key("hot"), "hot", {"a": b"a warm start reads me"})
    gets = events.EVENTS_CAP + 3 * events.TRIM_EVERY
    for _ in range(gets):
        store.get(key("hot"))
    rows = store.index.query("SELECT COUNT(*) AS n FROM events")[0]["n"]
    assert rows <= events.EVENTS_CAP + events.TRIM_EVERY, rows
    s = scan(store)
    assert (s.hits, s.misses) == (gets, 0)  # trimmed rows are still counted
    assert store.get(key("hot"), record=False).hits == gets


def test_gc_trims_an_events_table_grown_before_the_cap(store: Store) -> None:
    from aotc.cache import events

    store.put(key("k"), "k", {"a": b"x"})
    old = 3 * events.EVENTS_CAP  # a store that recorded hits and misses before the cap existed
    with store.index.write() as conn:
        conn.executemany("INSERT INTO events (time, key, kind, detail) VALUES (0, ?, ?, NULL)",
                         [(key("k"), "hit" if i % 3 else "miss") for i in range(old)])
    before = scan(store)
    plan_gc(store).execute()
    assert store.index.query("SELECT COUNT(*) AS n FROM events")[0]["n"] <= events.EVENTS_CAP
    after = scan(store)
    assert (after.hits, after.misses) == (before.hits, before.misses) == (old - old // 3, old // 3)


def test_signatures_made_elsewhere_arrive_with_the_entry(store: Store) -> None:
    """A pull or a bundle import hands ``put`` the signatures it verified: they are written in
    the entry's own transaction (a replica under a policy never sees the pulled entry unsigned);
    over a held record whose payload differs they would not verify, so they are not added."""
    public, sign = signer()
    staging = Store(store.root.parent / "elsewhere", create=True)
    made = staging.put(key("p"), "pulled", {"a": b"alpha"}, metadata={"m": 1})
    sig = sign(Store.signing_payload(made))[1]
    entry = store.put(key("p"), "pulled", {"a": b"alpha"}, metadata={"m": 1}, signatures={public: sig})
    assert entry.key == key("p")
    assert_signed_by(store, key("p"), {public})
    other_public, other_sign = signer()
    changed = staging.put(key("p"), "pulled", {"a": b"alpha"}, metadata={"m": 2})  # same blobs
    other = other_sign(Store.signing_payload(changed))[1]
    store.put(key("p"), "pulled", {"a": b"alpha"}, metadata={"m": 2}, signatures={other_public: other})
    assert_signed_by(store, key("p"), {public})  # the held record kept; the other payload's not added
