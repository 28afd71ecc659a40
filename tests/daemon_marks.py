"""The pytest marks every test file that runs a daemon with litellm shares.

Two third-party warnings are ignored, each for a reason that is not ours:

- litellm's client cache can build two clients for one key when the first
  jobs start at the same moment and drops one without closing it; its idle
  keep-alive socket is then reported when garbage-collected. That is
  litellm's, not the daemon's (the daemon opens no TCP socket of its own).
- watchdog's inotify emitter warns when `mkdir -p` creates nested folders
  faster than it adds watches (it re-adds one, harmlessly). With warnings as
  errors that warning would be raised inside, and kill, the emitter thread.

`DAEMON_TEST_MARKS` adds the `litellm_frozen` fixture (tests/conftest.py):
litellm imported once per module, outside the tests' waits.
"""

from __future__ import annotations

import pytest

THIRD_PARTY_WARNINGS = [
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <socket\.socket fd=\d+, family=2:"
        "pytest.PytestUnraisableExceptionWarning"
    ),
    pytest.mark.filterwarnings("ignore:Callback with id .* already exists:RuntimeWarning"),
]

DAEMON_TEST_MARKS = [*THIRD_PARTY_WARNINGS, pytest.mark.usefixtures("litellm_frozen")]
