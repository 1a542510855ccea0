"""A store others can write is not trusted (ssh's StrictModes for the store): without a policy that
requires signatures, loading code from a store whose root, ``store-v1/``, index, ``blobs/``,
``unpacked/`` or ``tmp/`` is writable by group or others, or owned by another user, is refused
with one line naming the path, its mode and the fix; a root-owned read-only store loads; with
trusted keys the signatures protect the code and a world-writable store loads. Real stores on
disk, real sqlite, real ed25519; the entries are small blobs put directly (no compile), except in
the one test marked slow."""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import shutil
import sqlite3
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aotc.cache import Store
from aotc.cache.permissions import unsafe_paths
from aotc.errors import TrustError, UnsafeStoreError
from aotc.fleet.tiered import TieredStore
from aotc.fleet.trust import TrustPolicy
from tests.conftest import PYTHON, aotc_warnings, copy_store, python_env

OTHER_UID = 12345
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


K = key("entry")


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """A store with one entry (a program blob and a 'kernel'), made under the process umask
    (022 here), closed so that each test opens it as a loader would."""
    path = tmp_path / "store"
    s = Store(path)
    s.put(K, "toy", {"program": b"{\"program\": 1}", "kernel/a.so": b"\x7fELF not really"},
          factors={"f": 1}, metadata={})
    s.close()
    yield path
    for p in [path, *path.rglob("*")]:  # let pytest remove what a test made read-only
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)


def tiered(root: Path, policy: TrustPolicy | None = None) -> TieredStore:
    return TieredStore(Store(root, create=False), policy=policy or TrustPolicy())


def refusal(root: Path, policy: TrustPolicy | None = None) -> str:
    """The one line a load from ``root`` is refused with."""
    with pytest.raises(UnsafeStoreError) as e:
        tiered(root, policy).get(K)
    msg = str(e.value)
    assert "\n" not in msg and len(msg.replace(str(root), "R")) < 240, msg
    assert isinstance(e.value, TrustError)  # callers' refusal handling applies unchanged
    return msg


def test_a_store_made_under_umask_022_loads(root: Path) -> None:
    assert unsafe_paths(root) == []
    t = tiered(root)
    entry = t.get(K)
    assert t.local.read_blob(entry, "program") == b"{\"program\": 1}"


def test_a_world_writable_store_is_refused_with_one_line(root: Path) -> None:
    root.chmod(0o777)
    msg = refusal(root)
    assert f"refusing to load code from store {root}: {root} is mode 0777 (writable by others)" in msg
    assert f"`chmod go-w {root}`" in msg and "AOTC_TRUST_KEYS" in msg
    # every door that hands out code refuses before looking anything up, pulling or building
    t = tiered(root)
    with pytest.raises(UnsafeStoreError):
        t.get_or_build(_wanted(), lambda: pytest.fail("built into an unsafe store"))
    root.chmod(0o755)  # the fix, as the line says: the next open loads
    assert tiered(root).get(K).key == K


def test_each_part_of_the_store_counts_and_several_get_one_recursive_fix(root: Path) -> None:
    base = root / "store-v1"
    for part in ["store-v1", "store-v1/blobs", "store-v1/tmp"]:
        path = root / part
        path.chmod(0o757)
        msg = refusal(root)
        assert f"{path} is mode 0757 (writable by others);" in msg and f"`chmod go-w {path}`" in msg
        path.chmod(0o755)
    (base / "index.sqlite").chmod(0o646)  # (sqlite gives a -wal/-shm it makes the index's mode)
    assert f"{base / 'index.sqlite'} is mode 0646 (writable by others)" in refusal(root)
    for p in base.glob("index.sqlite*"):
        p.chmod(0o644)
    (base / "unpacked").mkdir(mode=0o777)
    (base / "unpacked").chmod(0o1777)  # sticky: others still add files (a planted copy)
    assert "unpacked is mode 1777" in refusal(root)
    for p in [root, *root.rglob("*")]:  # `chmod -R 777`: every part, one line, one fix
        p.chmod(0o777)
    msg = refusal(root)
    assert f"{root} is mode 0777 (writable by others) (and " in msg and f"`chmod -R go-w {root}`" in msg


def test_a_group_writable_store_is_refused(root: Path) -> None:
    shared = _shared_group()
    base = root / "store-v1"
    os.chown(base, -1, shared)
    base.chmod(0o775)
    msg = refusal(root)
    assert f"{base} is mode 0775 (writable by its group)" in msg and f"`chmod go-w {base}`" in msg


def test_a_user_private_group_may_write_as_under_umask_002(tmp_path: Path) -> None:
    """Debian/Ubuntu login sessions run with umask 002 and a group per user: a group whose only
    member is the owner lets no one else in, so such a store loads (as Debian's ssh allows)."""
    me, gid = os.geteuid(), os.getegid()
    if not _is_private(gid, me):
        pytest.skip(f"group {gid} is not private to uid {me} here")
    old = os.umask(0o002)
    try:
        s = Store(tmp_path / "store")
        s.put(K, "toy", {"program": b"p"}, factors={}, metadata={})
        s.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "store" / "store-v1").stat().st_mode) == 0o775
    assert tiered(tmp_path / "store").get(K).key == K


@needs_root
def test_a_store_owned_by_another_user_is_refused(root: Path) -> None:
    os.chown(root, OTHER_UID, -1)  # mode 0755: only its owner writes it — but that is not us
    msg = refusal(root)
    assert f"{root} is mode 0755 (owned by uid {OTHER_UID})" in msg and f"`chown -R root {root}`" in msg
    os.chown(root, 0, -1)
    os.chown(root / "store-v1" / "index.sqlite", OTHER_UID, -1)  # the index alone is enough
    assert f"index.sqlite is mode 0644 (owned by uid {OTHER_UID})" in refusal(root)


def test_a_root_owned_read_only_store_loads(root: Path) -> None:
    """A shared mount as an image layer ships it: root-owned, 555 directories, 444 files."""
    _read_only(root)
    t = tiered(root)
    assert t.local.read_blob(t.get(K), "kernel/a.so") == b"\x7fELF not really"
    if os.stat(root).st_uid == 0:  # and for any other user of the machine: root owns it
        assert unsafe_paths(root, uid=OTHER_UID) == []


def test_a_root_owned_read_only_mount_loads_in_a_fresh_process(root: Path, tmp_path: Path) -> None:
    """The same on a real read-only bind mount (a private mount namespace): the store opens
    read-only and its entry is handed out and read."""
    from tests.test_serving import _read_only_mount_works

    why = _read_only_mount_works()
    if why:
        pytest.skip(why)
    _read_only(root)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = ("import sys; from aotc.cache import Store; from aotc.fleet.tiered import TieredStore; "
            "t = TieredStore(Store(sys.argv[1], create=False)); e = t.get(sys.argv[2]); "
            "print(t.local.read_only, t.local.read_blob(e, 'program').decode())")
    script = " && ".join([
        "mount --make-rprivate /", f"mount --bind {root} {mnt}", f"mount -o remount,bind,ro {mnt}",
        f"! touch {mnt}/probe 2>/dev/null", f"{PYTHON} -c \"{code}\" {mnt} {K}"])
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                         env=python_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "{\"program\":", "1}"]


def test_with_trusted_keys_a_world_writable_store_loads_signed_entries(root: Path) -> None:
    private = Ed25519PrivateKey.generate()
    public = private.public_key().public_bytes_raw().hex()
    s = Store(root)
    s.add_signature(K, public, private.sign(s.signing_payload(s.get(K, record=False))).hex())
    s.put(key("unsigned"), "planted", {"program": b"evil"}, factors={}, metadata={})
    s.close()
    for p in [root, *root.rglob("*")]:
        p.chmod(0o777)
    policy = TrustPolicy(frozenset({public}))
    assert tiered(root, policy).get(K).key == K  # the signature protects the code
    with pytest.raises(TrustError, match="not signed") as e:  # a planted entry is still refused
        tiered(root, policy).get(key("unsigned"))
    assert not isinstance(e.value, UnsafeStoreError)
    # keys with the opt-out no longer require signatures: the store check applies again
    assert "writable by others" in refusal(root, TrustPolicy(frozenset({public}), allow_unsigned=True))


def test_aotc_load_refuses_it_in_one_line(root: Path) -> None:
    import aotc

    root.chmod(0o777)
    with pytest.raises(UnsafeStoreError, match=r"^refusing to load code from store .*0777.*chmod go-w"):
        aotc.load(key=K, model=object(), store=root, trust=())


def test_the_store_commands_still_work_on_it(root: Path) -> None:
    """inspect, verify and gc load no code: they keep working on a store others can write."""
    from aotc.cli import cli

    for p in [root, *root.rglob("*")]:
        p.chmod(0o777)
    env = {"AOTC_TRUST_KEYS": ""}
    for args in (["inspect", "cache"], ["verify"], ["gc", "--dry-run"], ["gc"]):
        res = CliRunner().invoke(cli, ["--store", str(root), *args], env=env)
        assert res.exit_code == 0, (args, res.output)
        assert "refusing" not in res.output
    assert Store(root).keys() == [K]


def test_the_backend_falls_back_with_one_warning(root: Path, caplog) -> None:
    """Inside a server a refused store is one warning line and a fallback, never a crash; nothing
    is compiled into the store, and the refusal is not remembered as the graph's failure."""
    import torch

    import aotc

    for p in [root, *root.rglob("*")]:
        if p.is_dir():
            p.chmod(0o777)
    caplog.set_level("WARNING", logger="aotc")
    fn = torch.compile(lambda x: torch.relu(x) * 5, backend=aotc.backend(store=str(root), fallback="eager"))
    try:
        assert torch.equal(fn(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 10.0]))
    finally:
        torch._dynamo.reset()
    warnings = aotc_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "UnsafeStoreError: refusing to load code from store" in warnings[0]
    assert "eager runs it instead" in warnings[0]
    assert Store(root).keys() == [K]  # nothing built into it
    with sqlite3.connect(root / "store-v1" / "index.sqlite") as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "failures" not in tables or db.execute("SELECT COUNT(*) FROM failures").fetchone() == (0,)


@pytest.mark.slow
def test_a_compiled_model_is_refused_then_loads_once_fixed(compiled, tmp_path: Path) -> None:
    """End to end with a real compiled entry: ``aotc.load`` of a manifest from a world-writable
    copy is refused before anything is read; ``chmod -R go-w`` fixes it; a read-only root-owned
    copy (555/444) loads and runs."""
    import aotc

    _tmp, store, results = compiled
    manifest = results[2][0]
    copy = tmp_path / "store"
    copy_store(store.root, copy)
    shutil.rmtree(copy / "store-v1" / "unpacked", ignore_errors=True)  # earlier loads unpacked some
    for p in [copy, *copy.rglob("*")]:
        if p.is_dir():
            p.chmod(0o777)
    with pytest.raises(UnsafeStoreError, match=r"\(and \d+ more of its parts\).*chmod -R go-w"):
        aotc.load(manifest, store=copy, trust=())
    assert not (copy / "store-v1" / "unpacked").exists()  # refused before any blob was unpacked
    subprocess.run(["chmod", "-R", "go-w", str(copy)], check=True)
    assert aotc.load(manifest, store=copy, trust=()).key == results[2][1].key
    _read_only(copy)
    assert aotc.load(manifest, store=copy, trust=()).key == results[2][1].key
    for p in [copy, *copy.rglob("*")]:
        if p.is_dir():
            p.chmod(0o755)


# ------------------------------------------------------------------------------------ helpers


def _wanted():  # type: ignore[no-untyped-def]
    from aotc.fleet.tiered import Wanted

    return Wanted.by_key(K)


def _read_only(root: Path) -> None:
    """Make ``root`` what a read-only image layer ships: 444 files, then 555 directories."""
    paths = [root, *root.rglob("*")]
    for p in paths:
        if p.is_file():
            p.chmod(0o444)
    for p in sorted((p for p in paths if p.is_dir()), key=lambda p: -len(p.parts)):
        p.chmod(0o555)


def _is_private(gid: int, owner: int) -> bool:
    """Whether ``gid`` has exactly one member, ``owner`` (computed independently of aotc)."""
    try:
        name, group = pwd.getpwuid(owner).pw_name, grp.getgrgid(gid)
    except KeyError:
        return False
    primary = {p.pw_name for p in pwd.getpwall() if p.pw_gid == gid}
    return (primary | set(group.gr_mem)) == {name}


def _shared_group() -> int:
    """A group that someone besides this user is in (else one that does not exist: equally not
    private)."""
    me = os.geteuid()
    for p in pwd.getpwall():
        if p.pw_uid != me and p.pw_gid != os.getegid():
            return p.pw_gid
    return OTHER_UID
