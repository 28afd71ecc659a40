"""A real loopback Anthropic Message Batches API: /v1/messages/batches.

Create (requests inline), retrieve (processing_status, request_counts),
cancel, list (newest first, after_id paging) and the results (JSONL at
results_url, in an order that is not the requests' order). A batch runs by
its plan: ended after `latency_s`, some items errored or expired, or the
create's reply held so a test can SIGKILL the daemon after the batch exists
but before the daemon heard its id. Everything is counted: batches created,
requests answered (billed), polls.

    with AnthropicBatchServer() as server:
        server.plan = AnthropicPlan(errored=lambda req: "work=beta" in json.dumps(req))
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlparse

from tests.batch_server import LoopbackServer
from tests.llm_server import DEFAULT_REPORT

Request = dict[str, Any]  # one {custom_id, params} of a batch


@dataclasses.dataclass
class AnthropicPlan:
    """How the next batches behave (read when a batch is created)."""

    latency_s: float = 0.2
    errored: Callable[[Request], bool] = lambda request: False
    expired: Callable[[Request], bool] = lambda request: False
    hold_after_create: threading.Event | None = None  # set: the create's reply waits for it


@dataclasses.dataclass
class _Batch:
    id: str
    created_at: float
    plan: AnthropicPlan
    requests: list[Request]
    cancelled_at: float | None = None
    results: list[dict[str, Any]] | None = None  # once ended

    def ended(self) -> bool:
        return self.results is not None

    def as_json(self, base: str) -> dict[str, Any]:
        counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        if self.results is None:
            counts["processing"] = len(self.requests)
        else:
            for r in self.results:
                counts[r["result"]["type"]] += 1
        return {"id": self.id, "type": "message_batch",
                "processing_status": "ended" if self.ended() else
                ("canceling" if self.cancelled_at else "in_progress"),
                "request_counts": counts, "created_at": _iso(self.created_at),
                "expires_at": _iso(self.created_at + 86400),
                "ended_at": _iso(time.time()) if self.ended() else None,
                "cancel_initiated_at": _iso(self.cancelled_at) if self.cancelled_at else None,
                "archived_at": None,
                "results_url": f"{base}/v1/messages/batches/{self.id}/results"
                if self.ended() else None}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _message(request: Request) -> dict[str, Any]:
    params = request["params"]
    text = json.dumps(params["messages"])
    cached = any(isinstance(m.get("content"), list) and any(
        "cache_control" in p for p in m["content"]) for m in params["messages"])
    prompt_tokens = max(1, len(text) // 4)
    return {"id": f"msg_{uuid.uuid4().hex[:20]}", "type": "message", "role": "assistant",
            "model": params["model"], "content": [{"type": "text", "text": DEFAULT_REPORT}],
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens // 3 if cached else prompt_tokens,
                      "output_tokens": max(1, len(DEFAULT_REPORT) // 4),
                      "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": prompt_tokens - prompt_tokens // 3
                      if cached else 0}}


# Anthropic's answer to a key without credit: a 400, told by its words.
CREDIT_BODY = {"type": "error", "error": {
    "type": "invalid_request_error",
    "message": "Your credit balance is too low to access the Anthropic API. Please go to "
               "Plans & Billing to upgrade or purchase credits."}}

class AnthropicBatchServer(LoopbackServer):
    """The loopback Message Batches API."""

    THREAD_NAME = "anthropic-batch-server"

    def __init__(self) -> None:
        self.plan = AnthropicPlan()
        self._lock = threading.Lock()
        self.batches: dict[str, _Batch] = {}
        self.creates = 0
        self.polls = 0
        self.cancels = 0
        self.billed: list[str] = []  # "<batch id>/<custom_id>" of each succeeded request
        self.live_requests = 0  # POST /v1/messages: the live half of a bench
        self.headers_seen: list[dict[str, str]] = []
        self.refuse_key = False  # while set: every POST gets Anthropic's billing refusal
        self.key_refusals = 0
        self.failing_creates = 0  # this many creates get a 500 (nothing created)
        # With each failed create, another daemon on the same key creates a batch of
        # as many requests, its custom_ids made the same way (a 16-hex nonce of its
        # own, if they start with one): what a lost id's search may find.
        self.impostor = False
        self.impostors: list[str] = []  # the ids of those batches

    @property
    def url(self) -> str:
        return self.root_url

    def requests(self) -> list[Request]:
        """Every request of every batch created."""
        with self._lock:
            return [r for b in self.batches.values() for r in b.requests]

    # -- the API
    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            batch = _Batch(id=f"msgbatch_{uuid.uuid4().hex[:20]}", created_at=time.time(),
                           plan=self.plan, requests=list(body["requests"]))
            self.batches[batch.id] = batch
            self.creates += 1
            return batch.as_json(self.url)

    def fails_create(self, body: dict[str, Any]) -> bool:
        """A create to refuse with a 500 (and the impostor's batch made instead)."""
        with self._lock:
            if self.failing_creates <= 0:
                return False
            self.failing_creates -= 1
        if self.impostor:
            nonce = uuid.uuid4().hex[:16]
            made = self.create({"requests": [
                {**r, "custom_id": re.sub("^[0-9a-f]{16}-", f"{nonce}-", r["custom_id"])}
                for r in body.get("requests", [])]})
            self.impostors.append(made["id"])
        return True

    def retrieve(self, batch_id: str) -> dict[str, Any] | None:
        with self._lock:
            self.polls += 1
            batch = self.batches.get(batch_id)
            if batch is None:
                return None
            self._advance(batch)
            return batch.as_json(self.url)

    def cancel(self, batch_id: str) -> dict[str, Any] | None:
        with self._lock:
            batch = self.batches.get(batch_id)
            if batch is None:
                return None
            self.cancels += 1
            batch.cancelled_at = time.time()
            if not batch.ended():
                batch.results = [{"custom_id": r["custom_id"], "result": {"type": "canceled"}}
                                 for r in batch.requests]
            return batch.as_json(self.url)

    def listing(self, after_id: str | None, limit: int) -> dict[str, Any]:
        with self._lock:
            newest = sorted(self.batches.values(), key=lambda b: b.created_at, reverse=True)
            start = 0
            if after_id is not None:
                ids = [b.id for b in newest]
                start = ids.index(after_id) + 1 if after_id in ids else len(ids)
            page = newest[start:start + limit]
            return {"data": [b.as_json(self.url) for b in page],
                    "has_more": start + limit < len(newest),
                    "first_id": page[0].id if page else None,
                    "last_id": page[-1].id if page else None}

    def results(self, batch_id: str) -> bytes | None:
        with self._lock:
            batch = self.batches.get(batch_id)
            if batch is None or batch.results is None:
                return None
            # Not the requests' order: the daemon must match by custom_id.
            return "".join(json.dumps(r) + "\n" for r in reversed(batch.results)).encode()

    def _advance(self, batch: _Batch) -> None:
        if batch.ended() or time.time() - batch.created_at < batch.plan.latency_s:
            return
        results = []
        for request in batch.requests:
            cid = request["custom_id"]
            if batch.plan.expired(request):
                results.append({"custom_id": cid, "result": {"type": "expired"}})
            elif batch.plan.errored(request):
                results.append({"custom_id": cid, "result": {"type": "errored", "error": {
                    "type": "error", "error": {"type": "invalid_request_error",
                                               "message": "loopback: this request failed"}}}})
            else:
                results.append({"custom_id": cid, "result": {"type": "succeeded",
                                                             "message": _message(request)}})
                self.billed.append(f"{batch.id}/{cid}")
        batch.results = results


_ONE = re.compile(r"/v1/messages/batches/([^/]+)$")
_CANCEL = re.compile(r"/v1/messages/batches/([^/]+)/cancel$")
_RESULTS = re.compile(r"/v1/messages/batches/([^/]+)/results$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    @property
    def owner(self) -> AnthropicBatchServer:
        return self.server.owner  # type: ignore[attr-defined,no-any-return]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, payload: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _json(self, status: int, body: Any) -> None:
        self._send(status, json.dumps(body).encode())

    def _missing(self) -> None:
        self._json(404, {"type": "error", "error": {"type": "not_found_error",
                                                     "message": "loopback: not found"}})

    def do_GET(self) -> None:
        url = urlparse(self.path)
        owner = self.owner
        owner.headers_seen.append(dict(self.headers))
        if m := _RESULTS.fullmatch(url.path):
            data = owner.results(m.group(1))
            self._send(200, data, "application/x-jsonl") if data is not None \
                else self._missing()
        elif m := _ONE.fullmatch(url.path):
            found = owner.retrieve(m.group(1))
            self._json(200, found) if found else self._missing()
        elif url.path == "/v1/messages/batches":
            query = parse_qs(url.query)
            self._json(200, owner.listing(query.get("after_id", [None])[0],
                                          int(query.get("limit", ["20"])[0])))
        else:
            self._missing()

    def do_POST(self) -> None:
        url = urlparse(self.path)
        owner = self.owner
        owner.headers_seen.append(dict(self.headers))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if owner.refuse_key:  # out of credit: creates and live calls alike
            with owner._lock:
                owner.key_refusals += 1
            self._json(400, CREDIT_BODY)
        elif url.path == "/v1/messages":  # a live call
            with owner._lock:
                owner.live_requests += 1
            self._json(200, _message({"params": json.loads(raw or b"{}")}))
        elif url.path == "/v1/messages/batches" and owner.fails_create(
                json.loads(raw or b"{}")):
            self._json(500, {"type": "error", "error": {"type": "api_error",
                                                        "message": "Internal server error"}})
        elif url.path == "/v1/messages/batches":
            created = owner.create(json.loads(raw or b"{}"))
            if (hold := owner.plan.hold_after_create) is not None:
                hold.wait(60)
            self._json(200, created)
        elif m := _CANCEL.fullmatch(url.path):
            found = owner.cancel(m.group(1))
            self._json(200, found) if found else self._missing()
        else:
            self._missing()


AnthropicBatchServer.HANDLER = _Handler
