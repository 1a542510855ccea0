"""Signed entries and the trust policy: ed25519 (the ``cryptography`` package, imported only here
and only when signing or a policy is in force).

A signature covers ``Store.signing_payload(entry)``: the entry's record (key, name, factors,
metadata) and every blob's role and sha256. Blob bytes are re-hashed on every read, so a valid
signature over the digests vouches for every byte the loader will execute. With a policy — public
keys from ``AOTC_TRUST_KEYS`` (hex keys or files holding one, separated by commas or spaces) or
given explicitly — the loader checks the entry right after looking it up, before any blob is
read, unpickled or dlopen-ed, and refuses an unsigned or wrongly signed entry. Without a policy
nothing changes (digests are still verified).

Why ed25519: small keys (32 bytes, printable as 64 hex chars), deterministic signatures, fast
verification, and one well-maintained implementation in ``cryptography``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aotc.cache import Entry, Store
from aotc.errors import AotcError, TrustError
from aotc.settings import ENV, Settings, current

TRUST_ENV = ENV["trust_keys"]  # for messages: the variable is read in aotc.settings


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:  # pragma: no cover - a dependency; the message names the fix
        raise TrustError("signing needs the `cryptography` package: pip install cryptography") from e
    return ed25519


def generate_key(path: Path | str) -> str:
    """Write a new private key (32 raw bytes as hex, mode 0600) to ``path``; return the public
    key as hex. Refuses to overwrite an existing file."""
    ed = _crypto()
    path = Path(path)
    key = ed.Ed25519PrivateKey.generate()
    raw = key.private_bytes_raw().hex()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise TrustError(f"{path}: exists; choose another path (keys are never overwritten)") from None
    with os.fdopen(fd, "w") as f:
        f.write(raw + "\n")
    return key.public_key().public_bytes_raw().hex()


def _private_key(path: Path | str) -> Any:
    ed = _crypto()
    try:
        return ed.Ed25519PrivateKey.from_private_bytes(bytes.fromhex(Path(path).read_text().strip()))
    except (OSError, ValueError) as e:
        raise TrustError(f"{path}: not a signing key written by `aotc keygen` ({e})") from e


def sign_entry(store: Store, key: str, private_key_path: Path | str) -> str:
    """Sign entry ``key`` with the private key in ``private_key_path``; returns the public key."""
    private = _private_key(private_key_path)
    entry = store.get(key, record=False)
    public = private.public_key().public_bytes_raw().hex()
    store.add_signature(key, public, private.sign(store.signing_payload(entry)).hex())
    return public


def _parse_public(text: str) -> str:
    text = text.strip()
    if len(text) != 64 and Path(text).is_file():
        text = Path(text).read_text().strip()
    try:
        if len(bytes.fromhex(text)) != 32:
            raise ValueError("not 32 bytes")
    except ValueError:
        raise TrustError(f"trusted key {text[:20]!r}: expected 64 hex chars (an ed25519 public "
                         "key, as `aotc keygen` prints) or a file holding one") from None
    return text.lower()


def trust_policy(explicit: Iterable[str] = (), settings: Settings | None = None) -> frozenset[str]:
    """The trusted public keys: ``explicit`` ones plus the settings' (``AOTC_TRUST_KEYS``).
    Empty = no policy (entries are loaded whether signed or not)."""
    found = [*explicit, *(settings or current()).trust_keys]
    return frozenset(_parse_public(t) for t in found if t.strip())


def signature_state(store: Store, entry: Entry, trusted: frozenset[str]) -> str:
    """``trusted`` (a valid signature by a trusted key), ``bad-signature`` (a signature that does
    not match the entry: tampered), ``untrusted-signer`` (valid, but by no trusted key) or
    ``unsigned``."""
    return payload_state(store.signing_payload(entry), store.signatures(entry.key), trusted)


def valid_signatures(payload: bytes, sigs: dict[str, str]) -> dict[str, str]:
    """The signatures in ``sigs`` that verify against ``payload`` (no crypto import when none)."""
    if not sigs:
        return {}
    ed = _crypto()
    out = {}
    for public, sig in sigs.items():
        try:
            ed.Ed25519PublicKey.from_public_bytes(bytes.fromhex(public)).verify(bytes.fromhex(sig), payload)
            out[public] = sig
        except Exception:  # noqa: BLE001 - InvalidSignature, malformed hex or key: not valid
            continue
    return out


def payload_state(payload: bytes, sigs: dict[str, str], trusted: frozenset[str]) -> str:
    """``signature_state`` for a signing payload and its signatures held anywhere (a bundle)."""
    if not sigs:
        return "unsigned"
    valid = set(valid_signatures(payload, sigs))
    if valid & trusted:
        return "trusted"
    if len(valid) < len(sigs):
        return "bad-signature"
    return "untrusted-signer"


def enforce(store: Store, entry: Entry, trusted: frozenset[str]) -> None:
    """Raise ``TrustError`` unless ``entry`` is signed by a key in ``trusted`` (no-op when the
    policy is empty)."""
    if trusted:
        enforce_payload(store.signing_payload(entry), store.signatures(entry.key), trusted, entry)


def enforce_payload(payload: bytes, sigs: dict[str, str], trusted: frozenset[str],
                    entry: Entry) -> None:
    """``enforce`` for a payload and signatures held outside a store (a bundle being imported)."""
    if not trusted:
        return
    state = payload_state(payload, sigs, trusted)
    if state != "trusted":
        why = {"unsigned": "it is not signed",
               "bad-signature": "its signature does not match its contents (tampered?)",
               "untrusted-signer": "it is signed, but by no trusted key"}[state]
        raise TrustError(f"refusing entry {entry.key[:16]}… ({entry.name}): {why}; trusted keys "
                         f"come from {TRUST_ENV} / --trust; sign with `aotc sign {entry.key[:16]} "
                         "--key KEYFILE`")


def signature_report(store: Store, trusted: frozenset[str]) -> list[dict[str, Any]]:
    """Each entry's signature state (``signature_state``) with its signers, oldest first."""
    out = []
    for key in store.keys():
        try:
            entry = store.get(key, record=False)
        except AotcError as e:  # a corrupt row: verify reports it; here it cannot be trusted
            out.append({"key": key, "name": "?", "state": "unreadable", "signers": [],
                        "detail": str(e)})
            continue
        out.append({"key": key, "name": entry.name, "state": signature_state(store, entry, trusted),
                    "signers": sorted(store.signatures(key))})
    return out
