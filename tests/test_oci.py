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
from aotc.fleet.remote_api import Unconditional
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


def test_the_remote_takes_its_settings_as_arguments_never_from_the_environment(monkeypatch) -> None:
    """AOTC_OCI_INSECURE and DOCKER_CONFIG are read at an entry point (``Settings``) and reach
    the remote through ``make_remote``; the constructor itself reads nothing."""
    from aotc.fleet.remote import make_remote
    from aotc.fleet.remote_api import Remote
    from aotc.settings import Settings

    monkeypatch.setenv("AOTC_OCI_INSECURE", "1")
    monkeypatch.setenv("DOCKER_CONFIG", "/nowhere")
    url = "oci://registry.example.com/team/models"
    plain = OciRemote(url)
    assert not plain.insecure and plain.http.docker_config is None
    assert OciRemote(url, insecure=True).insecure
    made = make_remote(url, Settings(oci_insecure=True, docker_config=Path("/etc/docker")))
    assert isinstance(made, OciRemote) and isinstance(made, Remote)
    assert made.insecure and made.http.docker_config == Path("/etc/docker")
    assert not made.conditional
    assert not make_remote(url, Settings()).insecure  # the settings', not the environment's


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
    with pytest.raises(Unconditional):
        remote.put_tagged("leases/x.json", b"{}", if_absent=True)
    with pytest.raises(Unconditional):
        remote.delete_if_match("leases/x.json", '"0"')


def test_the_test_registry_ignores_conditional_headers(oci) -> None:
    """Why a registry has no leases: Distribution 2.8 (the test registry) accepts a manifest
    PUT with ``If-None-Match: *`` over an existing tag, one with a wrong ``If-Match``, and a
    DELETE with a wrong ``If-Match`` — there is no compare-and-swap to build a lease on."""
    remote = OciRemote(oci())
    config = remote._upload_bytes(b"{}", "application/vnd.oci.image.config.v1+json")
    base = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config, "layers": []}
    headers = {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}
    statuses = []
    for note, cond in (("a", {"If-None-Match": "*"}), ("b", {"If-None-Match": "*"}),
                       ("c", {"If-Match": '"sha256:' + "0" * 64 + '"'})):
        body = json.dumps({**base, "annotations": {"n": note}}).encode()
        statuses.append(remote.http.request("PUT", "PUT", "manifests/lease", data=body,
                                            headers={**headers, **cond}).status_code)
    assert statuses == [201, 201, 201]  # every condition ignored
    got = remote.http.request("GET", "GET", "manifests/lease", headers={"Accept": headers["Content-Type"]})
    assert got.json()["annotations"] == {"n": "c"}
    gone = remote.http.request("DELETE", "DELETE", f"manifests/{got.headers['Docker-Content-Digest']}",
                               headers={"If-Match": '"sha256:' + "0" * 64 + '"'})
    assert gone.status_code == 202


def _bcrypt_line(user: str, password: str) -> str | None:
    """An htpasswd line (bcrypt, what Distribution accepts) from the system's crypt(3); None
    where it cannot make one."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.11's crypt: fine for a test
        try:
            import crypt

            # cost 4 (bcrypt's least): the registry checks the password on every request
            hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
        except (ImportError, ValueError, OSError, AttributeError):
            return None
    return f"{user}:{hashed}" if hashed and hashed.startswith("$2") else None


def test_a_registry_that_wants_credentials_gets_the_docker_configs(compiled, oci, tmp_path: Path,
                                                                   monkeypatch) -> None:
    """A registry with Basic auth (htpasswd) and deletes off, as production registries run:
    without credentials one line naming `docker login`; with the docker config's, push and pull
    work; a delete the registry refuses is said, never taken for done."""
    import base64

    from tests.helpers.oci_registry import oci_registry

    line = _bcrypt_line("ci", "s3cret")
    if line is None:
        pytest.skip("this system's crypt(3) makes no bcrypt hashes")
    _tmp, store, results = compiled
    key = results[2][1].key
    (tmp_path / "htpasswd").write_text(line + "\n")
    (tmp_path / "reg").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.docker of the machine's
    with oci_registry(tmp_path / "reg", htpasswd=tmp_path / "htpasswd", delete=False) as (host, _b):
        url = f"oci://{host}/team/aotc"
        with pytest.raises(RemoteError, match=r"wants credentials.*docker login"):
            push_entry(store, OciRemote(url, docker_config=tmp_path / "nobody"), key)
        config = tmp_path / "docker"
        config.mkdir()
        wrong = base64.b64encode(b"ci:wrong").decode()
        (config / "config.json").write_text(json.dumps({"auths": {host: {"auth": wrong}}}))
        with pytest.raises(RemoteError, match="wants credentials"):
            push_entry(store, OciRemote(url, docker_config=config), key)
        right = base64.b64encode(b"ci:s3cret").decode()
        (config / "config.json").write_text(json.dumps({"auths": {host: {"auth": right}}}))
        monkeypatch.setenv("DOCKER_CONFIG", str(config))  # never read by the remote itself:
        with pytest.raises(RemoteError, match="wants credentials"):  # only what it is handed
            push_entry(store, OciRemote(url), key)
        assert push_entry(store, OciRemote(url, docker_config=config), key).moved
        replica = Store(tmp_path / "r")
        assert pull_entry(OciRemote(url, docker_config=config), replica, key, ALLOW).moved
        assert replica.keys() == [key]
        with pytest.raises(RemoteError, match="deletion disabled"):
            OciRemote(url, docker_config=config).delete(OciRemote.entry_name(key))
        assert OciRemote(url, docker_config=config).get_bytes(OciRemote.entry_name(key)) is not None


class _AnsweringServer:
    """A registry stand-in on 127.0.0.1 that answers every request with one canned HTTP
    response (``body`` under ``length``; a shorter body means the connection breaks off): what a
    real registry never serves, a hostile or broken one may."""

    def __init__(self, body: bytes, length: int | None = None) -> None:
        import socket
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"oci://127.0.0.1:{self.listener.getsockname()[1]}/team/aotc"
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (len(body) if length is None else length))

        def serve() -> None:
            while True:
                try:
                    conn, _addr = self.listener.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(65536)
                    conn.sendall(head + body)

        threading.Thread(target=serve, daemon=True).start()

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.listener.close()


def _manifest_with(spoil: str) -> bytes:
    from aotc.fleet.oci import ARTIFACT_TYPE, CONFIG_TYPE, LAYER_TYPE, MANIFEST_TYPE

    digest = "sha256:" + "ab" * 32
    m: dict = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": ARTIFACT_TYPE,
               "config": {"mediaType": CONFIG_TYPE, "digest": digest, "size": 2},
               "layers": [{"mediaType": LAYER_TYPE, "digest": digest, "size": 2,
                           "annotations": {"org.aotc.digest": "cd" * 32}}],
               "annotations": {"org.aotc.key": "ef" * 32}}
    if spoil == "annotations-a-list":
        m["annotations"] = ["org.aotc.key", "ef" * 32]
    elif spoil == "a-layer-not-an-object":
        m["layers"].append(1)
    elif spoil == "a-signature-number":
        m["annotations"]["org.aotc.signature." + "ab" * 32] = 7
    elif spoil == "config-a-string":
        m["config"] = CONFIG_TYPE
    return json.dumps(m).encode()


@pytest.mark.parametrize("spoil", ["annotations-a-list", "a-layer-not-an-object", "a-signature-number",
                                   "config-a-string"])
def test_a_manifest_of_the_wrong_shape_is_refused(spoil: str) -> None:
    """Every field read from a manifest has the shape it must (a real registry refuses such a
    manifest on upload; a hostile one serves it): one RemoteError, never a TypeError."""
    with _AnsweringServer(_manifest_with(spoil)) as url:
        remote = OciRemote(url)
        for name in (remote.entry_name("ef" * 32), remote.signature_name("ef" * 32, "ab" * 32)):
            with pytest.raises(RemoteError, match="is not an aotc entry"):
                remote.get_bytes(name)


def test_a_registry_answer_that_breaks_off_is_one_remote_error() -> None:
    """A manifest whose body stops half-way (the connection closed): a RemoteError naming the
    registry, not urllib3's own exception escaping into a server."""
    with _AnsweringServer(_manifest_with("none")[:40], length=5000) as url:
        remote = OciRemote(url)
        with pytest.raises(RemoteError, match="broke off"):
            remote.get_bytes(remote.entry_name("ef" * 32))


def test_a_listing_follows_the_registrys_pages() -> None:
    """A registry that pages its tag list (``Link: <…>; rel="next"``, as Distribution 3 and
    most hosted registries do; the test registry, 2.8, does not) is listed whole."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    k1, k2 = "1" * 64, "2" * 64

    class Pages(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            last = "last=" in self.path
            body = json.dumps({"name": "team/aotc", "tags": [k2 if last else k1, "name-x"]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if not last:
                self.send_header("Link", f'</v2/team/aotc/tags/list?n=2&last={k1}>; rel="next"')
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = OciRemote(f"oci://127.0.0.1:{server.server_address[1]}/team/aotc")
        assert {o.name for o in remote.list("entries/")} == {remote.entry_name(k1), remote.entry_name(k2)}
    finally:
        server.shutdown()
