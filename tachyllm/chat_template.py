"""Chat templates: a Jinja template compiled in the environment transformers renders them in, and
the --chat-template value (a file, or the template itself) read and checked before anything loads.

A leaf module (jinja2 loads with the first template: it is slow to import; measurements:
docs/design_measurements.md#jinja-import), so the tokenizer and the option declarations both use it.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tachyllm.errors import ConfigError

if TYPE_CHECKING:
    import jinja2


@lru_cache(maxsize=16)
def compile_chat_template(text: str) -> jinja2.Template:
    """The template compiled (cached by its text); ConfigError if it is not valid Jinja."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Same environment settings as transformers, so templates render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template is not valid Jinja (line {exc.lineno}): {exc.message}") from exc


def read_chat_template(value: str) -> str:
    """--chat-template's value: the template itself when it looks like one (braces or a line break,
    vLLM's test), else a Jinja file's path; compiled once to check it. Reading a template is
    therefore idempotent."""
    if any(c in value for c in "{}\n"):
        text = value
    else:
        try:
            text = Path(value).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(
                f"chat template file {value!r} not found (give a Jinja file, or the template text itself)"
            ) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the chat template file {value!r}: {e}") from None
    compile_chat_template(text)
    return text


def chat_template_flag(value: str) -> str:
    """read_chat_template as an argparse type: its message becomes the flag's one-line error."""
    try:
        return read_chat_template(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and '; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)
