"""The loopback server, driven through the real litellm, pins down the mapping
the product relies on: content, finish_reason, usage, the exception class per
failure, where Retry-After lives, and that max_retries=0 means one request.

Measured with litellm 1.110.2 / openai 3.57 (see each test for the detail):
connection refused and a non-JSON 200 both surface as litellm.InternalServerError
(status_code 500), not APIConnectionError; tell them from a real HTTP 500 by
exc.litellm_response_headers being None (or the openai.APIConnectionError in
the __context__ chain).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply, Request

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def litellm() -> ModuleType:
    """litellm, imported once per module (about 3-5 s), banner silenced."""
    import litellm as _litellm

    _litellm.suppress_debug_info = True
    return _litellm


def complete(
    litellm: ModuleType,
    server: LLMServer,
    model: str,
    messages: list[dict[str, Any]] | None = None,
    timeout: float = 5.0,
    **kwargs: Any,
) -> Any:
    """One litellm call with the SDK's and litellm's own retries off unless overridden."""
    kwargs.setdefault("max_retries", 0)
    kwargs.setdefault("num_retries", 0)
    return litellm.completion(
        model=model,
        api_base=server.url,
        messages=messages or [{"role": "user", "content": "compare the episodes"}],
        timeout=timeout,
        **kwargs,
    )


def exception_chain(exc: BaseException | None) -> list[type[BaseException]]:
    """The classes along __cause__/__context__, outermost first."""
    seen: list[type[BaseException]] = []
    ids: set[int] = set()
    while exc is not None and id(exc) not in ids:
        ids.add(id(exc))
        seen.append(type(exc))
        exc = exc.__cause__ or exc.__context__
    return seen


def post(server: LLMServer, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A raw stdlib POST, for what litellm cannot send (stream=true, other paths)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


# -- successful replies ----------------------------------------------------------


def test_ok_maps_content_finish_reason_and_usage(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    messages = [
        {"role": "system", "content": "s" * 41},
        {"role": "user", "content": "u" * 400},
    ]
    content = "The pilot rushes the inciting incident by a scene."  # 50 chars
    llm_server.script(Reply.ok(content, cached_tokens=64))
    before = time.monotonic()

    response = complete(litellm, llm_server, llm_model, messages)

    after = time.monotonic()
    assert response.choices[0].message.content == content
    assert response.choices[0].finish_reason == "stop"
    # Token counts come from the input: (41 + 400) // 4 and 50 // 4.
    assert response.usage.prompt_tokens == 110
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == 122
    # Cached prompt tokens: litellm keeps OpenAI's shape on usage.prompt_tokens_details.
    assert response.usage.prompt_tokens_details.cached_tokens == 64

    (request,) = llm_server.requests
    assert request.path == "/v1/chat/completions"
    assert request.model == "loopback-model"  # litellm strips the "openai/" provider prefix
    assert request.body is not None and request.body["messages"] == messages
    assert request.headers["authorization"] == "Bearer sk-test-loopback"
    assert before <= request.monotonic <= after
    assert abs(request.wall - time.time()) < 5


def test_explicit_token_counts_override_the_computed_ones(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    llm_server.script(Reply.ok("x" * 400, prompt_tokens=5000, completion_tokens=900))
    response = complete(litellm, llm_server, llm_model)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (5000, 900)
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_prompt_tokens_depend_on_the_input(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    short = complete(litellm, llm_server, llm_model, [{"role": "user", "content": "a" * 40}])
    long = complete(litellm, llm_server, llm_model, [{"role": "user", "content": "a" * 4000}])
    assert (short.usage.prompt_tokens, long.usage.prompt_tokens) == (10, 1000)


def test_empty_reply_comes_back_as_empty_string(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    llm_server.script(Reply.empty())
    response = complete(litellm, llm_server, llm_model)
    # Measured: "" (not None), finish_reason "stop". The product must refuse it itself.
    assert response.choices[0].message.content == ""
    assert response.choices[0].finish_reason == "stop"


def test_truncated_reply_has_finish_reason_length(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    llm_server.script(Reply.truncated("The second act"))
    response = complete(litellm, llm_server, llm_model)
    assert response.choices[0].message.content == "The second act"
    assert response.choices[0].finish_reason == "length"


def test_script_is_consumed_in_order_then_default_answers(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    llm_server.script(Reply.ok("first"), Reply.ok("second"))
    assert llm_server.pending == 2
    contents = [
        complete(litellm, llm_server, llm_model).choices[0].message.content for _ in range(3)
    ]
    assert contents == ["first", "second", DEFAULT_REPORT]
    assert llm_server.pending == 0

    def echo_model(request: Request) -> Reply:
        return Reply.ok(f"model={request.model} n={len(request.messages)}")

    llm_server.default = echo_model
    response = complete(litellm, llm_server, llm_model)
    assert response.choices[0].message.content == "model=loopback-model n=1"
    assert llm_server.request_count == 4
    stamps = [r.monotonic for r in llm_server.requests]
    assert stamps == sorted(stamps)

    llm_server.clear()
    assert (llm_server.request_count, llm_server.requests) == (0, [])


# -- HTTP errors -----------------------------------------------------------------


def test_429_is_rate_limit_error_with_retry_after_reachable(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    llm_server.script(Reply.status(429, retry_after=7))
    with pytest.raises(litellm.RateLimitError) as caught:
        complete(litellm, llm_server, llm_model)
    exc = caught.value
    assert exc.status_code == 429
    # Two places carry the server's headers (both case-insensitive httpx.Headers):
    assert exc.response.headers["retry-after"] == "7"
    assert exc.litellm_response_headers["Retry-After"] == "7"
    # exc.headers exists on RateLimitError but is None: not the place to look.
    assert exc.headers is None
    assert llm_server.request_count == 1


def test_fractional_retry_after_on_503(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    llm_server.script(Reply.status(503, retry_after=1.5))
    with pytest.raises(litellm.ServiceUnavailableError) as caught:
        complete(litellm, llm_server, llm_model)
    assert caught.value.status_code == 503
    assert float(caught.value.litellm_response_headers["retry-after"]) == 1.5


@pytest.mark.parametrize(
    ("code", "exc_name"),
    [
        (400, "BadRequestError"),
        (401, "AuthenticationError"),
        (404, "NotFoundError"),
        (422, "BadRequestError"),
        (500, "InternalServerError"),
        (502, "BadGatewayError"),
        (503, "ServiceUnavailableError"),
        # Surprises: 408 and 504 come back as litellm.Timeout; 403 as the generic APIError.
        (403, "APIError"),
        (408, "Timeout"),
        (504, "Timeout"),
    ],
)
def test_status_maps_to_litellm_exception(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str, code: int, exc_name: str
) -> None:
    llm_server.script(Reply.status(code))
    with pytest.raises(Exception) as caught:
        complete(litellm, llm_server, llm_model)
    exc: Any = caught.value
    assert type(exc) is getattr(litellm, exc_name)
    assert exc.status_code == code
    assert exc.litellm_response_headers is not None  # a real HTTP answer came back
    assert llm_server.request_count == 1


@pytest.mark.parametrize(
    ("retry_kwargs", "attempts"),
    [
        ({}, 3),  # the OpenAI SDK's own default: 1 try + 2 retries
        ({"max_retries": 0}, 1),
        ({"num_retries": 0}, 1),
        # num_retries wins: litellm hands it to the SDK as max_retries...
        ({"max_retries": 2, "num_retries": 0}, 1),
        # ...and then retries N more times itself (2N + 1 attempts in all).
        ({"max_retries": 0, "num_retries": 1}, 3),
    ],
)
def test_retry_options_decide_the_number_of_attempts(
    litellm: ModuleType,
    llm_server: LLMServer,
    llm_model: str,
    retry_kwargs: dict[str, int],
    attempts: int,
) -> None:
    # The OpenAI SDK honours a short Retry-After, so its retries are quick here.
    llm_server.script(*[Reply.status(429, retry_after=0.01)] * 10)
    with pytest.raises(litellm.RateLimitError):
        litellm.completion(
            model=llm_model,
            api_base=llm_server.url,
            messages=[{"role": "user", "content": "hi"}],
            timeout=5,
            **retry_kwargs,
        )
    assert llm_server.request_count == attempts
    # The SDK numbers its own attempts; litellm's retries restart the count at 0.
    assert llm_server.requests[0].headers["x-stainless-retry-count"] == "0"


# -- broken replies and timeouts -------------------------------------------------


def test_malformed_json_is_internal_server_error_without_headers(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    llm_server.script(Reply.malformed())
    with pytest.raises(litellm.InternalServerError) as caught:
        complete(litellm, llm_server, llm_model)
    exc = caught.value
    # litellm fakes a 500 around the parse failure; the reply's text is in the message.
    assert exc.status_code == 500
    assert "Empty or invalid response" in str(exc)
    assert exc.litellm_response_headers is None
    assert llm_server.request_count == 1


def test_hang_past_timeout_raises_timeout_after_the_timeout(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    llm_server.script(Reply.hang(5))
    started = time.monotonic()
    with pytest.raises(litellm.Timeout) as caught:
        complete(litellm, llm_server, llm_model, timeout=1)
    elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 2.5
    assert caught.value.status_code == 408
    assert llm_server.request_count == 1  # max_retries=0: the SDK did not retry the timeout


def test_latency_delays_every_reply(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    llm_server.latency = (0.3, 0.3)
    started = time.monotonic()
    complete(litellm, llm_server, llm_model)
    assert time.monotonic() - started >= 0.3
    llm_server.latency = None
    llm_server.script(Reply.delay(0.3, Reply.ok("late")))
    started = time.monotonic()
    assert complete(litellm, llm_server, llm_model).choices[0].message.content == "late"
    assert time.monotonic() - started >= 0.3


# -- the server going away -------------------------------------------------------


def test_stopped_server_is_connection_error_then_restart_on_same_port(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    complete(litellm, llm_server, llm_model)  # leaves a keep-alive connection in the pool
    port = llm_server.port
    llm_server.stop()

    with pytest.raises(litellm.InternalServerError) as caught:
        complete(litellm, llm_server, llm_model)
    exc = caught.value
    # Measured: not litellm.APIConnectionError but a synthetic 500 with no headers; the
    # SDK's APIConnectionError and the ConnectionRefusedError sit in the __context__ chain.
    assert exc.status_code == 500
    assert exc.litellm_response_headers is None
    chain = exception_chain(exc)
    import openai

    assert openai.APIConnectionError in chain
    assert ConnectionRefusedError in chain

    llm_server.start()
    assert llm_server.port == port
    response = complete(litellm, llm_server, llm_model)
    assert response.choices[0].message.content == DEFAULT_REPORT
    assert llm_server.request_count == 2  # the refused request never arrived


def test_stop_during_a_hang_ends_it_fast_and_the_client_sees_a_connection_error(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    llm_server.script(Reply.hang(30))
    stopper = threading.Timer(0.3, llm_server.stop)
    stopper.start()
    started = time.monotonic()
    with pytest.raises(litellm.InternalServerError) as caught:
        complete(litellm, llm_server, llm_model, timeout=10)
    stopper.join()
    assert time.monotonic() - started < 5  # the hang is 30 s
    assert caught.value.status_code == 500
    assert "Connection error" in str(caught.value)


def test_a_hanging_request_does_not_block_others(
    litellm: ModuleType, llm_server: LLMServer, llm_model: str
) -> None:
    llm_server.script(Reply.hang(30))
    outcome: list[BaseException] = []

    def hanging() -> None:
        try:
            post(llm_server, "/v1/chat/completions", {"model": "m", "messages": []})
        except BaseException as exc:  # noqa: B036 - recorded for the assertion below
            outcome.append(exc)

    thread = threading.Thread(target=hanging)
    thread.start()
    while llm_server.request_count == 0:
        time.sleep(0.01)
    started = time.monotonic()
    assert complete(litellm, llm_server, llm_model).choices[0].message.content == DEFAULT_REPORT
    assert time.monotonic() - started < 5  # generous for a loaded machine; the hang is 30 s

    started = time.monotonic()
    llm_server.stop()
    thread.join(timeout=5)
    assert time.monotonic() - started < 5
    assert not thread.is_alive()
    assert len(outcome) == 1  # the hanging client was cut off, not answered


# -- without litellm -------------------------------------------------------------


def test_stream_requests_are_refused_and_unknown_paths_are_404(llm_server: LLMServer) -> None:
    status, body = post(llm_server, "/v1/chat/completions", {"model": "m", "stream": True})
    assert status == 400
    assert "stream" in body["error"]["message"]
    status, body = post(llm_server, "/v1/embeddings", {"model": "m"})
    assert status == 404
    status, body = post(llm_server, "/chat/completions", {"model": "m", "messages": []})
    assert status == 200 and body["choices"][0]["message"]["content"] == DEFAULT_REPORT
    assert [r.path for r in llm_server.requests] == [
        "/v1/chat/completions",
        "/v1/embeddings",
        "/chat/completions",
    ]


def test_custom_error_body_is_sent_verbatim(llm_server: LLMServer) -> None:
    llm_server.script(Reply.status(400, body={"error": {"message": "context too long"}}))
    assert post(llm_server, "/v1/chat/completions", {}) == (
        400,
        {"error": {"message": "context too long"}},
    )


def test_seeded_latency_is_reproducible() -> None:
    draws = []
    for _ in range(2):
        server = LLMServer(latency=(0.0, 1.0), seed=7)
        draws.append([server._draw_latency() for _ in range(5)])
    assert draws[0] == draws[1]
    assert len(set(draws[0])) == 5


def test_cli_serves_until_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.llm_server", "--port", "0", "--latency-max", "0.01"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on http://127.0.0.1:") and line.endswith("/v1")
        url = line.removeprefix("listening on ")
        req = urllib.request.Request(
            f"{url}/chat/completions",
            data=json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert json.loads(resp.read())["choices"][0]["message"]["content"] == DEFAULT_REPORT
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        stderr = proc.stderr.read()
        proc.stderr.close()
    assert "stopped after 1 requests" in stderr
