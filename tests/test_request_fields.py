"""Every request field of /v1/completions and /v1/chat/completions is applied or refused: unknown
fields are a 400 naming them, and vLLM's sampling and chat extensions change the output as vLLM's
do; with the official openai client (vLLM's fields in extra_body)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from helpers.models import CHATML
from helpers.server import running_server

from tachyllm import LLM, SamplingParams
from tachyllm.loading.tokenizer import Tokenizer

GREEDY = {"temperature": 0, "ignore_eos": True}
ASK = [{"role": "user", "content": "The quick brown"}]
# The tiny models' chat template (helpers/models.py), with a variable a request sets through chat_template_kwargs.
THINKING = CHATML.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}",
)


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "thinking.jinja"
    path.write_text(THINKING)
    return path


@pytest.fixture(scope="module")
def url(model_path, template_file) -> Iterator[str]:
    with running_server(model_path, "--chat-template", str(template_file), "--served-model-name", "m") as base:
        yield base


@pytest.fixture(scope="module")
def tokenizer(model_path) -> Tokenizer:
    return Tokenizer.from_hf_dir(model_path)


@pytest.fixture(scope="module")
def offline(model_path) -> LLM:
    return LLM(model_path, dtype="float32", kv_cache_memory=4 << 20)


def refusal(call) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error"
    return error


def complete(client, **kwargs):
    return client.completions.create(model="m", prompt=kwargs.pop("prompt", "The quick brown"), **kwargs)


def chat(client, **kwargs):
    return client.chat.completions.create(model="m", messages=kwargs.pop("messages", ASK), **kwargs)


# -- unknown and unsupported fields -----------------------------------------------------------------


@pytest.mark.parametrize("call", [complete, chat])
def test_unknown_fields_are_refused_by_name(client, call):
    error = refusal(lambda: call(client, max_tokens=2, extra_body={"foo": 1}))
    assert error["param"] == "foo" and error["message"] == "unknown field 'foo': this server does not support it"
    error = refusal(lambda: call(client, max_tokens=2, stream=True, stream_options={"include_usage": True, "bar": 1}))
    assert error["param"] == "stream_options.bar" and "unknown field 'stream_options.bar'" in error["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "zz": 1}]}]},
         "messages[0].content[0].zz"),
        ({"messages": [{"role": "user", "content": "x", "zz": 1}]}, "messages[0].zz"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}, "q": 1}}, "tool_choice.q"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "q": 1}}},
         "response_format.json_schema.q"),
    ],
)  # fmt: skip
def test_unknown_nested_fields_are_refused_by_path(http, body, param):
    response = http.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"unknown field {param!r}")


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("functions", [{"name": "f"}], "send tools"),
        ("function_call", "auto", "send tool_choice"),
        ("audio", {"voice": "alloy", "format": "wav"}, "audio output"),
        ("prediction", {"type": "content", "content": "x"}, "predicted outputs"),
        ("web_search_options", {}, "web search"),
        ("reasoning_effort", "low", "chat_template_kwargs"),
        ("use_beam_search", True, "beam search"),
        ("chat_template", "{{ messages }}", "--chat-template"),
        ("modalities", ["text", "audio"], "only text"),
    ],
)
def test_openai_features_not_served_are_refused(client, field, value, words):
    error = refusal(lambda: chat(client, max_tokens=2, extra_body={field: value}))
    assert error["param"] == field and words in error["message"]


def test_harmless_openai_fields_are_accepted(client):
    out = chat(
        client,
        max_tokens=2,
        user="u",
        store=False,
        metadata={"k": "v"},
        service_tier="auto",
        parallel_tool_calls=True,
        modalities=["text"],
    )
    assert out.usage.completion_tokens >= 1
    assert complete(client, max_tokens=2, user="u").usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("include_stop_str_in_output", "yes"),
        ("skip_special_tokens", 1),
        ("spaces_between_special_tokens", None),
        ("min_tokens", "2"),
        ("top_k", 1.5),
        ("chat_template_kwargs", ["enable_thinking"]),
        ("add_generation_prompt", "no"),
        ("continue_final_message", 0),
    ],
)
def test_wrong_types_name_the_field(http, field, value):
    response = http.post("/v1/chat/completions", json={"messages": ASK, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


# -- vLLM's sampling extensions, on both endpoints ---------------------------------------------------


def texts_of(call, client, **kwargs) -> tuple[str, str]:
    """(whole, streamed) text of one greedy request."""
    if call is complete:
        whole = complete(client, **kwargs).choices[0].text
        streamed = "".join(c.choices[0].text for c in complete(client, stream=True, **kwargs) if c.choices)
    else:
        whole = chat(client, **kwargs).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, stream=True, **kwargs) if c.choices)
    return whole, streamed


@pytest.mark.parametrize("call", [complete, chat])
def test_include_stop_str_in_output(client, call):
    full, _ = texts_of(call, client, max_tokens=12, extra_body=GREEDY)
    stop = full[4:6]
    cut = full.index(stop)
    assert cut > 0
    without = texts_of(call, client, max_tokens=12, stop=[stop], extra_body=GREEDY)
    with_stop = texts_of(
        call, client, max_tokens=12, stop=[stop], extra_body={**GREEDY, "include_stop_str_in_output": True}
    )
    assert without == (full[:cut],) * 2
    assert with_stop == (full[: cut + len(stop)],) * 2


def test_include_stop_str_in_output_offline(offline):
    full = offline.generate("The quick", SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].outputs[0].text
    stop = full[5:7]
    out = offline.generate(
        "The quick",
        SamplingParams(max_tokens=12, stop=stop, include_stop_str_in_output=True, **GREEDY),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == full[: full.index(stop) + len(stop)] and out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_token_text_is_output_only_when_asked(offline):
    # vLLM's rule: the stop token (a stop_token_ids entry, or EOS) that ends the output is not
    # detokenized into its text, unless include_stop_str_in_output.
    full = offline.generate("The quick", SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0].outputs[0]
    stop = full.token_ids[3]
    texts = []
    for include in (False, True):
        params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop], include_stop_str_in_output=include)
        out = offline.generate("The quick", params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full.token_ids[:4] and out.stop_reason == stop
        texts.append(out.text)
    tokenizer = offline.get_tokenizer()
    assert texts == [tokenizer.decode(full.token_ids[:3]), tokenizer.decode(full.token_ids[:4])]


def test_tokenize_takes_the_chat_template_options(http, tokenizer):
    history = [*ASK, {"role": "assistant", "content": "fox jumps"}]
    body = {"messages": history, "add_generation_prompt": False, "continue_final_message": True}
    tokens = http.post("/tokenize", json=body).json()["tokens"]
    rendered = "<|im_start|>user\nThe quick brown<|im_end|>\n<|im_start|>assistant\nfox jumps"
    assert tokens == tokenizer.encode(rendered, add_special_tokens=False)
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    thinking_off = "<|im_start|>user\nThe quick brown<|im_end|>\n<|im_start|>assistant\n<think></think>"
    assert http.post("/tokenize", json=body).json()["tokens"] == tokenizer.encode(
        thinking_off, add_special_tokens=False
    )
    response = http.post("/tokenize", json={"messages": ASK, "continue_final_message": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("call", [complete, chat])
def test_skip_special_tokens(client, tokenizer, call):
    # A bias forces a special token: shown only when special tokens are kept.
    start = tokenizer.get_vocab()["<|im_start|>"]
    bias = {"logit_bias": {str(start): 100}, **GREEDY}
    assert texts_of(call, client, max_tokens=3, extra_body=bias) == ("", "")
    kept = texts_of(call, client, max_tokens=3, extra_body={**bias, "skip_special_tokens": False})
    assert kept == ("<|im_start|>" * 3,) * 2
    # Byte-level BPE adds nothing between special tokens: both settings write the same.
    spaced = texts_of(
        call,
        client,
        max_tokens=3,
        extra_body={**bias, "skip_special_tokens": False, "spaces_between_special_tokens": False},
    )
    assert spaced == kept


def offline_out(offline, call, max_tokens: int, **params):
    """The output the same greedy request gets offline (the server's template renders ASK as the model's does)."""
    sp = SamplingParams(max_tokens=max_tokens, **GREEDY, **params)
    out = (
        offline.generate("The quick brown", sp, use_tqdm=False)
        if call is complete
        else offline.chat(ASK, sp, use_tqdm=False)
    )
    return out[0].outputs[0]


@pytest.mark.parametrize("call", [complete, chat])
def test_logit_bias(client, offline, call):
    plain = offline_out(offline, call, 6)
    assert texts_of(call, client, max_tokens=6, extra_body=GREEDY) == (plain.text,) * 2
    target = next(t for t in range(5, 300) if t not in plain.token_ids)
    forced = texts_of(call, client, max_tokens=4, extra_body={**GREEDY, "logit_bias": {str(target): 100}})
    assert forced == (offline.get_tokenizer().decode([target] * 4),) * 2
    first = plain.token_ids[0]
    banned = texts_of(call, client, max_tokens=6, extra_body={**GREEDY, "logit_bias": {str(first): -100}})
    expected = offline_out(offline, call, 6, logit_bias={first: -100})
    assert expected.token_ids[0] != first and banned == (expected.text,) * 2


def test_logit_bias_is_per_row_in_a_batch(offline):
    # The sampler adds every row's biases in one vectorised call; rows without any are untouched.
    plain = SamplingParams(max_tokens=6, **GREEDY)
    alone = offline.generate(["The quick", "Paged"], plain, use_tqdm=False)
    biased = SamplingParams(max_tokens=6, logit_bias={alone[0].outputs[0].token_ids[0]: -100, 7: 3.0}, **GREEDY)
    mixed = offline.generate(["The quick", "Paged"], [biased, plain], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert mixed[0].outputs[0].token_ids[0] != alone[0].outputs[0].token_ids[0]


@pytest.mark.parametrize("call", [complete, chat])
def test_vllm_sampling_fields_are_applied(client, offline, call):
    """top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos: each changes the
    outcome the way it should."""
    greedy = offline_out(offline, call, 16)
    # top_k 1 and min_p 1 keep only the most likely token: sampling at temperature 1 becomes greedy.
    for restrict in ({"top_k": 1}, {"min_p": 1.0}):
        body = {"ignore_eos": True, **restrict}
        sampled = texts_of(call, client, max_tokens=16, temperature=1.0, seed=3, extra_body=body)
        assert sampled == (greedy.text,) * 2, restrict
    penalised = offline_out(offline, call, 40, repetition_penalty=3.0)
    # A token the greedy output repeats is penalised.
    assert penalised.token_ids != offline_out(offline, call, 40).token_ids
    served = texts_of(call, client, max_tokens=40, extra_body={**GREEDY, "repetition_penalty": 3.0})
    assert served == (penalised.text,) * 2
    stop = {"temperature": 0, "stop_token_ids": [greedy.token_ids[2]]}
    out = call(client, max_tokens=8, extra_body=stop)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 3
    out = call(client, max_tokens=8, extra_body={**stop, "min_tokens": 8})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    # ignore_eos: forced to the end-of-sequence token, the output stops at once, unless told not to.
    eos = {"temperature": 0, "logit_bias": {str(offline.get_tokenizer().eos_token_id): 100}}
    out = call(client, max_tokens=5, extra_body=eos)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1
    out = call(client, max_tokens=5, extra_body={**eos, "ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5


@pytest.mark.parametrize("call", [complete, chat])
def test_continuous_usage_stats(client, call):
    chunks = list(
        call(
            client,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=GREEDY,
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 6
    plain = list(call(client, max_tokens=6, stream=True, extra_body=GREEDY))
    assert all(c.usage is None for c in plain)


# -- chat templating: add_generation_prompt, continue_final_message, chat_template_kwargs -------------


def as_completion(client, prompt: str, **kwargs) -> tuple[str, int]:
    out = client.completions.create(model="m", prompt=prompt, max_tokens=6, extra_body=GREEDY, **kwargs)
    return out.choices[0].text, out.usage.prompt_tokens


def chat_text(client, messages, **extra) -> tuple[str, int]:
    out = chat(client, messages=messages, max_tokens=6, extra_body={**GREEDY, **extra})
    return out.choices[0].message.content, out.usage.prompt_tokens


def test_server_chat_template_and_its_variables(client, tokenizer):
    # --chat-template replaced the model's template; chat_template_kwargs set its variables.
    base = "<|im_start|>user\nThe quick brown<|im_end|>\n<|im_start|>assistant\n"
    assert chat_text(client, ASK) == as_completion(client, base)
    thinking_off = chat_text(client, ASK, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off == as_completion(client, base + "<think></think>")
    assert chat_text(client, ASK, chat_template_kwargs={"enable_thinking": True}) == as_completion(client, base)


def test_add_generation_prompt_and_continue_final_message(client):
    history = [*ASK, {"role": "assistant", "content": "fox jumps"}]
    rendered = "<|im_start|>user\nThe quick brown<|im_end|>\n<|im_start|>assistant\nfox jumps"
    assert chat_text(client, history, add_generation_prompt=False, continue_final_message=True) == as_completion(
        client, rendered
    )
    assert chat_text(client, ASK, add_generation_prompt=False) == as_completion(
        client, "<|im_start|>user\nThe quick brown<|im_end|>\n"
    )


@pytest.mark.parametrize(
    "messages, extra, param, words",
    [
        ([*ASK, {"role": "assistant", "content": "fox"}], {"continue_final_message": True}, "continue_final_message",
         "cannot both be true"),
        (ASK, {"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message", "assistant"),
        (ASK, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
        (ASK, {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs", "chat_template"),
    ],
)  # fmt: skip
def test_bad_chat_template_options(client, messages, extra, param, words):
    error = refusal(lambda: chat(client, messages=messages, max_tokens=2, extra_body=extra))
    assert error["param"] == param and words in error["message"]


def test_openapi_documents_the_fields(http):
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    chat_schema = schemas["ChatCompletionRequest"]
    assert chat_schema["additionalProperties"] is False
    for field in ("include_stop_str_in_output", "continue_final_message", "chat_template_kwargs", "modalities"):
        assert field in chat_schema["properties"]
    assert "continuous_usage_stats" in schemas["StreamOptions"]["properties"]
