"""Remembered failures with a reason class: a failure known to repeat is kept until the version
changes; an unknown one is retried with backoff (aotc/backend/given_up.py, cache/failures.py).

Real stores in tmp_path, real sqlite; time is the functions' ``now`` argument, never a sleep."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from aotc.backend.given_up import GivenUpBefore, forget, raise_if_given_up, reason_class, remember
from aotc.cache import Store, failures
from aotc.cli import cli
from aotc.errors import BackendError, CompileError, NumericMismatchError, TrustError

HOUR = 3600.0
DAY = 24 * HOUR
T0 = 1_700_000_000.0  # the first failure's time: every clock below is relative to it
KEY = "a" * 64


def _given_up(store: Store, now: float, key: str = KEY) -> bool:
    """Whether the backend would fall back at ``now`` (True) or compile the graph (False)."""
    try:
        raise_if_given_up(store, key, None, now=now)
    except GivenUpBefore:
        return True
    return False


def _killed_compiler() -> CompileError:
    """What the backend raises when the C++ compiler dies: aotc's error raised from another's."""
    try:
        try:
            raise RuntimeError("c++ compiler terminated by signal 9")
        except RuntimeError as e:
            raise CompileError("the C++ compiler failed on a kernel of piece 0") from e
    except CompileError as wrapped:
        return wrapped


def test_reason_classes() -> None:
    assert reason_class(NumericMismatchError("differs")) == failures.REPEATS
    assert reason_class(BackendError("graph node x calls y, which has no stable name")) == failures.REPEATS
    assert reason_class(_killed_compiler()) == failures.UNKNOWN
    assert reason_class(ValueError("a third-party library's bug")) == failures.UNKNOWN
    assert reason_class(TrustError("no signing key")) is None  # a setting, not the graph
    assert reason_class(OSError(28, "No space left on device")) is None  # the machine
    assert reason_class(GivenUpBefore("before")) is None


def test_backoff_grows_and_is_capped() -> None:
    waits = [failures.backoff(n) for n in range(1, 8)]
    assert waits[:4] == [HOUR, 4 * HOUR, 16 * HOUR, 64 * HOUR]
    assert waits[4:] == [7 * DAY] * 3 and failures.backoff(10_000) == 7 * DAY


def test_an_unknown_failure_is_retried_after_its_backoff_and_not_before(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    remember(store, "m", None, [], KEY, _killed_compiler(), None, now=T0)
    assert _given_up(store, T0 + 1) and _given_up(store, T0 + HOUR - 1)
    with pytest.raises(GivenUpBefore, match=r"1 try; unknown cause: tried again in 59m"):
        raise_if_given_up(store, KEY, None, now=T0 + 60)
    assert not _given_up(store, T0 + HOUR)  # due: the graph is compiled again

    # it fails again (at the retry): one more attempt, a four times longer wait
    remember(store, "m", None, [], KEY, _killed_compiler(), None, now=T0 + HOUR)
    found = failures.lookup(store, KEY, failures.failures(store)[0].version)
    assert found is not None and (found.reason_class, found.attempts, found.tries) == ("unknown", 2, 2)
    assert found.next_retry == T0 + HOUR + 4 * HOUR
    assert _given_up(store, T0 + 2 * HOUR) and _given_up(store, T0 + 5 * HOUR - 1)
    assert not _given_up(store, T0 + 5 * HOUR)

    # and again: 16 hours; then the retry succeeds and the row is forgotten
    remember(store, "m", None, [], KEY, ValueError("still broken"), None, now=T0 + 5 * HOUR)
    assert _given_up(store, T0 + 20 * HOUR) and not _given_up(store, T0 + 21 * HOUR)
    forget(store, KEY)  # what the backend does once the graph is stored
    assert failures.failures(store) == [] and not _given_up(store, T0 + 21 * HOUR)


def test_a_repeating_failure_is_remembered_across_time(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    remember(store, "m", None, [], KEY, NumericMismatchError("compiled output differs"), None, now=T0)
    for later in (HOUR, DAY, 30 * DAY, 3650 * DAY):
        with pytest.raises(GivenUpBefore, match="known to repeat: kept until aotc or its toolchain"):
            raise_if_given_up(store, KEY, None, now=T0 + later)
    (found,) = failures.failures(store)
    assert (found.reason_class, found.attempts, found.next_retry) == ("repeats", 1, None)
    assert not found.due(T0 + 3650 * DAY) and found.next_retry_str(T0) == "never"
    # another version (a new aotc, another tolerance) tries it again
    raise_if_given_up(store, KEY, (1e-2, 1e-2), now=T0)


def test_a_new_version_or_class_starts_the_attempts_again(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    for n in range(3):
        assert failures.remember(store, KEY, "m", "v1", "RuntimeError: x", failures.UNKNOWN, now=T0 + n)
    assert failures.lookup(store, KEY, "v1").attempts == 3  # type: ignore[union-attr]
    assert failures.remember(store, KEY, "m", "v2", "RuntimeError: x", failures.UNKNOWN, now=T0 + 10)
    found = failures.lookup(store, KEY, "v2")
    assert found is not None and (found.attempts, found.tries) == (1, 4)
    assert failures.remember(store, KEY, "m", "v2", "SplitError: y", failures.REPEATS, now=T0 + 20)
    found = failures.lookup(store, KEY, "v2")
    assert found is not None and (found.reason_class, found.attempts, found.tries) == ("repeats", 1, 5)
    with pytest.raises(ValueError, match="reason class"):
        failures.remember(store, KEY, "m", "v2", "x", "forever")


def test_a_graph_that_cannot_be_keyed_is_named_not_scheduled(tmp_path: Path) -> None:
    """Keying runs again at every start (nothing looks the row up): no retry time to show."""
    store = Store(tmp_path / "s")
    remember(store, "m", None, [], "", TypeError("key factor x: unsupported type"), None, now=T0)
    (found,) = failures.failures(store)
    assert found.key.startswith("unkeyed-") and found.reason_class == "repeats"


def _old_store(root: Path) -> None:
    """A store whose ``failures`` table predates the reason class, with one row in it."""
    Store(root).close()
    db = sqlite3.connect(root / "store-v1" / "index.sqlite")
    db.execute("DROP TABLE [failures]")
    db.execute("CREATE TABLE [failures] ([key] TEXT PRIMARY KEY, [name] TEXT NOT NULL,"
               " [version] TEXT NOT NULL, [reason] TEXT NOT NULL, [time] FLOAT NOT NULL,"
               " [tries] INTEGER NOT NULL DEFAULT 1)")
    db.execute("INSERT INTO [failures] VALUES (?, 'm', 'v1', 'RuntimeError: flaky', ?, 3)", (KEY, T0))
    db.commit()
    db.close()


def test_an_old_failures_table_is_read_as_unknown_with_one_attempt(tmp_path: Path) -> None:
    _old_store(tmp_path / "s")
    store = Store(tmp_path / "s")  # opening it adds the columns
    found = failures.lookup(store, KEY, "v1")
    assert found is not None and (found.reason_class, found.attempts, found.tries) == ("unknown", 1, 3)
    assert found.next_retry == T0 + HOUR and not found.due(T0 + HOUR - 1) and found.due(T0 + HOUR)
    assert failures.remember(store, KEY, "m", "v1", "RuntimeError: flaky", now=T0 + HOUR)
    found = failures.lookup(store, KEY, "v1")
    assert found is not None and (found.attempts, found.tries) == (2, 4)
    store.close()
    Store(tmp_path / "s").close()  # opening it again changes nothing
    columns = [r[1] for r in sqlite3.connect(tmp_path / "s" / "store-v1" / "index.sqlite")
               .execute("PRAGMA table_info([failures])")]
    assert columns.count("reason_class") == 1 and columns.count("attempts") == 1


def test_inspect_shows_class_attempts_and_next_retry(tmp_path: Path) -> None:
    import time

    store = Store(tmp_path / "s")
    now = time.time()
    remember(store, "flaky", None, [], "b" * 64, _killed_compiler(), None, now=now)
    remember(store, "flaky", None, [], "b" * 64, _killed_compiler(), None, now=now)
    remember(store, "wrong", None, [], "c" * 64, NumericMismatchError("differs"), None, now=now - 10)
    store.close()
    res = CliRunner().invoke(cli, ["--store", str(tmp_path / "s"), "inspect", "cache", "--json"],
                             catch_exceptions=False)
    rows = {f["name"]: f for f in json.loads(res.output)["failures"]}
    assert (rows["flaky"]["class"], rows["flaky"]["attempts"]) == ("unknown", 2)
    assert rows["flaky"]["next_retry"] == pytest.approx(now + 4 * HOUR)
    assert (rows["wrong"]["class"], rows["wrong"]["attempts"], rows["wrong"]["next_retry"]) == ("repeats", 1, None)

    table = CliRunner().invoke(cli, ["--store", str(tmp_path / "s"), "inspect", "cache"],
                               catch_exceptions=False).output
    lines = table.splitlines()
    header = next(ln for ln in lines if ln.startswith("NAME") and "CLASS" in ln)
    assert header.split()[:6] == ["NAME", "KEY", "CLASS", "ATTEMPTS", "NEXT", "RETRY"]
    flaky = next(ln for ln in lines if ln.startswith("flaky"))
    wrong = next(ln for ln in lines if ln.startswith("wrong"))
    assert flaky.split()[2:5] == ["unknown", "2", "in"] and ("in 3h" in flaky or "in 4h" in flaky)
    assert wrong.split()[2:5] == ["repeats", "1", "never"]
    assert "given up on (2;" in table and "2 given up" in table


def test_an_old_store_shows_in_inspect(tmp_path: Path) -> None:
    _old_store(tmp_path / "s")
    res = CliRunner().invoke(cli, ["--store", str(tmp_path / "s"), "inspect", "cache", "--json"],
                             catch_exceptions=False)
    (row,) = json.loads(res.output)["failures"]
    assert (row["class"], row["attempts"], row["tries"], row["next_retry"]) == ("unknown", 1, 3, T0 + HOUR)


_GRAPH = """
import json, torch
import aotc
from aotc.counters import COUNTERS

b = aotc.backend()
with torch.no_grad():
    torch.compile(lambda x: x * 2 + 1, backend=b)(torch.zeros(64))
print(json.dumps({"compiles": COUNTERS.compiles, "last": b.last}))
"""


@pytest.mark.slow
def test_the_backend_falls_back_until_an_unknown_failure_is_due_then_compiles_and_forgets_it(
        tmp_path: Path) -> None:
    """Through the real backend in fresh processes: an unknown failure not yet due falls back at
    once; once due, the graph is compiled again, stored, and its row forgotten."""
    import subprocess
    import time

    from aotc.backend.given_up import failure_version
    from tests.conftest import PYTHON, python_env

    root = tmp_path / "store"
    script = tmp_path / "graph.py"
    script.write_text(_GRAPH)
    env = {**python_env(), "AOTC_STORE": str(root), "AOTC_FALLBACK": "eager"}

    def run() -> dict:
        res = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    first = run()
    key = first["last"]["key"]
    assert first["compiles"] >= 1 and not first["last"]["hit"]
    store = Store(root)
    store.delete(key)  # as if it had failed: not stored, an unknown failure remembered just now
    version = failure_version((1e-4, 1e-4))  # float32's default tolerance
    failures.remember(store, key, "torch.compile", version, "RuntimeError: flaky", failures.UNKNOWN)
    store.close()

    held = run()
    assert held["compiles"] == 0 and held["last"]["fallback"] == "eager"
    assert re.search(r"unknown cause: tried again in \d+m", held["last"]["reason"]), held["last"]

    store = Store(root)
    failures.forget(store, key)
    failures.remember(store, key, "torch.compile", version, "RuntimeError: flaky", failures.UNKNOWN,
                      now=time.time() - 2 * HOUR)  # its retry is due
    store.close()
    again = run()
    assert again["compiles"] >= 1 and again["last"]["key"] == key and not again["last"]["hit"]
    store = Store(root)
    assert failures.failures(store) == [] and store.has(key)
    store.close()
