"""Structured-output constraints that compile but cannot run, and what a constraint may cost: refused
as bad input with the grammar engine's reason (at compile time where it shows there, else at the token
where it breaks), never as an engine error; beside them plain requests run as usual."""

from __future__ import annotations

import json
import threading
import time

import httpx
import llguidance
import pytest
from helpers.engine import GREEDY, assert_all_free, run, tiny_llm
from helpers.server import error_of, metrics, running_server, sse_events

from tachyllm import SamplingParams, StructuredOutputsParams
from tachyllm.config import EngineConfig
from tachyllm.errors import ConfigError, RequestError
from tachyllm.structured_output import compiler
from tachyllm.structured_output.grammar import clean_error

# A JSON schema whose only instance is infinite ({"x": {"x": ...}}), and a $ref cycle that never
# reaches a schema at all.
RECURSIVE = {
    "$ref": "#/$defs/node",
    "$defs": {"node": {"type": "object", "properties": {"x": {"$ref": "#/$defs/node"}}, "required": ["x"]}},
}
CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
ENDLESS = "Too many items"  # llguidance meets an output that never ends
NO_OUTPUT = "no output can complete the constraint"
LEXER = "lexer error: too many expressions"
# (constraint, what the refusal says): each compiles, and each failed at its first token in the engine.
CANNOT_RUN = {
    "self-recursive rule": ({"grammar": 'start: "a" start'}, ENDLESS),
    "gbnf self-reference": ({"grammar": "root ::= root"}, NO_OUTPUT),
    "huge repetition": ({"grammar": 'start: "a"~1000000'}, ENDLESS),
    "recursive $ref": ({"json": RECURSIVE}, ENDLESS),
    "$ref cycle": ({"json": CYCLE}, NO_OUTPUT),
    "huge regex repetition": ({"regex": "a{1000000}"}, LEXER),
    "nested regex repetition": ({"regex": "(x{1000}){1000}"}, LEXER),
    "rule of 3000 alternatives": ({"grammar": "start: " + " | ".join(f'"v{i}"' for i in range(3000))}, "Current row"),
}
# Compiles and starts ("q", then x or y), then forces "aaa..." forever: it breaks at its third token.
BREAKS_MIDWAY = 'start: "q" ("x" | "y") loop\nloop: "a" loop'


def big_schema(properties: int) -> dict:
    """A valid object schema of `properties` required, patterned strings (about 78 bytes each)."""
    names = [f"field_{i}" for i in range(properties)]
    return {
        "type": "object",
        "properties": {
            name: {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1}}}[0-9]+$"} for i, name in enumerate(names)
        },
        "required": names,
    }


def constrained(max_tokens: int = 20, n: int = 1, **constraint) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, n=n, temperature=0, structured_outputs=StructuredOutputsParams(**constraint)
    )


@pytest.fixture(scope="module")
def path(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(path):
    return tiny_llm(path)


# -- offline ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CANNOT_RUN))
def test_constraints_that_cannot_run_are_refused_when_added(llm, case):
    constraint, reason = CANNOT_RUN[case]
    engine = llm.engine
    with pytest.raises(RequestError, match=reason) as e:
        engine.add_request("bad", [5, 6, 7], constrained(**constraint))
    assert e.value.param == "structured_outputs" and "first token" in str(e.value)
    assert "<" not in str(e.value)  # no parser state or grammar dump
    assert not engine.has_unfinished_requests()
    # Refused again at once (the refusal is cached), and the engine serves the next request.
    with pytest.raises(RequestError, match=reason):
        engine.add_request("bad", [5, 6, 7], constrained(**constraint))
    out = run(llm, [[5, 6, 7]], constrained(regex="[0-9]{3}"))[0]
    assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].text) == 3
    assert "error" not in engine.stats.finished_reasons


def test_generate_answers_a_constraint_that_cannot_run_with_its_error(llm):
    bad, good = constrained(grammar='start: "a" start'), constrained(choice=["yes", "no"])
    outputs = llm.generate([[5, 6, 7], [5, 6, 7]], [bad, good], use_tqdm=False)
    assert outputs[0].outputs == [] and ENDLESS in outputs[0].error
    assert outputs[1].error is None and outputs[1].outputs[0].text in ("yes", "no")


def test_a_choice_of_10000_strings_runs_like_an_enum(llm):
    """A choice is one lexeme, as a JSON enum is: llguidance's 2000-item limit on a grammar rule's
    alternatives does not apply to it."""
    choices = [f"v{i}" for i in range(10_000)]
    out = run(llm, [[5, 6, 7]], constrained(choice=choices))[0]
    assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"
    # Prefixes of one another ("a" / "ab") and characters a Lark string escapes still work.
    for choice in (["a", "ab"], ['say "hi"\n', "back\\slash"]):
        out = run(llm, [[8, 9]], constrained(choice=choice), prefix=str(choice))[0]
        assert out.outputs[0].text in choice


def test_a_constraint_that_breaks_midway_rejects_its_request(llm):
    """It passes the compile-time check and breaks at its third token: every sample of the request ends
    "rejected" with the reason (not "error"), blocks are returned, and a free request beside it is
    unaffected."""
    engine = llm.engine
    before = dict(engine.stats.finished_reasons)
    free = SamplingParams(max_tokens=12, **GREEDY)
    outputs = run(llm, [[5, 6, 7], [9, 10, 11]], [constrained(n=2, grammar=BREAKS_MIDWAY), free], prefix="midway")
    rejected, plain = outputs
    assert [c.finish_reason for c in rejected.outputs] == ["rejected", "rejected"]
    assert ENDLESS in rejected.error and "at output token" in rejected.error and "<" not in rejected.error
    assert rejected.outputs[0].text.startswith("q")
    assert plain.error is None and plain.outputs[0].finish_reason == "length" and len(plain.outputs[0].token_ids) == 12
    reasons = engine.stats.finished_reasons
    assert reasons.get("rejected", 0) - before.get("rejected", 0) == 2
    assert reasons.get("error", 0) == before.get("error", 0)
    assert_all_free(llm)


def test_a_constraint_above_the_size_limit_is_refused_unbuilt(path, monkeypatch):
    built = []
    source = compiler.grammar_source
    monkeypatch.setattr(compiler, "grammar_source", lambda params: built.append(params) or source(params))
    llm = tiny_llm(path, max_constraint_bytes=10_000)
    schema = big_schema(200)
    size = len(json.dumps(schema))
    with pytest.raises(RequestError, match=f"{size} bytes, above the limit of 10000 bytes.*--max-constraint-bytes"):
        llm.engine.add_request("big", [5, 6], constrained(json=schema))
    assert not built  # refused before anything was compiled
    assert run(llm, [[5, 6]], constrained(json=big_schema(20)))[0].outputs[0].finish_reason in ("stop", "length")
    with pytest.raises(ConfigError, match="max_constraint_bytes"):
        EngineConfig(max_constraint_bytes=0)
    with pytest.raises(ConfigError, match="constraint_compile_timeout"):
        EngineConfig(constraint_compile_timeout=0)


def test_a_compile_past_the_timeout_is_refused_then_served_from_the_cache(path):
    """A request waits for its compile at most the timeout; the compile goes on and is cached, so that
    the same constraint is served afterwards."""
    llm = tiny_llm(path, constraint_compile_timeout=0.001, max_constraint_bytes=1 << 20)
    params = constrained(json=big_schema(3000))  # ~235 KB: a compile of a tenth of a second or more
    with pytest.raises(RequestError, match="did not compile within 0.001 s.*--constraint-compile-timeout"):
        llm.engine.add_request("slow", [5, 6], params)
    assert not llm.engine.has_unfinished_requests()
    deadline = time.monotonic() + 60
    while True:
        try:
            llm.engine.add_request("slow", [5, 6], params)
            break
        except RequestError:
            assert time.monotonic() < deadline, "the compile never finished"
            time.sleep(0.05)
    llm.engine.abort_all()


def test_grammar_engine_internals_never_reach_the_message(path):
    """A grammar past llguidance's symbol limit panics in Rust: the refusal is one sentence, no backtrace."""
    llm = tiny_llm(path, max_constraint_bytes=2 << 20)
    rules = range(70_000)
    grammar = "start: " + " ".join(f"r{i}" for i in rules) + "\n" + "\n".join(f'r{i}: "a"' for i in rules)
    with pytest.raises(RequestError) as e:
        llm.engine.add_request("panic", [5, 6], constrained(grammar=grammar))
    message = str(e.value)
    assert "gave up on this constraint" in message and "make it smaller" in message
    assert "backtrace" not in message and "\n" not in message
    # llguidance's verbose messages carry its parser state and the grammar: cut.
    tokenizer = llm.engine.input_processor.grammars.ll_tokenizer
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("grammar", "root ::= root"), log_level=0)
    matcher.compute_bitmask()
    assert "<state>" in matcher.get_error() and "<" not in clean_error(matcher.get_error())
    long_line = clean_error("at 1(8): bad\n   1 | " + "x" * 5000)
    assert len(long_line) < 300 and long_line.endswith("...")


# -- over HTTP ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(path):
    with running_server(str(path), "--served-model-name", "m", "--max-constraint-bytes", "512K") as base:
        yield base


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 8}


class PlainStream:
    """A free streamed completion running in a thread beside the test's requests."""

    def __init__(self, url: str, max_tokens: int = 48) -> None:
        self.url, self.max_tokens, self.events = url, max_tokens, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {**COMPLETION, "max_tokens": self.max_tokens, "stream": True, **GREEDY}
        with (
            httpx.Client(base_url=self.url, timeout=120) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            self.events = list(sse_events(r))

    def check_completed(self) -> None:
        self.thread.join(120)
        assert self.events[-1] == "[DONE]", self.events[-3:]
        reasons = [e["choices"][0]["finish_reason"] for e in self.events[:-1] if e["choices"]]
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


def http_cases() -> list[tuple[str, dict, str, str]]:
    """(path, body, param, reason): each CANNOT_RUN constraint in each field and route that takes it."""
    cases = []
    for constraint, reason in CANNOT_RUN.values():
        for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            cases.append((path, {**base, "structured_outputs": constraint}, "structured_outputs", reason))
    for schema, reason in ((RECURSIVE, ENDLESS), (CYCLE, NO_OUTPUT)):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        cases.append(("/v1/chat/completions", {**CHAT, "response_format": fmt}, "response_format", reason))
        cases.append(("/v1/completions", {**COMPLETION, "guided_json": schema}, "guided_json", reason))
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        body = {**CHAT, "tools": [tool], "tool_choice": "required"}
        cases.append(("/v1/chat/completions", body, "tools", reason))
        body = {"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
        cases.append(("/v1/responses", body, "text.format", reason))
    return cases


def test_constraints_that_cannot_run_are_400_streamed_or_not(url, http):
    plain = PlainStream(url)
    before = metrics(http)
    for path, body, param, reason in http_cases():
        for stream in (False, True):
            err = error_of(http.post(path, json={**body, "stream": stream}), 400)
            assert err["param"] == param and reason in err["message"], (path, err)
            assert err["type"] == "invalid_request_error" and "<" not in err["message"]
            if param == "tools":
                assert "tools[0].function.parameters" in err["message"]
    plain.check_completed()
    after = metrics(http)
    assert after.get(("tachy:request_success_total", (("finished_reason", "error"),)), 0) == before.get(
        ("tachy:request_success_total", (("finished_reason", "error"),)), 0
    )


def test_a_constraint_that_breaks_midway_is_400_or_an_error_event(url, http):
    key = ("tachy:request_success_total", (("finished_reason", "rejected"),))
    before = metrics(http)
    plain = PlainStream(url)
    constraint = {"max_tokens": 20, "temperature": 0, "structured_outputs": {"grammar": BREAKS_MIDWAY}}
    err = error_of(http.post("/v1/chat/completions", json={**CHAT, **constraint}), 400)
    assert err["param"] == "structured_outputs" and ENDLESS in err["message"] and "at output token" in err["message"]
    with http.stream("POST", "/v1/completions", json={**COMPLETION, **constraint, "stream": True}) as r:
        assert r.status_code == 200
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["param"] == "structured_outputs" and ENDLESS in error["message"]
    assert "".join(e["choices"][0]["text"] for e in events[:-2] if e.get("choices")).startswith("q")
    plain.check_completed()
    # Counted as rejected input: request_success_total{finished_reason="rejected"}, not "error".
    deadline = time.monotonic() + 30
    while metrics(http).get(key, 0) - before.get(key, 0) < 2:
        assert time.monotonic() < deadline, metrics(http)
        time.sleep(0.05)
    error_key = ("tachy:request_success_total", (("finished_reason", "error"),))
    assert metrics(http).get(error_key, 0) == before.get(error_key, 0)


def test_a_schema_above_the_size_flag_is_400_naming_it(url, http):
    schema = big_schema(13_500)  # ~1 MB
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    err = error_of(http.post("/v1/chat/completions", json={**CHAT, "response_format": fmt}), 400)
    assert err["param"] == "response_format" and "--max-constraint-bytes" in err["message"]
    assert "above the limit of 524288 bytes" in err["message"]
