"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log-softmax on the same
weights (fp32), through chunked prefill, prefix-cache hits, n > 1, mixed batches and preemption."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.engine import tiny_llm

from tachyllm import LLM, SamplingParams
from tachyllm.outputs import DeltaAccumulator, RequestOutput
from tachyllm.sampling_params import RequestOutputKind

TOP = 3
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    import transformers

    path = tiny_model_factory("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def prompts_of(lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(n)] for n in lengths]


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row i is the log-softmax that predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check(hf, prompt: list[int], got: list, top: int = TOP) -> None:
    """Every entry: the prompt token's logprob and rank, and the top-N ids and logprobs, as transformers has them."""
    ref = reference(hf, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        row, token, entry = ref[i - 1], prompt[i], got[i]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_lp, top_ids = row.topk(top)
        others = {t: lp for t, lp in entry.items() if lp.rank <= top}
        assert sorted(others) == sorted(top_ids.tolist()), f"position {i}"
        for t, lp in zip(top_ids.tolist(), top_lp.tolist()):
            assert others[t].logprob == pytest.approx(lp, abs=1e-4)
        assert set(entry) == set(top_ids.tolist()) | {token}


def generate(llm: LLM, prompts, params) -> list[RequestOutput]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return outs


def test_match_transformers_with_chunked_prefill(tiny):
    path, hf = tiny
    prompts = prompts_of((1, 2, 9, 30, 45))
    llm = tiny_llm(path, max_num_batched_tokens=7, enable_prefix_caching=False)  # every prompt over several chunks
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    outs = generate(llm, prompts, params)
    for prompt, out in zip(prompts, outs):
        check(hf, prompt, out.prompt_logprobs)
    assert outs[0].prompt_logprobs == [None]
    # The same prompts in one chunk each: the same tokens, and entries that match transformers too.
    whole = generate(tiny_llm(path, enable_prefix_caching=False), prompts, params)
    for prompt, a, b in zip(prompts, outs, whole):
        check(hf, prompt, b.prompt_logprobs)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_cached_prefix_is_recomputed(tiny):
    """A request that asks for prompt logprobs does not take its prompt from the prefix cache: every
    position is scored, as on a cold cache."""
    path, hf = tiny
    [prompt] = prompts_of((37,), seed=1)
    llm = tiny_llm(path, max_num_batched_tokens=16)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    generate(llm, [prompt], plain)  # warms the cache
    warm = generate(llm, [prompt], plain)[0]
    assert warm.num_cached_tokens > 0 and warm.prompt_logprobs is None
    scored = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
    for _ in range(2):  # the same prompt twice: both recomputed
        out = generate(llm, [prompt], scored)[0]
        assert out.num_cached_tokens == 0
        check(hf, prompt, out.prompt_logprobs)
        assert out.outputs[0].token_ids == warm.outputs[0].token_ids


def test_n_samples_and_a_mixed_batch(tiny):
    path, hf = tiny
    prompts = prompts_of((12, 20, 7, 26), seed=2)
    llm = tiny_llm(path, max_num_batched_tokens=24)
    params = [
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=TOP),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0, logprobs=1),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP),
    ]
    outs = generate(llm, prompts, params)
    check(hf, prompts[0], outs[0].prompt_logprobs)
    assert len(outs[0].outputs) == 3
    assert outs[1].prompt_logprobs is None
    ref = reference(hf, prompts[2])
    for i, entry in enumerate(outs[2].prompt_logprobs[1:], start=1):  # 0: the prompt token alone
        assert list(entry) == [prompts[2][i]]
        assert entry[prompts[2][i]].logprob == pytest.approx(ref[i - 1, prompts[2][i]].item(), abs=1e-4)
    assert len(outs[2].outputs[0].logprobs) == 4  # generated-token logprobs as before
    check(hf, prompts[3], outs[3].prompt_logprobs)
    # Scoring the prompt changes nothing of what is generated.
    alone = generate(tiny_llm(path), prompts[1:], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in alone]
    seeded = generate(tiny_llm(path), prompts[:1], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4))[0]
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in seeded.outputs]


def test_preempted_mid_prompt_scores_each_position_once(tiny):
    """Preempted after some chunks, the sequence is recomputed; the positions already scored are not
    scored again (its cached blocks serve only those), the others are."""
    path, hf = tiny
    [prompt] = prompts_of((40,), seed=3)
    llm = tiny_llm(path, max_num_batched_tokens=6)
    eng = llm.engine
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP))
    req = eng.requests["r"]
    for _ in range(3):
        assert eng.step() == []
    known = len(req.prompt_logprobs)
    assert 0 < known < len(prompt) - 1
    eng.scheduler._preempt(req.seqs[0])
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    check(hf, prompt, outs[-1].prompt_logprobs)
    assert eng.stats.num_preemptions == 1
    assert eng.stats.prefix_cache_hits == known // 4 * 4  # resumed on the blocks already scored


def test_preemption_under_a_small_cache(tiny):
    path, hf = tiny
    prompts = prompts_of((30, 41, 25, 38, 33, 44), seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    llm = tiny_llm(path, max_model_len=72, kv_cache_memory=96 << 10, max_num_batched_tokens=32)
    outs = generate(llm, prompts, params)
    assert llm.engine.stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        check(hf, prompt, out.prompt_logprobs, top=2)


def test_delta_outputs_carry_them_once(tiny):
    path, hf = tiny
    [prompt] = prompts_of((19,), seed=5)
    eng = tiny_llm(path, max_num_batched_tokens=8).engine
    params = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA
    )
    eng.add_request("d", prompt, params)
    deltas = []
    while eng.has_unfinished_requests():
        deltas += eng.step()
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
    acc = DeltaAccumulator()
    for d in deltas:
        acc.add(d)
    check(hf, prompt, acc.result().prompt_logprobs, top=1)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
        {"method": "draft_model", "model": "self:layers=1", "num_speculative_tokens": 2},
    ],
)
def test_with_speculative_decoding(tiny, spec):
    """Speculating sequences verify drafts while others prefill with their prompt rows scored."""
    path, hf = tiny
    prompts = prompts_of((14, 33, 21), seed=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=TOP)
    llm = tiny_llm(path, max_num_batched_tokens=16, speculative_config={**spec, "adaptive": False})
    outs = generate(llm, prompts, params)
    assert llm.engine.stats.spec_num_drafts > 0
    plain = generate(tiny_llm(path), prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out, ref in zip(prompts, outs, plain):
        check(hf, prompt, out.prompt_logprobs)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_bad_values_are_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


# -- the server: echo with logprobs, vLLM's prompt_logprobs ----------------------------------------

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def url(tiny):
    from helpers.server import running_server

    with running_server(str(tiny[0])) as base:
        yield base


@pytest.fixture(scope="module")
def prompt_ids(tiny) -> list[int]:
    return tiny_llm(tiny[0]).get_tokenizer().encode(PROMPT)


def check_echo_logprobs(hf, ids: list[int], lp, top: int) -> None:
    """The legacy shape of an echoed prompt: null first, then each token's logprob, as transformers has it."""
    ref = reference(hf, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[: len(ids)] == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert len(lp.top_logprobs[i]) <= top  # tokens that print alike merge
        assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i - 1].max().item(), abs=1e-4)


def test_echo_with_logprobs_and_no_new_tokens(client, tiny, prompt_ids):
    out = client.completions.create(
        model=str(tiny[0]), prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, extra_body={"temperature": 0}
    )
    [choice] = out.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    check_echo_logprobs(tiny[1], prompt_ids, choice.logprobs, 2)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(prompt_ids)
    # Token ids in, the same logprobs out; n choices each echo the prompt.
    by_ids = client.completions.create(model=str(tiny[0]), prompt=prompt_ids, echo=True, logprobs=2, max_tokens=0, n=2)
    assert [c.logprobs.token_logprobs for c in by_ids.choices] == [choice.logprobs.token_logprobs] * 2


def test_echo_with_logprobs_then_generated_tokens(client, tiny, prompt_ids):
    model = str(tiny[0])
    plain = client.completions.create(model=model, prompt=PROMPT, logprobs=2, max_tokens=4, extra_body=GREEDY)
    out = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, extra_body=GREEDY)
    [choice] = out.choices
    assert choice.text == PROMPT + plain.choices[0].text
    lp, k = choice.logprobs, len(prompt_ids)
    check_echo_logprobs(tiny[1], prompt_ids, lp, 2)
    assert lp.tokens[k:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[k:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset[k] == len(PROMPT)
    assert out.usage.completion_tokens == 4


def test_streamed_echo_sends_the_prompt_first(client, tiny, prompt_ids):
    model = str(tiny[0])
    whole = client.completions.create(
        model=model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=5, extra_body=GREEDY
    )
    chunks = list(
        client.completions.create(
            model=model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=5, stream=True, extra_body=GREEDY
        )
    )
    first = chunks[0].choices[0]
    assert first.text == PROMPT and len(first.logprobs.tokens) == len(prompt_ids)
    check_echo_logprobs(tiny[1], prompt_ids, first.logprobs, 1)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed = [
        lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    # Nothing generated: one chunk, the prompt, ended by its length.
    [only] = [
        c
        for c in client.completions.create(
            model=model, prompt=PROMPT, echo=True, max_tokens=0, stream=True, extra_body=GREEDY
        )
        if c.choices
    ]
    assert only.choices[0].text == PROMPT and only.choices[0].finish_reason == "length"


def test_vllm_prompt_logprobs_field(client, tiny, prompt_ids):
    model = str(tiny[0])
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    ref = reference(tiny[1], prompt_ids)
    for i, entry in enumerate(entries[1:], start=1):
        token = entry[str(prompt_ids[i])]
        assert token["logprob"] == pytest.approx(ref[i - 1, prompt_ids[i]].item(), abs=1e-4)
        assert token["rank"] == int((ref[i - 1] > ref[i - 1, prompt_ids[i]]).sum()) + 1
        assert len(entry) <= 3 and {lp["rank"] for lp in entry.values()} >= {1, 2}
    # Echo's logprobs (more alternatives) do not widen prompt_logprobs' entries.
    both = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=5, extra_body={"prompt_logprobs": 1}
    )
    assert all(len(e) <= 2 for e in both.choices[0].model_extra["prompt_logprobs"][1:])
    assert out.choices[0].model_extra["prompt_logprobs"] is not None
    assert (
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
        .choices[0]
        .model_extra.get("prompt_logprobs")
        is None
    )

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert chat_entries[0] is None and chat.usage.prompt_tokens == len(chat_entries)
    assert all(len(e) == 1 for e in chat_entries[1:])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"prompt_logprobs": "2"}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"echo": True, "logprobs": 21}, "logprobs"),
        ({"echo": True, "logprobs": -1, "max_tokens": 0}, "logprobs"),
        ({"echo": "yes"}, "echo"),
    ],
)
def test_bad_inputs(http, body, param):
    response = http.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_bad_inputs_on_chat(client, tiny):
    import openai

    for value in (-1, 21, 0.5):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=str(tiny[0]), messages=[{"role": "user", "content": "hi"}], extra_body={"prompt_logprobs": value}
            )
        assert e.value.body["param"] == "prompt_logprobs"


def test_tokenizer_info_for_lm_eval(http, tiny):
    """vLLM's /tokenizer_info, as lm-eval's remote tokenizer reads it: its eos_token tokenizes (with
    /tokenize, no special tokens added) to the model's EOS id."""
    tok = tiny_llm(tiny[0]).get_tokenizer()
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.decode([tok.eos_token_id], skip_special_tokens=False)
    ids = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert ids == [tok.eos_token_id]
    assert info["chat_template"] == tok.chat_template and info["add_bos_token"] == tok.add_bos
    assert info["model_max_length"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    missing = http.get("/tokenizer_info", params={"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
