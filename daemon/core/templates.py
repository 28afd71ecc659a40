"""Prompt templates: prompts/<name>.md.j2, the user's to edit.

Jinja2 with StrictUndefined, so a misspelt variable is an error and not an
empty hole in the prompt. A job reads the template file once: the bytes it
hashes (for the sidecar) are the bytes it renders the prompt and the archive
from, so an edit takes effect at the next job without a restart, and a job
never mixes two versions. Compiled templates are cached by content hash.
"""
from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from .errors import ConfigError

_CACHE_SIZE = 8
# What may be quoted from an UndefinedError: a variable or attribute name.
# Anything else in its message may be a value (the human screenplay).
_UNDEFINED_NAME = re.compile(r"'([^']{1,64})' is undefined|has no attribute '([^']{1,64})'")


@dataclass(frozen=True)
class LoadedTemplate:
    """One version of a template file: its hash and its compiled form."""

    path: Path
    source_hash: str
    template: jinja2.Template

    def render(self, **fields: Any) -> str:
        try:
            return self.template.render(**fields)
        except jinja2.UndefinedError as e:
            name = _undefined_name(e)
            line = _template_line(e, self.path)
            where = f", line {line}" if line else ""
            what = f"{name!r} is undefined" if name else "a variable is undefined"
            raise ConfigError(f"template {self.path}{where}: {what}") from None
        except Exception as e:
            # The message of a render-time error may quote a variable's value,
            # and the values include the human screenplay: name the kind and
            # the template line only.
            line = _template_line(e, self.path)
            where = f", line {line}" if line else ""
            raise ConfigError(f"template {self.path}{where}: render failed "
                              f"({type(e).__name__})") from None


class PromptTemplates:
    """The templates of one prompts/ folder. Cheap to build; files are read on use."""

    def __init__(self, prompts_dir: Path) -> None:
        self.prompts_dir = prompts_dir
        self._env = jinja2.Environment(
            undefined=jinja2.StrictUndefined,
            autoescape=False,  # prompts are Markdown for an LLM, not HTML
            keep_trailing_newline=True,
        )
        self._compiled: dict[tuple[str, str], jinja2.Template] = {}
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        return self.prompts_dir / f"{name}.md.j2"

    def load(self, name: str) -> LoadedTemplate:
        """Read the file now, compile it (cached by content), raise ConfigError if bad."""
        path = self.path(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"template {path} not found") from None
        except OSError as e:
            raise ConfigError(f"template {path}: cannot read: "
                              f"{e.strerror or type(e).__name__}") from None
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            template = self._compiled.get((name, digest))
        if template is None:
            template = self._compile(path, data)
            with self._lock:
                if len(self._compiled) >= _CACHE_SIZE:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[(name, digest)] = template
        return LoadedTemplate(path, digest, template)

    def source_hash(self, name: str) -> str:
        """sha256 of the template file as it is now."""
        path = self.path(name)
        try:
            return hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as e:
            raise ConfigError(f"template {path}: cannot read: "
                              f"{e.strerror or type(e).__name__}") from None

    def check(self, name: str) -> None:
        """Compile the template now, so a syntax error stops start-up with its line."""
        self.load(name)

    def render(self, name: str, **fields: Any) -> str:
        return self.load(name).render(**fields)

    def _compile(self, path: Path, data: bytes) -> jinja2.Template:
        try:
            source = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"template {path}: not valid UTF-8 (byte {e.start})") from None
        try:
            # filename=path: runtime errors carry the template's line in
            # their traceback, which _template_line reads.
            code = self._env.compile(source, name=path.name, filename=str(path))
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"template {path}, line {e.lineno}: {e.message}") from None
        return self._env.template_class.from_code(self._env, code, self._env.globals)


def _undefined_name(error: jinja2.UndefinedError) -> str | None:
    match = _UNDEFINED_NAME.search(error.message or "")
    if not match:
        return None
    name = match.group(1) or match.group(2)
    return name if name.isidentifier() else None


def _template_line(error: BaseException, path: Path) -> int | None:
    """The template line of a render error (Jinja maps its frames to the file)."""
    line = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(path):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
