"""The HTTP side of an OCI registry remote (:mod:`aotc.fleet.oci`): requests to one repository
through the ``oras`` library's session, each failure one ``RemoteError`` naming the registry,
bodies read up to a limit, and credentials. A registry that answers 401 gets the credentials of
the docker config (``docker login``; ``$DOCKER_CONFIG`` or ``~/.docker/config.json``): Basic, or
a Bearer token from its token service through oras — sent to the registry's own host only (an
upload URL the registry hands out may name another). The docker config directory is handed in
(``Settings.docker_config`` at an entry point): nothing here reads the environment. Tested with
oras 0.2.43 and Debian's docker-registry 2.8.2."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path
from typing import Any, cast

from aotc.errors import RemoteError

__all__ = ["RegistryHttp"]


def _oras() -> Any:
    try:
        import oras.provider
    except ImportError:  # pragma: no cover - an optional dependency; the message names the fix
        raise RemoteError("an oci:// remote needs oras: pip install 'aotc[oci]' (or oras)") from None
    return oras.provider


class RegistryHttp:
    """HTTP to the repository ``repo`` of the registry at ``host`` (``url`` names it in errors);
    ``docker_config``: the directory of the docker config with the credentials (None: oras's
    own default, ``~/.docker``)."""

    def __init__(self, url: str, host: str, repo: str, insecure: bool,
                 docker_config: Path | None = None) -> None:
        self.url, self.host, self.repo, self.insecure = url, host, repo, insecure
        self.docker_config = docker_config
        self.base = f"{'http' if insecure else 'https'}://{host}"
        self._registry: Any = None
        self._authorization: str | None = None  # the header the registry accepted last
        self._configs_read = False  # the docker config's credentials, read at the first 401

    @property
    def registry(self) -> Any:
        """The oras registry client, made on first use."""
        if self._registry is None:
            self._registry = _oras().Registry(hostname=self.host, insecure=self.insecure)
        return self._registry

    @property
    def errors(self) -> tuple[type[Exception], ...]:
        """What a stream of this registry's bytes may raise besides ``RemoteError``."""
        import requests
        import urllib3

        # urllib3's own (a connection cut mid-body, a read timeout) reach a stream's reader as is
        return (requests.RequestException, urllib3.exceptions.HTTPError, ValueError, OSError)

    def request(self, what: str, method: str, path: str, timeout: float = 120, **kw: Any) -> Any:
        """One HTTP request to the repository (``path`` under ``/v2/<repo>/``, or a full URL the
        registry handed out); a 401 is answered once with the docker config's credentials, and a
        401 after that is a ``RemoteError`` naming the fix."""
        url = path if path.startswith(("http://", "https://")) else f"{self.base}/v2/{self.repo}/{path}"
        headers = dict(kw.pop("headers", None) or {})
        session = self.registry.session
        ours = urllib.parse.urlsplit(url).netloc == self.host  # credentials go to the registry only
        try:
            if self._authorization and ours:
                headers["Authorization"] = self._authorization
            r = session.request(method, url, headers=headers, timeout=timeout, **kw)
            if r.status_code == 401 and ours and self._authorize(r):
                r.close()
                headers["Authorization"] = cast(str, self._authorization)
                r = session.request(method, url, headers=headers, timeout=timeout, **kw)
        except RemoteError:
            raise
        except Exception as e:  # noqa: BLE001 - requests' many errors: one line naming the registry
            raise RemoteError(f"{self.url}: {what} failed: cannot reach the registry ({e})") from None
        if r.status_code == 401:
            r.close()
            raise RemoteError(f"{self.url}: {what} refused: the registry wants credentials it "
                              f"accepts; log in (`docker login {self.host}`, or `oras login`): aotc "
                              "reads the docker config ($DOCKER_CONFIG or ~/.docker/config.json)")
        return r

    def _authorize(self, challenge: Any) -> bool:
        """Answer a 401 ``challenge`` from the docker config's credentials; whether there is an
        ``Authorization`` header to try."""
        auth = self.registry.auth
        if not self._configs_read:
            self._configs_read = True
            docker = self.docker_config  # $DOCKER_CONFIG at the entry point; oras reads only ~/.docker
            configs = [str(docker / "config.json")] if docker is not None else None
            try:
                auth.load_configs(self.registry.get_container(f"{self.host}/{self.repo}"), configs)
            except Exception as e:  # noqa: BLE001 - a damaged docker config: one line naming it
                raise RemoteError(f"{self.url}: cannot read the docker config's credentials ({e})") from None
        scheme = challenge.headers.get("Www-Authenticate", "").split(" ", 1)[0].lower()
        if scheme == "basic":
            basic = getattr(auth, "_basic_auth", None)  # what oras read from the docker config
            self._authorization = f"Basic {basic}" if basic else None
        elif scheme == "bearer":  # a token for this request's scope (pull, push) from the realm
            answer, changed = auth.authenticate_request(challenge, {}, refresh=True)
            self._authorization = answer.get("Authorization") if changed else None
        else:
            self._authorization = None
        return self._authorization is not None

    def read(self, r: Any, limit: int, what: str) -> bytes:
        """At most ``limit`` + 1 bytes of response ``r``'s body, the response closed after; a
        connection cut mid-body is a ``RemoteError`` naming ``what``."""
        try:
            return cast(bytes, r.raw.read(limit + 1, decode_content=True) or b"")
        except Exception as e:  # noqa: BLE001 - urllib3's many errors: one line naming the registry
            raise RemoteError(f"{self.url}: {what} failed: the registry's answer broke off ({e})") from None
        finally:
            r.close()

    def absolute(self, location: str) -> str:
        """A URL the registry handed out (an upload ``Location``, a ``Link``), made absolute."""
        return location if location.startswith(("http://", "https://")) else f"{self.base}{location}"

    def tags(self, page_size: int, limit: int) -> list[str]:
        """Every tag of the repository, following the registry's pages (``Link: <…>; rel=next``),
        each page read up to ``limit`` bytes."""
        tags: list[str] = []
        path = f"tags/list?n={page_size}"
        for _page in range(10_000):
            r = self.request("list tags", "GET", path, stream=True)
            if r.status_code != 200:
                r.close()
                if r.status_code == 404:
                    return tags
                raise RemoteError(f"{self.url}: listing tags failed: HTTP {r.status_code}")
            raw = self.read(r, limit, "list tags")
            try:
                page = json.loads(raw) if len(raw) <= limit else None
                tags += [str(t) for t in (page.get("tags") or [])]  # type: ignore[union-attr]  # None: caught
            except (ValueError, AttributeError, TypeError):
                raise RemoteError(f"{self.url}: the registry's tag list is not a JSON tag list") from None
            link = r.links.get("next", {}).get("url")
            if not link:
                return tags
            path = self.absolute(link)
        raise RemoteError(f"{self.url}: the registry's tag list does not end")
