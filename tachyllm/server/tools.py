"""Tool calling (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) on every model.

A model whose chat template writes Hermes-style `<tool_call>{...}</tool_call>` blocks (Qwen2.5 and
its kin) gets the tools through its own template and answers in that format. Any other model (the
default one included) gets tachyllm's generic format: a system message listing the tools, and a call
written as one JSON object, `{"tool_calls": [{"name": ..., "arguments": {...}}]}`. Either way,
`tool_choice` "required" or a named function is enforced by a grammar (structured outputs): one call
of the named function, one or more calls for "required" (one without parallel_tool_calls); "auto" is
parsed from what the model wrote. docs/tools.md has the details.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tachyllm.loading.tokenizer import Tokenizer
from tachyllm.sampling_params import StructuredOutputsParams
from tachyllm.server import protocol as p
from tachyllm.server.errors import bad_request
from tachyllm.structured_output.compiler import JSON_OPTIONS, GrammarCompiler, GrammarError
from tachyllm.structured_output.json_schema import without_undeclared_keys

HERMES = "hermes"  # the template's own <tool_call> blocks
GENERIC = "json"  # tachyllm's JSON object, for templates without tool calls
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_GENERIC_CALL = re.compile(r'\{\s*"tool_calls"')
_GENERIC_CALL_LIST = re.compile(r'\{\s*"tool_calls"\s*:\s*\[\s*')
_GENERIC_SEPARATOR = re.compile(r"\s*,\s*")
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def tool_format(chat_template: str | None, parser: str | None = None) -> str:
    """`parser` (--tool-call-parser: HERMES or GENERIC), else the template's own format."""
    if parser is not None:
        return parser
    return HERMES if chat_template and HERMES_OPEN in chat_template else GENERIC


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _arguments_value(arguments: Any) -> Any:
    """A history tool call's arguments as templates expect them: an object when the JSON text is one."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return arguments
    return arguments


def render_history(conversation: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    """The conversation as the template renders it. Hermes templates render assistant tool calls and
    `tool` messages themselves (arguments as objects). For the generic format, an assistant's calls
    become the JSON it would have written, and a tool's result becomes a user message that names its call."""
    out = []
    for m in conversation:
        calls = m.get("tool_calls")
        if fmt == HERMES:
            if calls:
                calls = [
                    {**c, "function": {**c["function"], "arguments": _arguments_value(c["function"]["arguments"])}}
                    for c in calls
                ]
                m = {**m, "tool_calls": calls}
            out.append(m)
        elif calls:
            written = [
                {"name": c["function"]["name"], "arguments": _arguments_value(c["function"]["arguments"])}
                for c in calls
            ]
            text = json.dumps({"tool_calls": written}, ensure_ascii=False)
            out.append({"role": "assistant", "content": f"{m['content']}\n{text}" if m["content"] else text})
        elif m["role"] == "tool":
            call = m.get("tool_call_id") or "?"
            out.append({"role": "user", "content": f"Result of tool call {call}:\n{m['content']}"})
        else:
            out.append(m)
    return out


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its prompt, its constraint and its answer."""

    format: str
    tools: list[dict[str, Any]]  # OpenAI tool objects ({"type": "function", "function": {...}})
    choice: str  # "auto", "required" or "named"
    named: str | None  # the function tool_choice names
    parallel: bool
    # The Hermes tags are special tokens of the model's tokenizer: its answers are decoded with special
    # tokens kept, or the tags (and so the calls) would vanish from the text (vLLM's Hermes parser does the same).
    keep_special_tokens: bool = False

    @property
    def forced(self) -> bool:
        """The grammar makes the whole answer calls ("required", a named function)."""
        return self.choice != "auto"

    @property
    def functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (Hermes templates only)."""
        return self.tools if self.format == HERMES else None

    def prompt(self, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The generic format's instructions as the first system message (the template's own otherwise)."""
        if self.format == HERMES:
            return conversation
        listed = [
            {"name": f["name"], "description": f.get("description", ""), "parameters": f.get("parameters") or {}}
            for f in self.functions
        ]
        text = (
            "You can call these tools; each takes arguments matching its JSON schema:\n"
            f"{json.dumps(listed, ensure_ascii=False)}\n"
            'To call tools, answer with only a JSON object {"tool_calls": [{"name": TOOL NAME, "arguments": '
            "{ARGUMENTS}}]} and nothing else."
        )
        if self.choice == "required":
            text += " You must call at least one tool."
        elif self.choice == "named":
            text += f" You must call the tool {self.named}."
        else:
            text += " If no tool is needed, answer normally."
        if conversation and conversation[0]["role"] == "system":
            first = conversation[0]
            return [{**first, "content": f"{first['content']}\n\n{text}"}, *conversation[1:]]
        return [{"role": "system", "content": text}, *conversation]

    def constraint(self, grammars: GrammarCompiler) -> StructuredOutputsParams | None:
        """The grammar that makes the model call a tool ("required", named); None for "auto". A named
        function, or "required" without parallel calls, is exactly one call; "required" with them is one
        or more. Each function's arguments are their own %json schema (so that a schema's "$ref"s
        resolve in it), in the compact JSON of structured outputs, with no undeclared keys. The Hermes
        tags are written as `grammars`' model writes them: its special tokens, where they are ones."""
        if self.choice == "auto":
            return None
        allowed = [f for f in self.functions if self.choice != "named" or f["name"] == self.named]
        rules = [f"call: {' | '.join(f'call_{i}' for i in range(len(allowed)))}"]
        for i, f in enumerate(allowed):
            parameters = without_undeclared_keys(f.get("parameters") or {"type": "object"})
            schema = {**parameters, "x-guidance": JSON_OPTIONS}
            opening = '{"name": ' + json.dumps(f["name"]) + ', "arguments": '
            rules.append(f"call_{i}: {_literal(opening)} %json {json.dumps(schema)} {_literal('}')}")
        several = self.choice == "required" and self.parallel
        if self.format == GENERIC:
            more = f"({_literal(', ')} call)*" if several else ""
            head, tail = '{"tool_calls": [', "]}"
            start = f"start: {_literal(head)} call {more} {_literal(tail)}"
        else:
            newline = _literal("\n")
            more = f"({newline} block)*" if several else ""
            start = f"start: block {more}"
            opening, closing = grammars.lark_text(HERMES_OPEN), grammars.lark_text(HERMES_CLOSE)
            rules.append(f"block: {opening} {newline} call {newline} {closing}")
        return StructuredOutputsParams(grammar="\n".join([start, *rules]))

    def answer(self, text: str, finish_reason: str) -> tuple[str | None, list[ToolCall], str]:
        """(content, tool calls, finish reason) of a finished answer. An answer that holds calls and that
        the model ended itself finishes with "tool_calls". One cut by a length limit keeps the calls it
        completed, without the one it was writing, and its "length". A forced choice's answer is calls
        only: it never has content, even with no complete call in it."""
        content, calls = self.parse(text, partial=finish_reason != "stop" or self.forced)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return (None if self.forced else content), calls, finish_reason

    def parse(self, text: str, partial: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of an answer; no calls when it holds none that parse as calls of these
        tools. `partial`: the answer may have been cut; the calls it completed count, and the one it did
        not finish is dropped."""
        names = {f["name"] for f in self.functions}
        if self.format == GENERIC:
            written = _generic_calls(text, partial)
            calls = _calls(written, names) if written is not None else []
            return (None, calls) if calls else (text, [])
        content, blocks = _hermes_blocks(text, partial)
        parsed = []
        for block in blocks:
            try:
                parsed.append(json.loads(block))
            except (json.JSONDecodeError, RecursionError):
                return text, []
        calls = _calls(parsed, names)
        if not calls or len(calls) != len(blocks):
            return text, []
        return content or None, calls


def _generic_calls(text: str, partial: bool) -> list[Any] | None:
    """The entries of a generic-format answer's "tool_calls" list; None if the answer is not such an
    object. `partial`: the entries the list completed, whatever follows them."""
    if not partial:
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return None
        written = value.get("tool_calls") if isinstance(value, dict) else None
        return written if isinstance(written, list) else None
    opening = _GENERIC_CALL_LIST.match(text.lstrip())
    if opening is None:
        return None
    rest, at = text.lstrip(), opening.end()
    entries: list[Any] = []
    decoder = json.JSONDecoder()
    while True:
        try:
            entry, at = decoder.raw_decode(rest, at)
        except (json.JSONDecodeError, RecursionError):
            return entries
        entries.append(entry)
        separator = _GENERIC_SEPARATOR.match(rest, at)
        if separator is None:
            return entries
        at = separator.end()


def _hermes_blocks(text: str, partial: bool) -> tuple[str, list[str]]:
    """(the text around the calls, stripped; the JSON of each <tool_call> block). `partial`: a block
    opened after the last complete one is dropped, with whatever follows it."""
    if partial:
        ends = [m.end() for m in _HERMES_BLOCK.finditer(text)]
        unfinished = text.find(HERMES_OPEN, ends[-1] if ends else 0)
        if unfinished >= 0:
            text = text[:unfinished]
    return _HERMES_BLOCK.sub("", text).strip(), _HERMES_BLOCK.findall(text)


def _calls(written: list[Any], names: set[str]) -> list[ToolCall]:
    """The calls of known functions with object arguments; [] if any entry is not one."""
    calls = []
    for entry in written:
        if not isinstance(entry, dict) or entry.get("name") not in names:
            return []
        arguments = entry.get("arguments", entry.get("parameters", {}))
        if not isinstance(arguments, dict):
            return []
        calls.append(ToolCall(entry["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


class ToolCallStream:
    """One streamed choice: text that may be the start of a tool call is held back until it is known
    not to be one; whatever is held is answered at the end (as calls, or as content after all)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already sent as content
        self._holding = False  # a tool call has begun: nothing more is content until the end

    def feed(self, delta: str) -> str:
        """The content to send now, of the text so far plus `delta`."""
        self.text += delta
        if self._holding:
            return ""
        if self.plan.format == GENERIC:
            if self.plan.forced:
                self._holding = True  # the grammar makes the whole answer a call
                return ""
            state = _generic_start(self.text)
            if state != "no":
                self._holding = state == "call"
                return ""
            return self._send(len(self.text))
        start = self.text.find(HERMES_OPEN, self.sent)
        if start >= 0:
            self._holding = True
            return self._send(start)
        # Hold a tail that could grow into the opening tag.
        keep = next((k for k in range(len(HERMES_OPEN) - 1, 0, -1) if self.text.endswith(HERMES_OPEN[:k])), 0)
        return self._send(len(self.text) - keep)

    def _send(self, end: int) -> str:
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def finish(self, finish_reason: str) -> tuple[str, list[ToolCall], str]:
        """(content still to send, tool calls, finish reason) at the end, as ToolPlan.answer has them."""
        content, calls, finish_reason = self.plan.answer(self.text, finish_reason)
        if content is None:
            return "", calls, finish_reason
        if not calls:
            return self.text[self.sent :], [], finish_reason
        # The content before the first call was sent; Hermes text around the later calls goes now (a
        # "length" answer's unfinished call dropped, as in `answer`).
        held = _hermes_blocks(self.text[self.sent :], partial=finish_reason == "length")[0]
        return held, calls, finish_reason


def _generic_start(text: str) -> str:
    """Whether an answer is a generic-format call: "call", "maybe" (it could still become one), or "no"."""
    head = text.lstrip()
    if _GENERIC_CALL.match(head):
        return "call"
    if not head:
        return "maybe"
    return "maybe" if head[0] == "{" and '"tool_calls"'.startswith(head[1:].lstrip()) else "no"


def tool_plan(body: p.ChatCompletionRequest, tokenizer: Tokenizer, parser: str | None = None) -> ToolPlan | None:
    """The request's tools as a plan in tool_format(tokenizer.chat_template, parser) (None: no tools, or
    tool_choice "none"); 400 for a choice that names no given tool or asks for tools without any."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", param="tools")
    named = None
    if isinstance(choice, p.NamedToolChoice):
        named = choice.function.name
        if named not in names:
            raise bad_request(f"tool_choice names {named!r}, which is not among the tools ({', '.join(names)})",
                              param="tool_choice")  # fmt: skip
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    kind = "named" if isinstance(choice, p.NamedToolChoice) else (choice or "auto")
    parallel = body.parallel_tool_calls is not False
    fmt = tool_format(tokenizer.chat_template, parser)
    return ToolPlan(fmt, tools, kind, named, parallel, keep_special_tokens=fmt == HERMES and _special_tags(tokenizer))


def _special_tags(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer has a Hermes tag as a special token (which decoding drops by default)."""
    ids = [tokenizer.token_id(tag) for tag in (HERMES_OPEN, HERMES_CLOSE)]
    return any(token is not None and tokenizer.is_special(token) for token in ids)


async def check_tool_schemas(compiler: GrammarCompiler, plan: ToolPlan) -> None:
    """Every tool's parameters is a JSON schema structured outputs can enforce (checked off the event
    loop); else a 400 naming the tool. A schema the call grammar enforces ("required", the named tool) is
    compiled on its own, which finds one that fails at its first token (no finite instance, a limit of
    the grammar engine) and names its tool; the others, which no grammar enforces, are only validated."""
    for i, function in enumerate(plan.functions):
        schema = function.get("parameters")
        if schema is None:
            continue
        enforced = plan.choice == "required" or (plan.choice == "named" and function["name"] == plan.named)
        try:
            await asyncio.to_thread(
                compiler.compile if enforced else compiler.check, StructuredOutputsParams(json=schema)
            )
        except GrammarError as e:
            raise bad_request(
                f"tools[{i}].function.parameters is not a usable JSON schema: {e}", param="tools"
            ) from None
