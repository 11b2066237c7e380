"""The offline chat API as vLLM's (issue #20, point 6): LLM.chat's template options, one output per
conversation, llm.get_tokenizer(); and --chat-template, checked before the model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CHATML

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
