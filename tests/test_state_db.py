"""The state database: status reads it while a daemon process writes it, a bad
database is moved aside and rebuilt (once, not at every start), a state.json
of the daemons before it is migrated, and only changed rows are written.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest

from skilltrain.daemon.commands import status
from skilltrain.daemon.core import state_db
from skilltrain.daemon.infra.state import SetState, StateStore
from tests.daemon_helpers import (
    DaemonProcess,
    SetId,
    Workspace,
    build_workspace,
    run_cli,
    run_once_in_process,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import LLMServer

pytestmark = DAEMON_TEST_MARKS

# Written by the StateStore of before the database (daemon/state.py at d84ba8e):
# two sets, a step reopened once, a run's spend, a notice.
LEGACY = Path(__file__).with_name("legacy_state_v1.json")
NO_AUDIT = "[integrity]\naudit_on_start = false\n"
R = "r1"


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def ws(tmp_path: Path, llm_server: LLMServer) -> Workspace:
    return build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.2,
                           extra=NO_AUDIT)


def test_status_reads_the_database_while_the_daemon_process_writes_it(ws: Workspace) -> None:
    done = ws.write_step(R, 1, 1, success=True)[0]
    run_once_in_process(ws)
    waiting = SetId(R, 1, 2, "alpha", 1, 3)

    with DaemonProcess(ws) as daemon:
        daemon.wait_event("daemon.started", 60, pid=daemon.pid)
        scripts = ws.scripts(R, 1, 2, "alpha")
        scripts.mkdir(parents=True)
        (scripts / "ep01.txt").write_text("INT. DOCK - NIGHT\n", encoding="utf-8")

        def status_shows_it() -> bool:
            result, _ = run_cli("status", "--json", "--config", str(ws.config_path))
            assert result.returncode == 0, result.stderr
            data = json.loads(result.stdout)
            sets = {row["set"]: row["state"] for row in data["sets"]}
            assert data["daemon"]["state_unreadable"] is None
            return (data["daemon"]["pid"] == daemon.pid and sets.get(done.id) == "done"
                    and sets.get(waiting.id) == "waiting")

        wait_until(status_shows_it, 30, message="status to show the daemon's new set")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0

    # Closed cleanly: no WAL left, and status on a stopped daemon creates nothing.
    before = listing(ws.state_file.parent)
    assert [n for n in before if n.startswith("state")] == ["state.sqlite3"]
    result, _ = run_cli("status", "--config", str(ws.config_path))
    assert result.returncode == 0 and "daemon not running" in result.stdout, result.stderr
    assert listing(ws.state_file.parent) == before


def _garbage(path: Path) -> None:
    path.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 40)


def _truncated(path: Path) -> None:
    store = StateStore(path.parent.parent, path)
    for n in range(200):
        store.update(f"r9/epoch_01/step_01/w{n:03d}/01-03", SetState.FAILED, reason="x" * 200)
    store.flush(force=True)
    store.close()
    with open(path, "r+b") as f:
        f.truncate(4096 * 3)


def _foreign(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE recipes (name TEXT)")
    conn.commit()
    conn.close()


def _future_schema(path: Path) -> None:
    state_db.StateDB(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {state_db.SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()


@pytest.mark.parametrize("spoil", [_garbage, _truncated, _foreign, _future_schema],
                         ids=["garbage", "truncated", "foreign", "future-schema"])
def test_a_bad_database_is_moved_aside_logged_once_and_rebuilt(ws: Workspace, spoil: object
                                                               ) -> None:
    s = ws.write_step(R, 1, 1, success=True)[0]
    ws.state_file.parent.mkdir(parents=True)
    assert callable(spoil)
    spoil(ws.state_file)
    bad = ws.state_file.read_bytes()
    # status says so, and leaves the file for the daemon to move
    assert "not a state database" in status.collect(ws.runs)["daemon"]["state_unreadable"]
    assert listing(ws.state_file.parent) == ["state.sqlite3"]

    run_once_in_process(ws)

    (line,) = ws.events("state.unreadable")
    assert line["level"] == "error" and "rebuilt from runs/" in line["reason"]
    (kept,) = ws.state_file.parent.glob("state.sqlite3.bad-*")
    assert kept.read_bytes() == bad and kept.name in line["reason"]
    assert ws.state()["sets"][s.id]["state"] == "done"

    run_once_in_process(ws)  # the next start finds a good database: no second event
    assert len(ws.events("state.unreadable")) == 1
    assert status.collect(ws.runs)["daemon"]["state_unreadable"] is None


def test_state_json_of_the_old_daemon_is_migrated_once(ws: Workspace) -> None:
    legacy = ws.runs / ".skilltrain" / "state.json"
    legacy.parent.mkdir(parents=True)
    shutil.copy(LEGACY, legacy)
    old = json.loads(LEGACY.read_text(encoding="utf-8"))
    # The old file predates the last report's time (for /metrics): unknown, not made up.
    old_spend = {run: {**spend, "last_report_at": None} for run, spend in old["spend"].items()}
    # Before the first start, status reads the old file.
    assert status.collect(ws.runs)["spend"] == old_spend

    run_once_in_process(ws)

    assert ws.events("state.unreadable") == []
    assert not legacy.exists() and legacy.with_name("state.json.migrated").is_file()
    state = ws.state()
    assert state["spend"] == old_spend
    assert state["notices"] == old["notices"]
    # The sets' and steps' folders are not in this tree: the scan forgot them,
    # in the database too (a run made again under its name starts afresh).
    assert old["sets"] and old["steps"]
    assert state["sets"] == {} and state["steps"] == {}

    run_once_in_process(ws)  # migrated once: the next start leaves the renamed file alone
    assert ws.state()["spend"] == old_spend
    assert not legacy.exists()


def test_a_flush_writes_only_the_changed_rows(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    store = StateStore(tmp_path, path)
    ids = [f"r1/epoch_01/step_01/w{n:03d}/01-03" for n in range(50)]
    for set_id in ids:
        store.update(set_id, SetState.WAITING, reason="ep02.txt missing")
    store.step("r1/epoch_01/step_01").reported_at = 1.0
    assert store.flush()
    assert not store.flush()  # nothing changed since

    statements: list[str] = []
    assert store._db is not None
    store._db._conn.set_trace_callback(statements.append)
    store.update(ids[7], SetState.DONE, reason=None)
    store.forget(ids[8])
    assert store.flush()
    writes = [s for s in statements if s.startswith(("INSERT", "DELETE"))]
    # One row deleted, one written, the six meta values (pid, heartbeat, started and
    # scanned at, the LLM limits, the LLM endpoints): nothing of the other 48 sets.
    deleted, written = [w for w in writes if " sets " in w]
    assert deleted == f"DELETE FROM sets WHERE key = '{ids[8]}'"
    # The record's JSON, and its step and state in the columns status counts by.
    assert written.startswith(
        f"INSERT OR REPLACE INTO sets VALUES ('{ids[7]}', "
        f"'{json.dumps(_row(store, ids[7]), separators=(',', ':'))}', "
        "'r1/epoch_01/step_01', 'done', "), written
    assert len(writes) == 8 and all(" meta " in w for w in writes[2:])
    store.close()
    reread = state_db.read_only(path)
    assert reread is not None and len(reread["sets"]) == 49
    assert reread["sets"][ids[7]]["state"] == "done"
    assert reread["steps"]["r1/epoch_01/step_01"]["reported_at"] == 1.0


def _row(store: StateStore, set_id: str) -> dict[str, object]:
    rec = store.get(set_id)
    assert rec is not None
    return {**rec.__dict__, "state": rec.state.value}


def test_a_notice_naming_answer_key_words_is_stored_redacted(tmp_path: Path) -> None:
    # A notice's reason names folders and files, which the writer named: it is
    # checked against every work before it reaches the state, like a log line.
    from skilltrain.daemon.guard import leakguard

    line = "Nobody ever crosses the salt marsh after the lantern goes dark"
    index = leakguard.HumanIndex.build("w", {1: f"MARA\n{line}.\n"})
    leakguard.install(leakguard.AnswerKeys([index]))
    store = StateStore(tmp_path / "runs")
    store.notice("runs/r1/epoch_01", "set.ignored", f"a folder named '{line}'")
    # The path it is kept under is the writer's naming too.
    kept_as = store.notice(f"runs/r1/{line}", "set.ignored", "not an epoch_NN folder")
    assert len(store.notices) == 2 and kept_as in store.notices
    for path, entry in store.notices.items():
        assert "salt marsh" not in path + entry["reason"]
    assert leakguard.REDACTION_MARKER in store.notices["runs/r1/epoch_01"]["reason"]
    assert kept_as.startswith("runs/r1/") and leakguard.REDACTION_MARKER in kept_as


def test_the_counts_kept_as_sets_change_match_a_recount(tmp_path: Path) -> None:
    """counts() is kept up to date at each change (the main loop asks every
    second); it must always say what counting the records says."""
    import random
    from collections import Counter

    store = StateStore(tmp_path / "runs")
    rng = random.Random(7)
    states = list(SetState)
    for i in range(3000):
        set_id = f"r/epoch_00/step_00/w/{rng.randrange(200)}"
        if rng.random() < 0.15:
            store.forget(set_id)
        elif rng.random() < 0.3:
            store.update(set_id, rng.choice(states))  # a no-op when the state is the same
        else:
            store.update(set_id, rng.choice(states), reason=f"change {i}")
        if i % 500 == 0:
            assert store.counts() == Counter(r.state.value for r in store.sets.values())
    assert store.counts() == Counter(r.state.value for r in store.sets.values())
    store.flush()
    store.close()
    reloaded = StateStore(tmp_path / "runs")
    assert reloaded.load() is None
    assert reloaded.counts() == store.counts() and sum(reloaded.counts().values()) > 0


def _version_1(path: Path, sets: dict[str, dict[str, object]]) -> None:
    """A state database as a daemon before schema version 2 wrote it."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    for table in ("sets", "steps", "spend", "notices", "meta"):
        conn.execute(f"CREATE TABLE {table} (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.executemany("INSERT INTO sets VALUES (?, ?)",
                     [(key, json.dumps(value)) for key, value in sets.items()])
    conn.execute("INSERT INTO meta VALUES ('heartbeat', '1700000000.0')")
    conn.execute("PRAGMA user_version = 1")
    conn.close()


def test_a_version_1_database_is_read_by_status_and_upgraded_by_the_daemon(
        tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    path = runs / ".skilltrain" / "state.sqlite3"
    path.parent.mkdir(parents=True)
    sets = {f"{R}/epoch_01/step_0{n // 3}/w{n % 3}/01-03": {
        "state": "failed" if n == 4 else "done", "reason": "HTTP 500" if n == 4 else None,
        "attempts": 5 if n == 4 else 0, "next_retry_at": None, "fingerprint": None,
        "refused_fingerprint": None, "updated_at": 1700000000.0 + n} for n in range(9)}
    _version_1(path, sets)

    # A daemon of before still running it: status reads it as it is.
    before = status.collect(runs, all_sets=True)
    assert before["daemon"]["state_unreadable"] is None
    assert before["totals"] == {"done": 8, "failed": 1}
    assert [a["id"] for a in before["attention"]] == [f"{R}/epoch_01/step_01/w1/01-03"]
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 1

    store = StateStore(runs)
    assert store.load() is None  # upgraded in place, nothing lost
    assert len(store.sets) == 9
    store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == state_db.SCHEMA_VERSION
    assert conn.execute("SELECT step, state, updated_at FROM sets WHERE key = ?",
                        (f"{R}/epoch_01/step_01/w1/01-03",)).fetchone() == (
        f"{R}/epoch_01/step_01", "failed", 1700000004.0)
    conn.close()
    after = status.collect(runs, all_sets=True)
    for key in ("totals", "runs", "steps", "attention", "sets"):
        assert after[key] == before[key], key


def test_a_set_first_recorded_in_a_state_with_nothing_else_to_say_is_kept(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path / "runs", tmp_path / "state.sqlite3")
    store.update("r1/epoch_01/step_01/alpha/01-03", SetState.DONE)
    rec = store.get("r1/epoch_01/step_01/alpha/01-03")
    assert rec is not None and rec.state == SetState.DONE
    assert store.counts().get("done") == 1
    store.flush(force=True)
    store.close()
    again = StateStore(tmp_path / "runs", tmp_path / "state.sqlite3")
    again.load()
    assert (r := again.get("r1/epoch_01/step_01/alpha/01-03")) and r.state == SetState.DONE
    again.close()


def test_the_tally_counts_each_steps_set_records_not_done_across_a_reload(
        tmp_path: Path) -> None:
    # The step barrier's "not yet" after every job's end reads this count instead
    # of listing the step's sets: it must follow every change, forget and load.
    runs = tmp_path / "runs"
    step, other = "r1/epoch_00/step_00", "r1/epoch_00/step_01"
    store = StateStore(runs)
    store.load()
    store.update(f"{step}/w/01-03", SetState.QUEUED)
    store.update(f"{step}/w/04-06", SetState.RUNNING)
    store.update(f"{other}/w/01-03", SetState.DONE)
    assert (store.tally.open_in[step], store.tally.open_in[other]) == (2, 0)
    store.update(f"{step}/w/01-03", SetState.DONE)
    store.update(f"{step}/w/04-06", SetState.DONE, reason=None)
    assert store.tally.open_in[step] == 0
    store.update(f"{step}/w/04-06", SetState.STALE)
    store.update(f"{other}/w/01-03", SetState.FAILED)
    assert (store.tally.open_in[step], store.tally.open_in[other]) == (1, 1)
    store.forget(f"{other}/w/01-03")
    assert store.tally.open_in[other] == 0
    store.flush(force=True)
    store.close()

    again = StateStore(runs)
    again.load()
    assert (again.tally.open_in[step], again.tally.open_in[other]) == (1, 0)
    assert again.counts() == {"done": 1, "stale": 1}
