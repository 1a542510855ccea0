"""Suite 3 — crashes: `aotc compile` (a real subprocess) killed with SIGKILL at 20 random points;
after every kill the store verifies clean and holds no partial entry; the next compile succeeds,
resuming the pieces the killed ones had finished, and its entry warm-starts equal to eager.

A point is a progress event of the compile plus a random delay: the 20 events are drawn as a
shuffled, stratified sample (start, capture, split, compiling, a piece finished: 3-4 each; then
check twice and "stored" last) so kills land in every phase — including the store write and the clean-up after
it — while the finished pieces a killed compile leaves behind keep the suite affordable.
Set AOTC_CRASH_SEED to replay a sequence."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from aotc._torch.task_result import RESULT_FILE
from aotc.cache import Store, verify
from tests.conftest import AOTC_CLI, PYTHON, python_env, tiny_manifest

pytestmark = pytest.mark.slow

POINTS = 20
EVENTS = {  # progress text that marks the event on stderr -> (times drawn, longest delay, s)
    "start": ("", 3, 2.5), "capture": ("] capture", 3, 1.5), "split": ("] split", 3, 1.5),
    "compiling": ("compiling", 4, 1.5), "piece": (" piece ", 4, 0.2),
}  # a piece kill lands right at its line: from Inductor's warm cache the next piece is quick
LATE = {"check": ("] check", 2, 0.05), "stored": ("] stored", 1, 0.3)}  # last: after these the
# checkpoints may be gone (the entry stored), and the next --force compile starts from scratch


def _run_until(cmd: list[str], marker: str, delay: float) -> tuple[bool, str]:
    """Start ``cmd``; ``delay`` s after a stderr line containing ``marker`` appears, SIGKILL it.
    Returns (killed, stderr seen)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=python_env())
    seen: list[str] = []
    hit = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if marker in line:
                hit.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if marker:
        while not hit.wait(0.05):
            if proc.poll() is not None:
                break
    time.sleep(delay)
    killed = proc.poll() is None
    if killed:
        os.kill(proc.pid, signal.SIGKILL)
    rc = proc.wait(600)
    reader.join(10)
    assert killed or rc == 0, "".join(seen)[-2000:]
    return killed, "".join(seen)


def _finished_pieces(root: Path) -> int:
    """How many finished piece results the compile work directories hold (one a kill caught
    being removed, ``….removing-PID``, is no compile's to resume)."""
    tmp = root / "store-v1" / "tmp"
    return sum(1 for w in tmp.glob("compile-*") if ".removing-" not in w.name for d in w.iterdir()
               if d.is_dir() and not d.name.startswith(".") and (d / RESULT_FILE).exists())


def test_sigkill_at_random_points_then_compile_succeeds(tmp_path) -> None:
    seed = int(os.environ.get("AOTC_CRASH_SEED", str(time.time_ns() % 10**9)))
    rng = random.Random(seed)
    manifest = tiny_manifest(tmp_path, "toy-crash")
    root = tmp_path / "store"
    cmd = [*AOTC_CLI, "--store", str(root), "compile", str(manifest)]
    plan = [name for name, (_m, times, _d) in EVENTS.items() for _ in range(times)]
    rng.shuffle(plan)
    plan += [name for name, (_m, times, _d) in LATE.items() for _ in range(times)]
    table = {**EVENTS, **LATE}
    assert len(plan) == POINTS
    kills: dict[str, int] = {}
    completed = runs = resumed_runs = 0
    spent: list[str] = []
    left = 0  # finished pieces the last killed run left behind
    while sum(kills.values()) < POINTS and runs < POINTS * 2:
        event = plan[min(sum(kills.values()), POINTS - 1)]
        marker, _times, longest = table[event]
        delay = 0.0 if event == "piece" and "piece" not in kills else rng.uniform(0.0, longest)
        t = time.perf_counter()
        killed, seen = _run_until(cmd, marker, delay)
        spent.append(f"{event} {time.perf_counter() - t:.0f}s")
        runs += 1
        resumed = "resumed from an interrupted compile" in seen
        resumed_runs += resumed
        # a run that got as far as compiling resumes what the killed one before it had finished
        assert resumed or not left or "compiling" not in seen, (
            f"seed {seed}: {left} finished pieces were left, the next run compiled them again")
        left = _finished_pieces(root)
        if killed:
            kills[event] = kills.get(event, 0) + 1
        else:
            completed += 1
        store = Store(root)
        report = verify(store)
        assert report.ok and not [p for p in report.problems if p.kind != "orphan"], (
            f"seed {seed}, after a kill at {event}: {[p.describe() for p in report.problems]}")
        for key in store.keys():  # an entry is there only if complete (verify hashed every blob)
            assert store.get(key, record=False).metadata.get("numerics"), key
            if sum(kills.values()) < POINTS:
                store.delete(key)  # finished early: compile from scratch again for the next points
        store.close()
    total = sum(kills.values())
    print(f"crash suite (seed {seed}): {total} SIGKILLs survived of {total} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(kills.items()))}), {completed} runs completed "
          f"unkilled, {resumed_runs} runs resumed finished pieces; store verified clean after each "
          f"({', '.join(spent)})")
    assert total == POINTS
    assert resumed_runs >= 1, "no run resumed the pieces an earlier, killed run had finished"

    final = subprocess.run([*AOTC_CLI, "--store", str(root), "compile", str(manifest),
                            "--json"], capture_output=True, text=True, env=python_env(), timeout=600)
    assert final.returncode == 0, final.stderr[-2000:]
    result = json.loads(final.stdout)
    assert result["hit"] or result["compiles"] + result["resumed"] == 2  # 2 unique pieces
    run = subprocess.run([*AOTC_CLI, "--store", str(root), "run", str(manifest),
                          "--sizes", "1,2,5", "--check-eager", "--json"], capture_output=True,
                         text=True, env=python_env(), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    store = Store(root)
    assert verify(store).ok and len(store.keys()) == 1
    leftovers = [p.name for p in store.tmp_dir.iterdir()
                 if p.name.startswith("compile-") and ".removing-" not in p.name]
    assert leftovers == []  # the last compile cleaned its checkpoints
