"""A request's prompts as the engine's InputProcessor makes them: completions' prompts tokenized,
chat messages rendered in the model's template; off the event loop, for a long prompt takes the
tokenizer a while (~0.4 s per MiB)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from tachyllm.engine.input_processor import Prompt
from tachyllm.errors import ConfigError, RequestError
from tachyllm.server import protocol as p
from tachyllm.server.errors import bad_request
from tachyllm.server.state import ServedModel, ServerState
from tachyllm.server.tools import ToolPlan, render_history

R = TypeVar("R")

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


async def completion_prompts(state: ServerState, model: ServedModel, prompt: str | list) -> list[Prompt]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items = [prompt]
    else:
        items = prompt
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(items) > state.limits.max_prompts:
        raise bad_request(
            f"at most {state.limits.max_prompts} prompts per request on this server (--max-prompts-per-request), "
            f"got {len(items)}",
            param="prompt",
        )
    for item in items:
        if isinstance(item, str):
            model.check_prompt_chars(len(item), "prompt")
    processor = model.processor
    try:
        return await asyncio.to_thread(lambda: [processor.process_prompt(item) for item in items])
    except RequestError as e:
        raise bad_request(str(e), param=e.param or "prompt") from None


def chat_conversation(messages: list[p.ChatMessage]) -> list[dict[str, str]]:
    conversation = []
    for i, m in enumerate(messages):
        role = CHAT_ROLES[m.role]
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise bad_request(
                        f"only text content parts are supported, got type {part.type!r}",
                        param=f"messages[{i}].content[{j}]",
                    )
                if part.text is None:
                    raise bad_request(
                        "a content part of type 'text' needs a 'text' field", param=f"messages[{i}].content[{j}].text"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        elif m.content is None:
            if role != "assistant":
                raise bad_request("content is required", param=f"messages[{i}].content")
            content = m.refusal or ""  # a refusal's text is what the assistant said
        else:
            content = m.content
        check_answer_fields(m, role, f"messages[{i}]")
        message: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls:
            if role != "assistant":
                raise bad_request("only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if role == "tool":
            if m.tool_call_id is None:
                raise bad_request(
                    "a tool message needs the tool_call_id it answers", param=f"messages[{i}].tool_call_id"
                )
            message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
        conversation.append(message)
    return conversation


def check_answer_fields(m: p.ChatMessage, role: str, where: str) -> None:
    """The fields an answer sent back as it came (message.model_dump()) carries besides content and
    tool_calls: null, or on an assistant message its refusal and annotations (the citations of its text)."""
    if m.audio is not None:
        raise bad_request("audio is not supported; send the answer's text as content", param=f"{where}.audio")
    if m.function_call is not None:
        raise bad_request("the legacy function_call is not supported; send tool_calls", param=f"{where}.function_call")
    if role != "assistant":
        for name in ("refusal", "annotations"):
            if getattr(m, name) is not None:
                raise bad_request(f"only assistant messages carry {name}", param=f"{where}.{name}")


def rendered_conversation(
    model: ServedModel, messages: list[p.ChatMessage], plan: ToolPlan | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as the chat template renders them: tool calls and results in the history in
    the model's tool format, and the request's tools (tools.py)."""
    fmt = plan.format if plan is not None else model.tool_format
    conversation = render_history(chat_conversation(messages), fmt)
    if plan is None:
        return conversation, None
    return plan.prompt(conversation), plan.template_tools()


async def chat_prompt(
    model: ServedModel,
    messages: list[p.ChatMessage],
    plan: ToolPlan | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_vars: dict[str, Any] | None = None,
    param: str = "messages",
) -> Prompt:
    """The prompt of a chat completion: the conversation rendered, tokenized and checked.
    `template_vars`: the request's chat_template_kwargs; `param`: the field the messages came in."""
    conversation, tools = rendered_conversation(model, messages, plan)
    model.check_prompt_chars(sum(len(m["content"]) for m in conversation), param)
    processor = model.processor
    return await in_thread_for_messages(
        param,
        lambda: processor.process_prompt(
            processor.chat_prompt_ids(
                conversation,
                add_generation_prompt,
                tools,
                continue_final_message=continue_final_message,
                template_vars=template_vars,
            )
        ),
    )


async def chat_token_ids(
    model: ServedModel,
    messages: list[p.ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_vars: dict[str, Any] | None,
) -> list[int]:
    """The conversation's token ids, as /tokenize shows them (no prompt checks: nothing will run)."""
    conversation, _ = rendered_conversation(model, messages, None)
    return await in_thread_for_messages(
        "messages",
        lambda: model.processor.chat_prompt_ids(
            conversation,
            add_generation_prompt,
            continue_final_message=continue_final_message,
            template_vars=template_vars,
        ),
    )


async def in_thread_for_messages(param: str, render: Callable[[], R]) -> R:
    """Runs `render` off the event loop; a template that refuses the conversation is the fault of the
    messages (in the field `param`)."""
    try:
        return await asyncio.to_thread(render)
    except RequestError as e:
        raise bad_request(str(e), param=e.param or param) from None
    except ConfigError as e:
        raise bad_request(str(e), param=param) from None
