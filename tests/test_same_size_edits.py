"""An episode rewritten after its report in a way that keeps its size, mtime
and inode (`rsync --inplace -t`, `cp --preserve=timestamps` over it, `touch
-r`): only its ctime moves, and the stat signature (daemon/service/observe.py)
must see it, with the state kept or lost. A ctime that moves with the text
unchanged (chmod, a new hard link) is no change: the content hashes say so,
nothing is sent again. Signatures kept by a daemon from before ctime was in
them (state and sidecars) cost a re-hash after the upgrade, never a new
report. Real files, a real daemon in this process, a loopback LLM server."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from skilltrain.daemon.core import config, layout
from skilltrain.daemon.infra.state import StateStore
from skilltrain.daemon.service.observe import observe, sigs_digest
from tests.daemon_helpers import SetId, Workspace, build_workspace, run_once_in_process
from tests.llm_server import LLMServer

SET = SetId("r1", 0, 0, "alpha", 1, 3)
KEY = layout.SetKey(SET.run, SET.epoch, SET.step, SET.work, SET.first, SET.last)


def reported(tmp_path: Path, server: LLMServer) -> Workspace:
    ws = build_workspace(tmp_path, server.url, works={"alpha": 3},
                         extra="[integrity]\naudit_on_start = false\n")
    ws.write_step("r1", 0, 0, success=True)
    run_once_in_process(ws)
    assert ws.has_report(SET) and server.request_count == 1
    return ws


def episode(ws: Workspace) -> Path:
    return ws.scripts("r1", 0, 0, "alpha") / "ep02.txt"


def rewrite_in_place_keeping_mtime(path: Path) -> None:
    """Other text of the same size, in the same inode, its mtime put back."""
    before = path.stat()
    old = path.read_bytes()
    with open(path, "r+b") as f:
        f.write(old.swapcase())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert path.read_bytes() != old
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == \
        (before.st_size, before.st_mtime_ns, before.st_ino)
    assert after.st_ctime_ns != before.st_ctime_ns


def sidecar_matches_disk(ws: Workspace) -> bool:
    sha = ws.read_sidecar(SET)["model_episodes"]["ep02.txt"]
    return bool(sha == hashlib.sha256(episode(ws).read_bytes()).hexdigest())


def lose_state(ws: Workspace) -> None:
    for path in ws.state_file.parent.glob(ws.state_file.name + "*"):
        path.unlink()


def signature_now(ws: Workspace) -> str:
    cfg = config.load(ws.config_path)
    return sigs_digest(observe(KEY, cfg.paths.runs, cfg.paths.data).sigs)


def test_a_same_size_rewrite_with_its_mtime_put_back_is_redone(
        tmp_path: Path, llm_server: LLMServer) -> None:
    ws = reported(tmp_path, llm_server)
    rewrite_in_place_keeping_mtime(episode(ws))
    run_once_in_process(ws)
    assert llm_server.request_count == 2 and sidecar_matches_disk(ws)
    assert ws.state()["sets"][SET.id]["state"] == "done"


def test_a_same_size_rewrite_is_redone_after_a_lost_state_too(
        tmp_path: Path, llm_server: LLMServer) -> None:
    ws = reported(tmp_path, llm_server)
    rewrite_in_place_keeping_mtime(episode(ws))
    lose_state(ws)  # only the sidecar's kept signature is left to judge by
    run_once_in_process(ws)
    assert llm_server.request_count == 2 and sidecar_matches_disk(ws)


def test_a_chmod_or_a_hard_link_moves_ctime_but_redoes_nothing(
        tmp_path: Path, llm_server: LLMServer) -> None:
    ws = reported(tmp_path, llm_server)
    path = episode(ws)
    before = path.stat().st_ctime_ns
    path.chmod(0o600)
    os.link(path, ws.outside / "ep02-backup.txt")
    assert path.stat().st_ctime_ns != before
    run_once_in_process(ws)
    assert llm_server.request_count == 1 and ws.events("set.stale") == []
    record = ws.state()["sets"][SET.id]
    # The hashes said "unchanged" once; the new signature is kept, so the next
    # look is stat calls again.
    assert record["state"] == "done" and record["fingerprint"]["sigs"] == signature_now(ws)


def old_signature(ws: Workspace) -> str:
    """sigs_digest as a daemon from before ctime was in it wrote it."""
    scripts = ws.scripts("r1", 0, 0, "alpha")
    text = ";".join(f"{n}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
                    for n in (1, 2, 3) for st in [(scripts / f"ep{n:02d}.txt").stat()])
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def as_an_older_daemon_left_it(ws: Workspace) -> None:
    """The state's fingerprint and the sidecar's signature in the old format."""
    old = old_signature(ws)
    sidecar = ws.read_sidecar(SET)
    sidecar["model_stat_sigs"] = old
    ws.sidecar(SET).write_text(json.dumps(sidecar), encoding="utf-8")
    cfg = config.load(ws.config_path)
    state = StateStore(cfg.paths.runs, cfg.paths.state)
    state.load()
    record = state.get(SET.id)
    assert record is not None and record.fingerprint is not None
    state.update(SET.id, record.state, fingerprint={**record.fingerprint, "sigs": old})
    state.flush(force=True)
    state.close()


def test_an_upgraded_daemon_rehashes_old_signatures_and_sends_nothing(
        tmp_path: Path, llm_server: LLMServer) -> None:
    ws = reported(tmp_path, llm_server)
    as_an_older_daemon_left_it(ws)
    assert ws.state()["sets"][SET.id]["fingerprint"]["sigs"] == old_signature(ws)
    run_once_in_process(ws)
    assert llm_server.request_count == 1 and ws.events("set.stale") == []
    assert ws.state()["sets"][SET.id]["fingerprint"]["sigs"] == signature_now(ws)
    lose_state(ws)  # and with only the old sidecar to go by
    run_once_in_process(ws)
    assert llm_server.request_count == 1 and ws.events("set.stale") == []


def test_an_upgraded_daemon_redoes_a_rewrite_the_older_one_could_not_see(
        tmp_path: Path, llm_server: LLMServer) -> None:
    ws = reported(tmp_path, llm_server)
    as_an_older_daemon_left_it(ws)
    rewrite_in_place_keeping_mtime(episode(ws))  # the old signature still matches it
    assert old_signature(ws) == ws.read_sidecar(SET)["model_stat_sigs"]
    run_once_in_process(ws)
    assert llm_server.request_count == 2 and sidecar_matches_disk(ws)
