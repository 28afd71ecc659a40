"""Session-wide safety for the LLM and the loopback server fixtures.

The environment is fixed here, at import, because pytest imports conftest
before any test module, so before anything can import litellm.
"""

from __future__ import annotations

import os

# litellm fetches its model cost map from the internet at import; this keeps it offline.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

# No test may reach a real provider: drop real keys and base-URL redirections.
for _name in (
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "OPENAI_ORGANIZATION",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "AZURE_API_KEY",
    "AZURE_OPENAI_API_KEY",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "MISTRAL_API_KEY",
    "GROQ_API_KEY",
    "OPENROUTER_API_KEY",
    "LITELLM_API_KEY",
):
    os.environ.pop(_name, None)

# litellm's "openai/" provider builds an OpenAI SDK client, which refuses to
# start without an API key even when api_base is the loopback server. A dummy
# key satisfies it; it is worthless anywhere else, and the loopback server
# records it in the Authorization header, so tests can check it was sent.
os.environ["OPENAI_API_KEY"] = "sk-test-loopback"

from collections.abc import Callable, Iterator  # noqa: E402 - the environment must be set first
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import pytest  # noqa: E402

from tests.llm_server import LLMServer  # noqa: E402

if TYPE_CHECKING:
    from skilltrain.handlers.loss import LossJob

if TYPE_CHECKING:
    from tests.daemon_helpers import InProcessDaemon, Workspace

LOOPBACK_MODEL = "openai/loopback-model"


@pytest.fixture
def llm_server() -> Iterator[LLMServer]:
    """A started loopback OpenAI-compatible server on a free port, stopped after the test."""
    server = LLMServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def llm_model() -> str:
    """The litellm model id to use with `llm_server` (pass api_base=llm_server.url)."""
    return LOOPBACK_MODEL


@pytest.fixture(scope="module")
def litellm_frozen() -> Iterator[None]:
    """litellm imported and frozen out of the collector for the module
    (tests.daemon_helpers.litellm_warm_and_frozen); its clients closed after."""
    from tests.daemon_helpers import litellm_warm_and_frozen, release_llm_clients

    with litellm_warm_and_frozen():
        yield
    release_llm_clients()


@pytest.fixture
def start() -> Iterator[Callable[..., InProcessDaemon]]:
    """Start in-process daemons (`start(ws, **kwargs)`); every one is stopped
    (and drained) after the test."""
    from tests.daemon_helpers import InProcessDaemon, release_llm_clients

    started: list[InProcessDaemon] = []

    def _start(ws: Workspace, **kwargs: Any) -> InProcessDaemon:
        d = InProcessDaemon(ws, **kwargs).start()
        started.append(d)
        return d

    yield _start
    for d in reversed(started):
        d.stop()
    release_llm_clients()


@pytest.fixture(autouse=True)
def _answer_keys_reset() -> Iterator[None]:
    """A daemon installs the answer keys process-wide; no test inherits another's."""
    from skilltrain.daemon.guard import leakguard

    yield
    leakguard.install(None)


@pytest.fixture
def answer_keys() -> None:
    """Answer keys installed but empty: library log records are checked, not withheld."""
    from skilltrain.daemon.guard import leakguard

    leakguard.install(leakguard.AnswerKeys(()))


@pytest.fixture
def example_loss_job(tmp_path: Path) -> LossJob:
    """A loss job on the shipped example: its draft's ep01-03 as a run's scripts/."""
    import shutil

    from skilltrain.daemon.core import dataset
    from skilltrain.handlers import loss

    example = Path(__file__).resolve().parent.parent / "data" / "example"
    scripts = tmp_path / "runs" / "r1" / "epoch_00" / "step_00" / "example" / "scripts"
    scripts.mkdir(parents=True)
    for n in (1, 2, 3):
        shutil.copy(example / "model_draft" / f"ep{n:02d}.txt", scripts)
    report = tmp_path / "runs" / "r1" / "loss" / "epoch_00" / "step_00" / "example_ep01-03.md"
    return loss.LossJob(work=dataset.load_work(example), scripts_dir=scripts,
                        report_path=report, first=1, last=3)
