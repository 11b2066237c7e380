"""The chat API as vLLM's and OpenAI's: offline, LLM.chat's template options, one output per
conversation, llm.get_tokenizer(); --chat-template, checked before the model loads; and on the server,
an answer sent back as the openai client gives it (message.model_dump())."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.models import CHATML
from helpers.server import error_of
from helpers.server import tool_room_url as url  # noqa: F401  (a fixture)

from tachyllm import LLM, SamplingParams
from tachyllm.config import EngineConfig
from tachyllm.entrypoints.cli import build_parser
from tachyllm.errors import ConfigError, RequestError

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
ASK = [{"role": "user", "content": "The quick brown"}]
PLAIN = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)
THINKING = (
    "{{ messages[-1]['content'] }}{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
)


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return LLM(model_path, dtype="float32", kv_cache_memory=4 << 20)


def prompt_ids(outputs) -> list[list[int]]:
    return [out.prompt_token_ids for out in outputs]


def test_get_tokenizer_is_usable_like_vllms(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The quick brown")
    assert tokenizer.decode(ids) == "The quick brown"
    text = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nThe quick brown<|im_end|>\n<|im_start|>assistant\n"
    token_ids = tokenizer.apply_chat_template(ASK, tokenize=True)
    assert token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.eos_token_id == tokenizer.get_vocab()["<|im_end|>"] and tokenizer.vocab_size > 100
    # What LLM.chat renders is what the tokenizer renders.
    assert llm.chat(ASK, GREEDY, use_tqdm=False)[0].prompt_token_ids == token_ids


def test_chat_takes_a_list_of_conversations(llm):
    second = [{"role": "user", "content": "Paged attention"}]
    outs = llm.chat([ASK, second], GREEDY, use_tqdm=False)
    assert len(outs) == 2
    alone = [llm.chat(conv, GREEDY, use_tqdm=False)[0] for conv in (ASK, second)]
    assert prompt_ids(outs) == prompt_ids(alone)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


def test_chat_template_options(llm, tmp_path):
    tokenizer = llm.get_tokenizer()

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    out = llm.chat(ASK, GREEDY, chat_template=PLAIN, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids("[user] The quick brown\n>")
    # Output from the prompt the template made: the same as generating from those ids.
    same = llm.generate({"prompt_token_ids": ids("[user] The quick brown\n>")}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    template_file = tmp_path / "plain.jinja"
    template_file.write_text(PLAIN)
    assert llm.chat(ASK, GREEDY, chat_template=str(template_file), use_tqdm=False)[0].prompt_token_ids == ids(
        "[user] The quick brown\n>"
    )
    no_prompt = llm.chat(ASK, GREEDY, chat_template=PLAIN, add_generation_prompt=False, use_tqdm=False)[0]
    assert no_prompt.prompt_token_ids == ids("[user] The quick brown\n")
    history = [*ASK, {"role": "assistant", "content": "fox jumps"}]
    continued = llm.chat(history, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert continued.prompt_token_ids == ids(
        "<|im_start|>user\nThe quick brown<|im_end|>\n<|im_start|>assistant\nfox jumps"
    )
    kwargs = {"enable_thinking": False}
    thinking = llm.chat(ASK, GREEDY, chat_template=THINKING, chat_template_kwargs=kwargs, use_tqdm=False)[0]
    assert thinking.prompt_token_ids == ids("The quick brown<nothink>")
    assert llm.chat(ASK, GREEDY, chat_template=THINKING, use_tqdm=False)[0].prompt_token_ids == ids("The quick brown")


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"continue_final_message": True}, RequestError, "cannot both be true"),
        ({"continue_final_message": True, "add_generation_prompt": False}, RequestError, "assistant"),
        ({"chat_template_kwargs": {"messages": []}}, RequestError, "may not set messages"),
        ({"chat_template": "{% for %}"}, ConfigError, "not valid Jinja"),
        ({"chat_template": "no/such/template.jinja"}, ConfigError, "not found"),
    ],
)
def test_bad_chat_options_raise_before_anything_runs(llm, kwargs, error, words):
    with pytest.raises(error, match=words):
        llm.chat(ASK, GREEDY, use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_engine_chat_template_replaces_the_models(model_path, tmp_path):
    template_file = tmp_path / "t.jinja"
    template_file.write_text(PLAIN)
    llm = LLM(model_path, dtype="float32", kv_cache_memory=4 << 20, chat_template=str(template_file))
    tokenizer = llm.get_tokenizer()
    assert tokenizer.chat_template == PLAIN
    assert llm.chat(ASK, GREEDY, use_tqdm=False)[0].prompt_token_ids == tokenizer.encode(
        "[user] The quick brown\n>", add_special_tokens=False
    )
    # Another engine of the same model keeps the model's own template.
    assert LLM(model_path, dtype="float32", kv_cache_memory=4 << 20).get_tokenizer().chat_template == CHATML


@pytest.mark.parametrize(
    "value, words",
    [("no/such/template.jinja", "not found"), ("{% for %}", "not valid Jinja"), (".", "cannot read")],
)
def test_chat_template_flag_errors_in_one_line(value, words, capsys):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", "--chat-template", value])
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--chat-template" in err and words in err
    with pytest.raises(ConfigError, match=words):
        EngineConfig(chat_template=value)


def test_serve_refuses_a_bad_template_before_loading(tmp_path):
    # A model path that does not exist either: the template's error comes first, from the parser.
    result = subprocess.run(
        [sys.executable, "-m", "tachyllm.entrypoints.cli", "serve", "--model", str(tmp_path / "none"),
         "--chat-template", str(tmp_path / "missing.jinja")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "chat template file" in result.stderr and "missing.jinja" in result.stderr
    assert "Traceback" not in result.stderr


def test_template_file_reads_as_its_text(tmp_path):
    path = Path(tmp_path / "t.jinja")
    path.write_text(CHATML)
    assert EngineConfig(chat_template=str(path)).chat_template == CHATML


# -- the server's chat: an answer sent back as the openai client gives it --------------------------------


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def chat(client, messages: list[dict], **options):
    return client.chat.completions.create(
        model="m", messages=messages, **{"max_tokens": 4, "temperature": 0, **options}
    )


def test_an_answer_sent_back_as_it_came(client):
    """messages.append(reply.choices[0].message.model_dump()): the SDK's response-message fields, nulls
    included, render as the plain assistant message would."""
    dumped = chat(client, ASK).choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys() and dumped["refusal"] is None
    then = {"role": "user", "content": "And then?"}
    echoed = chat(client, [*ASK, dumped, then])
    plain = chat(client, [*ASK, {"role": "assistant", "content": dumped["content"]}, then])
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens
    assert echoed.choices[0].message.content == plain.choices[0].message.content
    # A refusal's text is what the assistant said; annotations are accepted.
    refused = {"role": "assistant", "content": None, "refusal": "I cannot help.", "annotations": []}
    said = {"role": "assistant", "content": "I cannot help."}
    assert (
        chat(client, [*ASK, refused, then]).usage.prompt_tokens == chat(client, [*ASK, said, then]).usage.prompt_tokens
    )


def test_an_answer_with_tool_calls_sent_back_as_it_came(client):
    reply = chat(client, ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    message = reply.choices[0].message
    [call] = message.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "content": "18 C"}
    echoed = chat(client, [*ASK, message.model_dump(), result], tools=[WEATHER])
    function = {"name": call.function.name, "arguments": call.function.arguments}
    plain = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call.id, "type": "function", "function": function}],
    }
    assert echoed.usage.prompt_tokens == chat(client, [*ASK, plain, result], tools=[WEATHER]).usage.prompt_tokens


@pytest.mark.parametrize(
    "message, param, words",
    [
        ({"role": "assistant", "content": "x", "audio": {"id": "audio_1"}}, "messages[1].audio", "audio"),
        ({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
         "messages[1].function_call", "send tool_calls"),
        ({"role": "user", "content": "x", "refusal": "no"}, "messages[1].refusal", "only assistant messages"),
        ({"role": "user", "content": "x", "annotations": []}, "messages[1].annotations", "only assistant messages"),
        ({"role": "assistant", "content": "x", "reasoning_contents": None}, "messages[1].reasoning_contents",
         "unknown field"),
    ],
)  # fmt: skip
def test_fields_of_an_answer_that_cannot_be_sent_back(http, message, param, words):
    response = http.post("/v1/chat/completions", json={"model": "m", "messages": [*ASK, message], "max_tokens": 2})
    error = error_of(response, 400)
    assert error["param"] == param and words in error["message"], error
