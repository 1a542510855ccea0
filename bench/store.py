"""Store throughput: put and get (read + decompress + re-hash) on ~256 MiB of compiler-like
artifacts, side by side with a raw file read and the `zstd -3` command on the same bytes.

    python bench/store.py [--mib 256] [--json]

Artifacts: shared libraries (slices of torch's own .so files) and generated Python source (torch's
Inductor sources), about half each, as a compiled piece's entry holds. Figures are ratios to raw read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from aotc.cache import Store


def make_corpus(dest: Path, mib: int) -> list[Path]:
    """Write ~mib MiB of artifact-like files into dest (half .so slices, half .py text)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    torch_dir = Path(spec.origin).parent if spec and spec.origin else None
    budget = mib << 20
    files: list[Path] = []
    libs = sorted((torch_dir / "lib").glob("*.so*"), key=lambda p: -p.stat().st_size) if torch_dir else []
    srcs = sorted((torch_dir / "_inductor").rglob("*.py")) if torch_dir else []
    so_budget, py_budget = budget // 2, budget - budget // 2
    i = 0
    for lib in libs:  # 16 MiB slices of real machine code
        with open(lib, "rb") as f:
            while so_budget > 0:
                chunk = f.read(min(16 << 20, so_budget))
                if not chunk:
                    break
                p = dest / f"kernel{i}.so"
                p.write_bytes(chunk)
                files.append(p)
                so_budget -= len(chunk)
                i += 1
        if so_budget <= 0:
            break
    text = b"".join(p.read_bytes() for p in srcs) or os.urandom(1 << 20).hex().encode()
    j = 0
    while py_budget > 0:  # generated-source-sized files (~2 MiB each)
        n = min(2 << 20, py_budget)
        start = (j * 7919 * 4096) % max(len(text) - n, 1)
        p = dest / f"piece{j}.py"
        p.write_bytes(text[start:start + n])
        files.append(p)
        py_budget -= n
        j += 1
    return files


def drop_page_cache_hint(paths: list[Path]) -> None:
    """Ask the kernel to drop these files from the page cache (best effort, no root needed)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except (OSError, AttributeError):
            pass


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def lookup_seconds(root: Path, others: int) -> float:
    """Median seconds of a lookup by probe (``Store.entry_rows(probe)``, what ``aotc.load`` asks
    first) in a store holding one wanted entry and ``others`` entries of other probes."""
    import statistics

    store = Store(root)
    try:
        store.put("a" * 64, "wanted", {"program": b"p"}, metadata={"probe": "p" * 64})
        with store.index.write() as conn:
            conn.executemany("INSERT INTO entries (key, name, factors, metadata, created, "
                             "last_used, probe) VALUES (?, 'other', '{}', ?, 0, 0, ?)",
                             [(f"{i:064x}", '{"probe": "%064x"}' % i, f"{i:064x}")
                              for i in range(others)])
        times = []
        for _ in range(21):
            t = time.perf_counter()
            assert len(store.entry_rows("p" * 64)) == 1
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aotc-bench-store-"))
    try:
        corpus = work / "corpus"
        corpus.mkdir()
        files = make_corpus(corpus, args.mib)
        total = sum(p.stat().st_size for p in files)
        mb = total / 1e6

        def raw_read() -> None:
            for p in files:
                with open(p, "rb") as f:
                    while f.read(1 << 20):
                        pass

        raw_read()  # warm the page cache: every contender reads warm bytes
        t_raw = min(timed(raw_read) for _ in range(3))

        zdir = work / "zstd"
        zdir.mkdir()
        t_zstd = timed(lambda: [subprocess.run(["zstd", "-3", "-q", "-f", str(p), "-o",
                                                str(zdir / (p.name + ".zst"))], check=True)
                                for p in files]) if shutil.which("zstd") else float("nan")
        t_unzstd = timed(lambda: [subprocess.run(["zstd", "-d", "-q", "-c", str(zdir / (p.name + ".zst"))],
                                                 check=True, stdout=subprocess.DEVNULL)
                                  for p in files]) if shutil.which("zstd") else float("nan")

        store = Store(work / "store")
        entry_key = "f" * 64
        t_put = timed(lambda: store.put(entry_key, "bench", {p.name: p for p in files}))
        stored = store.get(entry_key, record=False).stored_size
        entry = store.get(entry_key)
        out = work / "out"

        def get_to_files() -> None:
            for role in entry.blobs:
                store.extract_blob(entry, role, out / role)

        def get_bytes() -> None:
            for role in entry.blobs:
                store.read_blob(entry, role)

        def get_parallel() -> None:
            store.extract_blobs(entry, {role: out / role for role in entry.blobs})

        def raw_read_cold() -> None:
            drop_page_cache_hint(files)
            raw_read()

        get_to_files()
        t_get = min(timed(get_to_files) for _ in range(2))
        t_get_par = min(timed(get_parallel) for _ in range(2))
        t_raw_cold = timed(raw_read_cold)
        raw_read()
        t_get_bytes = min(timed(get_bytes) for _ in range(2))
        res = {
            "bytes": total, "files": len(files), "compression_ratio": round(total / stored, 2),
            "raw_read_MBps": round(mb / t_raw), "raw_read_cold_MBps": round(mb / t_raw_cold), "zstd3_compress_MBps": round(mb / t_zstd),
            "zstd_decompress_MBps": round(mb / t_unzstd),
            "put_MBps": round(mb / t_put), "get_to_file_MBps": round(mb / t_get),
            "get_bytes_MBps": round(mb / t_get_bytes),
            "get_vs_raw_read": round(t_raw / t_get_bytes, 3),
            "get_to_file_vs_raw_read": round(t_raw / t_get, 3),
            "get_parallel_MBps": round(mb / t_get_par),
            "get_parallel_vs_raw_read": round(t_raw / t_get_par, 3),
            "get_parallel_vs_cold_raw_read": round(t_raw_cold / t_get_par, 3),
            "cpus": os.cpu_count(),
            "put_vs_zstd3_command": round(t_zstd / t_put, 3),
        }
        empty, full = lookup_seconds(work / "lookup-0", 0), lookup_seconds(work / "lookup-100k", 100_000)
        res.update({"lookup_ms_1_entry": round(empty * 1e3, 3),
                    "lookup_ms_100k_entries": round(full * 1e3, 3),
                    "lookup_100k_minus_1_entry_ms": round((full - empty) * 1e3, 3)})
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            print(f"store bench: {total / 2**20:.0f} MiB in {len(files)} files "
                  f"(half .so, half .py), compression {res['compression_ratio']}x")
            for k, v in res.items():
                if k not in ("bytes", "files", "compression_ratio"):
                    print(f"  {k:26s} {v}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
