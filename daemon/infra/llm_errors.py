"""What a provider's error says: a key it refuses, when to come back, its headers.

A 429 is usually a rate limit that a wait fixes, but OpenAI's
insufficient_quota is a 429 too, and no wait fixes it (PITFALLS): they are
told apart by the error's code and type, not by the status.
"""
from __future__ import annotations

from typing import Any

# OpenAI's error codes (and types) that no wait fixes: the key has no credit.
_QUOTA_CODES = frozenset({"insufficient_quota", "billing_hard_limit_reached",
                          "billing_not_active", "access_terminated"})
_BILLING_TEXT = ("credit balance is too low", "billing_error", "exceeded your current quota")


def refused_key(error: BaseException) -> str | None:
    """Why the provider refuses the key itself, or None for any other error.

    "quota" (OpenAI's insufficient_quota, a 429), "billing" (a 402, Anthropic's
    billing_error or "credit balance is too low", a 400), "authentication"
    (401, 403). Told by the error's code and type, not by the status alone:
    a 429 is usually a rate limit that a wait fixes (PITFALLS).
    """
    status, marks, text = _marks(error)
    if marks & _QUOTA_CODES or any(c in text for c in _QUOTA_CODES):
        return "quota" if marks & {"insufficient_quota"} or "insufficient_quota" in text \
            else "billing"
    if status == 402 or "billing_error" in marks or any(t in text for t in _BILLING_TEXT):
        return "billing"
    if status in (401, 403) or marks & {"authentication_error", "permission_error",
                                        "invalid_api_key"}:
        return "authentication"
    return None


def flex_unavailable(error: BaseException) -> bool:
    """Is this OpenAI flex's "429 Resource Unavailable" (no capacity now, not billed)?

    OpenAI's flex guide names it "a `429 Resource Unavailable` error code"
    (developers.openai.com/api/docs/guides/flex-processing, "Resource
    unavailable errors"); clients tell it by `error.code == "resource_unavailable"`.
    Told by code, type or message, like refused_key, not by the status: a
    429 that says nothing of resources is a rate limit.
    """
    _status, marks, text = _marks(error)
    return "resource_unavailable" in marks or "resource unavailable" in text


def _marks(error: BaseException) -> tuple[int, set[str], str]:
    """The error's HTTP status, its body's code and type, and its message (and
    the body's) in lower case on one line. Read from the SDKs' errors and from
    httpx's HTTPStatusError (anthropic_batches.py), whose body is the response's."""
    status = getattr(error, "status_code", 0) or 0
    body = getattr(error, "body", None)
    response = getattr(error, "response", None)
    if not status and response is not None:
        status = getattr(response, "status_code", 0) or 0
        body = _json(response) if body is None else body
    inner = body.get("error") if isinstance(body, dict) else None
    inner = inner if isinstance(inner, dict) else body if isinstance(body, dict) else {}
    marks = {str(inner.get(k) or "").lower() for k in ("code", "type")}
    said = f"{getattr(error, 'message', '') or error} {inner.get('message') or ''}"
    return status, marks, " ".join(said.split()).lower()


def _json(response: Any) -> Any:
    try:
        return response.json()
    except Exception:
        return None


def error_headers(error: BaseException) -> dict[str, str]:
    headers: Any = getattr(error, "litellm_response_headers", None)
    response = getattr(error, "response", None)
    if headers is None and response is not None:
        headers = getattr(response, "headers", None)
    try:
        return {str(k): str(v) for k, v in dict(headers or {}).items()}
    except Exception:
        return {}


def retry_after(error: BaseException) -> float | None:
    """Seconds the server asked us to wait, if it said: the finest word it gives.

    retry-after-ms; then, when the reply says the requests window is spent
    (remaining 0), the time until one request is free again by its reset
    header (`25ms`, an RFC 3339 time); then Retry-After as seconds or as an
    HTTP date (the OpenAI SDK's parser; its method uses nothing of the client).
    A whole-second Retry-After is coarse: a window refilling every 25 ms is
    not a second's wait.
    """
    from openai._base_client import BaseClient

    from .llm_headers import read_rate_headers, refill_s

    headers: Any = getattr(error, "litellm_response_headers", None)
    response = getattr(error, "response", None)
    if headers is None and response is not None:
        headers = getattr(response, "headers", None)
    if not headers:
        return None
    try:
        lowered = {str(k).lower(): str(v) for k, v in dict(headers).items()}
        window = read_rate_headers(lowered)
        if "retry-after-ms" not in lowered and window.requests_left == 0 \
                and window.requests_reset_s is not None:
            return refill_s(window.requests_reset_s, window.requests_limit, 0, 1)
        seconds = BaseClient._parse_retry_after_header(None, lowered)  # type: ignore[arg-type]
    except Exception:
        return None
    return None if seconds is None else max(0.0, float(seconds))
