"""Signed entries and the trust policy: ed25519 (the ``cryptography`` package, imported only here
and only when signing or a policy is in force).

A signature covers ``Store.signing_payload(entry)``: the entry's record (key, name, factors,
metadata) and every blob's role and sha256. Blob bytes are re-hashed on every read, so a valid
signature over the digests vouches for every byte the loader will execute.

Secure by default, as Nix treats what a substituter brings in: an entry that crosses a machine
boundary — a pull, a pull-through, a bundle import — is checked there, before any blob is
fetched, and needs a valid signature by a trusted key (``AOTC_TRUST_KEYS``: hex keys or files
holding one, separated by commas or spaces; or given explicitly) unless the user opts out
(``AOTC_ALLOW_UNSIGNED=1`` / ``--allow-unsigned``, said once per source on the ``aotc`` logger).
A signature that does not match its entry (tampered) is refused even then. What this machine
compiled itself loads without any key. With trusted keys set, the loader also checks every entry
it loads, local ones included, before any blob is read, unpickled or dlopen-ed — so a node that
must run only what CI signed says so with the keys alone. ``AOTC_SIGNING_KEY`` (a key file from
``aotc keygen``) makes a compile, the backend and a push sign what they store: the key is read
(:func:`load_signer`) where the journey starts, before any work, and the signature is written
in the same transaction as the entry (``Store.put(..., sign=)``), so no entry is ever visible
unsigned. The policy (:class:`TrustPolicy`) comes from the operator only — ``AOTC_TRUST_KEYS``,
``--trust``, ``trust=`` — never from data such as a saved record.

Without a policy that requires signatures (trusted keys, no opt-out), the local store's index is
the authority on what an entry's code is, so a store someone else could write is refused before
any entry is handed out (:func:`enforce_store`, ssh's ``StrictModes``): its root, ``store-v1/``,
the index and the blob, unpacked and staging directories must be owned by this user or root and
not writable by group or others (:mod:`aotc.cache.permissions`). A read-only, root-owned shared
mount passes; with trusted keys set the signatures protect the code and the check is skipped.

Why ed25519: small keys (32 bytes, printable as 64 hex chars), deterministic signatures, fast
verification, and one well-maintained implementation in ``cryptography``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotc.cache import Entry, Store
from aotc.cache.permissions import UnsafePath, unsafe_paths
from aotc.errors import AotcError, TrustError, UnsafeStoreError
from aotc.log import logger
from aotc.settings import ENV, Settings

TRUST_ENV = ENV["trust_keys"]  # for messages: the variable is read in aotc.settings
UNSIGNED_ENV = ENV["allow_unsigned"]
_WARNED: set[str] = set()  # sources whose unsigned entries were let in, said once each
_SAFE_STORES: weakref.WeakSet[Store] = weakref.WeakSet()  # stores found safe: checked once per open


@dataclass(frozen=True)
class TrustPolicy:
    """The operator's trust policy: the trusted public keys (hex; empty = no keys) and whether
    unsigned entries may cross a machine boundary (``allow_unsigned``, the explicit opt-out).
    Built at an entry point from the operator's settings and arguments only — never from data
    (a saved record, an entry) — and checked with :meth:`check`."""

    keys: frozenset[str] = frozenset()
    allow_unsigned: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", frozenset(self.keys))

    @property
    def requires_signatures(self) -> bool:
        """Whether every entry loaded here needs a trusted signature, local ones included
        (trusted keys, and no ``allow_unsigned`` opt-out)."""
        return bool(self.keys) and not self.allow_unsigned

    def state(self, payload: bytes, sigs: dict[str, str]) -> str:
        """``trusted``, ``bad-signature``, ``untrusted-signer`` or ``unsigned`` (:func:`payload_state`)."""
        return payload_state(payload, sigs, self)

    def check(self, entry: Entry, sigs: dict[str, str], crossing: str | None = None) -> None:
        """Raise ``TrustError`` unless ``entry`` with signatures ``sigs`` may be used here
        (:func:`enforce_payload`): ``crossing`` names where it comes from when it crosses a
        machine boundary (a remote URL, a bundle)."""
        enforce_payload(Store.signing_payload(entry), sigs, self, entry, crossing)


NO_KEYS = TrustPolicy()  # the default policy: no trusted keys; unsigned entries refused when crossing


@dataclass(frozen=True)
class Signer:
    """A private signing key, read (and checked) once where a journey starts: ``sign(payload)``
    gives ``(public key hex, signature hex)`` — what ``Store.put(..., sign=)`` takes."""

    path: str
    public: str
    _private: Any = field(repr=False, compare=False)

    def sign(self, payload: bytes) -> tuple[str, str]:
        """The signature of ``payload`` by this key."""
        return self.public, self._private.sign(payload).hex()


def load_signer(path: str | Path | None) -> Signer | None:
    """The signer of the key file at ``path`` (``AOTC_SIGNING_KEY``); None without a path. A
    file that is not a key raises ``TrustError`` at once — before any work is done."""
    if not path:
        return None
    private = _private_key(path)
    return Signer(str(path), _public_hex(private), private)


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
    signer = load_signer(private_key_path)
    if signer is None:
        raise TrustError("signing needs a key file: `aotc keygen FILE` writes one")
    return _add_signature(store, key, signer)


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


def trust_policy(explicit: Iterable[str] | TrustPolicy = (), settings: Settings | None = None,
                 allow_unsigned: bool = False) -> TrustPolicy:
    """The operator's policy: ``explicit`` keys (or a ``TrustPolicy``, whose keys and opt-out
    are kept) plus the ``settings``' (``AOTC_TRUST_KEYS``, ``AOTC_ALLOW_UNSIGNED``; None: the
    arguments alone) and the opt-out ``allow_unsigned``."""
    if isinstance(explicit, TrustPolicy):
        keys = list(explicit.keys)
    else:
        keys = [explicit] if isinstance(explicit, str) else list(explicit)
    allow = allow_unsigned or (isinstance(explicit, TrustPolicy) and explicit.allow_unsigned)
    if settings is not None:
        keys += settings.trust_keys
        allow = allow or settings.allow_unsigned
    return TrustPolicy(frozenset(_parse_public(t) for t in keys if t.strip()), bool(allow))


def public_key_of(private_key_path: Path | str) -> str:
    """The public key (hex) of the private key in that file."""
    return _public_hex(_private_key(private_key_path))


def _public_hex(private: Any) -> str:
    return str(private.public_key().public_bytes_raw().hex())


def sign_with(store: Store, key: str, signer: Signer | None) -> str | None:
    """Sign entry ``key`` with ``signer`` unless it has signed it already; the signer's public
    key, or None without a signer (an entry put with ``sign=`` is signed already)."""
    if signer is None:
        return None
    if signer.public not in store.signatures(key):
        _add_signature(store, key, signer)
    return signer.public


def _add_signature(store: Store, key: str, signer: Signer) -> str:
    """``signer``'s signature of entry ``key`` as held now; its public key."""
    entry = store.get(key, record=False)
    store.add_signature(key, *signer.sign(store.signing_payload(entry)))
    return signer.public


def signature_state(store: Store, entry: Entry, trusted: TrustPolicy) -> str:
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


def payload_state(payload: bytes, sigs: dict[str, str], trusted: TrustPolicy) -> str:
    """``signature_state`` for a signing payload and its signatures held anywhere (a bundle)."""
    if not sigs:
        return "unsigned"
    valid = set(valid_signatures(payload, sigs))
    if valid & trusted.keys:
        return "trusted"
    if len(valid) < len(sigs):
        return "bad-signature"
    return "untrusted-signer"


def enforce(store: Store, entry: Entry, trusted: TrustPolicy) -> None:
    """Raise ``TrustError`` unless ``entry`` (in the local store) may be loaded: the store must
    be safe to load code from (:func:`enforce_store`) and, with trusted keys, the entry signed by
    one; no signature check without trusted keys (what is local was compiled here, or was
    checked when it crossed into this store). ``allow_unsigned`` lets unsigned entries load."""
    enforce_store(store, trusted)
    if trusted.keys:
        trusted.check(entry, store.signatures(entry.key))


def enforce_store(store: Store, trusted: TrustPolicy) -> None:
    """Raise ``UnsafeStoreError`` (one line: the path, its mode, the fix) when code is about to
    be loaded from ``store`` but someone other than this user or root could write it
    (:func:`aotc.cache.permissions.unsafe_paths`) — unless ``trusted`` requires signatures, which
    then protect the code. A few ``stat`` calls, once per opened store that passes."""
    if trusted.requires_signatures or store in _SAFE_STORES:
        return
    bad = unsafe_paths(store.root)
    if not bad:
        _SAFE_STORES.add(store)
        return
    raise UnsafeStoreError(unsafe_store_message(store.root, bad))


def unsafe_store_message(root: Path, bad: list[UnsafePath]) -> str:
    """The one line refusing the store at ``root`` for the unsafe parts ``bad`` (not empty)."""
    more = f" (and {len(bad) - 1} more of its parts)" if len(bad) > 1 else ""
    fixes = []
    if any(b.foreign_owner for b in bad):
        fixes.append(f"`chown -R {_me()} {root}`")
    if any(b.group_writable or b.other_writable for b in bad):
        writable = [b for b in bad if b.group_writable or b.other_writable]
        fixes.append(f"`chmod go-w {writable[0].path}`" if len(writable) == 1
                     else f"`chmod -R go-w {root}`")
    return (f"refusing to load code from store {root}: {bad[0].describe()}{more}; run "
            f"{' and '.join(fixes)}, or set {TRUST_ENV} (--trust) to require signed entries")


def _me() -> str:
    """This process's user name (its uid when it has none), for a ``chown`` fix."""
    uid = os.geteuid()
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def enforce_payload(payload: bytes, sigs: dict[str, str], trusted: TrustPolicy,
                    entry: Entry, crossing: str | None = None) -> None:
    """The check for a payload and its signatures. ``crossing``: where the entry comes from when
    it crosses a machine boundary (a remote URL, a bundle path) — then a trusted signature is
    needed even without keys, unless the policy allows unsigned entries; otherwise only under
    trusted keys (:func:`enforce`)."""
    if not trusted.keys and crossing is None:
        return
    state = payload_state(payload, sigs, trusted)
    if state == "trusted":
        return
    if trusted.allow_unsigned and state != "bad-signature":
        source = crossing or "this store"
        if source not in _WARNED:
            _WARNED.add(source)
            logger("trust").warning("aotc: %s: loading entries not signed by a trusted key from %s",
                                    UNSIGNED_ENV, source)
        return
    why = {"unsigned": "it is not signed",
           "bad-signature": "its signature does not match its contents (tampered?)",
           "untrusted-signer": "it is signed, but by no trusted key"}[state]
    if crossing is not None and not trusted.keys and state != "bad-signature":
        raise TrustError(f"refusing entry {entry.key[:16]}… ({entry.name}) from {crossing}: {why} "
                         f"and no trusted key is set; set {TRUST_ENV} (or --trust) to the public "
                         f"key it is signed with, or {UNSIGNED_ENV}=1 / --allow-unsigned to accept "
                         "unsigned entries")
    source = f" from {crossing}" if crossing else ""
    raise TrustError(f"refusing entry {entry.key[:16]}… ({entry.name}){source}: {why}; trusted keys "
                     f"come from {TRUST_ENV} / --trust; sign with `aotc sign {entry.key[:16]} "
                     "--key KEYFILE` (or AOTC_SIGNING_KEY where it is built)")


def signature_report(store: Store, trusted: TrustPolicy) -> list[dict[str, Any]]:
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
