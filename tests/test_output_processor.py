"""The output processor: per-step deltas from the scheduler become RequestOutputs of each output kind,
detokenized, cut at stop strings (also when several speculative tokens arrive in one step)."""

from __future__ import annotations

import pytest
from helpers.engine import GREEDY, assert_all_free, random_prompts, tiny_llm

from tachyllm import SamplingParams
from tachyllm.outputs import CompletionOutput, RequestOutput
from tachyllm.sampling_params import RequestOutputKind

KINDS = list(RequestOutputKind)


def outputs_by_step(llm, prompts, params: SamplingParams) -> dict[str, list[RequestOutput]]:
    """Every output the engine emitted, per request, in order."""
    eng = llm.engine
    seen: dict[str, list[RequestOutput]] = {}
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, params)
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.setdefault(out.request_id, []).append(out)
    assert_all_free(llm)
    return seen


def accumulated(outs: list[RequestOutput], kind: RequestOutputKind) -> list[CompletionOutput]:
    """What a caller ends up with: the last output, or for DELTA the concatenation of all of them."""
    if kind is not RequestOutputKind.DELTA:
        return outs[-1].outputs
    total = {}
    for out in outs:
        for c in out.outputs:
            acc = total.setdefault(
                c.index, CompletionOutput(c.index, "", [], logprobs=[] if c.logprobs is not None else None)
            )
            acc.text += c.text
            acc.token_ids += c.token_ids
            if c.logprobs is not None:
                acc.logprobs += c.logprobs
            acc.finish_reason, acc.stop_reason, acc.cumulative_logprob = (
                c.finish_reason,
                c.stop_reason,
                c.cumulative_logprob,
            )
    return [total[i] for i in sorted(total)]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama")


def test_every_output_kind_adds_up_to_the_same_completion(model_path):
    prompts = random_prompts(3, 3, shared=0, tail=(4, 9))
    results = {}
    for kind in KINDS:
        params = SamplingParams(
            n=2, temperature=0.8, seed=1, max_tokens=12, logprobs=2, ignore_eos=True, output_kind=kind
        )
        seen = outputs_by_step(tiny_llm(model_path), prompts, params)
        results[kind] = {rid: accumulated(outs, kind) for rid, outs in seen.items()}
        if kind is RequestOutputKind.FINAL_ONLY:
            assert all(len(outs) == 1 and outs[0].finished for outs in seen.values())
        if kind is RequestOutputKind.DELTA:
            # Each delta holds only the new tokens: one sampled token per step here.
            assert all(len(c.token_ids) <= 1 for outs in seen.values() for o in outs for c in o.outputs)
        if kind is RequestOutputKind.CUMULATIVE:
            assert all(len(outs) == 12 for outs in seen.values())  # one output per generated token
    reference = results[RequestOutputKind.CUMULATIVE]
    for kind in KINDS:
        for rid, completions in results[kind].items():
            assert [(c.text, c.token_ids, c.finish_reason) for c in completions] == [
                (c.text, c.token_ids, c.finish_reason) for c in reference[rid]
            ]
            assert [c.logprobs for c in completions] == [c.logprobs for c in reference[rid]]
            assert all(len(c.token_ids) == 12 and len(c.logprobs) == 12 for c in completions)


def stop_case(model_path) -> tuple[list[int], list[int], str, str, int]:
    """A prompt, its greedy continuation, a stop string taken from the middle of that continuation's
    text, the text before it, and how many tokens it takes to complete the stop string."""
    llm = tiny_llm(model_path)
    prompt = random_prompts(7, 1, shared=0, tail=(6, 7))[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=40, **GREEDY), use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    text, tokens = out.text, out.token_ids
    start = len(tokenizer.decode(tokens[:20]))
    stop = text[start : start + 3]
    assert len(stop) == 3 and text.find(stop) == start, "the tiny model's text must allow a fresh 3-char stop"
    needed = next(n for n in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:n]))
    return prompt, tokens, stop, text[:start], needed


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
def test_stop_strings_cut_text_and_tokens(model_path, kind, speculate):
    prompt, tokens, stop, before, needed = stop_case(model_path)
    options = {}
    if speculate:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 6, "adaptive": False}
    llm = tiny_llm(model_path, **options)
    if speculate:  # drafts from the reference: several tokens, the stop string's among them, per step
        llm.engine.speculator.proposer.lookup = lambda seq, k: tokens[seq.num_output_tokens : seq.num_output_tokens + k]
    params = SamplingParams(max_tokens=40, stop=[stop], output_kind=kind, **GREEDY)
    seen = outputs_by_step(llm, [prompt], params)["0"]
    (c,) = accumulated(seen, kind)
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (before, tokens[:needed], "stop", stop)
    stats = llm.engine.stats
    assert stats.finished_reasons == {"stop": 1} and stats.num_generation_tokens == needed
    if speculate:
        assert stats.spec_num_accepted_tokens > 0
    if kind is RequestOutputKind.DELTA:  # no delta ever showed a part of the stop string
        assert stop not in "".join(c.text for o in seen for c in o.outputs)


def test_a_stop_string_wins_over_the_length_limit_of_the_same_token(model_path):
    prompt, tokens, stop, before, needed = stop_case(model_path)
    llm = tiny_llm(model_path)
    out = llm.generate([prompt], SamplingParams(max_tokens=needed, stop=[stop], **GREEDY), use_tqdm=False)[0]
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (before, tokens[:needed], "stop", stop)
    assert llm.engine.stats.finished_reasons == {"stop": 1}


@pytest.mark.parametrize("stop", [None, ["\x00never"]], ids=["no-stop", "stop-string"])
def test_final_only_text_is_made_once_unless_stop_strings_need_it(model_path, monkeypatch, stop):
    """A FINAL_ONLY sample without stop strings is detokenized once, when it ends (the same text as a
    streamed one here: the first test); stop strings need the text as it grows, token by token."""
    from tachyllm.detokenizer import IncrementalDetokenizer

    calls = []
    add_tokens = IncrementalDetokenizer.add_tokens
    monkeypatch.setattr(
        IncrementalDetokenizer, "add_tokens", lambda self, ids: calls.append(len(ids)) or add_tokens(self, ids)
    )
    prompts = random_prompts(3, 2, shared=0, tail=(4, 9))
    params = SamplingParams(max_tokens=12, stop=stop, output_kind=RequestOutputKind.FINAL_ONLY, **GREEDY)
    seen = outputs_by_step(tiny_llm(model_path), prompts, params)
    assert all(len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 12 for outs in seen.values())
    assert calls == ([12, 12] if stop is None else [1] * 24)
