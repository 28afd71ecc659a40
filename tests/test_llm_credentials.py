"""Which API-key variables a model lacks (llm.missing_credentials): asked at
every call to an api_base server, answered from a kept list while it holds."""
from __future__ import annotations

import pytest

from skilltrain.daemon.infra import llm


def test_a_key_exported_after_a_call_is_seen_at_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """llm.missing_credentials keeps litellm's answer (asked at every call to a
    local server) only while every variable it names stays unset."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    model, base = "openai/skilltrain-test-credentials", "http://127.0.0.1:9/v1"
    assert llm.missing_credentials(model, base) == ["OPENAI_API_KEY"]
    assert llm.missing_credentials(model, base) == ["OPENAI_API_KEY"]
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    assert llm.missing_credentials(model, base) == []
    monkeypatch.delenv("OPENAI_API_KEY")
    assert llm.missing_credentials(model, base) == ["OPENAI_API_KEY"]



def test_a_variable_litellm_does_not_list_is_seen_once_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """litellm takes ANTHROPIC_AUTH_TOKEN for a missing ANTHROPIC_API_KEY: a kept
    answer must not outlive a change of the environment it did not name."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    model, base = "anthropic/claude-3-5-haiku-20241022", "http://127.0.0.1:9"
    assert llm.missing_credentials(model, base) == ["ANTHROPIC_API_KEY"]
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "token")
    assert llm.missing_credentials(model, base) == []
