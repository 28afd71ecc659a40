"""A real loopback OpenAI-compatible batch API: /v1/files and /v1/batches.

litellm's create_file / create_batch / retrieve_batch / list_batches /
cancel_batch / file_content talk HTTP to it exactly as to OpenAI. It also
answers /v1/chat/completions (the live path: `batch_failed = "live"`, the
bench's live half), with the same replies.

A batch runs by its plan (BatchPlan): done after `latency_s`, some requests
failed, expired or cancelled with only some answered, or held at a point of
its life (after the upload, after the create) so a test can SIGKILL the
daemon right there. Everything the server saw is counted: uploads, batches
created, requests answered (billed), polls.

    with BatchServer() as server:
        server.plan = BatchPlan(latency_s=0.3, fail={"alpha/04-06"})
"""

from __future__ import annotations

import dataclasses
import email.parser
import email.policy
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import parse_qs, urlparse

from tests.llm_server import DEFAULT_REPORT, Reply, Request, completion_body

Responder = Callable[[dict[str, Any]], Reply]
QUOTA_BODY = {"error": {"message": "You exceeded your current quota, please check your plan "
                                   "and billing details.", "type": "insufficient_quota",
                        "param": None, "code": "insufficient_quota"}}


def default_responder(body: dict[str, Any]) -> Reply:
    return Reply.ok(DEFAULT_REPORT)


@dataclasses.dataclass
class BatchPlan:
    """How the next batches behave (read when a batch is created)."""

    latency_s: float = 0.2  # created -> completed (or expired)
    end: str = "completed"  # "completed" | "expired" | "failed" (the whole batch)
    answered: int | None = None  # expired: how many requests got an answer first
    fail: Callable[[dict[str, Any]], bool] = lambda line: False  # item -> error line
    fail_message: str = "loopback: this request failed"
    hold_after_upload: threading.Event | None = None  # set: the upload's reply waits for it
    hold_after_create: threading.Event | None = None  # set: the create's reply waits for it


@dataclasses.dataclass
class _Batch:
    id: str
    input_file_id: str
    metadata: dict[str, str]
    created_at: float
    plan: BatchPlan
    lines: list[dict[str, Any]]
    status: str = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    cancelled_at: float | None = None
    counts: dict[str, int] = dataclasses.field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "batch", "endpoint": "/v1/chat/completions",
                "errors": ({"object": "list", "data": [{"code": "loopback",
                                                          "message": "loopback: batch failed"}]}
                           if self.status == "failed" else None),
                "input_file_id": self.input_file_id, "completion_window": "24h",
                "status": self.status, "output_file_id": self.output_file_id,
                "error_file_id": self.error_file_id, "created_at": int(self.created_at),
                "in_progress_at": None, "expires_at": int(self.created_at) + 86400,
                "finalizing_at": None, "completed_at": None, "failed_at": None,
                "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                "request_counts": {"total": len(self.lines),
                                   "completed": self.counts.get("completed", 0),
                                   "failed": self.counts.get("failed", 0)},
                "metadata": self.metadata}


class LoopbackServer:
    """A ThreadingHTTPServer on 127.0.0.1's next free port, serving `HANDLER` in a
    thread; the handler reaches this object as `self.server.owner`."""

    HANDLER: type[BaseHTTPRequestHandler]
    THREAD_NAME = "loopback-server"
    _httpd: ThreadingHTTPServer | None = None

    def start(self) -> Self:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), self.HANDLER)
        httpd.daemon_threads = True
        httpd.owner = self  # type: ignore[attr-defined]
        self._httpd = httpd
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True, name=self.THREAD_NAME).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def root_url(self) -> str:
        assert self._httpd is not None
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"


class BatchServer(LoopbackServer):
    """The loopback files + batches API (and chat completions)."""

    THREAD_NAME = "batch-server"

    def __init__(self, *, responder: Responder = default_responder) -> None:
        self.responder = responder
        self.plan = BatchPlan()
        # The plans of the next batches, one each in order, before `plan`: a test
        # that changed `plan` after an event raced the daemon's next create.
        self.next_plans: list[BatchPlan] = []
        self._lock = threading.Lock()
        self.files: dict[str, bytes] = {}
        self.batches: dict[str, _Batch] = {}
        self.uploads = 0
        self.creates = 0
        self.reject_creates = 0  # the next this many creates get HTTP 400 (not accepted)
        self.deleted = 0  # files deleted (DELETE /v1/files/<id>)
        self.refuse_key = False  # while set: every request gets 429 insufficient_quota
        self.key_refusals = 0
        self.rejected = 0
        self.polls = 0
        self.cancels = 0
        self.billed: list[str] = []  # custom_id of every request answered in a batch
        self.live_requests = 0
        self.era = 0  # set by a test: which daemon was running when a request came
        self.live_log: list[tuple[int, dict[str, Any]]] = []  # (era, body) of each live call

    @property
    def url(self) -> str:
        return f"{self.root_url}/v1"

    # -- what a test looks at
    def batch_list(self) -> list[_Batch]:
        with self._lock:
            return list(self.batches.values())

    def request_lines(self) -> list[dict[str, Any]]:
        """Every request line of every batch created."""
        return [line for batch in self.batch_list() for line in batch.lines]

    # -- the API
    def upload(self, data: bytes) -> dict[str, Any]:
        with self._lock:
            file_id = f"file-{uuid.uuid4().hex[:20]}"
            self.files[file_id] = data
            self.uploads += 1
        return {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                "filename": "input.jsonl", "purpose": "batch", "status": "processed"}

    def delete(self, file_id: str) -> dict[str, Any] | None:
        with self._lock:
            if self.files.pop(file_id, None) is None:
                return None
            self.deleted += 1
        return {"id": file_id, "object": "file", "deleted": True}

    def create(self, body: dict[str, Any]) -> dict[str, Any] | None:
        with self._lock:
            data = self.files.get(str(body.get("input_file_id")))
            if data is None:
                return None
            lines = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
            batch = _Batch(id=f"batch_{uuid.uuid4().hex[:20]}",
                           input_file_id=str(body["input_file_id"]),
                           metadata=dict(body.get("metadata") or {}), created_at=time.monotonic(),
                           plan=self.next_plans.pop(0) if self.next_plans else self.plan,
                           lines=lines)
            self.batches[batch.id] = batch
            self.creates += 1
            return batch.as_json()

    def take_rejection(self) -> bool:
        with self._lock:
            if self.reject_creates <= 0:
                return False
            self.reject_creates -= 1
            self.rejected += 1
            return True

    def retrieve(self, batch_id: str) -> dict[str, Any] | None:
        with self._lock:
            self.polls += 1
            batch = self.batches.get(batch_id)
            if batch is None:
                return None
            self._advance(batch)
            return batch.as_json()

    def cancel(self, batch_id: str) -> dict[str, Any] | None:
        with self._lock:
            batch = self.batches.get(batch_id)
            if batch is None:
                return None
            self.cancels += 1
            if batch.status in ("validating", "in_progress"):
                batch.status = "cancelling"
                batch.cancelled_at = time.monotonic()
            return batch.as_json()

    def listing(self, after: str | None, limit: int) -> dict[str, Any]:
        with self._lock:
            newest_first = sorted(self.batches.values(), key=lambda b: -b.created_at)
            if after is not None:
                ids = [b.id for b in newest_first]
                newest_first = newest_first[ids.index(after) + 1:] if after in ids else []
            page = newest_first[:limit]
            return {"object": "list", "data": [b.as_json() for b in page],
                    "first_id": page[0].id if page else None,
                    "last_id": page[-1].id if page else None,
                    "has_more": len(newest_first) > limit}

    def _advance(self, batch: _Batch) -> None:
        """Move a batch on by the clock (under the lock)."""
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return
        if batch.status == "cancelling":
            self._finish(batch, "cancelled", answered=0)
            return
        if time.monotonic() - batch.created_at < batch.plan.latency_s:
            batch.status = "in_progress"
            return
        plan = batch.plan
        if plan.end == "expired":
            self._finish(batch, "expired", answered=plan.answered or 0)
        elif plan.end == "failed":
            self._finish(batch, "failed", answered=0)
        else:
            self._finish(batch, "completed", answered=len(batch.lines))

    def _finish(self, batch: _Batch, status: str, answered: int) -> None:
        out: list[str] = []
        err: list[str] = []
        for line in batch.lines[:answered]:
            custom_id = line["custom_id"]
            if batch.plan.fail(line):
                err.append(json.dumps({"id": f"req_{uuid.uuid4().hex[:8]}", "custom_id": custom_id,
                                       "response": {"status_code": 500, "body": {"error": {
                                           "message": batch.plan.fail_message,
                                           "type": "server_error"}}},
                                       "error": {"code": "server_error",
                                                 "message": batch.plan.fail_message}}))
                continue
            body = line["body"]
            request = Request(time.monotonic(), time.time(), "/v1/chat/completions", {}, body,
                              body.get("model"))
            reply = self.responder(body)
            out.append(json.dumps({"id": f"req_{uuid.uuid4().hex[:8]}", "custom_id": custom_id,
                                   "response": {"status_code": 200,
                                                "request_id": uuid.uuid4().hex[:8],
                                                "body": completion_body(reply, request)},
                                   "error": None}))
            self.billed.append(custom_id)
        if out:
            batch.output_file_id = f"file-{uuid.uuid4().hex[:20]}"
            self.files[batch.output_file_id] = ("\n".join(out) + "\n").encode()
        if err:
            batch.error_file_id = f"file-{uuid.uuid4().hex[:20]}"
            self.files[batch.error_file_id] = ("\n".join(err) + "\n").encode()
        batch.counts = {"completed": len(out), "failed": len(err)}
        batch.status = status

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.live_requests += 1
            self.live_log.append((self.era, body))
        request = Request(time.monotonic(), time.time(), "/v1/chat/completions", {}, body,
                          body.get("model"))
        return completion_body(self.responder(body), request)


_BATCH = re.compile(r"/v1/batches/([^/]+)$")
_CANCEL = re.compile(r"/v1/batches/([^/]+)/cancel$")
_CONTENT = re.compile(r"/v1/files/([^/]+)/content$")
_FILE = re.compile(r"/v1/files/([^/]+)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    @property
    def owner(self) -> BatchServer:
        return self.server.owner  # type: ignore[attr-defined,no-any-return]

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _json(self, status: int, body: Any) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, payload: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _missing(self) -> None:
        self._json(404, {"error": {"message": "loopback: not found",
                                   "type": "invalid_request_error"}})

    def do_GET(self) -> None:
        url = urlparse(self.path)
        owner = self.owner
        if owner.refuse_key:  # a poll with the key refused (its credit gone meanwhile)
            with owner._lock:
                owner.key_refusals += 1
            self._json(429, QUOTA_BODY)
        elif m := _CONTENT.fullmatch(url.path):
            data = owner.files.get(m.group(1))
            if data is None:
                self._missing()
            else:
                self._send(200, data, "application/octet-stream")
        elif m := _BATCH.fullmatch(url.path):
            found = owner.retrieve(m.group(1))
            self._json(200, found) if found else self._missing()
        elif url.path == "/v1/batches":
            query = parse_qs(url.query)
            self._json(200, owner.listing(query.get("after", [None])[0],
                                          int(query.get("limit", ["20"])[0])))
        else:
            self._missing()

    def do_POST(self) -> None:
        url = urlparse(self.path)
        owner = self.owner
        raw = self._body()
        if owner.refuse_key:  # out of credit: upload, create and live calls alike
            with owner._lock:
                owner.key_refusals += 1
            self._json(429, QUOTA_BODY)
        elif url.path == "/v1/files":
            data = _multipart_file(self.headers.get("Content-Type", ""), raw)
            reply = owner.upload(data)
            if (hold := owner.plan.hold_after_upload) is not None:
                hold.wait(60)
            self._json(200, reply)
        elif url.path == "/v1/batches" and owner.take_rejection():
            self._json(400, {"error": {"message": "loopback: this batch is not accepted",
                                       "type": "invalid_request_error"}})
        elif url.path == "/v1/batches":
            created = owner.create(json.loads(raw or b"{}"))
            if created and (hold := owner.plan.hold_after_create) is not None:
                hold.wait(60)
            self._json(200, created) if created else self._missing()
        elif m := _CANCEL.fullmatch(url.path):
            found = owner.cancel(m.group(1))
            self._json(200, found) if found else self._missing()
        elif url.path in ("/v1/chat/completions", "/chat/completions"):
            self._json(200, owner.chat(json.loads(raw or b"{}")))
        else:
            self._missing()


    def do_DELETE(self) -> None:
        url = urlparse(self.path)
        m = _FILE.fullmatch(url.path)
        found = self.owner.delete(m.group(1)) if m else None
        self._json(200, found) if found else self._missing()


def _multipart_file(content_type: str, raw: bytes) -> bytes:
    """The `file` part of a multipart/form-data upload."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + raw)
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == "file":
            payload = part.get_payload(decode=True)
            return payload if isinstance(payload, bytes) else b""
    return b""


BatchServer.HANDLER = _Handler
