"""Every form a server says "come back later" in, over real HTTP to the loopback server.

Retry-After in seconds (integral or not), Retry-After as an HTTP date, and
the OpenAI-style retry-after-ms: each is honoured (up to backoff_max_s), on
a 429 and on a 503. The wait is what the retry policy asks its `sleep` for.
"""

from __future__ import annotations

import email.utils
import time

import pytest

from skilltrain.daemon.core.config import LLMConfig
from skilltrain.daemon.infra import llm
from tests.conftest import LOOPBACK_MODEL
from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply

MESSAGES = [{"role": "user", "content": "Compare these two screenplays."}]
BACKOFF_MAX_S = 60.0


def settings(server: LLMServer) -> LLMConfig:
    # Backoff alone waits at most 0.01 s: anything longer came from the server.
    return LLMConfig(model=LOOPBACK_MODEL, api_base=server.url, timeout_s=10.0, max_retries=2,
                     backoff_initial_s=0.01, backoff_max_s=BACKOFF_MAX_S)


def waits_for(server: LLMServer, first: Reply) -> list[float]:
    server.script(first, Reply.ok(DEFAULT_REPORT))
    waits: list[float] = []
    completion = llm.complete(MESSAGES, settings(server), sleep=waits.append)
    assert completion.text == DEFAULT_REPORT and completion.attempts == 2
    return waits


@pytest.mark.parametrize("code", [429, 503])
@pytest.mark.parametrize(
    ("headers", "low", "high"),
    [
        pytest.param((("Retry-After", "7"),), 7.0, 7.0, id="seconds"),
        pytest.param((("Retry-After", "2.5"),), 2.5, 2.5, id="fractional-seconds"),
        pytest.param((("retry-after-ms", "1500"),), 1.5, 1.5, id="retry-after-ms"),
        # An HTTP date has whole seconds: 20 s ahead is 19-20 s from now.
        pytest.param("date+20", 18.0, 20.0, id="http-date"),
    ],
)
def test_every_retry_after_form_is_honoured(
    llm_server: LLMServer, code: int, headers: tuple[tuple[str, str], ...] | str,
    low: float, high: float,
) -> None:
    if headers == "date+20":
        headers = (("Retry-After", email.utils.formatdate(time.time() + 20, usegmt=True)),)
    assert isinstance(headers, tuple)
    waits = waits_for(llm_server, Reply(kind="error", code=code, headers=headers))
    assert len(waits) == 1 and low <= waits[0] <= high, waits


def test_a_date_in_the_past_means_no_extra_wait(llm_server: LLMServer) -> None:
    past = email.utils.formatdate(time.time() - 3600, usegmt=True)
    waits = waits_for(llm_server, Reply(kind="error", code=429, headers=(("Retry-After", past),)))
    assert len(waits) == 1 and 0 <= waits[0] <= 0.01


def test_retry_after_ms_wins_over_retry_after(llm_server: LLMServer) -> None:
    both = (("Retry-After", "30"), ("retry-after-ms", "400"))
    assert waits_for(llm_server, Reply(kind="error", code=429, headers=both)) == [0.4]


def test_the_last_retry_after_reaches_the_daemon_in_every_form(llm_server: LLMServer) -> None:
    """When a job gives up, LLMError carries the server's last word for the set's retry."""
    date = email.utils.formatdate(time.time() + 20, usegmt=True)
    llm_server.script(
        Reply(kind="error", code=429, headers=(("retry-after-ms", "100"),)),
        Reply(kind="error", code=429, headers=(("Retry-After", date),)),
    )
    cfg = settings(llm_server).model_copy(update={"max_retries": 1})
    with pytest.raises(llm.LLMError) as failed:
        llm.complete(MESSAGES, cfg, sleep=lambda s: None)
    assert failed.value.retry_after_s is not None and 18.0 <= failed.value.retry_after_s <= 20.0
