"""One frozen :class:`Context`, built once at each entry point and passed down.

The entry points are the CLI's group, ``aotc.load``, ``aotc.compile``, the backend's call, a
saved backend record being loaded (``AotcCompiled``) and the vLLM plugin — as vLLM passes its
``VllmConfig`` down. Each reads the environment once (:meth:`Context.from_env`) and merges what
its caller passed explicitly; everything below takes what it needs from the context and reads
no ``AOTC_*`` variable (a layout test holds it).

The context carries the operator's decisions: where the local store and the remote are, the
trust policy (from the operator's keys and opt-out only — never from data), the signing key
(read and checked here, before any work), how the loader loads, the lease settings and the
fallback policy of the backend. The remaining settings (logging, the report file, the S3
endpoint …) are in ``settings``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from aotc.fleet.trust import Signer, TrustPolicy, load_signer, trust_policy
from aotc.settings import Settings

__all__ = ["Context", "LeaseSettings"]


@dataclass(frozen=True)
class LeaseSettings:
    """How a fleet shares one compile: a lease lives ``ttl`` seconds without a heartbeat; a
    process waits at most ``wait`` seconds for another's lease (0: never waits)."""

    ttl: float = 60.0
    wait: float = 1800.0


@dataclass(frozen=True)
class Context:
    """What an entry point decided, handed down (module doc). ``store``: a ``Store``, a
    directory or a remote URL (None: ``AOTC_STORE``, else the default directory); ``remote``: a
    URL or a remote (None: ``AOTC_REMOTE``)."""

    settings: Settings = field(default_factory=Settings)
    store: Any = None
    remote: Any = None
    trust: TrustPolicy = field(default_factory=TrustPolicy)
    signing_key: str | None = None
    loader: str = "fast"  # "inductor": every piece through Inductor's loader
    lease: LeaseSettings = field(default_factory=LeaseSettings)
    fallback: str | None = None  # as written (AOTC_FALLBACK); checked by the backend's config

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, store: Any = None, remote: Any = None,
                 trust: Iterable[str] | TrustPolicy = (), allow_unsigned: bool = False) -> Context:
        """The context of an entry point: the environment (``env``, default the process's) read
        once, with the caller's explicit ``store``, ``remote``, trusted keys and opt-out."""
        return cls.from_settings(Settings.from_env(env), store=store, remote=remote, trust=trust,
                                 allow_unsigned=allow_unsigned)

    @classmethod
    def from_settings(cls, settings: Settings, *, store: Any = None, remote: Any = None,
                      trust: Iterable[str] | TrustPolicy = (), allow_unsigned: bool = False) -> Context:
        """The context for already-read ``settings`` (the CLI reads them in its group)."""
        return cls(settings=settings, store=store, remote=remote,
                   trust=trust_policy(trust, settings, allow_unsigned),
                   signing_key=settings.signing_key, loader=settings.loader,
                   lease=LeaseSettings(settings.lease_ttl, settings.lease_wait),
                   fallback=settings.fallback)

    @cached_property
    def signer(self) -> Signer | None:
        """The signing key (``AOTC_SIGNING_KEY``), read once; a file that is not a key raises
        ``TrustError`` — journeys that store ask for it before any work."""
        return load_signer(self.signing_key)

    def open_tiered(self, manifest: Any = None, create: bool = False) -> Any:
        """The tiered store this context names (:func:`aotc.fleet.tiered.open_tiered`)."""
        from aotc.fleet.tiered import open_tiered

        return open_tiered(self, manifest=manifest, create=create)
