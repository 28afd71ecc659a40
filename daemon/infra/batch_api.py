"""The provider's batch API: files and batches, OpenAI-shaped (`api_for` also gives
Anthropic's Message Batches: anthropic_batches.py, the same calls).

    upload (JSONL, in memory) -> create (metadata skilltrain_key) -> retrieve ... -> file content

One request line per set (`custom_id` names it), the chat body exactly as
a live call sends it. The input file holds the prompts, hence the answer
key: it goes to the provider as a live call's body does and is never
written to disk. Every provider message that reaches the log or a reason
passes llm._describe (echo check, answer-key guard, one line, 200 chars),
like a live call's errors.

Prices: the batch price from litellm's cost map
(`input_cost_per_token_batches`, `output_cost_per_token_batches`); a model
without one gets `cost_usd: None` and a note, never a guessed price.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.config import LLMConfig
from ..core.errors import LLMError
from . import llm
from .llm_errors import refused_key

ENDPOINT = "/v1/chat/completions"
COMPLETION_WINDOW = "24h"
LIST_PAGE = 100
LIST_PAGES = 20  # how far back a lost batch is looked for (2,000 batches)
# Provider statuses after which nothing changes any more.
FINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# Providers whose batches litellm speaks to in the OpenAI shape; and Anthropic's own.
OPENAI_SHAPED = frozenset({"openai", "hosted_vllm", "litellm_proxy"})
SUPPORTED_PROVIDERS = OPENAI_SHAPED | {"anthropic"}
LIMITS = {"requests": 50_000, "bytes": 200 * 1024 * 1024}  # one batch, the provider's
# Where the prompts (hence the answer key) stay once a batch has them: said once per run.
RETENTION = ("the input and output files (the prompts, so the answer key, and the replies) "
             "are kept in your organization's files until deleted")


class BatchAPIError(LLMError):
    """A files or batches call failed; the message is guarded. `blocked`: the
    provider refuses the key itself (quota, billing, auth: llm_errors.refused_key).
    `sent`: the prompts (so the answer key) reached the provider all the same
    (an input file uploaded before the create failed). `status`: the HTTP
    status of the provider's answer, if it gave one (None: a timeout, a reset)."""

    def __init__(self, message: str, *, blocked: str | None = None, sent: bool = False,
                 status: int | None = None) -> None:
        super().__init__(message, blocked=blocked)
        self.sent = sent
        self.status = status


@dataclass(frozen=True)
class BatchStatus:
    batch_id: str
    status: str
    counts: dict[str, int]
    output_file_id: str | None
    error_file_id: str | None
    metadata: dict[str, str]
    errors: str | None  # the batch's own error, guarded


@dataclass(frozen=True)
class ItemResult:
    """One output or error line: a reply, or the provider's error for it."""

    custom_id: str
    body: dict[str, Any] | None  # the chat completion, when status 200
    status_code: int | None
    error: str | None  # the provider's error message, unguarded until describe()


def provider_of(settings: LLMConfig) -> tuple[str, str]:
    """(the model name the provider knows, the litellm provider)."""
    name, provider, _, _ = llm.litellm().get_llm_provider(settings.model)
    return str(name), str(provider)


def supported(settings: LLMConfig) -> str | None:
    """Why this model cannot go through a batch API (None: it can)."""
    if settings.model.startswith(llm.BUILTIN_PREFIX):
        return "the built-in reviewer has no batch API"
    try:
        provider = provider_of(settings)[1]
    except Exception:
        return f"litellm does not know the provider of {settings.model!r}"
    if provider not in SUPPORTED_PROVIDERS:
        return (f"batch mode speaks the OpenAI batch API (openai/..., an OpenAI-compatible "
                f"api_base) and Anthropic's Message Batches (anthropic/...); "
                f"{settings.model!r} is provider {provider!r}")
    return None


def api_for(settings: LLMConfig) -> BatchAPI:
    """The batch API of the model's provider (one shape of calls for batch.py)."""
    try:
        provider = provider_of(settings)[1]
    except Exception:
        provider = "openai"
    if provider == "anthropic":
        from .anthropic_batches import AnthropicBatchAPI

        return AnthropicBatchAPI(settings)
    return BatchAPI(settings)


def request_line(custom_id: str, messages: Sequence[llm.Message],
                 settings: LLMConfig, model_name: str) -> str:
    body: dict[str, Any] = {"model": model_name, "messages": list(messages)}
    if settings.max_output_tokens:
        body["max_tokens"] = settings.max_output_tokens
    if settings.temperature is not None:
        body["temperature"] = settings.temperature
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                       "body": body}, ensure_ascii=False)


class BatchAPI:
    """The five calls, with the connection settings of `[llm]`.

    Through the OpenAI SDK client litellm itself uses, owned here: litellm
    1.110's file and batch functions build a new client for every call and
    never close it (an open socket left behind per poll, and the client's
    construction paid each time). One client, one keep-alive connection.
    """

    LIMITS = LIMITS
    RETENTION = RETENTION
    PROVIDER = "openai"

    def __init__(self, settings: LLMConfig) -> None:
        self.settings = settings
        self._client: Any = None
        self._lock = threading.Lock()

    @staticmethod
    def request_line(custom_id: str, messages: Sequence[llm.Message], settings: LLMConfig,
                     model_name: str) -> str:
        return request_line(custom_id, messages, settings, model_name)

    @staticmethod
    def completion(body: dict[str, Any], model: str) -> tuple[llm.Completion, str | None]:
        return completion(body, model)

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._new_client()
            return self._client

    def _new_client(self) -> Any:
        llm.litellm()  # the offline cost map and quiet logging, set up once
        import openai

        key = os.environ.get("OPENAI_API_KEY")
        if self.settings.api_base and llm.missing_credentials(
                self.settings.model, self.settings.api_base):
            key = llm.LOCAL_SERVER_KEY
        return openai.OpenAI(api_key=key, base_url=self.settings.api_base,
                             timeout=self.settings.timeout_s, max_retries=0)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        try:
            return fn(self.client())
        except Exception as e:
            # The provider's words, through the same guard as a live call's.
            text = llm._describe(e, "", self.settings.api_base)
            status = getattr(e, "status_code", None)
            raise BatchAPIError(f"batch {what} failed: {text}", blocked=refused_key(e),
                                status=status if isinstance(status, int) else None) from None

    def submit(self, lines: Sequence[str], metadata: dict[str, str]) -> str:
        """Upload the requests and create the batch; its provider id."""
        data = ("\n".join(lines) + "\n").encode("utf-8")
        uploaded = self._call("upload", lambda c: c.files.create(
            file=("skilltrain-batch.jsonl", data), purpose="batch"))
        try:
            batch = self._call("create", lambda c: c.batches.create(
                completion_window=COMPLETION_WINDOW, endpoint=ENDPOINT,
                input_file_id=uploaded.id, metadata=metadata))
        except BatchAPIError as e:
            # Refused (a 4xx): no batch will read the file, it would only keep the key
            # there. A timeout or a 5xx may have made the batch all the same (the next
            # poll looks for it): its input stays.
            refused = e.status is not None and 400 <= e.status < 500
            left = self._delete_input(str(uploaded.id)) if refused else ""
            raise BatchAPIError(f"{e}{left}", blocked=e.blocked, sent=True,
                                status=e.status) from None
        return str(batch.id)

    def _delete_input(self, file_id: str) -> str:
        """Delete an input file no batch reads; what to add to the error if it stays."""
        try:
            self._call("delete", lambda c: c.files.delete(file_id))
        except BatchAPIError as e:
            return f"; its input file {file_id} is left at the provider ({e})"
        return ""

    def retrieve(self, batch_id: str) -> BatchStatus:
        return _status(self._call("poll", lambda c: c.batches.retrieve(batch_id)),
                       self.settings.api_base)

    def cancel(self, batch_id: str) -> None:
        self._call("cancel", lambda c: c.batches.cancel(batch_id))

    def find(self, key: str, created_after: float, requests: int,
             taken: Collection[str] = ()) -> str | None:
        """The id of the batch we created with metadata skilltrain_key=key, if any
        (none of `taken`, the batches other records own)."""
        after: str | None = None
        for _ in range(LIST_PAGES):
            page = self._call("list", lambda c, a=after: c.batches.list(  # type: ignore[misc]
                limit=LIST_PAGE, **({"after": a} if a else {})))
            data = list(getattr(page, "data", None) or [])
            for batch in data:
                if (getattr(batch, "metadata", None) or {}).get("skilltrain_key") == key \
                        and str(batch.id) not in taken:
                    return str(batch.id)
            if not data or not getattr(page, "has_more", False):
                return None
            after = str(data[-1].id)
        return None

    def results(self, file_id: str | None) -> list[ItemResult]:
        """The lines of an output or error file, each by its custom_id."""
        if not file_id:
            return []
        content = self._call("download", lambda c: c.files.content(file_id))
        text = content.content.decode("utf-8", "replace")
        return [r for r in (_item(line) for line in text.splitlines() if line.strip()) if r]


def _status(batch: Any, api_base: str | None) -> BatchStatus:
    counts_obj = getattr(batch, "request_counts", None)
    counts = {k: int(getattr(counts_obj, k, 0) or 0) for k in ("total", "completed", "failed")}
    errors = getattr(batch, "errors", None)
    error_text = None
    if errors:
        data = getattr(errors, "data", None) or []
        first = data[0] if data else errors
        message = getattr(first, "message", None) or (first.get("message")
                                                      if isinstance(first, dict) else None)
        error_text = llm._describe(_ProviderError(str(message or first)), "", api_base)
    return BatchStatus(batch_id=str(batch.id), status=str(batch.status), counts=counts,
                       output_file_id=getattr(batch, "output_file_id", None),
                       error_file_id=getattr(batch, "error_file_id", None),
                       metadata=dict(getattr(batch, "metadata", None) or {}),
                       errors=error_text)


def _item(line: str) -> ItemResult | None:
    try:
        data = json.loads(line)
        custom_id = str(data["custom_id"])
    except (ValueError, KeyError, TypeError):
        return None  # not a line of ours: its sets are handled as unanswered
    response = data.get("response") or {}
    error = data.get("error")
    status = response.get("status_code") if isinstance(response, dict) else None
    body = response.get("body") if isinstance(response, dict) else None
    if status == 200 and isinstance(body, dict) and not error:
        return ItemResult(custom_id, body, 200, None)
    message = None
    if isinstance(error, dict):
        message = error.get("message")
    elif isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
    return ItemResult(custom_id, None, status if isinstance(status, int) else None,
                      str(message or error or "no reply for this request"))


class _ProviderError(Exception):
    """A provider's error text in the shape llm._describe reads (message, status)."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code


def describe_item_error(item: ItemResult, prompt: str, api_base: str | None) -> str:
    """The provider's error for one request, guarded like a live call's."""
    text = llm._describe(_ProviderError(item.error or "", item.status_code), prompt, api_base)
    return f"the batch failed this request: {text}"


def completion(body: dict[str, Any], model: str) -> tuple[llm.Completion, str | None]:
    """A batch reply as a live Completion, priced at the batch price; and the cost note."""
    choices = body.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    tokens_in = int(usage.get("prompt_tokens") or 0)
    tokens_out = int(usage.get("completion_tokens") or 0)
    cached = int(details.get("cached_tokens") or usage.get("cache_read_input_tokens") or 0)
    written = int(usage.get("cache_creation_input_tokens") or 0)
    cost, note = batch_cost(model, tokens_in, tokens_out, cached)
    content = message.get("content") if isinstance(message, dict) else None
    return llm.Completion(
        text=content if isinstance(content, str) else "",
        finish_reason=llm._finish_reason(choice.get("finish_reason")),
        tokens_in=tokens_in, tokens_out=tokens_out, tokens_cached=cached,
        cost_usd=cost, attempts=1, tokens_cache_write=written), note


def batch_cost(model: str, tokens_in: int, tokens_out: int,
               cached: int = 0) -> tuple[float | None, str | None]:
    """The cost at the model's batch price, or (None, why not)."""
    try:
        info = llm.litellm().get_model_info(model)
    except Exception:
        return None, f"litellm's cost map does not know {model}: cost unknown"
    price_in = info.get("input_cost_per_token_batches")
    price_out = info.get("output_cost_per_token_batches")
    if price_in is None or price_out is None:
        return None, f"litellm's cost map has no batch price for {model}: cost unknown"
    price_cached = info.get("cache_read_input_token_cost_batches")
    note = None
    if price_cached is None:
        price_cached = price_in
        if cached:
            note = ("no batch price for cached tokens: counted at the batch input price "
                    "(an upper bound)")
    cost = (tokens_in - cached) * price_in + cached * price_cached + tokens_out * price_out
    return float(cost), note
