"""Every LLM call goes through here: litellm, with one retry policy.

PITFALLS: the OpenAI SDK under litellm retries on its own (3 attempts) and litellm's
`num_retries` adds more on top, with no wait. Both are switched off (`max_retries=0`,
`num_retries=0`) and tenacity runs the retries (llm_retry.py) with the project's one backoff policy
(core/backoff.py: exponential, full jitter) on 429/5xx/timeouts/connection errors, at least as
long as the server asks (Retry-After in seconds or as an HTTP date, or retry-after-ms, read by
the OpenAI SDK's own parser), no retry on auth or bad-request errors.

Calls are `litellm.acompletion` coroutines on the one LLM event loop (llm_loop.py): a call in
flight holds no thread. `[llm] timeout_s` bounds each attempt as a whole (the HTTP client's
timeout is per read, and a server sending a byte every few seconds never trips it): at the
deadline the request is cancelled, its connection closed, nothing left running. Each attempt
holds a slot of its endpoint's limiter (llm_limit.py) and gives it back, with the provider's
rate-limit headers, before any backoff.

litellm costs ~5 s to import: imported on first use, `status`, `tail`, `audit`, `--help` never pay.
"""
from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..core import backoff, textnorm
from ..core.config import BUILTIN_MODEL, LLMConfig
from ..core.errors import ConfigError, LLMError
from ..guard import leakguard
from . import llm_flex, llm_loop
from .llm_endpoints import Slot
from .llm_errors import error_headers as _error_headers
from .llm_errors import flex_unavailable, refused_key
from .llm_errors import retry_after as _retry_after
from .llm_retry import AsyncSleep, RetryableError, RetryHook, retried

Message = dict[str, Any]
BUILTIN_PREFIX = BUILTIN_MODEL.split("/")[0] + "/"

LOGGING_THREADS = 2  # litellm's success/failure handlers (it logs nothing we need)
_import_lock = threading.Lock()
_litellm: ModuleType | None = None


def litellm() -> ModuleType:
    """Import and configure litellm once: offline cost map, no banners."""
    global _litellm
    with _import_lock:
        if _litellm is None:
            # Must be set before the import: otherwise litellm fetches its cost
            # map from the internet at import time.
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            # Its logging executor would grow to 100 threads under many calls.
            os.environ.setdefault("LOGGING_EXECUTOR_MAX_THREADS", str(LOGGING_THREADS))
            import litellm as module

            module.suppress_debug_info = True  # no "Give Feedback" banner on stdout
            module.telemetry = False
            from . import log

            log.adopt_library_loggers()  # litellm's own stdout handlers: route through ours
            from ..reviewer import craft_provider

            craft_provider.register()
            _litellm = module
    return _litellm


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str | None
    tokens_in: int
    tokens_out: int
    tokens_cached: int
    cost_usd: float | None
    attempts: int
    # Prompt tokens written to the provider's cache (Anthropic's
    # cache_creation_input_tokens): billed above the input price.
    tokens_cache_write: int = 0
    service_tier: str | None = None  # "flex", or "standard" after flex fell back (llm_flex)


def warm_up(model: str) -> None:
    """Import litellm and load the tokenizer now, off the first job's clock."""
    count_tokens(model, [{"role": "user", "content": "warm up"}])


def count_tokens(model: str, messages: Sequence[Message]) -> int:
    return int(litellm().token_counter(model=model, messages=list(messages)))


# Every job asks. An unknown model costs litellm a search of its map and a raise
# (59 us; a known one it caches): kept until the map's size changes (register_model).
_unknown_models: set[tuple[str, int]] = set()


def max_input_tokens(model: str) -> int | None:
    """The model's input window, or None when litellm does not know the model."""
    lm = litellm()
    if (unknown := (model, len(lm.model_cost))) in _unknown_models:
        return None
    try:
        info = lm.get_model_info(model)
    except Exception:
        _unknown_models.add(unknown)  # a few ids a process: the config's, a run's
        return None
    value = info.get("max_input_tokens") or info.get("max_tokens")
    return int(value) if value else None


# Providers whose prompt caching needs explicit cache_control markers; the
# others (OpenAI, DeepSeek, ...) cache a repeated prefix by themselves, and
# an OpenAI-compatible local server may not accept content parts at all.
EXPLICIT_CACHE_PROVIDERS = frozenset({"anthropic", "bedrock", "vertex_ai", "vertex_ai_beta"})


def wants_cache_markers(model: str) -> bool:
    """Should the stable prompt prefix be sent as a cache_control content part?"""
    lm = litellm()
    from litellm.utils import supports_prompt_caching

    try:
        provider = lm.get_llm_provider(model)[1]
        return provider in EXPLICIT_CACHE_PROVIDERS and bool(supports_prompt_caching(model=model))
    except Exception:
        return False  # unknown model: plain text is always accepted


def complete(messages: Sequence[Message], settings: LLMConfig, *,
             on_retry: RetryHook | None = None,
             sleep: Callable[[float], None] | None = None) -> Completion:
    """`acomplete` run on the LLM loop, from a thread that may block (the one-shot CLI).

    `sleep`: a synchronous stand-in for the policy's waits (tests pass a
    recorder); None waits on the loop without blocking it.
    """
    waits: AsyncSleep | None = None
    if sleep is not None:
        sync_sleep = sleep

        async def recorded(seconds: float) -> None:
            sync_sleep(seconds)

        waits = recorded
    return llm_loop.shared().run(llm_flex.complete(acomplete, messages, settings,
                                                   on_retry=on_retry, sleep=waits))


async def acomplete(messages: Sequence[Message], settings: LLMConfig, *,
                    on_retry: RetryHook | None = None, sleep: AsyncSleep | None = None,
                    slot: Slot | None = None) -> Completion:
    """One chat completion with the retry policy; raises LLMError when it gives up.

    Runs on the LLM loop. `slot`: the endpoint's limiter slot (may already be
    held): taken for each attempt and given back when the attempt ends, with
    what the provider said, so a wait between attempts holds no slot.
    `sleep` is how the policy waits: the daemon passes one that ends early
    (raising) on shutdown; tests pass a recorder.
    """
    slot = slot or Slot(None)
    attempts = 0

    async def attempt() -> Any:
        nonlocal attempts
        await slot.take()
        attempts += 1
        try:
            response = await _call(messages, settings)
        except RetryableError as e:
            slot.give_back("rate_limited" if e.rate_limited else "error",
                           retry_after_s=e.retry_after_s, headers=e.headers)
            raise
        except llm_flex.FlexUnavailable:
            slot.give_back(llm_flex.FLEX_OUTCOME)  # no rate limit: the limit stays
            raise
        except LLMError as e:
            # A key the provider refuses (quota, billing, auth) blocks the endpoint.
            slot.give_back("blocked" if e.blocked else "error",
                           blocked=(e.blocked, str(e)) if e.blocked else None)
            raise
        except BaseException:
            slot.give_back("error")
            raise
        choices = getattr(response, "choices", None)
        if not choices or getattr(choices[0], "message", None) is None:
            # A 200 with `choices: []`: no reply at all, as transient as a 5xx.
            slot.give_back("error", headers=_reply_headers(response))
            raise RetryableError("malformed reply: the response has no choices")
        usage = getattr(response, "usage", None)
        slot.give_back("ok", headers=_reply_headers(response),
                       tokens=int(getattr(usage, "total_tokens", 0) or 0))
        return response

    try:
        try:
            # Most calls: one attempt, and no retry machinery (tenacity's ~25 us).
            response: Any = await attempt()
        except RetryableError as e:
            response = await retried(attempt, e, backoff.llm_call(settings),
                                    settings.max_retries, on_retry, sleep)
    except RetryableError as e:
        # A rate limit is tried again later (outcomes.py): not "gave up".
        said = (f"rate-limited on {attempts} attempts in a row" if e.rate_limited
                else f"gave up after {attempts} attempts")
        raise LLMError(f"{said}: {e}", e.retry_after_s, rate_limited=e.rate_limited) from None
    except BaseException:
        slot.give_back()  # stopped (Abandoned, cancelled) while it held the slot
        raise
    return _completion(response, settings.model, attempts)


async def _call(messages: Sequence[Message], settings: LLMConfig) -> Any:
    lm = litellm()
    if settings.model.startswith(BUILTIN_PREFIX):
        # Other code may have replaced litellm.custom_provider_map since.
        from ..reviewer import craft_provider

        craft_provider.register()
    kwargs = _request_kwargs(messages, settings)
    where = settings.api_base

    def describe(error: BaseException) -> str:
        # Only on error: the prompt's text is joined for the echo check then.
        return _describe(error, "\n".join(message_texts(messages)), where)

    def retryable(e: BaseException) -> RetryableError:
        code = getattr(e, "status_code", 0) or 0
        retry_after = _retry_after(e)
        # A 503 that says when to come back is the provider's rate limit too.
        limited = code == 429 or (code == 503 and retry_after is not None)
        return RetryableError(describe(e), retry_after, rate_limited=limited,
                              headers=_error_headers(e))

    try:
        return await _request(lm, kwargs, settings.timeout_s, describe)
    except (lm.RateLimitError, lm.InternalServerError, lm.ServiceUnavailableError,
            lm.Timeout, lm.APIConnectionError, lm.BadGatewayError) as e:
        raise retryable(e) from None
    except lm.APIError as e:
        # Any other provider-side 5xx we do not know by name is transient too.
        if (getattr(e, "status_code", 0) or 0) >= 500:
            raise retryable(e) from None
        raise LLMError(describe(e)) from None
    except (lm.AuthenticationError, lm.BadRequestError) as e:
        raise LLMError(describe(e)) from None
    except Exception as e:
        if type(e).__module__.startswith(("litellm", "openai", "httpx", "aiohttp")):
            raise LLMError(describe(e)) from None
        raise


PROBE_PROMPT: list[Message] = [{"role": "user", "content": "Reply with OK."}]


async def probe(settings: LLMConfig) -> str:
    """One small real call, no retry: does the endpoint take the key again? "ok";
    "blocked" (still refused); "rate_limited" (the key works, the provider is
    busy); "error" (nothing learnt: a 5xx, a timeout)."""
    small = settings.model_copy(update={"max_output_tokens": 1, "max_retries": 0,
                                        "service_tier": None})  # flex's 429s say nothing of the key
    try:
        await acomplete(PROBE_PROMPT, small)
    except LLMError as e:
        return "blocked" if e.blocked else "rate_limited" if e.rate_limited else "error"
    except Exception:
        return "error"
    return "ok"


async def _request(lm: ModuleType, kwargs: dict[str, Any], timeout_s: float,
                   describe: Callable[[BaseException], str]) -> Any:
    """The request within its deadline; a key the provider refuses told apart first
    (an insufficient_quota is a 429 that no wait fixes)."""
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            return await lm.acompletion(**kwargs)
    except TimeoutError:
        if not deadline.expired():
            raise  # a TimeoutError of the library's own: handled as any error
        # The request was cancelled at the deadline: nothing is left running.
        raise RetryableError(f"no complete reply within {timeout_s:g}s "
                             "([llm] timeout_s bounds the whole request)") from None
    except Exception as e:
        if flex_unavailable(e):  # flex has no capacity now: llm_flex.complete waits
            raise llm_flex.FlexUnavailable(describe(e)) from None
        if (kind := refused_key(e)) is not None:
            raise LLMError(describe(e), blocked=kind) from None
        raise


def _reply_headers(response: Any) -> dict[str, str]:
    """The provider's headers of a reply (its x-ratelimit-* among them)."""
    hidden = getattr(response, "_hidden_params", None) or {}
    headers = hidden.get("additional_headers") if isinstance(hidden, dict) else None
    return {str(k): str(v) for k, v in headers.items()} if isinstance(headers, dict) else {}


def _request_kwargs(messages: Sequence[Message], settings: LLMConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": settings.model,
        "messages": list(messages),
        "timeout": settings.timeout_s,
        "max_retries": 0,  # the OpenAI SDK's own retries: off, ours rule
        "num_retries": 0,  # litellm's retries: off
    }
    if settings.api_base:
        kwargs["api_base"] = settings.api_base
    if settings.max_output_tokens:
        kwargs["max_tokens"] = settings.max_output_tokens
    if settings.temperature is not None:
        kwargs["temperature"] = settings.temperature
    if settings.flex:
        kwargs["service_tier"] = "flex"  # litellm passes it on; prices the reply at flex
    if settings.api_base and missing_credentials(settings.model, settings.api_base):
        # A local OpenAI-compatible server needs no key, but the SDK refuses
        # to start without one.
        kwargs["api_key"] = LOCAL_SERVER_KEY
    return kwargs


# A provider message sharing this many words in a row with the prompt echoes it.
ECHO_WORDS = 6
MESSAGE_CHARS = 200
WITHHELD = "(message withheld: it quotes the prompt)"
LOCAL_SERVER_KEY = "no-key-needed"  # sent to an api_base server when no key is set


def missing_credentials(model: str, api_base: str | None = None) -> list[str]:
    """The environment variables holding an API key that `model` needs and lacks
    (litellm's validate_environment also lists base-URL variables, as ollama's
    OLLAMA_API_BASE: only keys and tokens count). Asked at every call to a local
    server (~0.3 ms in litellm): kept while no variable is set or unset (litellm
    takes some it does not list as missing: ANTHROPIC_AUTH_TOKEN, AWS_PROFILE)."""
    if model.startswith(BUILTIN_PREFIX):
        return []
    names = tuple(os.environ)
    if (kept := _missing.get((model, api_base))) is not None and kept[0] == names:
        return list(kept[1])
    try:
        report = litellm().validate_environment(model=model, api_base=api_base)
    except Exception:
        return []  # a provider litellm cannot check: the first call will say
    missing = [str(k) for k in report.get("missing_keys") or []]
    missing = [k for k in missing if "KEY" in k or "TOKEN" in k]
    _missing[(model, api_base)] = (names, tuple(missing))
    return missing


_missing: dict[tuple[str, str | None], tuple[tuple[str, ...], tuple[str, ...]]] = {}


def check_credentials(settings: LLMConfig) -> None:
    """A provider model without its API key is a configuration error, found at
    start and not as five retried failures of the first job."""
    if settings.api_base or settings.model.startswith(BUILTIN_PREFIX):
        return  # an api_base server (vLLM, Ollama) may need no key: see _call
    missing = missing_credentials(settings.model)
    if missing:
        raise ConfigError(f"[llm] model = {settings.model!r} needs the environment variable "
                          f"{' or '.join(missing)}, which is not set (API keys come from the "
                          "environment, never from config.toml)")


def message_texts(messages: Sequence[Message]) -> list[str]:
    """The text of every message and content part, in order."""
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return parts


def _echoes(message: str, prompt: str) -> bool:
    """Does `message` repeat ECHO_WORDS words of `prompt` in a row, in any disguise?
    Compared as normalised words (leakguard's: case, separators, escapes, zero-width
    characters and look-alikes do not matter), not as substrings: an echo
    upper-cased, pipe-joined or JSON-escaped is still an echo."""
    views = textnorm.readings(message) if prompt and message else []
    said = {h for view in views for h in leakguard.shingle_hashes(view.tokens, ECHO_WORDS)}
    if not said:
        return False
    # A prompt may be megabytes: only its runs of words the message uses are hashed.
    words = {t for view in views for t in view.tokens}
    toks = textnorm.tokens(prompt)
    known = bytes(t in words for t in toks)
    return any(not said.isdisjoint(leakguard.shingle_hashes(toks[m.start():m.end()], ECHO_WORDS))
               for m in re.finditer(b"\x01{%d,}" % ECHO_WORDS, known))


def _describe(error: BaseException, prompt: str = "", api_base: str | None = None) -> str:
    """Class and status, and the provider's message if it quotes nothing.

    The message is the provider's, not ours: it can echo the request (hence
    the prompt, hence the human text) or a key. It is kept to one line and
    MESSAGE_CHARS characters, and dropped whole when it shares ECHO_WORDS
    words in a row with the prompt or holds a passage of any work's answer
    key (leakguard.installed); log scrubbing removes anything shaped like a
    key. What is left is checked again by the log and the state store.
    """
    status = getattr(error, "status_code", None)
    message = " ".join(str(getattr(error, "message", "") or error).split())[:MESSAGE_CHARS]
    keys = leakguard.installed()
    if _echoes(message, prompt) or (keys is not None and keys.leaks(message)):
        message = WITHHELD
    kind = type(error).__name__
    if getattr(error, "litellm_response_headers", "") is None and "Connection error" in message:
        # litellm reports a refused or dropped connection as a 500 it never got.
        where = f" at {api_base}" if api_base else ""
        return f"connection to the LLM server{where} failed ({kind}): {message}"
    return f"{kind} (HTTP {status}): {message}" if status else f"{kind}: {message}"


def _completion(response: Any, model: str, attempts: int) -> Completion:
    choice = response.choices[0]
    usage = getattr(response, "usage", None)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) or 0
    cached = cached or getattr(usage, "cache_read_input_tokens", 0) or 0
    written = (getattr(details, "cache_write_tokens", None)
               or getattr(usage, "cache_creation_input_tokens", 0) or 0)
    return Completion(
        text=choice.message.content or "",
        finish_reason=_finish_reason(choice.finish_reason),
        tokens_in=int(getattr(usage, "prompt_tokens", 0) or 0),
        tokens_out=int(getattr(usage, "completion_tokens", 0) or 0),
        tokens_cached=int(cached),
        cost_usd=_cost(response, model),
        attempts=attempts,
        tokens_cache_write=int(written),
    )


_FINISH_REASON = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,39}")


def _finish_reason(value: object) -> str | None:
    """The provider's finish_reason if it looks like one; else only its size.

    It ends up in an error reason (a cut-off report is refused with it), and a
    provider may put anything there, the prompt included.
    """
    if value is None or (isinstance(value, str) and _FINISH_REASON.fullmatch(value)):
        return value
    return f"unrecognised ({len(str(value))} chars)"


def _cost(response: Any, model: str) -> float | None:
    if model == BUILTIN_MODEL:
        return 0.0
    hidden = getattr(response, "_hidden_params", None) or {}
    if "response_cost" in hidden:
        # litellm priced the reply already (None: an unmapped model); asking
        # again costs ~0.3-0.5 ms of CPU per job.
        cost = hidden["response_cost"]
        return None if cost is None else float(cost)
    try:
        return float(litellm().completion_cost(completion_response=response))
    except Exception:
        return None  # unmapped model: unknown cost, not zero
