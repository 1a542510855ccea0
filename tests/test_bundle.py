"""Bundles: `aotc export` an entry to one relocatable file, `aotc import` it into a store on
another path, warm-start from there equal to eager; importing twice is a no-op; hostile or broken
bundles (path traversal, links, device files, duplicates, oversized members, truncation, a
tampered blob, a decompression bomb) are refused before anything enters the store."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Callable

import pytest
import torch
import zstandard
from click.testing import CliRunner

import aotc
from aotc.model.build import build_model, make_inputs
from aotc.fleet.bundle import BundleError, export_entry, import_bundle
from aotc.cache import Store
from aotc.cli import cli
from aotc.manifest import load_manifest
from aotc.fleet.trust import TrustError, TrustPolicy, generate_key, sign_entry

pytestmark = pytest.mark.slow
ALLOW = TrustPolicy(allow_unsigned=True)  # the explicit opt-out, where a test is not about trust


@pytest.fixture(scope="module")
def bundle(compiled, tmp_path_factory) -> tuple[Path, str, Path]:
    _tmp, store, results = compiled
    out = tmp_path_factory.mktemp("bundle") / "toy-2.aotc"
    res = CliRunner().invoke(cli, ["--store", str(store.root), "export", results[2][1].key[:12],
                                   "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["key"] == results[2][1].key
    return out, results[2][1].key, results[2][0]


def _members(path: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(path) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]


def _write(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if info.isreg():
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def test_round_trip_on_another_path_warm_starts_and_is_idempotent(bundle, tmp_path) -> None:
    path, key, manifest = bundle
    text = path.read_bytes()
    assert b"/tmp/" not in text and str(Path.cwd()).encode() not in text  # relocatable
    root = tmp_path / "elsewhere" / "store"
    # an unsigned bundle comes from another machine: refused by default, the fix named
    refused = CliRunner().invoke(cli, ["--store", str(root), "import", str(path)],
                                 env={"AOTC_TRUST_KEYS": "", "AOTC_ALLOW_UNSIGNED": ""})
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1
    assert "no trusted key is set" in refused.output and "--allow-unsigned" in refused.output
    first = CliRunner().invoke(cli, ["--store", str(root), "import", str(path), "--json",
                                     "--allow-unsigned"])
    assert first.exit_code == 0, first.output
    assert json.loads(first.output)["imported"] is True
    again = CliRunner().invoke(cli, ["--store", str(root), "import", str(path), "--json"],
                               env={"AOTC_ALLOW_UNSIGNED": "1"})
    assert again.exit_code == 0 and json.loads(again.output)["imported"] is False
    store = Store(root)
    assert store.keys() == [key]
    m = load_manifest(manifest)
    model = build_model(m)
    runner = aotc.load(m, model=model, store=store)
    x = make_inputs(m, 5)
    with torch.no_grad():
        assert torch.allclose(runner(*x), model(*x), atol=1e-4, rtol=1e-4)
    again_export = tmp_path / "again.aotc"  # the same entry exports to the same bytes
    export_entry(store, key, again_export)
    assert again_export.read_bytes() == text


def _traversal(ms):  # type: ignore[no-untyped-def]
    info = tarfile.TarInfo("../../evil.py")
    return ms + [(info, b"print('owned')")]


def _symlink(ms):  # type: ignore[no-untyped-def]
    head, blobs = ms[0], ms[1:]
    link = tarfile.TarInfo(blobs[0][0].name)
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    return [head, (link, b""), *blobs[1:]]


def _device(ms):  # type: ignore[no-untyped-def]
    head, blobs = ms[0], ms[1:]
    dev = tarfile.TarInfo(blobs[0][0].name)
    dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 3
    return [head, (dev, b""), *blobs[1:]]


def _duplicate(ms):  # type: ignore[no-untyped-def]
    return ms + [ms[1]]


def _oversized(ms):  # type: ignore[no-untyped-def]
    head, (info, data), *rest = ms
    return [head, (info, data + b"\0" * 4096), *rest]


def _tampered(ms):  # type: ignore[no-untyped-def]
    head, (info, data), *rest = ms
    digest = info.name.removeprefix("blobs/")
    rec = json.loads(head[1])
    size = next(b["size"] for b in rec["blobs"].values() if b["digest"] == digest)
    other = zstandard.ZstdCompressor().compress(b"x" * size)[: len(data)]  # fits the bound
    return [head, (info, other), *rest]


def _bomb(ms):  # type: ignore[no-untyped-def]
    """The largest blob swapped for a small, whole zstd frame expanding far past its recorded size."""
    head, *blobs = ms
    i = max(range(len(blobs)), key=lambda k: len(blobs[k][1]))
    info, data = blobs[i]
    rec = json.loads(head[1])
    size = next(b["size"] for b in rec["blobs"].values() if info.name.endswith(b["digest"]))
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (size + (64 << 20)))
    assert len(bomb) <= len(data)  # fits the member bound: only the decompression bound stops it
    blobs[i] = (info, bomb)
    return [head, *blobs]


def _key_mismatch(ms):  # type: ignore[no-untyped-def]
    head, *rest = ms
    rec = json.loads(head[1])
    rec["factors"]["manifest"]["max_tokens"] = 1 << 20  # claims another model under the same key
    return [(head[0], json.dumps(rec).encode()), *rest]


def _record_not_first(ms):  # type: ignore[no-untyped-def]
    return ms[1:] + ms[:1]


def _bad_record(ms):  # type: ignore[no-untyped-def]
    head, *rest = ms
    return [(head[0], b'{"format": 1, "key": "zz"}'), *rest]


HOSTILE: list[tuple[Callable, str]] = [
    (_traversal, "unexpected member"), (_symlink, "link or special"), (_device, "link or special"),
    (_duplicate, "appears twice"), (_oversized, "larger than"), (_tampered, "does not hash"),
    (_bomb, "decompresses beyond"), (_record_not_first, "first member"),
    (_bad_record, "not a valid bundle record"), (_key_mismatch, "not the hash of its factors"),
]


@pytest.mark.parametrize("make,needle", HOSTILE, ids=[h[0].__name__.strip("_") for h in HOSTILE])
def test_hostile_bundle_refused_store_untouched(bundle, tmp_path, make, needle) -> None:
    path, _key, _m = bundle
    bad = _write(tmp_path / "bad.aotc", make(_members(path)))
    store = Store(tmp_path / "store")
    with pytest.raises(BundleError, match=needle):
        import_bundle(store, bad, ALLOW)
    assert store.keys() == [] and not list(store.blobs_dir.rglob("*")) and not list(store.tmp_dir.iterdir())
    assert not (tmp_path / "evil.py").exists() and not (tmp_path.parent / "evil.py").exists()


@pytest.mark.parametrize("cut", [0.05, 0.5, 0.98])
def test_truncated_bundle_refused(bundle, tmp_path, cut) -> None:
    """Cut within the members' bytes (a cut inside the tar's trailing zero padding loses nothing:
    where that padding starts depends on the entry's size)."""
    import tarfile

    path, _key, _m = bundle
    data = path.read_bytes()
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    end = last.offset_data + last.size  # the last byte any member owns
    bad = tmp_path / "cut.aotc"
    bad.write_bytes(data[: int(end * cut)])
    store = Store(tmp_path / "store")
    res = CliRunner().invoke(cli, ["--store", str(store.root), "import", str(bad), "--allow-unsigned"])
    assert res.exit_code == 1 and "Error:" in res.output and "Traceback" not in res.output, res.output
    assert store.keys() == []


def test_trust_policy_applies_to_import(compiled, bundle, tmp_path) -> None:
    path, key, _m = bundle
    public = generate_key(tmp_path / "k")
    # refused before any blob is staged (unsigned, or signed by another test's key: the session
    # store is shared, and a push under AOTC_SIGNING_KEY signs what it pushes)
    with pytest.raises(TrustError, match="not signed|by no trusted key"):
        import_bundle(Store(tmp_path / "a"), path, trusted=TrustPolicy(frozenset({public})))
    src = Store(tmp_path / "src")
    import_bundle(src, path, ALLOW)
    sign_entry(src, key, tmp_path / "k")
    signed = tmp_path / "signed.aotc"
    export_entry(src, key, signed)
    dest = Store(tmp_path / "b")
    assert import_bundle(dest, signed, trusted=TrustPolicy(frozenset({public}))).imported
    assert dest.signatures(key) == src.signatures(key)
    members = _members(signed)  # a signed record whose factors were edited: refused
    rec = json.loads(members[0][1])
    rec["metadata"]["note"] = "edited"
    members[0] = (members[0][0], json.dumps(rec).encode())
    with pytest.raises(TrustError, match="does not match"):
        import_bundle(Store(tmp_path / "c"), _write(tmp_path / "edited.aotc", members),
                      trusted=TrustPolicy(frozenset({public})))
    print(f"bundle suite: {len(HOSTILE)} hostile kinds + 3 truncations + 2 trust cases refused")
