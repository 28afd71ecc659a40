"""A real loopback OpenAI-compatible chat completions server for tests and benchmarks.

litellm talks HTTP to it exactly as to a provider (model ``openai/<name>``,
``api_base=server.url``), so tests exercise litellm's real error mapping,
timeouts and token accounting instead of ``mock_response``'s fixed numbers.

    with LLMServer() as server:
        server.script(Reply.status(429, retry_after=2), Reply.ok("fine"))
        ...  # the first request gets a 429, the second "fine", later ones the default

Stdlib only, so bench/ scripts can run it in another process:
``python -m tests.llm_server --port 8765``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})

DEFAULT_REPORT = (
    "A craft report. The model episodes compress the second act and lose the "
    "midpoint reversal that the original builds over three scenes. Dialogue "
    "carries exposition that the original leaves to action lines. Scene endings "
    "resolve too early, so the cliffhanger pull between episodes is weaker."
)

# Error "type" and "code" per status, in the shape OpenAI sends them: litellm's
# exception mapping keys on the status, but a realistic body keeps messages honest.
_ERROR_KINDS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "permission_denied"),
    404: ("not_found_error", "model_not_found"),
    408: ("timeout_error", "timeout"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", "unprocessable_entity"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    502: ("server_error", "bad_gateway"),
    503: ("server_error", "overloaded"),
    504: ("server_error", "gateway_timeout"),
}


@dataclasses.dataclass(frozen=True)
class Request:
    """One request as the server saw it."""

    monotonic: float  # time.monotonic() on arrival, comparable with the test's clock
    wall: float  # time.time() on arrival
    path: str
    headers: dict[str, str]  # names lower-cased: "authorization", "x-stainless-retry-count"
    body: dict[str, Any] | None  # parsed JSON, None if the body was not a JSON object
    model: str | None  # body["model"]; litellm strips the "openai/" prefix

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The chat messages of the request, [] if there were none."""
        if self.body is None or not isinstance(self.body.get("messages"), list):
            return []
        return [m for m in self.body["messages"] if isinstance(m, dict)]

    @property
    def service_tier(self) -> str | None:
        """The request's service_tier ("flex"), None when it sent none."""
        tier = self.body.get("service_tier") if self.body is not None else None
        return tier if isinstance(tier, str) else None

    @property
    def prompt_chars(self) -> int:
        """Total characters of all message contents (text parts of multi-part ones too)."""
        return sum(_content_chars(m.get("content")) for m in self.messages)


def _content_chars(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # [{"type": "text", "text": "..."}, ...]
        texts = (p.get("text") for p in content if isinstance(p, dict))
        return sum(len(t) for t in texts if isinstance(t, str))
    return 0


@dataclasses.dataclass(frozen=True)
class Reply:
    """How the server answers one request. Build with the constructors, not directly."""

    kind: str  # "ok" | "error" | "raw" | "no_choices"
    code: int = 200  # HTTP status
    content: str = ""
    finish_reason: str = "stop"
    prompt_tokens: int | None = None  # None: computed from the request
    completion_tokens: int | None = None  # None: computed from content
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # sent as Anthropic's usage.cache_creation_input_tokens
    retry_after: float | None = None
    body: dict[str, Any] | None = None
    raw: bytes = b""
    delay_s: float = 0.0  # wait this long before answering
    headers: tuple[tuple[str, str], ...] = ()  # sent as they are (e.g. retry-after-ms)
    trickle_s: float = 0.0  # > 0: send the body one byte every trickle_s seconds

    @classmethod
    def ok(
        cls,
        content: str,
        finish_reason: str = "stop",
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> Reply:
        """A valid chat.completion. Unset token counts are derived from the input:
        prompt = chars of all message contents // 4, completion = len(content) // 4,
        each at least 1, so token accounting sees numbers that depend on the prompt."""
        return cls(
            kind="ok",
            content=content,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
            cache_write_tokens=cache_write_tokens,
        )

    @classmethod
    def status(
        cls, code: int, retry_after: float | None = None, body: dict[str, Any] | None = None
    ) -> Reply:
        """An HTTP error with an OpenAI-shaped error body (or `body` verbatim),
        plus a Retry-After header when `retry_after` is given."""
        return cls(kind="error", code=code, retry_after=retry_after, body=body)

    @classmethod
    def hang(cls, seconds: float, content: str = DEFAULT_REPORT) -> Reply:
        """Answer ok only after `seconds`: long enough for the client's timeout to fire.
        Stopping the server ends the wait at once (the connection is dropped)."""
        return cls.delay(seconds, cls.ok(content))

    @classmethod
    def malformed(cls) -> Reply:
        """HTTP 200 whose body is not JSON."""
        return cls(kind="raw", raw=b"<html>upstream proxy error: this is not JSON")

    @classmethod
    def empty(cls) -> Reply:
        """A valid completion whose content is the empty string."""
        return cls.ok("")

    @classmethod
    def truncated(cls, content: str = DEFAULT_REPORT[:80]) -> Reply:
        """A valid completion cut off at the token limit (finish_reason "length")."""
        return cls.ok(content, finish_reason="length")

    @classmethod
    def no_choices(cls) -> Reply:
        """A well-formed chat.completion with `choices: []` (no reply at all)."""
        return cls(kind="no_choices")

    @classmethod
    def trickle(cls, every_s: float = 2.0, content: str = DEFAULT_REPORT) -> Reply:
        """A valid completion whose body arrives one byte every `every_s` seconds:
        with `every_s` under the client's per-read timeout, no single read waits
        long enough for it to fire."""
        return dataclasses.replace(cls.ok(content), trickle_s=every_s)

    @classmethod
    def flex_unavailable(cls) -> Reply:
        """OpenAI flex's "429 Resource Unavailable": no flex capacity now (not billed).
        OpenAI's flex guide names the status and words; clients test `code`."""
        return cls.status(429, body={"error": {
            "message": "Resource Unavailable: flex processing has no capacity for this "
                       "request now", "type": "resource_unavailable",
            "code": "resource_unavailable", "param": None}})

    @classmethod
    def delay(cls, seconds: float, reply: Reply) -> Reply:
        """`reply`, sent after waiting `seconds`."""
        return dataclasses.replace(reply, delay_s=seconds)


Responder = Callable[[Request], Reply]


@dataclasses.dataclass
class FlexCapacity:
    """A responder with OpenAI's flex tier: a request with service_tier "flex" is
    refused (Reply.flex_unavailable) while `unavailable` is set, and also the first
    `refuse_first` flex requests; every other request gets `reply`."""

    refuse_first: int = 0
    reply: Reply = dataclasses.field(default_factory=lambda: Reply.ok(DEFAULT_REPORT))
    unavailable: threading.Event = dataclasses.field(default_factory=threading.Event)
    flex: int = 0  # flex requests seen
    refused: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def __call__(self, request: Request) -> Reply:
        if request.service_tier != "flex":
            return self.reply
        with self._lock:
            self.flex += 1
            refuse = self.unavailable.is_set() or self.flex <= self.refuse_first
            self.refused += refuse
        return Reply.flex_unavailable() if refuse else self.reply


def default_responder(request: Request) -> Reply:
    """The reply when nothing is scripted: a fixed multi-sentence report."""
    return Reply.ok(DEFAULT_REPORT)


def completion_body(reply: Reply, request: Request) -> dict[str, Any]:
    """The chat.completion JSON for an "ok" reply to `request`."""
    prompt = reply.prompt_tokens
    if prompt is None:
        prompt = max(1, request.prompt_chars // 4)
    completion = reply.completion_tokens
    if completion is None:
        completion = max(1, len(reply.content) // 4)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
    }
    if reply.cache_write_tokens:
        usage["cache_creation_input_tokens"] = reply.cache_write_tokens
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model or "loopback-model",
        # The tier that served it, as OpenAI says it: "flex" when asked, else "default".
        "service_tier": "flex" if request.service_tier == "flex" else "default",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply.content},
                "finish_reason": reply.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage,
    }


def error_body(code: int) -> dict[str, Any]:
    """An OpenAI-shaped error body for HTTP status `code`."""
    err_type, err_code = _ERROR_KINDS.get(code, ("api_error", str(code)))
    return {"error": {"message": f"loopback: HTTP {code}", "type": err_type, "code": err_code}}


def _retry_after_header(seconds: float) -> str:
    # Integral seconds are what providers send; a fraction keeps short test waits short.
    return str(int(seconds)) if float(seconds).is_integer() else repr(float(seconds))


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keeps connections alive like a real provider, so the client's
    # connection pool (and its stale connections after a restart) is exercised too.
    protocol_version = "HTTP/1.1"
    timeout = 120  # an idle keep-alive connection frees its thread after this long
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._track(self.connection, add=False)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests and benchmarks must not drown in access logs."""

    def do_GET(self) -> None:
        self._send_json(404, error_body(404))

    def do_POST(self) -> None:
        owner = self.server.owner
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        request = _make_request(self.path, {k.lower(): v for k, v in self.headers.items()}, raw)
        owner._record(request)
        if self.path not in CHAT_PATHS:
            self._send_json(404, error_body(404))
            return
        if request.body is not None and request.body.get("stream"):
            self._send_json(400, _message_error(400, "loopback server does not stream"))
            return
        reply = owner._next_reply(request)
        if self.server.stopping.wait(reply.delay_s + owner._draw_latency()):
            # Stopping: drop the connection unanswered, like a server going away.
            self.close_connection = True
            return
        self._send_reply(reply, request)

    def _send_reply(self, reply: Reply, request: Request) -> None:
        if reply.kind == "ok" and reply.trickle_s > 0:
            payload = json.dumps(completion_body(reply, request)).encode()
            self._send(200, payload, "application/json", {}, trickle_s=reply.trickle_s)
        elif reply.kind == "ok":
            self._send_json(200, completion_body(reply, request), dict(reply.headers))
        elif reply.kind == "no_choices":
            body = completion_body(Reply.ok(""), request)
            body["choices"] = []
            self._send_json(200, body)
        elif reply.kind == "error":
            headers = {}
            if reply.retry_after is not None:
                headers["Retry-After"] = _retry_after_header(reply.retry_after)
            headers.update(reply.headers)
            body = reply.body if reply.body is not None else error_body(reply.code)
            self._send_json(reply.code, body, headers)
        else:
            self._send(reply.code, reply.raw, "text/html", {})

    def _send_json(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        self._send(status, json.dumps(body).encode(), "application/json", headers or {})

    def _send(
        self,
        status: int,
        payload: bytes,
        ctype: str,
        headers: dict[str, str],
        trickle_s: float = 0.0,
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if trickle_s <= 0:
                self.wfile.write(payload)
                return
            for i in range(len(payload)):
                self.wfile.write(payload[i : i + 1])
                self.wfile.flush()
                if self.server.stopping.wait(trickle_s):
                    self.close_connection = True
                    return
        except OSError:
            # The client gave up (its timeout fired) or stop() cut the socket.
            self.close_connection = True


def _message_error(code: int, message: str) -> dict[str, Any]:
    body = error_body(code)
    body["error"]["message"] = message
    return body


def _make_request(path: str, headers: dict[str, str], raw: bytes) -> Request:
    body: dict[str, Any] | None
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = None
    body = parsed if isinstance(parsed, dict) else None
    model = body.get("model") if body is not None else None
    return Request(
        monotonic=time.monotonic(),
        wall=time.time(),
        path=path,
        headers=headers,
        body=body,
        model=model if isinstance(model, str) else None,
    )


class _HTTPServer(ThreadingHTTPServer):
    allow_reuse_address = True  # restart on the same port despite TIME_WAIT
    daemon_threads = True
    # socketserver's default backlog is 5: a burst of 40 connects on a loaded
    # machine overflows it and the dropped SYNs come back only after the
    # kernel's 1 s, 3 s, 7 s... retransmits (a provider listens with far more).
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], owner: LLMServer) -> None:
        self.owner = owner
        # One per run, so a handler left over from before a restart still sees its stop.
        self.stopping = threading.Event()
        super().__init__(address, _Handler)


class LLMServer:
    """A loopback fake of the OpenAI chat completions API, restartable on its port.

    State (recorded requests, scripted replies, default responder, latency)
    survives stop()/start(), so a test can take the server away and bring it back.
    """

    def __init__(
        self,
        port: int = 0,
        *,
        default: Responder = default_responder,
        latency: tuple[float, float] | None = None,
        seed: int = 0,
    ) -> None:
        self.default: Responder = default
        self.latency: tuple[float, float] | None = latency
        self._port = port
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._requests: list[Request] = []
        self._queue: collections.deque[Reply] = collections.deque()
        self._connections: set[socket.socket] = set()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> LLMServer:
        """Bind 127.0.0.1 (the first start picks a free port; restarts reuse it) and serve."""
        if self._httpd is not None:
            raise RuntimeError("LLMServer already started")
        httpd = _HTTPServer(("127.0.0.1", self._port), self)
        self._port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"llm-server-{self._port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port; pending and hanging requests are dropped."""
        httpd, thread = self._httpd, self._thread
        if httpd is None or thread is None:
            return
        # Order matters: wake hanging handlers first, then stop accepting, then cut
        # idle keep-alive connections so clients see the server gone, not a live socket.
        httpd.stopping.set()
        httpd.shutdown()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the peer
        httpd.server_close()
        thread.join(timeout=5)
        self._httpd = None
        self._thread = None

    def __enter__(self) -> LLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The bound port (0 before the first start when no port was given)."""
        return self._port

    @property
    def url(self) -> str:
        """The api_base for litellm: ``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self._port}/v1"

    @property
    def running(self) -> bool:
        return self._httpd is not None

    # -- scripting and inspection ----------------------------------------------

    def script(self, *replies: Reply) -> None:
        """Queue replies, consumed in order, one per request; then `default` answers."""
        with self._lock:
            self._queue.extend(replies)

    @property
    def pending(self) -> int:
        """Scripted replies not yet consumed."""
        with self._lock:
            return len(self._queue)

    @property
    def requests(self) -> list[Request]:
        """A copy of every request received so far, in arrival order."""
        with self._lock:
            return list(self._requests)

    @property
    def request_count(self) -> int:
        with self._lock:
            return len(self._requests)

    def clear(self) -> None:
        """Forget recorded requests and scripted replies."""
        with self._lock:
            self._requests.clear()
            self._queue.clear()

    # -- used by the handler threads -------------------------------------------

    def _record(self, request: Request) -> None:
        with self._lock:
            self._requests.append(request)

    def _next_reply(self, request: Request) -> Reply:
        with self._lock:
            scripted = self._queue.popleft() if self._queue else None
        return scripted if scripted is not None else self.default(request)

    def _draw_latency(self) -> float:
        latency = self.latency
        if latency is None:
            return 0.0
        with self._lock:  # one seeded stream across threads: reproducible in sum
            return self._rng.uniform(*latency)

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)


def main(argv: list[str] | None = None) -> int:
    """Run the server in the foreground until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m tests.llm_server", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--latency-min", type=float, default=None, metavar="S")
    parser.add_argument("--latency-max", type=float, default=None, metavar="S")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    latency = None
    if args.latency_min is not None or args.latency_max is not None:
        low = args.latency_min if args.latency_min is not None else 0.0
        high = args.latency_max if args.latency_max is not None else low
        if not 0 <= low <= high:
            parser.error("need 0 <= --latency-min <= --latency-max")
        latency = (low, high)

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()  # only a flag: the main thread does the shutdown

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = LLMServer(args.port, latency=latency, seed=args.seed).start()
    print(f"listening on {server.url}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
    print(f"stopped after {server.request_count} requests", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
