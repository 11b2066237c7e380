"""vLLM's names that carry a meaning here: SamplingParams' allowed_token_ids, bad_words and
truncate_prompt_tokens; the --tokenizer, --max-logprobs, hub, logging and tool-parser flags."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient
from helpers.models import make_tiny_model

from tachyllm import LLM, SamplingParams
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import engine_config
from tachyllm.entrypoints.cli import build_parser
from tachyllm.errors import ConfigError, ModelLoadError
from tachyllm.sampling.sampler import bad_word_endings
from tachyllm.server.app import build_app
from tachyllm.server.async_engine import AsyncEngine

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return LLM(model_path, dtype="float32", kv_cache_memory="4M")


def greedy(llm: LLM, prompt, **options):
    return llm.generate(prompt, SamplingParams(**{"temperature": 0, "max_tokens": 12, **options}), use_tqdm=False)[0]


# -- allowed_token_ids ------------------------------------------------------------------------------


def test_allowed_token_ids_are_the_only_tokens_sampled(llm):
    unrestricted = greedy(llm, PROMPT).outputs[0].token_ids
    allowed = [t for t in range(40, 60) if t not in unrestricted][:3]
    for temperature in (0, 1.0):
        out = llm.generate(
            PROMPT,
            SamplingParams(temperature=temperature, max_tokens=12, seed=1, allowed_token_ids=allowed),
            use_tqdm=False,
        )[0]
        assert out.error is None and len(out.outputs[0].token_ids) == 12
        assert set(out.outputs[0].token_ids) <= set(allowed)


@pytest.mark.parametrize("value", [[], [-1], [1.5], "12", [True]])
def test_bad_allowed_token_ids_are_value_errors(value):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=value)


def test_allowed_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.get_tokenizer().vocab_size
    out = greedy(llm, PROMPT, allowed_token_ids=[3, vocab + 5])
    assert out.error == f"allowed_token_ids: token id {vocab + 5} is not in the vocabulary (ids 0 to {vocab - 1})"
    assert greedy(llm, PROMPT).error is None  # the engine goes on


# -- bad_words --------------------------------------------------------------------------------------


def test_bad_word_endings_follow_vllms_rule():
    words = [[7], [3, 4], [1, 2, 5]]
    assert bad_word_endings(words, []) == [7]  # a one-token word always; longer ones need their start generated
    assert bad_word_endings(words, [9, 3]) == [7, 4]
    assert bad_word_endings(words, [1, 2]) == [7, 5]
    assert bad_word_endings(words, [2]) == [7]  # a partial start is no start


def round_trips(tokenizer, ids: list[int]) -> bool:
    text = tokenizer.decode(ids)
    return text.strip() == text and tokenizer.encode(text, add_special_tokens=False) == ids


def test_bad_words_are_never_generated(llm):
    tokenizer = llm.get_tokenizer()
    unrestricted = greedy(llm, PROMPT).outputs[0].token_ids
    one = next(t for t in unrestricted if round_trips(tokenizer, [t]))
    out = greedy(llm, PROMPT, bad_words=[tokenizer.decode([one])])
    assert out.error is None and one not in out.outputs[0].token_ids
    # A two-token word: its first token may still come, its second never right after it.
    start = next(i for i in range(len(unrestricted) - 1) if round_trips(tokenizer, unrestricted[i : i + 2]))
    pair = unrestricted[start : start + 2]
    tokens = greedy(llm, PROMPT, bad_words=[tokenizer.decode(pair)]).outputs[0].token_ids
    assert tokens[: start + 1] == unrestricted[: start + 1] and tokens[start + 1] != pair[1]
    assert all(tokens[i : i + 2] != pair for i in range(len(tokens) - 1))


def test_bad_words_cover_the_word_after_a_space(llm):
    processor = llm.engine.input_processor
    tokenizer = llm.get_tokenizer()
    sequences = processor.bad_words_token_ids(["fox"])
    assert tokenizer.encode("fox", add_special_tokens=False) in sequences
    spaced = tokenizer.encode(" fox", add_special_tokens=False)
    assert (spaced in sequences) == (len(spaced) == len(sequences[0]) and spaced[0] != sequences[0][0])


@pytest.mark.parametrize("value", [[""], ["  "], "fox", [3]])
def test_bad_bad_words_are_value_errors(value):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=value)


def test_bad_words_leave_the_callers_params_alone(llm):
    params = SamplingParams(temperature=0, max_tokens=2, bad_words=["fox"])
    llm.generate(PROMPT, params, use_tqdm=False)
    assert params.bad_words_token_ids == []


# -- truncate_prompt_tokens -------------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.get_tokenizer().encode(PROMPT * 4)
    out = greedy(llm, {"prompt_token_ids": ids}, truncate_prompt_tokens=5)
    assert out.prompt_token_ids == ids[-5:]
    assert out.outputs[0].token_ids == greedy(llm, {"prompt_token_ids": ids[-5:]}).outputs[0].token_ids
    assert greedy(llm, {"prompt_token_ids": ids[:3]}, truncate_prompt_tokens=5).prompt_token_ids == ids[:3]
    assert greedy(llm, {"prompt_token_ids": ids}, truncate_prompt_tokens=-1).prompt_token_ids == ids  # fits


@pytest.mark.parametrize("value", [0, -2, 1.5, "5"])
def test_bad_truncate_prompt_tokens_are_value_errors(value):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=value)


# -- --max-logprobs ----------------------------------------------------------------------------------


def test_max_logprobs_bounds_each_request(model_path):
    llm = LLM(model_path, dtype="float32", kv_cache_memory="4M", max_logprobs=2)
    assert greedy(llm, PROMPT, logprobs=2).error is None
    refused = greedy(llm, PROMPT, logprobs=3)
    assert (
        refused.error == "logprobs: 3 alternatives per token were requested, more than this engine's max_logprobs (2)"
    )
    assert "prompt_logprobs" in greedy(llm, PROMPT, prompt_logprobs=5).error
    everything = LLM(model_path, dtype="float32", kv_cache_memory="4M", max_logprobs=-1)
    out = greedy(everything, PROMPT, logprobs=50, max_tokens=1)
    assert out.error is None and len(out.outputs[0].logprobs[0]) >= 50
    with pytest.raises(ConfigError, match="max_logprobs"):
        LLM(model_path, max_logprobs=-2)


def test_max_logprobs_is_a_400_on_the_server(model_path):
    args = build_parser().parse_args(
        ["serve", "--model", model_path, "--dtype", "float32", "--kv-cache-memory", "4M", "--max-logprobs", "1"]
    )
    engine = AsyncEngine(lambda: LLMEngine(engine_config(args)))
    try:
        http = TestClient(build_app(engine, args), base_url="http://127.0.0.1")
        ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logprobs": 1})
        assert ok.status_code == 200, ok.text
        refused = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logprobs": 2})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
        assert "max_logprobs (1)" in refused.json()["error"]["message"]
    finally:
        engine.shutdown(10)


# -- --tokenizer -------------------------------------------------------------------------------------


def test_tokenizer_replaces_the_models(model_path, tmp_path):
    other = tmp_path / "tokenizer"
    other.mkdir()
    shutil.copy(f"{model_path}/tokenizer.json", other)
    tokenizer_config = json.loads(open(f"{model_path}/tokenizer_config.json").read())
    (other / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": "{{ 'mine' }}"}))
    llm = LLM(model_path, dtype="float32", kv_cache_memory="4M", tokenizer=str(other))
    assert llm.get_tokenizer().chat_template == "{{ 'mine' }}"
    assert build_parser().parse_args(["serve", "--tokenizer", str(other)]).tokenizer == str(other)
    with pytest.raises(ModelLoadError, match="tokenizer path does not exist"):
        LLM(model_path, tokenizer=str(tmp_path / "missing"))


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path):
    small = make_tiny_model(tmp_path / "small", vocab_size=100)  # its tokenizer has 400 tokens
    with pytest.raises(ConfigError, match="more than the model's vocabulary"):
        LLM(str(small), tokenizer=str(small))


# -- hub flags ----------------------------------------------------------------------------------------


def tachy_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tachyllm.entrypoints.cli", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("flag", ["--revision", "--download-dir", "--tokenizer-revision"])
def test_hub_flags_are_one_line_errors(flag):
    done = tachy_cli("serve", "some/model", flag, "main")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"tachy serve: error: argument {flag}: tachyllm has no model hub: models and")


def test_hub_options_offline(model_path):
    with pytest.raises(ValueError, match="revision: tachyllm has no model hub"):
        LLM(model_path, revision="main")
    llm = LLM(model_path, dtype="float32", kv_cache_memory="4M", trust_remote_code=True)  # means nothing here
    assert greedy(llm, PROMPT).error is None
    assert build_parser().parse_args(["serve", "--trust-remote-code"]).trust_remote_code is True


# -- server flags ------------------------------------------------------------------------------------


def test_logging_flags_take_vllms_names():
    args = build_parser().parse_args(["serve", "--disable-log-stats", "--enable-log-requests"])
    assert args.log_stats_interval == 0 and args.disable_log_requests is False
    assert build_parser().parse_args(["serve", "--disable-log-requests"]).disable_log_requests is True


def test_tool_call_parser_picks_the_format(model_path):
    """The tiny model's ChatML template writes no <tool_call>: json by default. Under hermes the tools go to
    the template (which ignores them) instead of the generic format's system message: a shorter prompt."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools, "max_tokens": 1}
    prompt_tokens = {}
    for flags, fmt in [
        ([], "json"),
        (["--tool-call-parser", "hermes"], "hermes"),
        (["--tool-call-parser", "json"], "json"),
    ]:
        argv = [
            "serve",
            "--model",
            model_path,
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "4M",
            "--enable-auto-tool-choice",
        ]
        args = build_parser().parse_args([*argv, *flags])
        engine = AsyncEngine(lambda: LLMEngine(engine_config(args)))
        try:
            app = build_app(engine, args)
            assert app.state.server.models[0].tool_format == fmt
            response = TestClient(app, base_url="http://127.0.0.1").post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            prompt_tokens[tuple(flags)] = response.json()["usage"]["prompt_tokens"]
        finally:
            engine.shutdown(10)
    assert prompt_tokens[()] == prompt_tokens[("--tool-call-parser", "json")]
    assert prompt_tokens[("--tool-call-parser", "hermes")] < prompt_tokens[()]


def test_an_unknown_tool_call_parser_lists_ours():
    done = tachy_cli("serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "tachyllm has no tool call parser 'llama3_json'; its parsers: hermes" in done.stderr


# -- get_tokenizer as transformers users call it -------------------------------------------------------


def test_get_tokenizer_answers_transformers_calls(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The quick brown fox")
    encoded = tokenizer("The quick brown fox")
    assert encoded.input_ids == encoded["input_ids"] == ids and encoded.attention_mask == [1] * len(ids)
    batch = tokenizer(["The quick", "brown fox jumps"])
    assert batch.input_ids == [tokenizer.encode("The quick"), tokenizer.encode("brown fox jumps")]
    assert [len(mask) for mask in batch["attention_mask"]] == [len(i) for i in batch.input_ids]
    assert tokenizer.batch_decode(batch.input_ids) == ["The quick", "brown fox jumps"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens == [tokenizer.id_to_token(i) for i in ids] and tokenizer.convert_ids_to_tokens(ids[0]) == tokens[0]
    assert tokenizer.convert_tokens_to_ids(tokens) == ids and tokenizer.convert_tokens_to_ids("<no such>") is None
    vocab = tokenizer.get_vocab()
    assert tokenizer.pad_token_id == vocab["<|endoftext|>"] and tokenizer.eos_token_id == vocab["<|im_end|>"]
    assert len(tokenizer) == tokenizer.vocab_size
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert tokenizer.decode(chat, skip_special_tokens=False).startswith("<|im_start|>user\nhi")
    with pytest.raises(AttributeError):
        encoded.token_type_ids
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tokenizer.convert_ids_to_tokens([10**6])


def test_pad_token_id_survives_the_checkpoint_cache(llm):
    from tachyllm.loading.tokenizer import Tokenizer

    tokenizer = llm.get_tokenizer()
    assert Tokenizer.from_state(tokenizer.to_state()).pad_token_id == tokenizer.pad_token_id is not None
    state = tokenizer.to_state()
    del state["pad_token_id"]  # a cache written before the pad token was kept
    assert Tokenizer.from_state(state).pad_token_id is None
