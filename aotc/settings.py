"""Every ``AOTC_*`` environment variable, read in one place into a frozen :class:`Settings`.

Entry points (the CLI's group, ``aotc.load``, ``aotc.compile``, the backend's call, the vLLM
plugin) read the environment once — into an :class:`aotc.context.Context` — and pass it down;
nothing else in aotc reads an ``AOTC_*`` variable (a layout test holds it). ``AOTC_MERGE`` (the
backend's merged programs, removed) is no longer read: setting it does nothing.

| variable | field | meaning |
|---|---|---|
| ``AOTC_STORE`` | ``store`` | the local store directory, or an ``s3://bucket/prefix`` remote that is then *the* store (the default directory caches it) |
| ``AOTC_REMOTE`` | ``remote`` | the remote store for push, pull and pull-through on a local miss |
| ``AOTC_S3_ENDPOINT`` | ``s3_endpoint`` | an S3-compatible endpoint (MinIO, Ceph, moto) instead of boto3's configuration |
| ``AOTC_TRUST_KEYS`` | ``trust_keys`` | trusted public keys (hex, or files holding one; comma or space separated): a policy for every load, import and pull |
| ``AOTC_ALLOW_UNSIGNED`` | ``allow_unsigned`` | ``1``: entries that cross a machine boundary (pull, pull-through, bundle import) may be unsigned (the explicit opt-out of :mod:`aotc.fleet.trust`) |
| ``AOTC_SIGNING_KEY`` | ``signing_key`` | a private key file (``aotc keygen``): compiles, the backend and ``push`` sign what they store and push |
| ``AOTC_LEASE_TTL`` | ``lease_ttl`` | seconds a compile lease in the remote lives without a heartbeat (default 60): a dead holder's lease is taken over after that (:mod:`aotc.fleet.lease`) |
| ``AOTC_LEASE_WAIT`` | ``lease_wait`` | the most seconds a process waits for another's compile lease before compiling itself (default 1800) |
| ``AOTC_OCI_INSECURE`` | ``oci_insecure`` | ``1``: talk plain HTTP to an ``oci://`` registry (loopback addresses always do) |
| ``AOTC_LOADER`` | ``loader`` | ``inductor``: load every piece through ``CompiledArtifact.load`` instead of the fast path |
| ``AOTC_PROGRESS`` | ``progress`` | ``1``: the same as ``AOTC_LOG=info`` (kept for scripts that set it) |
| ``AOTC_LOG`` | ``log`` | ``debug``, ``info``, ``warning`` or ``error``: aotc's log lines at that level on stderr (:mod:`aotc.log`); unset: logging as the process configured it (warnings still reach stderr when nothing is configured) |
| ``AOTC_SPLITTING_OPS`` | ``splitting_ops`` | the ``torch.compile`` backend's splitting ops (comma separated; default: vLLM's attention ops, aten SDPA, ``aotc::attention``) |
| ``AOTC_REPORT`` | ``report`` | a file the backend appends one JSON line to per graph it handles (key, hit, seconds): how ``aotc compile`` of a vLLM manifest learns what the engine's processes did |
| ``AOTC_COMPILE_SIZES`` | ``compile_sizes`` | the backend's compile sizes (comma separated; default none: the dynamic artifact only) |
| ``AOTC_VLLM_RECORDS`` | ``vllm_records`` | ``0``: aotc's vLLM plugin leaves vLLM's AOT cache alone (no shipped record is brought in, none vLLM saves is stored; :mod:`aotc.vllm.plugin`) |
| ``AOTC_MAX_SIZE`` | ``max_size`` | the local store's bound (``10G``, ``500M``; binary units): after each put the least recently used entries are evicted while the store is over it — never one a running process holds or one used in the last 5 minutes (:mod:`aotc.cache.bound`); unset: no bound |
| ``AOTC_FALLBACK`` | ``fallback`` | what a graph the backend cannot serve (unkeyable, a failed compile or numeric check, a damaged entry) falls back to: ``inductor`` (default), ``eager``, or ``error`` to raise (CI, tests) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV", "Settings", "is_remote_url", "parse_max_size"]

ENV = {"store": "AOTC_STORE", "remote": "AOTC_REMOTE", "s3_endpoint": "AOTC_S3_ENDPOINT",
       "trust_keys": "AOTC_TRUST_KEYS", "loader": "AOTC_LOADER", "progress": "AOTC_PROGRESS",
       "splitting_ops": "AOTC_SPLITTING_OPS", "compile_sizes": "AOTC_COMPILE_SIZES",
       "report": "AOTC_REPORT", "fallback": "AOTC_FALLBACK", "log": "AOTC_LOG",
       "vllm_records": "AOTC_VLLM_RECORDS", "allow_unsigned": "AOTC_ALLOW_UNSIGNED",
       "signing_key": "AOTC_SIGNING_KEY", "lease_ttl": "AOTC_LEASE_TTL", "lease_wait": "AOTC_LEASE_WAIT",
       "oci_insecure": "AOTC_OCI_INSECURE", "max_size": "AOTC_MAX_SIZE"}


def is_remote_url(value: object) -> bool:
    """Whether ``value`` names a remote store (``s3://…`` or an OCI registry ``oci://…``)
    rather than a directory."""
    return isinstance(value, str) and value.startswith(("s3://", "oci://"))


@dataclass(frozen=True)
class Settings:
    """aotc's configuration from the environment (see the module's table)."""

    store: str | None = None
    remote: str | None = None
    s3_endpoint: str | None = None
    trust_keys: tuple[str, ...] = ()
    loader: str = "fast"
    progress: bool = False
    cache_home: Path | None = None  # $XDG_CACHE_HOME: where the default store lives
    docker_config: Path | None = None  # $DOCKER_CONFIG: docker's config dir (registry credentials)
    splitting_ops: str | None = None  # as written; parsed by aotc.backend.config
    compile_sizes: str | None = None
    report: str | None = None
    fallback: str | None = None  # as written; checked by aotc.backend.config.fallback_policy
    log: str | None = None  # a level name of aotc.log.LEVELS (AOTC_PROGRESS=1 means "info")
    vllm_records: bool = True  # the vLLM plugin brings shipped AOT records in
    allow_unsigned: bool = False  # unsigned entries may cross a machine boundary
    signing_key: str | None = None  # a private key file: sign what is stored and pushed
    lease_ttl: float = 60.0  # seconds a compile lease lives without a heartbeat
    lease_wait: float = 1800.0  # the most seconds a process waits for another's lease
    oci_insecure: bool = False  # plain HTTP to an oci:// registry
    max_size: int | None = None  # bytes: the local store's bound (None: unbounded)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read the variables once (``env`` default: the process environment). A bad ``AOTC_LOG``
        (or lease time, or ``AOTC_MAX_SIZE``) raises :class:`~aotc.errors.SettingsError`."""
        env = os.environ if env is None else env
        text = {k: (env.get(v) or "").strip() or None for k, v in ENV.items()}
        loader = (text["loader"] or "fast").lower()
        progress = _flag(text["progress"], False)
        log = (text["log"] or ("info" if progress else "")).lower() or None
        if log is not None and log not in ("debug", "info", "warning", "error"):
            from aotc.errors import SettingsError

            raise SettingsError(f"AOTC_LOG={text['log']!r}: use debug, info, warning or error")
        xdg, docker = env.get("XDG_CACHE_HOME"), env.get("DOCKER_CONFIG")
        return cls(
            store=text["store"], remote=text["remote"], s3_endpoint=text["s3_endpoint"],
            trust_keys=tuple(t for t in (text["trust_keys"] or "").replace(",", " ").split() if t),
            loader="inductor" if loader == "inductor" else "fast",
            progress=progress, log=log,
            cache_home=Path(xdg).expanduser() if xdg else None,
            docker_config=Path(docker).expanduser() if docker else None,
            splitting_ops=text["splitting_ops"], compile_sizes=text["compile_sizes"],
            report=text["report"], fallback=text["fallback"],
            vllm_records=_flag(text["vllm_records"], True),
            allow_unsigned=_flag(text["allow_unsigned"], False),
            signing_key=text["signing_key"],
            lease_ttl=_seconds(text["lease_ttl"], "lease_ttl", 60.0),
            lease_wait=_seconds(text["lease_wait"], "lease_wait", 1800.0),
            oci_insecure=_flag(text["oci_insecure"], False),
            max_size=parse_max_size(text["max_size"], ENV["max_size"]),
        )

    @property
    def store_is_remote(self) -> bool:
        """``AOTC_STORE`` names a remote (``s3://…``): it is the store, cached locally."""
        return is_remote_url(self.store)

    def default_store_path(self) -> Path:
        """The local store: ``AOTC_STORE`` (a directory), else ``$XDG_CACHE_HOME/aotc``, else
        ``~/.cache/aotc``."""
        if self.store and not self.store_is_remote:
            return Path(self.store).expanduser()
        return (self.cache_home or Path.home() / ".cache") / "aotc"


def _flag(text: str | None, default: bool) -> bool:
    """A yes/no variable: unset is ``default``; ``0``, ``false``, ``no`` are no, anything else yes."""
    if text is None:
        return default
    return text.lower() not in ("0", "false", "no")


def _seconds(text: str | None, field: str, default: float) -> float:
    """A positive number of seconds from a variable (``default`` when unset)."""
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        from aotc.errors import SettingsError

        raise SettingsError(f"{ENV[field]}={text!r}: expected a positive number of seconds")
    return value


def parse_max_size(text: str | None, name: str = "AOTC_MAX_SIZE") -> int | None:
    """A store bound (``10G``, ``500M``, ``1.5GiB``, bytes) from a variable or option ``name``;
    None when unset. A bad value raises :class:`~aotc.errors.SettingsError` naming ``name``."""
    if text is None:
        return None
    from aotc.cache.bound import parse_size

    try:
        return parse_size(text)
    except ValueError:
        from aotc.errors import SettingsError

        raise SettingsError(f"{name}={text!r}: expected a size such as 10G or 500M") from None
