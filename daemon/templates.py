"""Prompt templates: prompts/<name>.md.j2, the user's to edit.

Jinja2 with StrictUndefined, so a misspelt variable is an error and not an
empty hole in the prompt. The loader re-reads a template whose file changed
(auto_reload), so an edit takes effect at the next job without a restart;
the template's content hash goes into the report's sidecar, so an edit also
makes earlier reports stale.
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import jinja2

from skilltrain.errors import ConfigError


class PromptTemplates:
    """The templates of one prompts/ folder. Cheap to build; files are read on use."""

    def __init__(self, prompts_dir: Path) -> None:
        self.prompts_dir = prompts_dir
        self._env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(prompts_dir)),
            undefined=jinja2.StrictUndefined,
            autoescape=False,  # prompts are Markdown for an LLM, not HTML
            keep_trailing_newline=True,
            auto_reload=True,
        )
        # Jinja's template cache is shared; compiling the same template from
        # several worker threads at once is safe but wasteful.
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        return self.prompts_dir / f"{name}.md.j2"

    def source_hash(self, name: str) -> str:
        """sha256 of the template file as it is now."""
        try:
            return hashlib.sha256(self.path(name).read_bytes()).hexdigest()
        except OSError as e:
            raise ConfigError(f"template {self.path(name)}: cannot read: "
                              f"{e.strerror or type(e).__name__}") from None

    def check(self, name: str) -> None:
        """Compile the template now, so a syntax error stops start-up with its line."""
        self._get(name)

    def render(self, name: str, **fields: Any) -> str:
        template = self._get(name)
        try:
            return template.render(**fields)
        except jinja2.UndefinedError as e:
            raise ConfigError(f"template {self.path(name)}: {e.message}") from None
        except Exception as e:
            # The message of a render-time error may quote a variable's value,
            # and the values include the human screenplay: name the kind and
            # the template line only.
            line = _template_line(e, self.path(name))
            where = f", line {line}" if line else ""
            raise ConfigError(f"template {self.path(name)}{where}: render failed "
                              f"({type(e).__name__})") from None

    def _get(self, name: str) -> jinja2.Template:
        try:
            with self._lock:
                return self._env.get_template(self.path(name).name)
        except jinja2.TemplateNotFound:
            raise ConfigError(f"template {self.path(name)} not found") from None
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"template {self.path(name)}, line {e.lineno}: "
                              f"{e.message}") from None


def _template_line(error: BaseException, path: Path) -> int | None:
    """The template line of a render error (Jinja maps its frames to the file)."""
    line = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(path):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
