"""The "engine" argument group of every `tachy` command, generated from the EngineConfig fields.

Each field becomes --field-name-with-dashes with the field's default and the help, choices and parser of
its metadata (config.option); a bool field becomes a --name / --no-name pair. Adding an engine option is
therefore one edit: a field of EngineConfig.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

from tachyllm.argtypes import none_or, one_of
from tachyllm.config import EngineConfig


def _value_parser(field: dataclasses.Field, annotation: Any) -> Callable[[str], Any]:
    """The flag's `type=`: the metadata's parse, else the field's type; an optional number also takes "none"
    (an optional string keeps the word: --quant-skip none means skip nothing)."""
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = typing.get_args(annotation) if is_union else (annotation,)
    optional = type(None) in members
    kinds = [m for m in members if m is not type(None)]
    parse = field.metadata.get("parse")
    if parse is None:
        if len(kinds) != 1 or kinds[0] not in (int, float, str):
            raise TypeError(f"EngineConfig.{field.name}: give its option a parse= for type {annotation}")
        parse = kinds[0]
    return none_or(parse) if optional and parse in (int, float) else parse


class KeepEvery(argparse.Action):
    """Stores the flag's value as usual (the last one given wins) and every value given, in order, in
    `<dest>_all`: for a flag that one command takes once and another several times."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        every = getattr(namespace, f"{self.dest}_all", None) or []
        setattr(namespace, f"{self.dest}_all", [*every, values])


# vLLM's flags that fetch a model from the Hugging Face hub. tachyllm opens local files only.
NO_HUB = (
    "tachyllm has no model hub: models and tokenizers are local paths (a GGUF file or a Hugging Face model "
    "directory); download the model first and give its path"
)
HUB_FLAGS = {
    "--revision": "the hub revision (branch, tag or commit) of the model",
    "--tokenizer-revision": "the hub revision of the tokenizer",
    "--download-dir": "where to download hub models",
}


class NoModelHub(argparse.Action):
    """A vLLM hub flag: refused with NO_HUB, in one line, whatever its value."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise argparse.ArgumentError(self, NO_HUB)


def add_hub_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model hub (vLLM's flags; models are local paths here)")
    for flag, what in HUB_FLAGS.items():
        group.add_argument(flag, action=NoModelHub, default=argparse.SUPPRESS, metavar="X", help=f"{what}: refused")
    group.add_argument(
        "--trust-remote-code", action="store_true", default=argparse.SUPPRESS,
        help="accepted and ignored: tachyllm runs its own implementation of each model family, never a checkpoint's"
        " Python code",
    )  # fmt: skip


def add_engine_args(parser: argparse.ArgumentParser, repeatable: dict[str, str] | None = None) -> None:
    """`repeatable`: fields whose flag may be given several times (KeepEvery), with the help text to
    append."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    repeatable = repeatable or {}
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        options: dict[str, Any] = {"default": field.default, "help": field.metadata.get("help")}
        if field.name in repeatable:
            options.update(action=KeepEvery, help=f"{options['help']}; {repeatable[field.name]}")
            parser.set_defaults(**{f"{field.name}_all": []})
        if hints[field.name] is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = _value_parser(field, hints[field.name])
            choices = field.metadata.get("choices")
            if choices is not None and field.default is None:
                # An optional field is unset by "none" (a Ray Serve YAML's null): one more choice, and --help
                # says so (argparse's choices= would list Python's None, which the command line cannot spell).
                options["type"] = none_or(one_of(choices, options["type"]))
                options["metavar"] = "{" + ",".join(map(str, (*choices, "none"))) + "}"
            else:
                options["choices"] = choices
        group.add_argument(flag, **options)
    add_hub_args(parser)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed arguments (a parser that add_engine_args built)."""
    return EngineConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(EngineConfig)})
