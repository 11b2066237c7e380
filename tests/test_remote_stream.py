"""RemoteStream (ray_serve/remote_engine.py) against scripted replica streams, without Ray processes: a replica
that dies before the request streamed a token gets it retried once; after a token, the stream fails with
replica_failed; refusals arrive as the server's own exceptions; closing cancels the replica's generator."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("ray")
from ray.exceptions import ActorDiedError  # noqa: E402

from tachyllm.engine.input_processor import ProcessedRequest  # noqa: E402
from tachyllm.errors import RequestError  # noqa: E402
from tachyllm.outputs import (  # noqa: E402
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from tachyllm.pooling_params import PoolingParams  # noqa: E402
from tachyllm.ray_serve.pending_prefill import pending_prefill  # noqa: E402
from tachyllm.ray_serve.remote_engine import RemoteStream, prompt_block_hashes  # noqa: E402
from tachyllm.ray_serve.replica import ACCEPTED, EngineInfo, RemoteError  # noqa: E402
from tachyllm.ray_serve.router_metrics import router_metrics  # noqa: E402
from tachyllm.sampling_params import SamplingParams  # noqa: E402
from tachyllm.server.async_engine import QueueFullError  # noqa: E402
from tachyllm.server.errors import APIError  # noqa: E402


def output(tokens: list[int], finished: bool = False) -> RequestOutput:
    choice = CompletionOutput(0, "x" * len(tokens), tokens, "length" if finished else None)
    return RequestOutput("r", None, [1, 2, 3], [choice], finished, RequestMetrics(arrival_time=0.0))


class ScriptedGenerator:
    """A replica's stream: yields the script's items, raising the exceptions in it."""

    def __init__(self, script: list) -> None:
        self.script = list(script)
        self.cancelled = False

    async def __anext__(self):
        if not self.script:
            raise StopAsyncIteration
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngine:
    """What RemoteStream uses of RemoteEngine; each call plays the next script."""

    def __init__(self, *scripts: list, block_size: int = 4) -> None:
        self.name = "fake"
        self.retries = 1
        self.open_streams: set = set()
        self.info = EngineInfo("fake", 64, 100, None, None, block_size, b"key", True)
        self.generators = [ScriptedGenerator(s) for s in scripts]
        self.calls: list[list[bytes]] = []
        self.request_ids: list[str] = []
        self.owe_blocks: int | None = None  # as the router would: each call owes this many blocks

    def call(self, request_id, request, max_queued, hashes):
        self.calls.append(hashes)
        self.request_ids.append(request_id)
        if self.owe_blocks is not None:
            pending_prefill().add(request_id, "fake", f"replica{len(self.calls)}", self.owe_blocks)
        return self.generators[len(self.calls) - 1]


def died() -> ActorDiedError:
    return ActorDiedError()


def request() -> ProcessedRequest:
    return ProcessedRequest(None, list(range(10)), SamplingParams(max_tokens=4))


async def drain(engine: FakeEngine) -> list[RequestOutput]:
    stream = RemoteStream(engine, "r", request(), None)
    await stream.start()
    return [out async for out in stream]


def retries() -> float:
    return router_metrics().retries.labels("fake")._value.get()


def test_a_replica_dying_before_any_token_means_one_retry_elsewhere():
    before = retries()
    # Dies before accepting; then a replica accepts and dies before its first token; the third never plays.
    engine = FakeEngine([died()], [ACCEPTED, output([]), died()], [ACCEPTED, output([5]), output([6], True)])
    engine.retries = 2
    outs = asyncio.run(drain(engine))
    assert [o.outputs[0].token_ids for o in outs] == [[], [5], [6]]
    assert len(engine.calls) == 3 and retries() == before + 2 and not engine.open_streams
    # The router gets the hash chain of the blocks a cache can serve (10 tokens, blocks of 4: two).
    assert engine.calls[0] == prompt_block_hashes(list(range(10)), engine.info) and len(engine.calls[0]) == 2


def test_one_retry_only():
    engine = FakeEngine([died()], [died()], [ACCEPTED, output([1], True)])
    with pytest.raises(Exception, match="died"):
        asyncio.run(drain(engine))
    assert len(engine.calls) == 2


def test_a_replica_dying_after_a_token_fails_the_stream():
    engine = FakeEngine([ACCEPTED, output([7]), died()], [ACCEPTED, output([1], True)])

    async def run() -> tuple[list[RequestOutput], APIError]:
        stream = RemoteStream(engine, "r", request(), None)
        await stream.start()
        got = [await stream.__anext__()]
        with pytest.raises(APIError) as failure:
            await stream.__anext__()
        return got, failure.value

    got, error = asyncio.run(run())
    assert got[0].outputs[0].token_ids == [7]
    assert error.status == 503 and error.body.error.code == "replica_failed"
    assert len(engine.calls) == 1 and not engine.open_streams


def test_refusals_arrive_as_the_servers_exceptions():
    engine = FakeEngine([RemoteError("refused", "max_tokens is too large", "max_tokens")])
    with pytest.raises(RequestError) as refused:
        asyncio.run(drain(engine))
    assert refused.value.param == "max_tokens"
    engine = FakeEngine([RemoteError("queue_full", "full", num_queued=5, limit=5)])
    with pytest.raises(QueueFullError):
        asyncio.run(drain(engine))


def test_close_cancels_the_replicas_generator():
    engine = FakeEngine([ACCEPTED, output([1]), output([2], True)])

    async def run() -> None:
        stream = RemoteStream(engine, "r", request(), None)
        await stream.start()
        await stream.__anext__()
        stream.close()
        stream.close()
        assert [o async for o in stream] == []

    asyncio.run(run())
    assert engine.generators[0].cancelled and not engine.open_streams


def test_an_engine_failing_before_any_token_is_a_retry_too_and_a_retry_refused_is_replica_failed():
    engine = FakeEngine([ACCEPTED, RemoteError("engine_dead", "step hung")], [ACCEPTED, output([3], True)])
    assert [o.outputs[0].token_ids for o in asyncio.run(drain(engine))] == [[3]]
    assert engine.generators[0].cancelled  # the failed attempt's generator is let go
    engine = FakeEngine([died()], [RemoteError("queue_full", "full", num_queued=5, limit=5)])
    with pytest.raises(APIError) as failure:
        asyncio.run(drain(engine))
    assert failure.value.body.error.code == "replica_failed" and not engine.open_streams


def test_prefill_is_owed_until_the_first_token_and_a_dead_attempt_owes_nothing():
    """The router records each attempt's uncached blocks against its replica (pending_prefill.py); the
    stream settles them at the attempt's first token, or when the attempt fails."""
    engine = FakeEngine([ACCEPTED, died()], [ACCEPTED, output([]), output([5]), output([6], True)])
    engine.owe_blocks = 3
    ledger = pending_prefill()

    async def run() -> None:
        stream = RemoteStream(engine, "owed", request(), None)
        await stream.start()
        assert ledger.blocks("replica1") == 3
        assert (await stream.__anext__()).outputs[0].token_ids == []  # the first attempt died; the retry
        assert ledger.blocks("replica1") == 0 and ledger.blocks("replica2") == 3  # has no token yet
        assert (await stream.__anext__()).outputs[0].token_ids == [5]
        assert ledger.blocks("replica2") == 0  # prefilled, still streaming
        assert [o.outputs[0].token_ids async for o in stream] == [[6]]

    asyncio.run(run())
    assert engine.request_ids == ["owed", "owed-retry1"]
    # A closed stream owes nothing either.
    engine = FakeEngine([ACCEPTED, output([1], True)])
    engine.owe_blocks = 2
    stream = RemoteStream(engine, "closed", request(), None)
    asyncio.run(stream.start())
    assert ledger.blocks("replica1") == 2
    stream.close()
    assert ledger.blocks("replica1") == 0


def test_a_traced_request_records_where_it_was_sent_and_its_retry():
    from tachyllm.otel import TracedRequest
    from tachyllm.server.request_trace import tracing

    engine = FakeEngine([ACCEPTED, output([]), died()], [ACCEPTED, output([4], True)])
    with tracing(TracedRequest(0.0, "chat")) as traced:
        outs = asyncio.run(drain(engine))
    assert outs[-1].finished
    assert [(e.name, e.attributes) for e in traced.events] == [
        ("routed", {"engine_request_id": "r", "attempt": 0}),
        ("retry", {"reason": "its replica died", "attempt": 1}),
        ("routed", {"engine_request_id": "r-retry1", "attempt": 1}),
    ]


def test_a_pooling_requests_one_output_streams_through():
    """A pooling request's one output (no tokens, no choices) is its answer: it ends the stream."""
    result = PoolingRequestOutput("r", [1, 2, 3], PoolingOutput(torch.ones(4)), True, RequestMetrics(arrival_time=0.0))
    engine = FakeEngine([ACCEPTED, result], [ACCEPTED, output([1], True)])
    pooled = ProcessedRequest(None, list(range(10)), PoolingParams())

    async def run() -> list:
        stream = RemoteStream(engine, "r", pooled, None)
        await stream.start()
        return [out async for out in stream]

    (got,) = asyncio.run(run())
    assert got is result and len(engine.calls) == 1 and not engine.open_streams
