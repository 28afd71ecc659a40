"""`builtin/craft-metrics`: the built-in reviewer as a litellm custom provider.

It is the default "model" on a machine with no API key, reached through
litellm like any other model: it reads the two screenplays out of the rendered
loss prompt by their episode headers (craft_prompt), measures both and
answers with the report (craft_report). It never reads the text for meaning,
so nothing of the answer key can travel through it.

litellm is imported inside `register()` only: the pure modules (prompt
blocks, parsing, measuring, report) stay cheap to import for the CLI and the
tests.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from .craft_prompt import CraftMetricsError, messages_text
from .craft_report import MODEL_ID, PROVIDER, report_for_prompt

_LOCK = threading.Lock()
_MARK = "skilltrain_craft_metrics"
_handler: Any = None

MODEL_INFO: dict[str, Any] = {
    "max_tokens": 8192,
    "max_input_tokens": 1_000_000,
    "max_output_tokens": 8192,
    "input_cost_per_token": 0.0,
    "output_cost_per_token": 0.0,
    # Without the cache prices register_model logs a warning about defaulting them.
    "cache_creation_input_token_cost": 0.0,
    "cache_read_input_token_cost": 0.0,
    "litellm_provider": PROVIDER,
    "mode": "chat",
}


def _make_handler() -> Any:
    """Build the CustomLLM subclass; litellm is imported here, not at module import."""
    import litellm
    from litellm.llms.custom_llm import CustomLLM, CustomLLMError

    def answer(messages: Sequence[Any]) -> tuple[str, int, int]:
        try:
            report = report_for_prompt(messages_text(messages))
        except CraftMetricsError as exc:
            # 400 maps to litellm.BadRequestError; the message names numbers only.
            raise CustomLLMError(status_code=400, message=str(exc)) from None
        # litellm's token_counter reads its bundled tiktoken files: offline and deterministic.
        prompt_tokens = litellm.token_counter(model=MODEL_ID, messages=list(messages))
        return report, prompt_tokens, litellm.token_counter(model=MODEL_ID, text=report)

    def respond(messages: Sequence[Any], model_response: Any) -> Any:
        report, prompt_tokens, completion_tokens = answer(messages)
        model_response.choices[0].message.content = report
        model_response.choices[0].finish_reason = "stop"
        model_response.model = MODEL_ID
        model_response.usage = litellm.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return model_response

    def one_chunk(messages: Sequence[Any]) -> dict[str, Any]:
        # The whole report as one GenericStreamingChunk: stream=True callers work too.
        report, prompt_tokens, completion_tokens = answer(messages)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return {"text": report, "is_finished": True, "finish_reason": "stop", "usage": usage}

    class CraftMetricsLLM(CustomLLM):
        """litellm handler for builtin/craft-metrics."""

        skilltrain_craft_metrics = True  # _MARK: recognises our entry across re-imports

        def completion(self, model: str, messages: list[Any], *args: Any, **kwargs: Any) -> Any:
            return respond(messages, kwargs["model_response"])

        async def acompletion(
            self, model: str, messages: list[Any], *args: Any, **kwargs: Any
        ) -> Any:
            # Measuring is CPU work (milliseconds per episode): on the loop's
            # small executor, so the loop keeps serving other calls' timeouts.
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, respond, messages, kwargs["model_response"])

        def streaming(
            self, model: str, messages: list[Any], *args: Any, **kwargs: Any
        ) -> Iterator[Any]:
            yield one_chunk(messages)

        # litellm types this as a coroutine returning an iterator, but its stream
        # wrapper consumes an async generator, which is what it gets here.
        async def astreaming(  # type: ignore[override]
            self, model: str, messages: list[Any], *args: Any, **kwargs: Any
        ) -> AsyncIterator[Any]:
            yield one_chunk(messages)

    return CraftMetricsLLM()


def register() -> None:
    """Make `builtin/craft-metrics` callable through litellm. Idempotent, thread-safe.

    Appends to litellm.custom_provider_map instead of assigning it, so other
    custom providers stay. Call it again before use if other code may have
    reassigned that list.
    """
    global _handler
    import litellm

    with _LOCK:
        if _handler is None:
            _handler = _make_handler()
        entries = [e for e in litellm.custom_provider_map if e.get("provider") == PROVIDER]
        if not entries:
            litellm.custom_provider_map.append({"provider": PROVIDER, "custom_handler": _handler})
        elif not any(getattr(e["custom_handler"], _MARK, False) for e in entries):
            raise RuntimeError(
                f"litellm custom provider {PROVIDER!r} is already taken by another handler"
            )
        # register_model also teaches get_llm_provider the "builtin/" prefix, so
        # get_model_info and completion_cost work before the first completion.
        if MODEL_ID not in litellm.model_cost:
            litellm.register_model({MODEL_ID: dict(MODEL_INFO)})
