"""`skilltrain status` says what each LLM endpoint's limiter does (issue 36):
pacing on the provider's stated limit, adaptive, or BLOCKED by a refused key
(then as the first thing that needs attention). A real daemon, a real
`skilltrain status` process reading the state store, real HTTP."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_helpers import Start, build_workspace, release_llm_clients, run_cli, wait_until
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.limited_llm_server import RateLimits
from tests.llm_server import LLMServer, Reply, Request
from tests.test_refused_key import QUOTA

pytestmark = DAEMON_TEST_MARKS


@pytest.fixture(autouse=True)
def _release_llm_clients() -> Iterator[None]:
    yield
    release_llm_clients()


def test_status_says_what_the_endpoint_does_blocked_first_of_all(
    tmp_path: Path, start: Start
) -> None:
    limits = RateLimits(requests_per_s=50)
    refused = threading.Event()

    def answer(request: Request) -> Reply:
        return QUOTA if refused.is_set() else limits(request)

    with LLMServer(default=answer) as server:
        ws = build_workspace(tmp_path, server.url, works={"w0": 6, "w1": 6}, settle_s=0.0,
                             max_attempts=1, retry_backoff_s=0.1,
                             concurrency="adaptive")  # type: ignore[arg-type]
        text = ws.config_path.read_text()
        ws.config_path.write_text(text.replace("[loss]", "probe_refused_key_s = 0.5\n[loss]"))

        def status() -> str:
            return run_cli("status", "--config", str(ws.config_path))[0].stdout

        first = ws.write_step("r1", 1, 1, success=True)
        start(ws)
        wait_until(lambda: all(ws.has_report(s) for s in first), 30, message="step 1")
        wait_until(lambda: "pacing on the provider's stated limit (50 requests), calls "
                   "started " in status(), 10, message="the stated limit and rate in status")

        refused.set()
        second = ws.write_step("r1", 1, 2, success=True)
        wait_until(lambda: "BLOCKED" in status(), 15, message="BLOCKED in status")
        text = status()
        endpoint = [line for line in text.splitlines() if "BLOCKED" in line]
        assert endpoint and "the provider refuses the API key (quota) since" in endpoint[0]
        assert "next probe in" in endpoint[0]
        attention = text[text.index("needs attention"):].splitlines()
        assert attention[1].split()[0] == "blocked", attention  # first of all
        assert "loopback-model@127.0.0.1:" in attention[1]
        data = json.loads(run_cli("status", "--json", "--config", str(ws.config_path))[0]
                          .stdout)
        assert data["attention_by_kind"]["blocked"] == 1
        (row,) = [a for a in data["attention"] if a["kind"] == "blocked"]
        assert row["what"] == "endpoint" and "exceeded your current quota" in row["reason"]

        refused.clear()
        wait_until(lambda: all(ws.has_report(s) for s in second), 30, message="step 2")
        wait_until(lambda: "BLOCKED" not in status(), 10, message="BLOCKED gone")
        assert "pacing on the provider's stated limit" in status()
    assert len(ws.events("llm.blocked")) == 1 and len(ws.events("llm.unblocked")) == 1
