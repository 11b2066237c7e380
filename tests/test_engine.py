"""Engine behaviour on a tiny model: stops, streaming text, seeds, n, logprobs, metrics, bad input."""

from __future__ import annotations

import pytest
import torch

from tachyllm import LLM, SamplingParams
from tachyllm.errors import ModelLoadError, RequestError

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(
        str(tiny_model_factory("llama")), dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_model_len=256
    )


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


def stream_texts(llm: LLM, prompt, params) -> list[str]:
    llm.engine.add_request("stream", prompt, params)
    texts = []
    while llm.engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in llm.engine.step()]
    return texts


def test_stop_string_across_token_boundary(llm):
    prompt = "The quick brown fox"
    full = llm.generate(prompt, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # A stop string made of the end of one token's text and the start of the next one's.
    i = next(
        i
        for i in range(3, len(pieces) - 1)
        if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i]) >= 2
    )
    stop = pieces[i][-2:] + pieces[i + 1][len(pieces[i]) : len(pieces[i]) + 2]
    start = full.text.find(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=24, stop=[stop], **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:start]
    # Streaming never shows a prefix of the stop string that is later taken back.
    texts = stream_texts(llm, prompt, SamplingParams(max_tokens=24, stop=[stop], **GREEDY))
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == out.text
    assert all_blocks_free(llm)


def test_stop_token_ids_and_eos(llm):
    full = llm.generate("abc", SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[4]
    out = llm.generate("abc", SamplingParams(max_tokens=10, stop_token_ids=[stop_id], **GREEDY), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    # min_tokens keeps the stop token from ending the sequence early.
    out = llm.generate(
        "abc", SamplingParams(max_tokens=10, min_tokens=10, stop_token_ids=[stop_id], **GREEDY), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 10


def test_streamed_text_is_monotone_and_valid_utf8(llm):
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)
        texts = stream_texts(llm, "Emoji: 🚀 東京", params)
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        final = texts[-1]
        assert all("\ufffd" not in t for t in texts[:-1]) or "\ufffd" in final


def test_seed_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    mixed = llm.generate(["x y z", "hello", "1 2 3 4"], [noise, params, noise], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate(
        "hello", SamplingParams(temperature=1.0, seed=8, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples(llm):
    out = llm.generate(
        "hello", SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert all_blocks_free(llm)


def test_logprobs_match_reference_log_softmax(llm, tiny_model_factory):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_factory("llama"), dtype=torch.float32).eval()
    prompt = [5, 17, 42, 99, 100]
    out = llm.generate([prompt], SamplingParams(max_tokens=5, logprobs=3, **GREEDY), use_tqdm=False)[0].outputs[0]
    ids = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert entry[token].rank == 1
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        top = row.topk(3)
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tid].logprob - lp) < 1e-4
    assert abs(out.cumulative_logprob - sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))) < 1e-5


def test_metrics_recorded(llm):
    out = llm.generate("hello there", SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.ttft > 0 and m.mean_tpot > 0 and m.num_generated_tokens == 6


def test_too_long_prompt_fails_alone(llm):
    params = SamplingParams(max_tokens=8, **GREEDY)
    outs = llm.generate(["short one", [5] * 300, "", [10**6], "another"], params, use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 8
    assert "max_model_len" in outs[1].error and outs[1].outputs == []
    assert "empty" in outs[2].error
    assert "token ids" in outs[3].error
    assert outs[4].error is None and len(outs[4].outputs[0].token_ids) == 8
    assert all_blocks_free(llm)
    with pytest.raises(RequestError, match="max_model_len"):
        llm.engine.add_request("too-long", [5] * 300, params)
    assert not llm.engine.has_unfinished_requests()


def test_request_larger_than_cache_is_rejected(tiny_model_factory):
    small = LLM(
        str(tiny_model_factory("llama")), dtype="float32", block_size=4, kv_cache_memory=16 * 4096, max_model_len=256
    )
    blocks = small.engine.block_manager.num_blocks
    out = small.generate([[5] * (blocks * 4)], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert "KV blocks" in out.error


def test_bad_model_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist.gguf"))
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tmp_path), dtype="int3")
    with pytest.raises(TypeError, match="unknown LLM option"):
        LLM(str(tmp_path), max_num_seq=3)


def test_cli_bad_input_is_one_line(tmp_path):
    import subprocess
    import sys

    missing = tmp_path / "missing.gguf"
    r = subprocess.run(
        [sys.executable, "-m", "tachyllm.entrypoints.cli", "generate", "hi", "--model", str(missing)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert str(missing) in r.stderr.strip().splitlines()[-1]
    r = subprocess.run(
        [sys.executable, "-m", "tachyllm.entrypoints.cli", "generate", "hi", "--temperature", "-1",
         "--model", str(missing)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_cli_generate_streams(tiny_model_factory):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "tachyllm.entrypoints.cli", "--log-level", "WARNING", "generate", "The quick",
         "--model", str(tiny_model_factory("llama")), "--temperature", "0", "--max-tokens", "8", "--ignore-eos",
         "--dtype", "float32", "--kv-cache-memory", "4M"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory=4 << 20)
    expected = llm.generate("The quick", SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0].outputs[0].text
    assert r.stdout == expected + "\n"


def test_cli_chat_repl_answers_each_turn(tiny_model_factory):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "tachyllm.entrypoints.cli", "--log-level", "WARNING", "chat",
         "--model", str(tiny_model_factory("llama")), "--temperature", "0", "--max-tokens", "5", "--ignore-eos",
         "--dtype", "float32", "--kv-cache-memory", "4M"],
        input="hello\n\nsecond turn\n/exit\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("assistant> ") == 2


def test_generate_from_another_thread_warns_once(llm, caplog):
    """A second thread running the engine gets its own OpenMP pool (slower on CPU): said once."""
    import threading

    params = SamplingParams(temperature=0, max_tokens=2)
    with caplog.at_level("WARNING", logger="tachyllm"):
        llm.generate(["main thread"], params, use_tqdm=False)
        assert "another thread" not in caplog.text
        for _ in range(2):
            worker = threading.Thread(target=lambda: llm.generate(["other thread"], params, use_tqdm=False))
            worker.start()
            worker.join()
    assert caplog.text.count("LLM.generate called from another thread") == 1


def test_text_and_tokens_prompts_as_vllm_takes_them(llm):
    """vLLM's TextPrompt / TokensPrompt dicts, alone or in a list, give what the bare text or ids give;
    a dict of another shape fails alone, with a message."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = llm.get_tokenizer().encode("Hello there")
    bare = llm.generate(["Hello there", ids], params, use_tqdm=False)
    dicts = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in bare]
    assert dicts[0].prompt == "Hello there" and dicts[1].prompt_token_ids == ids
    assert (
        llm.generate({"prompt": "Hello there"}, params, use_tqdm=False)[0].outputs[0].token_ids
        == bare[0].outputs[0].token_ids
    )
    bad, good = llm.generate([{"text": "Hi"}, "Hi"], params, use_tqdm=False)
    assert bad.error and "prompt_token_ids" in bad.error and not bad.outputs
    assert good.error is None and len(good.outputs[0].token_ids) == 6
