"""Structured outputs: every constraint kind enforced in the batch (offline and over HTTP), beside free
requests, with speculation, preemption and n > 1; bad constraints refused with a precise error."""

from __future__ import annotations

import copy
import json
import re
import threading

import jsonschema
import numpy as np
import openai
import pytest
import torch
from helpers.engine import GREEDY, random_prompts, run, tiny_llm, token_ids
from helpers.server import error_of, running_server
from helpers.spec_decode import NGRAM, SUFFIX, draft, with_oracle
from hypothesis import given, settings
from hypothesis import strategies as st

from tachyllm import SamplingParams, StructuredOutputsParams
from tachyllm.errors import RequestError
from tachyllm.runner import kv_cache
from tachyllm.sampling.sampler import Sampler
from tachyllm.step import SamplingInput
from tachyllm.structured_output.json_schema import without_undeclared_keys

COLOR = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "n", "ok"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe later"]
LARK = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[a-z]{2,4}/'
GBNF = 'root ::= "up" | "down"'


def constrained(**constraint) -> SamplingParams:
    return SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(**constraint), **GREEDY)


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), COLOR)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "lark":
        assert re.fullmatch(r"(hi|hello) [a-z]{2,4}", text), text
    else:
        assert text in ("up", "down"), text


CONSTRAINTS = {
    "json": {"json": COLOR},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "lark": {"grammar": LARK},
    "gbnf": {"grammar": GBNF},
}


@pytest.fixture(scope="module")
def path(tiny_model_factory):
    return tiny_model_factory("llama")


def test_every_kind_in_one_mixed_batch_and_free_rows_unchanged(path):
    """Constrained and free requests share a batch: each constrained output matches its constraint and
    ends with "stop" when the grammar completes; the free ones get the tokens they get alone."""
    llm = tiny_llm(path)
    prompts = random_prompts(3, 10, shared=4, tail=(3, 12))
    free = SamplingParams(max_tokens=24, **GREEDY)
    alone = token_ids(run(llm, prompts[:5], free, prefix="alone"))
    kinds = list(CONSTRAINTS)
    params = [free] * 5 + [constrained(**CONSTRAINTS[k]) for k in kinds]
    outputs = run(llm, prompts, params)
    assert token_ids(outputs[:5]) == alone
    for kind, out in zip(kinds, outputs[5:]):
        completion = out.outputs[0]
        check(kind, completion.text)
        assert completion.finish_reason == "stop"


def test_chunked_prefill_and_cached_prefixes_give_the_same_constrained_tokens(path):
    prompts = random_prompts(6, 6, shared=12, tail=(10, 30))
    params = [constrained(**CONSTRAINTS[k]) for k in ("json", "regex", "lark", "choice", "gbnf", "json")]
    whole = token_ids(run(tiny_llm(path, enable_prefix_caching=False), prompts, params))
    chunked = tiny_llm(path, max_num_batched_tokens=8)
    assert token_ids(run(chunked, prompts, params)) == whole
    assert token_ids(run(chunked, prompts, params, prefix="again")) == whole  # now from the prefix cache
    assert chunked.engine.stats.prefix_cache_hits > 0


def test_max_tokens_cuts_a_json_output_with_length(path):
    out = run(
        tiny_llm(path),
        [[5, 6, 7]],
        SamplingParams(max_tokens=3, **{**GREEDY}, structured_outputs=StructuredOutputsParams(json=COLOR)),
    )[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].text.startswith("{")


def test_sampled_n_and_logprobs_see_only_allowed_tokens(path):
    llm = tiny_llm(path)
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=7,
        max_tokens=20,
        logprobs=5,
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )
    out = run(llm, [[9, 10, 11, 12]], params)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.text in CHOICES and c.finish_reason == "stop"
        for entry in c.logprobs:
            assert all(np.isfinite(lp.logprob) for lp in entry.values())
    # The first token of "maybe later", "no" or "yes": the top entries of the first position are those.
    first = {lp.decoded_token for lp in out.outputs[0].logprobs[0].values()}
    assert all(any(choice.startswith(t) for choice in CHOICES) for t in first), first


@pytest.mark.parametrize("spec", [NGRAM, draft("self:layers=1")], ids=["ngram", "draft"])
def test_greedy_output_is_identical_with_speculation(path, spec):
    """Drafts are cut where the grammar refuses them, each verified position is masked, and only accepted
    tokens advance the grammar: the same tokens as without speculation."""
    prompts = random_prompts(5, 6, shared=6, tail=(2, 8))
    kinds = ["json", "regex", "lark", "json", "choice", "regex"]
    params = [constrained(**CONSTRAINTS[k]) for k in kinds]
    expected = token_ids(run(tiny_llm(path), prompts, params))
    llm = tiny_llm(path, speculative_config=spec)
    if spec is NGRAM:
        with_oracle(llm, prompts, expected)
    outputs = run(llm, prompts, params)
    assert token_ids(outputs) == expected
    for kind, out in zip(kinds, outputs):
        check(kind, out.outputs[0].text)
    stats = llm.engine.stats
    if spec is NGRAM:  # the oracle's drafts (some corrupted, then cut) are verified and partly accepted
        assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    # A random one-layer draft model's proposals are nearly all refused by the grammars and cut before
    # verification: identity is what this run shows.


@pytest.mark.native  # the suffix trees are C++
def test_suffix_drafts_are_verified_under_the_grammar(path):
    """Constrained rows beside a free one; the second wave is drafted from the first's outputs (the
    global tree), the free row's text offered to the constrained ones too: drafts the grammar
    refuses are cut, and the tokens are those of a run without speculation."""
    prompts = random_prompts(6, 4, shared=6, tail=(2, 8))
    kinds = ["json", "regex", "lark", "choice"]
    params = [constrained(**CONSTRAINTS[k]) for k in kinds] + [SamplingParams(max_tokens=40, **GREEDY)]
    prompts.append(prompts[0])
    expected = token_ids(run(tiny_llm(path), prompts, params))
    llm = tiny_llm(path, speculative_config=SUFFIX)
    outputs = run(llm, prompts, params) + run(llm, prompts, params, prefix="b")
    assert token_ids(outputs) == expected + expected
    for kind, out in zip(kinds * 2, outputs[:4] + outputs[5:9]):
        check(kind, out.outputs[0].text)
    stats = llm.engine.stats
    assert stats.spec_num_accepted_tokens > 0
    assert sum(o.metrics.spec_num_accepted_tokens for o in outputs[5:9]) > 0


def test_preempted_constrained_requests_match_unpreempted(path):
    max_len, block_size = 64, 4
    prompts = random_prompts(8, 12, shared=0, tail=(8, 24))
    kinds = [list(CONSTRAINTS)[i % len(CONSTRAINTS)] for i in range(len(prompts))]
    params = [constrained(**CONSTRAINTS[k]) for k in kinds]
    expected = token_ids(run(tiny_llm(path, max_model_len=max_len), prompts, params))
    block_bytes = kv_cache.bytes_per_block(tiny_llm(path).engine.model_config, block_size, torch.float32)
    small = tiny_llm(path, max_model_len=max_len, kv_cache_memory=3 * (max_len // block_size) * block_bytes)
    outputs = run(small, prompts, params)
    assert small.engine.stats.num_preemptions > 0
    assert token_ids(outputs) == expected


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"regex": "(unclosed"}, "unclosed group"),
        ({"grammar": "start: undefined_rule"}, 'unknown name: "undefined_rule"'),
        ({"json": '{"type": "object", '}, "not valid JSON"),
        ({"json": {"type": "string", "format": "no-such-format"}}, "Unknown format: no-such-format"),
        ({"json": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}, "Invalid type: frobnicate"),
    ],
)
def test_bad_constraints_are_refused_and_queue_nothing(path, constraint, message):
    llm = tiny_llm(path)
    with pytest.raises(RequestError, match=message) as e:
        llm.engine.add_request("bad", [5, 6, 7], constrained(**constraint))
    assert e.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()
    assert run(llm, [[5, 6, 7]], constrained(regex=REGEX))[0].outputs[0].finish_reason == "stop"


def test_structured_outputs_params_take_exactly_one_constraint():
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": [1]}, {"regex": ""}, {"json": 5}):
        with pytest.raises(ValueError, match="structured outputs"):
            StructuredOutputsParams(**bad)
    # Key order is kept: the grammar writes the properties in the schema's order.
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).key() != StructuredOutputsParams(json={"a": 2, "b": 1}).key()


def test_compiled_grammars_are_cached(path):
    llm = tiny_llm(path)
    grammars = llm.engine.input_processor.grammars
    first = grammars.compile(StructuredOutputsParams(json=COLOR))
    assert grammars.compile(StructuredOutputsParams(json=dict(COLOR))) is first
    assert grammars.compile(StructuredOutputsParams(json=json.dumps(COLOR))) is first  # the same JSON text
    assert grammars.compile(StructuredOutputsParams(json=json.dumps(COLOR, indent=1))) is not first


# Declared keys are made of these letters; the undeclared key "zz" is never the start of one.
KEYS = st.text(alphabet="abcdefgh", min_size=1, max_size=4)
LEAVES = [
    ({"type": "integer"}, st.integers(-99, 99)),
    ({"type": "boolean"}, st.booleans()),
    ({"type": "string", "maxLength": 4}, st.text(alphabet="xyz", max_size=4)),
    ({"enum": ["p", "q"]}, st.sampled_from(["p", "q"])),
]


@st.composite
def objects(draw, depth: int = 0):
    """(an object schema, an instance of it, [(path to each object in the instance, whether its schema
    allows undeclared keys)]). Some objects say additionalProperties: true or false, most say nothing;
    some nested ones are $defs that the schema refers to."""
    allows = draw(st.sampled_from([None, None, True, False]))  # None: additionalProperties left out
    names = draw(st.lists(KEYS, max_size=3, unique=True))
    required = [name for name in names if draw(st.booleans())]
    properties, definitions, value, paths = {}, {}, {}, [((), allows is True)]
    for name in names:
        # $refs resolve from the root: only the root's properties refer to its $defs.
        kind = draw(st.sampled_from(["leaf", "object", "array", "ref"][: 4 - depth])) if depth < 2 else "leaf"
        present = name in required or draw(st.booleans())
        if kind == "leaf":
            schema, values = draw(st.sampled_from(LEAVES))
            item = draw(values)
        else:
            schema, item, inner = draw(objects(depth + 1))
            if kind == "array":
                schema, item = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}, [item]
            if present:
                inner_path = (name, 0) if kind == "array" else (name,)
                paths += [(inner_path + path, allowed) for path, allowed in inner]
            if kind == "ref":
                definitions[f"d{len(definitions)}"] = schema
                schema = {"$ref": f"#/$defs/d{len(definitions) - 1}"}
        properties[name] = schema
        if present:
            value[name] = item
    schema = {"type": "object", "properties": properties, "required": required}
    if allows is not None:
        schema["additionalProperties"] = allows
    if definitions:
        schema["$defs"] = definitions
    return schema, value, paths


@pytest.fixture(scope="module")
def grammars(path):
    return tiny_llm(path).engine.input_processor.grammars


@settings(max_examples=80, deadline=None)
@given(drawn=objects(), data=st.data())
def test_json_schemas_allow_no_undeclared_keys_unless_they_say_so(grammars, drawn, data):
    """An object schema without additionalProperties takes no key it does not declare (vLLM's default, OpenAI's
    strict mode), at any depth, through $refs too; additionalProperties: true still takes one."""
    schema, value, paths = drawn
    jsonschema.validate(value, schema)
    tokenizer = grammars._tokenizer

    def takes(instance) -> bool:
        tokens = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
        grammar = grammars.compile(StructuredOutputsParams(json=schema)).start()
        if grammar.valid_prefix(tokens) < len(tokens):
            return False
        for token in tokens:
            grammar.accept(token)
        return grammar.is_terminated

    assert takes(value)
    where, allowed = data.draw(st.sampled_from(paths))
    with_extra = copy.deepcopy(value)
    target = with_extra
    for step in where:
        target = target[step]
    target["zz"] = 0
    assert takes(with_extra) == allowed, (where, with_extra)


def test_undeclared_keys_are_closed_as_written_and_intersections_left_open():
    """Only objects that declare keys are closed; what a schema says of other keys is kept, and an allOf of
    several schemas (whose keys the grammar engine intersects) stays as written, with the $defs it names."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    closed = without_undeclared_keys({"$defs": {"p": point}, "anyOf": [{"$ref": "#/$defs/p"}, point]})
    assert closed["$defs"]["p"]["additionalProperties"] is False and closed["anyOf"][1]["additionalProperties"] is False
    assert point == {"type": "object", "properties": {"x": {"type": "integer"}}}  # the input is not changed
    for kept in ({"type": "object"}, {**point, "additionalProperties": {"type": "string"}}, {"type": "string"}):
        assert without_undeclared_keys(kept) == kept
    both = {"$defs": {"p": point}, "allOf": [{"$ref": "#/$defs/p"}, {"properties": {"y": {"type": "string"}}}]}
    assert without_undeclared_keys(both) == both


def test_sampler_masks_exactly_the_forbidden_tokens():
    vocab = 70
    sampler = Sampler(vocab, [69], torch.device("cpu"), seed=0)
    allowed = [3, 31, 32, 64]
    mask = torch.zeros(1, 3, dtype=torch.int32)
    for t in allowed:
        mask[0, t // 32] |= 1 << (t % 32) if t % 32 != 31 else -(2**31)
    free = SamplingInput(SamplingParams(temperature=0), [1, 2], 2)
    bound = SamplingInput(SamplingParams(temperature=0), [1, 2], 2, token_bitmask=mask)
    logits = torch.randn(2, vocab)
    out = sampler.constrain(logits, [free, bound])
    assert torch.equal(out[0], logits[0])
    assert sorted(torch.isfinite(out[1]).nonzero().squeeze(1).tolist()) == allowed
    # Nothing allowed (a failed matcher): EOS is, so the sequence can end.
    dead = SamplingInput(SamplingParams(temperature=0), [1], 1, token_bitmask=torch.zeros(1, 3, dtype=torch.int32))
    assert torch.isfinite(sampler.constrain(logits[:1], [dead])[0]).nonzero().squeeze(1).tolist() == [69]


# -- over HTTP ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(path):
    with running_server(str(path), "--served-model-name", "m") as base:
        yield base


def test_every_request_field_on_both_endpoints(client):
    chat = [{"role": "user", "content": "Pick one."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": COLOR, "strict": True}}
    reply = client.chat.completions.create(model="m", messages=chat, response_format=fmt, max_tokens=60, temperature=0)
    check("json", reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop"
    text = client.completions.create(
        model="m", prompt="Answer:", max_tokens=60, temperature=0, extra_body={"response_format": fmt}
    )
    check("json", text.choices[0].text)
    for extra, kind in (
        ({"structured_outputs": {"regex": REGEX}}, "regex"),
        ({"structured_outputs": {"choice": CHOICES}}, "choice"),
        ({"structured_outputs": {"grammar": LARK}}, "lark"),
        ({"guided_choice": CHOICES}, "choice"),
        ({"guided_regex": REGEX}, "regex"),
        ({"guided_json": COLOR}, "json"),
        ({"guided_grammar": GBNF}, "gbnf"),
    ):
        reply = client.chat.completions.create(model="m", messages=chat, max_tokens=60, temperature=0, extra_body=extra)
        check(kind, reply.choices[0].message.content)
        out = client.completions.create(model="m", prompt="Say:", max_tokens=60, temperature=0, extra_body=extra)
        check(kind, out.choices[0].text)


def test_grammars_compile_off_the_engine_thread(client, monkeypatch):
    """A constraint never seen before compiles in a server worker thread; the engine thread only finds it cached."""
    from tachyllm.structured_output import compiler

    threads = []
    source = compiler.grammar_source
    monkeypatch.setattr(
        compiler, "grammar_source", lambda params: threads.append(threading.current_thread().name) or source(params)
    )
    chat = [{"role": "user", "content": "Pick one."}]
    reply = client.chat.completions.create(
        model="m", messages=chat, max_tokens=20, temperature=0, extra_body={"guided_regex": "[a-c]{3}z"}
    )
    assert re.fullmatch("[a-c]{3}z", reply.choices[0].message.content)
    assert threads and "tachy-engine" not in threads, threads


def test_streamed_constrained_output_equals_whole(client):
    chat = [{"role": "user", "content": "Pick one."}]
    body = {"model": "m", "messages": chat, "max_tokens": 60, "temperature": 0, "extra_body": {"guided_json": COLOR}}
    whole = client.chat.completions.create(**body).choices[0].message.content
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
         "response_format", "Invalid type: nope"),
        ({"structured_outputs": {"regex": "(", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs", "unclosed group"),
        ({"structured_outputs": {"grammar": "start: ???"}}, "structured_outputs", "Expected value"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured-output constraint"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "not response_format"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_field(http, extra, param, message):
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        err = error_of(http.post(path, json={"model": "m", "max_tokens": 5, **body, **extra}), 400)
        assert err["param"] == param and message in err["message"], err
    # The server goes on serving.
    ok = http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 5, "guided_regex": REGEX})
    assert ok.status_code == 200


# -- the default model ---------------------------------------------------------------------------------------

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "city": {"type": "string", "maxLength": 24},
        },
        "required": ["person", "city"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "count": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["score", "count"],
        "additionalProperties": False,
    },
    "patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        },
        "required": ["code", "email"],
        "additionalProperties": False,
    },
}


@pytest.mark.slow
def test_default_model_outputs_validate_against_their_schemas(default_model_path):
    with running_server(default_model_path, "--served-model-name", "m", "--kv-cache-memory", "64M") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        for name, schema in SCHEMAS.items():
            fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
            reply = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"Give me an example {name.replace('_', ' ')} as JSON."}],
                response_format=fmt,
                max_tokens=120,
                temperature=0,
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)
        reply = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
            response_format={"type": "json_object"},
            max_tokens=120,
            temperature=0,
        )
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
