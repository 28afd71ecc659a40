"""The provider's stated limit moving mid-run (issue 36): the limiter re-anchors on
the new figure at once, and says so in one line; headers that go or come back
are said too. First the rule on its own, then against the limited loopback
whose limit is halved, raised and hidden while calls run."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from skilltrain.daemon.commands.tail_format import _f_llm_pacing
from skilltrain.daemon.infra.llm_headers import GONE_AFTER
from skilltrain.daemon.infra.llm_limit import Limiter
from tests.daemon_helpers import release_llm_clients
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.limited_llm_server import RateLimits
from tests.llm_server import LLMServer
from tests.test_llm_limit import calls, limiter, run

pytestmark = DAEMON_TEST_MARKS


@pytest.fixture(autouse=True)
def _release_llm_clients() -> Iterator[None]:
    yield
    release_llm_clients()


def stated(n: int, left: int | None = None) -> dict[str, str]:
    return {"x-ratelimit-limit-requests": str(n),
            "x-ratelimit-remaining-requests": str(n if left is None else left),
            "x-ratelimit-reset-requests": "1s"}


def pacing(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "llm.pacing"]


def test_a_changed_stated_limit_re_anchors_the_limit_at_once_and_says_so_once() -> None:
    async def scenario() -> None:
        lim, events, _ = limiter()
        lim.limit, lim.slow_start = 40, False
        # A new figure counts from its second reply in a row; a straggler (a reply
        # to a call sent before the change) does not flap it back and forth.
        for figure in (2400, 2400, 1200, 2400, 1200, 1200, 1200, 2400, 2400):
            lim.release(await lim.acquire(), "ok", headers=stated(figure))
        lines = pacing(events)
        assert [(e["change"], e["previous_requests_limit"], e["requests_limit"])
                for e in lines] == [("stated", None, 2400), ("changed", 2400, 1200),
                                    ("changed", 1200, 2400)]
        assert [(e["previous"], e["limit"]) for e in lines[1:]] == [(40, 20), (20, 40)]
        assert lim.limit == 40 and lim.usage.rate_limited == 0  # no 429 was needed
        text = " ".join(_f_llm_pacing(lines[1]))
        assert "pacing on the provider's stated limit: 2400 -> 1200 requests" in text
        # A 429 of a call admitted before the cut is the same episode: no second cut.
        lim.limit = 40
        old = await lim.acquire()
        for _ in range(2):
            lim.release(await lim.acquire(), "ok", headers=stated(1200))
        lim.release(old, "rate_limited", headers=stated(1200, left=0))
        assert lim.limit == 20

    run(scenario())


def test_headers_that_go_fall_back_to_aimd_and_their_return_is_said() -> None:
    async def scenario() -> None:
        lim, events, _ = limiter()
        lim.release(await lim.acquire(), "ok", headers=stated(600))
        for _ in range(GONE_AFTER - 1):
            lim.release(await lim.acquire(), "ok", headers={"content-type": "json"})
        lim.release(await lim.acquire(), "error")  # a timeout says nothing of headers
        assert [e["change"] for e in pacing(events)] == ["stated"]
        lim.release(await lim.acquire(), "ok")
        lim.release(await lim.acquire(), "ok", headers=stated(600))
        lines = pacing(events)
        assert [e["change"] for e in lines] == ["stated", "gone", "stated"]
        assert "states no limit any more (was 600 requests)" in " ".join(
            _f_llm_pacing(lines[1]))

    run(scenario())


def test_against_the_loopback_the_pacing_follows_its_limit_down_up_and_away() -> None:
    """R = 20/s halved to 10 after 1 s, back to 20 after 3 s, then no headers:
    each is one llm.pacing line as it happens, the calls-at-once limit follows
    the figure (no 429 episode needed), and no call fails."""
    limits = RateLimits(requests_per_s=20)
    events: list[dict[str, Any]] = []
    lim = Limiter("loopback", fixed=None, ceiling=64,
                  on_change=lambda event, **f: events.append({"event": event, **f,
                                                              "at": time.monotonic()}))
    seen: dict[str, int] = {}

    def snap(name: str) -> None:
        seen[name] = limits.limited

    def unstate() -> None:
        snap("unstated")
        limits.stated = False

    moves = [threading.Timer(1.0, snap, ["halved"]), threading.Timer(1.0, limits.set_rate, [10]),
             threading.Timer(3.0, snap, ["raised"]), threading.Timer(3.0, limits.set_rate, [20]),
             threading.Timer(4.5, unstate)]
    with LLMServer(default=limits, latency=(0.25, 0.25)) as server:
        t0 = time.monotonic()
        for timer in moves:
            timer.start()
        results = calls(server, lim, 110)
        for timer in moves:
            timer.join()
    assert not [r for r in results if isinstance(r, Exception)]
    lines = [(e["change"], e["previous_requests_limit"], e["requests_limit"])
             for e in pacing(events)]
    assert lines == [("stated", None, 20), ("changed", 20, 10), ("changed", 10, 20),
                     ("gone", 20, None)], lines
    halved, raised = pacing(events)[1:3]
    assert halved["at"] - t0 < 1.0 + 1.5  # within a reply or two of the change (loaded box)
    assert halved["limit"] <= max(1, round(halved["previous"] / 2))
    assert raised["limit"] > halved["limit"]
    # Served at the halved rate while it lasted; the change itself cost few 429s.
    assert limits.rate(t0 + 1.6, t0 + 3.0) <= 10 * 1.3
    print(f"429s: slow start {seen['halved']}, halved {seen['raised'] - seen['halved']}, "
          f"raised {seen['unstated'] - seen['raised']}, unstated "
          f"{limits.limited - seen['unstated']}; served {limits.served}")
    # Loose: the calls in flight at the change, and their retries, still meet the
    # new wall (2 to 26 429s seen on a loaded 2-core machine); the guarantee here
    # is the re-anchoring above, the rate is the bench's (bench/llm_bench.py limits).
    assert seen["unstated"] <= 0.5 * limits.served, seen


def test_a_stated_rate_is_paced_to_at_its_limit_with_few_429s() -> None:
    """R = 30/s, 0.4 s a reply, every reply stating the window: the calls are
    served at the stated rate, not a margin below it (issue 36 saw 84-88 %), and
    429s stay rare. Before pacing on the rate: 25.9/s of 30 with 75 429s."""
    limits = RateLimits(requests_per_s=30)
    lim = Limiter("loopback", fixed=None, ceiling=64)
    with LLMServer(default=limits, latency=(0.4, 0.4)) as server:
        results = calls(server, lim, 180)
    assert not [r for r in results if isinstance(r, Exception)]
    served = limits.served_at
    steady = limits.rate(served[len(served) // 5], served[-len(served) // 5])
    print(f"served {steady:.1f}/s of 30, {limits.limited} 429s")
    assert steady >= 30 * 0.9, steady
    assert limits.limited <= 180 * 0.03, limits.limited
