"""Anthropic's Message Batches API, behind the same calls as the OpenAI shape (batch_api.py).

    POST /v1/messages/batches {requests: [{custom_id, params}]} -> GET .../{id}
      (processing_status, request_counts) ... ended -> results_url (JSONL, any order)

Plain HTTP (httpx, already pinned through litellm and openai): litellm 1.110.2
only retrieves Anthropic batches (its create raises NotImplementedError), and
the anthropic SDK is not a dependency. One client, one keep-alive connection.

Each request's `params` are a live call's body: the same messages, the
answer-key prefix marked for the prompt cache the same way, with the one-hour
duration the provider recommends for batches (a batch may take longer than
the default five minutes to reach the next request). Results are matched by
custom_id. An item `errored` is the provider's error for it (retried like a
failed live call); `canceled` and `expired` items are unanswered (sent again,
no attempt counted). Prices: the model's batch prices from litellm's cost map.

The batch API takes no metadata, so a batch whose id a killed daemon never
recorded is found by what its record knows: created after the record, with
as many requests, and no other record's (`find`); the request ids are unique
across every batch, so one adopted by mistake answers none of the sets.
"""
from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from typing import Any

from ..core.config import LLMConfig
from . import llm
from .batch_api import BatchAPI, BatchAPIError, BatchStatus, ItemResult, batch_cost
from .llm_errors import refused_key

API_VERSION = "2023-06-01"
DEFAULT_BASE = "https://api.anthropic.com"
DEFAULT_MAX_TOKENS = 4096  # a request must say one; [llm] max_output_tokens when set
CACHE_TTL = "1h"
LIST_PAGE = 100
LIST_PAGES = 10
# A batch created this long before its record was saved is still taken as its own
# (the record is written before the create: the clocks are the same machine's).
CREATED_SLACK_S = 5.0
LIMITS = {"requests": 100_000, "bytes": 256 * 1024 * 1024}  # one batch, the provider's
RETENTION = ("a batch is not eligible for zero data retention; its results (the replies) "
             "are kept 29 days, and the requests (the prompts, so the answer key) with it")


def request_line(custom_id: str, messages: Sequence[llm.Message], settings: LLMConfig,
                 model_name: str) -> str:
    params: dict[str, Any] = {"model": model_name,
                              "max_tokens": settings.max_output_tokens or DEFAULT_MAX_TOKENS,
                              "messages": [_with_batch_cache(m) for m in messages]}
    if settings.temperature is not None:
        params["temperature"] = settings.temperature
    return json.dumps({"custom_id": custom_id, "params": params}, ensure_ascii=False)


def _with_batch_cache(message: llm.Message) -> llm.Message:
    """The live call's cache mark, with the batch's one-hour duration."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [{**part, "cache_control": {**part["cache_control"], "ttl": CACHE_TTL}}
             if isinstance(part, dict) and "cache_control" in part else part
             for part in content]
    return {**message, "content": parts}


def completion(body: dict[str, Any], model: str) -> tuple[llm.Completion, str | None]:
    """A succeeded item's message as a live Completion, at the batch price; the cost note."""
    blocks = body.get("content") or []
    text = "".join(b.get("text", "") for b in blocks
                   if isinstance(b, dict) and b.get("type") == "text")
    usage = body.get("usage") or {}
    read = int(usage.get("cache_read_input_tokens") or 0)
    written = int(usage.get("cache_creation_input_tokens") or 0)
    # Anthropic's input_tokens leaves out the cached prefix: ours counts all of it.
    tokens_in = int(usage.get("input_tokens") or 0) + read + written
    tokens_out = int(usage.get("output_tokens") or 0)
    cost, note = batch_cost(model, tokens_in - written, tokens_out, read)
    if cost is not None and written:
        cost += written * _cache_write_price(model)
    stop = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}
    return llm.Completion(
        text=text, finish_reason=llm._finish_reason(stop.get(str(body.get("stop_reason")),
                                                             body.get("stop_reason"))),
        tokens_in=tokens_in, tokens_out=tokens_out, tokens_cached=read, cost_usd=cost,
        attempts=1, tokens_cache_write=written), note


def _cache_write_price(model: str) -> float:
    """A cache write inside a batch: the cache-write price at the batch discount."""
    info = llm.litellm().get_model_info(model)
    live_in = float(info.get("input_cost_per_token") or 0.0)
    batch_in = float(info.get("input_cost_per_token_batches") or live_in)
    write = float(info.get("cache_creation_input_token_cost") or live_in)
    return write * (batch_in / live_in if live_in else 1.0)


class AnthropicBatchAPI(BatchAPI):
    """submit, retrieve, cancel, find, results: the calls batch.py makes (the client's
    life, one per daemon, as the OpenAI shape's)."""

    request_line = staticmethod(request_line)
    completion = staticmethod(completion)
    LIMITS = LIMITS
    RETENTION = RETENTION
    PROVIDER = "anthropic"

    def __init__(self, settings: LLMConfig) -> None:
        super().__init__(settings)
        base = (settings.api_base or DEFAULT_BASE).rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base

    def _new_client(self) -> Any:
        import httpx

        key = os.environ.get("ANTHROPIC_API_KEY") or llm.LOCAL_SERVER_KEY
        return httpx.Client(timeout=self.settings.timeout_s,
                            headers={"x-api-key": key, "anthropic-version": API_VERSION,
                                     "content-type": "application/json"})

    def _request(self, what: str, method: str, url: str, **kwargs: Any) -> Any:
        try:
            response = self.client().request(method, url, **kwargs)
            response.raise_for_status()
            return response
        except Exception as e:
            # The provider's words, through the same guard as a live call's.
            text = llm._describe(e, "", self.settings.api_base)
            raise BatchAPIError(f"batch {what} failed: {text}",
                                blocked=refused_key(e)) from None

    def _url(self, *parts: str) -> str:
        return "/".join([f"{self.base}/v1/messages/batches", *parts])

    def submit(self, lines: Sequence[str], metadata: dict[str, str]) -> str:
        """Create the batch (its requests inline); its provider id. No metadata here."""
        requests = [json.loads(line) for line in lines]
        batch = self._request("create", "POST", self._url(), json={"requests": requests}).json()
        return str(batch["id"])

    def retrieve(self, batch_id: str) -> BatchStatus:
        return _status(self._request("poll", "GET", self._url(batch_id)).json())

    def cancel(self, batch_id: str) -> None:
        self._request("cancel", "POST", self._url(batch_id, "cancel"))

    def find(self, key: str, created_after: float, requests: int,
             taken: Collection[str] = ()) -> str | None:
        """The batch a daemon killed before it saved the id created: the first one
        created since its record with as many requests (the API keeps no metadata)
        that no other record owns (`taken`); the first, as a record's own batch is
        created right after it (the newest would take a later record's). Size and
        time can still match another daemon's batch on the same key: its request
        ids then answer none of ours (batch_results: unique across every batch),
        and the sets are sent again."""
        after: str | None = None
        found: str | None = None  # the oldest match so far (the list is newest first)
        for _ in range(LIST_PAGES):
            params: dict[str, Any] = {"limit": LIST_PAGE, **({"after_id": after} if after else {})}
            page = self._request("list", "GET", self._url(), params=params).json()
            data = list(page.get("data") or [])
            for batch in data:
                created = _epoch(batch.get("created_at"))
                if created is not None and created < created_after - CREATED_SLACK_S:
                    return found
                if _total(batch.get("request_counts") or {}) == requests \
                        and str(batch["id"]) not in taken:
                    found = str(batch["id"])
            if not data or not page.get("has_more"):
                return found
            after = str(page.get("last_id") or data[-1]["id"])
        return found

    def results(self, url: str | None) -> list[ItemResult]:
        """Each result line, by its custom_id (in any order); canceled and expired
        items are left out: unanswered, they are sent again."""
        if not url:
            return []
        text = self._request("download", "GET", url).text
        return [r for r in (_item(line) for line in text.splitlines() if line.strip()) if r]


def _total(counts: dict[str, Any]) -> int:
    return sum(int(counts.get(k) or 0)
               for k in ("processing", "succeeded", "errored", "canceled", "expired"))


def _epoch(value: Any) -> float | None:
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _status(batch: dict[str, Any]) -> BatchStatus:
    counts = batch.get("request_counts") or {}
    ended = batch.get("processing_status") == "ended"
    status = ("cancelled" if batch.get("cancel_initiated_at") else "completed") if ended \
        else "cancelling" if batch.get("processing_status") == "canceling" else "in_progress"
    return BatchStatus(batch_id=str(batch["id"]), status=status,
                       counts={"total": _total(counts),
                               "completed": int(counts.get("succeeded") or 0),
                               "failed": int(counts.get("errored") or 0)},
                       output_file_id=batch.get("results_url") if ended else None,
                       error_file_id=None, metadata={}, errors=None)


def _item(line: str) -> ItemResult | None:
    try:
        data = json.loads(line)
        custom_id = str(data["custom_id"])
        result = data["result"]
        kind = result["type"]
    except (ValueError, KeyError, TypeError):
        return None  # not a line of ours: its set is handled as unanswered
    if kind == "succeeded" and isinstance(result.get("message"), dict):
        return ItemResult(custom_id, result["message"], 200, None)
    if kind == "errored":
        error = result.get("error") if isinstance(result.get("error"), dict) else {}
        inner = error["error"] if isinstance(error.get("error"), dict) else error
        return ItemResult(custom_id, None, None,
                          str(inner.get("message") or inner.get("type") or "errored"))
    return None  # canceled, expired: never ran
