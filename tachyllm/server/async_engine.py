"""AsyncEngine: drives one LLMEngine from a background thread and streams its outputs to asyncio tasks.

The LLMEngine is not thread-safe, so exactly one thread (the step loop) ever touches it; that
thread also builds it, so that all of the engine's compute, weight packing included, runs in one
thread: OpenMP keeps a thread pool per thread that starts parallel regions, and with a second pool
alive (the main thread's, after loading the model there) libgomp counts more threads than cores and
lets idle workers spin only briefly before sleeping, so every parallel region of a step waits for
a futex wake-up (measured: offline 64 x 128/128 Q4_1 with 8-bit activations, engine driven from
another thread, ~560 tok/s when the model was loaded in the main thread vs ~640-720 loaded in the
driving thread, as fast as the main thread itself). Other threads only append operations (add,
abort) to a list under a lock; the loop applies them between steps and hands results back to each
caller's event loop with call_soon_threadsafe. When there is nothing to do the loop sleeps on a
condition variable, so an idle server burns no CPU (a tensor-parallel engine's loop wakes twice a
second to check that its workers live).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tachyllm.engine.input_processor import ProcessedRequest
from tachyllm.engine.llm_engine import EngineSnapshot, LLMEngine
from tachyllm.errors import RequestError, TachyError
from tachyllm.host_malloc import use_one_arena
from tachyllm.otel import trace_options
from tachyllm.outputs import DeltaAccumulator, EngineOutput, RequestOutput
from tachyllm.pooling_params import PoolingParams
from tachyllm.sampling_params import RequestOutputKind, SamplingParams

# A request's parameters: generation's, or a pooling request's (one final PoolingRequestOutput).
RequestParams = SamplingParams | PoolingParams

# The engine thread lets go of the GIL in every tensor op and must win it back after each one. While
# another thread of this process holds it (a /tokenize answer of a million ids being written, a long
# detokenization), each win-back waits out the interpreter's switch interval, 5 ms by default, so a
# step of a few hundred ops stalled for as long as that thread worked. At 0.5 ms the stall is a tenth
# (measurements: docs/design_measurements.md#server-gil-switch-interval-and-heap-freeze).
GIL_SWITCH_INTERVAL_S = 0.0005

# How often an idle engine that can fail between steps (a tensor-parallel worker can die) is checked.
HEALTH_CHECK_INTERVAL_S = 0.5

logger = logging.getLogger("tachyllm.server")

# Called on the engine thread with every output of an iteration (step outputs and aborts).
OutputListener = Callable[[list[EngineOutput]], None]


class EngineDeadError(TachyError):
    """The step loop stopped (it failed, or the engine was shut down); no request can run."""


class QueueFullError(TachyError):
    """Admitting the requests would leave more than the allowed number waiting for a batch slot."""

    def __init__(self, num_queued: int, limit: int) -> None:
        super().__init__(f"{num_queued} requests are waiting to start (limit {limit})")
        self.num_queued = num_queued
        self.limit = limit


class OutputStream(Protocol):
    """What the routes use of a request's outputs: a RequestStream, or ray_serve's RemoteStream."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[EngineOutput]: ...

    async def __anext__(self) -> EngineOutput: ...

    def close(self) -> None: ...


class RequestStream:
    """One request's outputs, in order, as an async iterator; close() aborts the request if unfinished.

    The server asks for DELTA outputs (what each step added), so a consumer that fell behind gets the
    outputs waiting for it added up into one; of CUMULATIVE (or FINAL_ONLY) outputs, each holds all
    before it, so the newest waiting one is the one to give.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self._deltas = output_kind == RequestOutputKind.DELTA
        self.loop = asyncio.get_running_loop()
        self._engine = engine
        self._queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self._done = False  # finished, failed or closed: nothing more to read

    def put(self, item: EngineOutput | BaseException) -> None:
        """Runs on the consumer's event loop (the engine thread schedules it there)."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if not isinstance(item, BaseException) and not self._queue.empty():
            item = self._add_up_waiting(item)
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def _add_up_waiting(self, first: EngineOutput) -> EngineOutput | BaseException:
        """`first` and the outputs queued behind it as one; an error among them wins (it ends the request)."""
        total = DeltaAccumulator()
        latest: EngineOutput | BaseException = first
        if isinstance(first, RequestOutput):
            total.add(first)
        while not self._queue.empty():
            latest = self._queue.get_nowait()
            if isinstance(latest, BaseException):
                return latest
            if self._deltas and isinstance(latest, RequestOutput):
                total.add(latest)
        return total.result() if self._deltas else latest

    def close(self) -> None:
        """Aborts the request unless it already finished; safe to call any number of times."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)


@dataclass
class _Add:
    stream: RequestStream
    prompt: str | list[int] | ProcessedRequest
    params: RequestParams
    arrival_time: float
    priority: int
    accepted: asyncio.Future  # resolved on stream.loop once the engine took (or refused) the request
    slots: int = 0  # free batch slots its sequences were counted into when it was admitted
    queued: bool = False  # counted as waiting for a batch slot when it was admitted


@dataclass
class _PendingAdds:
    """Adds admitted and not yet in the engine's snapshot: what admission counts besides the snapshot."""

    requests: int = 0
    slots: int = 0  # the free batch slots they take
    queued: int = 0  # those that wait for a batch slot

    def count(self, adds: list[_Add], sign: int = 1) -> None:
        self.requests += sign * len(adds)
        self.slots += sign * sum(add.slots for add in adds)
        self.queued += sign * sum(add.queued for add in adds)


@dataclass
class _Abort:
    request_id: str | None  # None: every request


class _Outbox:
    """Calls to run on event loops, gathered during one iteration and sent one batch per loop."""

    def __init__(self) -> None:
        self._calls: dict[asyncio.AbstractEventLoop, list[tuple[Callable, tuple]]] = {}

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
        self._calls.setdefault(loop, []).append((fn, args))

    def flush(self) -> None:
        for loop, calls in self._calls.items():
            try:
                loop.call_soon_threadsafe(_run_calls, calls)
            except RuntimeError:  # that loop was closed: its consumers are gone
                pass
        self._calls = {}


def _answered_with_output(op: _Add | _Abort) -> bool:
    """A pooling request's add: its caller waits for its one output, which the step now starting computes,
    so its acceptance goes out with the step's outputs, one wake-up of the caller's event loop instead of
    two, and the loop does not compete with the compute threads for the cores and the GIL during the step
    (docs/design_measurements.md#served-embedding-latency)."""
    return isinstance(op, _Add) and isinstance(op.params, PoolingParams)


def _run_calls(calls: list[tuple[Callable, tuple]]) -> None:
    for fn, args in calls:
        fn(*args)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled while waiting
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class AsyncEngine:
    """Owns an LLMEngine and its step-loop thread; every method may be called from any thread
    (add_request and generate from a running event loop)."""

    def __init__(self, build_engine: Callable[[], LLMEngine]) -> None:
        """Starts the loop thread, which calls `build_engine`; returns once the engine is built
        (raising what building raised)."""
        self._listeners: list[OutputListener] = []
        self._cond = threading.Condition()
        self._ops: list[_Add | _Abort] = []  # guarded by _cond
        self._pending = _PendingAdds()  # guarded by _cond
        self._snapshot = EngineSnapshot()  # guarded by _cond
        self._stopping = False  # shutdown() was called; the loop ends after its next iteration
        self._closed = False  # the loop has ended; guarded by _cond
        self._busy_since: float | None = None  # time.monotonic() when the loop's current iteration began
        self._abandoned = False  # abandon() answered every stream: the loop delivers nothing more
        self.error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        # Before the engine's thread allocates anything: it then shares the main arena (host_malloc.py).
        use_one_arena()
        built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(build_engine, built), name="tachy-engine", daemon=True)
        self._thread.start()
        built.wait()
        if self._build_error is not None:
            raise self._build_error
        # What exists now (the interpreter's modules, the model, the block tables) lives as long as the
        # engine, yet every full garbage collection walked all of it, holding the GIL meanwhile: no step
        # and no request moved for ~150 ms in a server process, longer beside a bigger heap. Frozen, it is
        # left out of collections (reference counting still frees it); shutdown thaws it, so that cycles
        # of this engine's can be collected once it is gone. The collection first keeps startup's
        # garbage from being frozen with it.
        gc.collect()
        gc.freeze()
        engine = self._engine  # touched by the loop thread only, from here on
        # What the HTTP layer needs, so it never touches the engine itself. The tokenizer is shared
        # with the loop thread: encoding and decoding leave it unchanged, so that is safe.
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.trace_options = trace_options(engine.config)  # where the server sends request traces, if anywhere
        self.model_config = engine.model_config  # the server checks LoRA adapters against it at start
        self.input_processor = engine.input_processor  # thread-safe: tokenizer and plain limits
        self.default_sampling_params = engine.default_sampling_params
        # What the model is served for (docs/pooling.md): generation, or embeddings / scores.
        self.runner_type = engine.runner_type
        self.pooling_tasks = engine.pooling_tasks
        self.embedding_dim = engine.embedding_dim
        self.is_matryoshka = engine.is_matryoshka
        # Reads a LoRA adapter's files on the calling thread, for the engine to install (thread-safe).
        self._prepare_adapter = engine.lora.prepare if engine.lora is not None else None

    # -- any thread ---------------------------------------------------------------------------
    def add_output_listener(self, listener: OutputListener) -> None:
        self._listeners.append(listener)

    async def add_request(
        self, request_id: str, prompt: str | list[int] | ProcessedRequest, params: RequestParams, priority: int = 0
    ) -> RequestStream:
        """Queues a request and waits until the engine took it (at most one step): raises
        RequestError when the engine refuses it, so callers can answer 400 before streaming."""
        return (await self.add_requests([(request_id, prompt, params)], priority=priority))[0]

    async def add_requests(
        self,
        requests: Sequence[tuple[str, str | list[int] | ProcessedRequest, RequestParams]],
        max_queued: int | None = None,
        priority: int = 0,
    ) -> list[RequestStream]:
        """Queues (request id, prompt, params) requests all or none, and waits until the engine took
        them. With `max_queued`, raises QueueFullError instead when more than that many requests
        would be waiting for a batch slot: the batch's free slots (max_num_seqs) take the requests
        first, in arrival order, so that a burst reaching an idle engine fills its batch and then
        the queue. The check and the queueing happen under one lock, so the limit is exact however
        many callers race for it. A refusal by the engine (RequestError) closes the others and raises."""
        # Grammars compile off the event loop and the engine thread; the engine's own compile is then
        # a cache hit (a refused constraint raises RequestError here, before anything is queued).
        constrained = {
            id(p): p for _, _, p in requests if isinstance(p, SamplingParams) and p.structured_outputs is not None
        }
        for constrained_params in constrained.values():
            await asyncio.to_thread(self.input_processor.compile_grammar, constrained_params)
        # So are a LoRA adapter's files read (and checked: a bad one raises AdapterError here): the engine
        # thread only installs the weights, and running streams never wait for a file.
        if self._prepare_adapter is not None:
            loras = {p.lora_request for _, p, _ in requests if isinstance(p, ProcessedRequest) and p.lora_request}
            for lora in loras:
                await asyncio.to_thread(self._prepare_adapter, lora)
        loop = asyncio.get_running_loop()
        now = time.time()
        adds = []
        for request_id, prompt, params in requests:
            # A pooling request has one output, its final one.
            kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.FINAL_ONLY
            stream = RequestStream(self, request_id, kind)
            adds.append(_Add(stream, prompt, params, now, priority, loop.create_future()))
        with self._cond:
            if self._closed:  # the loop is gone: nobody would ever answer
                raise self._stopped_error()
            queued = self._snapshot.num_queued + self._pending.queued
            free_slots = max(self._snapshot.free_batch_slots - self._pending.slots, 0)
            for add in adds:
                n = add.params.n if isinstance(add.params, SamplingParams) else 1
                add.slots = min(free_slots, n)
                add.queued = add.slots < n
                free_slots -= add.slots
            if max_queued is not None and queued + sum(add.queued for add in adds) > max_queued:
                raise QueueFullError(queued, max_queued)
            self._pending.count(adds)
            self._ops.extend(adds)
            self._cond.notify()
        try:
            results = await asyncio.gather(*(add.accepted for add in adds), return_exceptions=True)
        except asyncio.CancelledError:  # the caller left: closing queues an abort after each add
            for add in adds:
                add.stream.close()
            raise
        if failures := [r for r in results if isinstance(r, BaseException)]:
            for add in adds:
                add.stream.close()
            raise failures[0]
        return [add.stream for add in adds]

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[EngineOutput]:
        """Yields the request's outputs until it finishes; leaving early aborts it."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._submit(_Abort(request_id))

    def abort_all(self) -> None:
        self._submit(_Abort(None))

    @property
    def snapshot(self) -> EngineSnapshot:
        with self._cond:
            return self._snapshot

    @property
    def num_queued(self) -> int:
        """Requests waiting for a batch slot, counting those submitted since the last step."""
        with self._cond:
            return 0 if self._closed else self._snapshot.num_queued + self._pending.queued

    @property
    def num_unfinished(self) -> int:
        with self._cond:
            if self._closed:
                return 0
            return self._snapshot.num_running + self._snapshot.num_waiting + self._pending.requests

    @property
    def is_running(self) -> bool:
        """The step loop is alive (it has neither failed nor been shut down)."""
        with self._cond:
            return not self._closed

    def busy_seconds(self) -> float:
        """How long the loop's current iteration (its ops, its step, its answers) has run; 0 while
        it waits for work. A watchdog reads it to tell a busy engine from a hung one."""
        started = self._busy_since
        return 0.0 if started is None else time.monotonic() - started

    def abandon(self, reason: str, failed: bool) -> None:
        """Ends every open request now with EngineDeadError(reason), from any thread, without waiting
        for the loop (whose step may hang); the loop stops after its current step. `failed`: the
        engine is at fault (a hung step), as opposed to a shutdown that cannot wait."""
        with self._cond:
            if self._closed:
                return
            self._closed = self._stopping = self._abandoned = True
            if failed:
                self.error = EngineDeadError(reason)
            ops, self._ops = self._ops, []
            # Answered before the loop wakes up, so that no stream sees an abort first. The loop
            # may still be mid-step (hung, or not yet at the lock): a copy of the dict is one atomic
            # step under the GIL, and from here on the loop delivers nothing.
            self._fail_streams(EngineDeadError(reason), ops, list(self._streams.values()))
            self._cond.notify()

    def shutdown(self, timeout: float | None = None) -> None:
        """Aborts whatever is left, stops the loop and waits for its thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        gc.unfreeze()

    def _stopped_error(self) -> EngineDeadError:
        """What a request gets once the loop has stopped: why it stopped."""
        return EngineDeadError(f"the engine stopped: {self.error}" if self.error else "the engine was shut down")

    def _submit(self, op: _Abort) -> None:
        with self._cond:
            if self._closed:
                return
            self._ops.append(op)
            self._cond.notify()

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self, build_engine: Callable[[], LLMEngine], built: threading.Event) -> None:
        try:
            self._engine = build_engine()
            self._publish([])  # admission counts the idle engine's free batch slots from the start
        except BaseException as e:
            self._build_error = e
            with self._cond:
                self._closed = True
            return
        finally:
            built.set()
        engine = self._engine  # its constructor set this thread's compute threads
        # An idle engine that can fail between steps (its tensor-parallel workers can die) is checked
        # this often; any other sleeps until there is work.
        idle_check_s = HEALTH_CHECK_INTERVAL_S if engine.can_fail_between_steps else None
        ops: list[_Add | _Abort] = []
        outbox = _Outbox()
        try:
            while True:
                self._busy_since = None
                with self._cond:
                    while not (self._ops or self._stopping or engine.has_unfinished_requests()):
                        if not self._cond.wait(idle_check_s):
                            break  # time for the health check
                    ops, self._ops = self._ops, []
                    stopping = self._stopping
                self._busy_since = time.monotonic()
                outbox = _Outbox()
                outputs = self._apply(ops, outbox)
                applied_adds = [op for op in ops if isinstance(op, _Add)]
                # Snapshot and metrics are updated before answers go out, so whoever reacts to an
                # answer (sends the next request, scrapes /metrics) sees the state that produced it.
                if stopping:
                    outputs += self._engine.abort_all()
                elif ops:
                    self._publish(applied_adds)
                    applied_adds = []
                    if not all(_answered_with_output(op) for op in ops):
                        outbox.flush()  # acceptances go out before the step, not after it
                if not stopping and engine.has_unfinished_requests():
                    outputs += engine.step()
                if (failure := engine.check_health()) is not None:
                    # The engine cannot serve again (a dead tensor-parallel worker): its requests and
                    # everything still waiting end with EngineDeadError, and the loop stops, so that
                    # /health tells it and the server exits for its supervisor to restart it.
                    logger.error("the engine failed: %s", failure)
                    self.error = failure
                    self._notify_listeners(outputs)  # the failed requests still count in the metrics
                    break
                if not self._abandoned:
                    self._deliver(outputs, outbox)
                self._publish(applied_adds)
                self._notify_listeners(outputs)
                outbox.flush()
                if stopping:
                    break
        except Exception as e:  # outside the step's fault barrier: fail every request rather than hang
            logger.exception("engine loop failed; failing all requests")
            self.error = e
        finally:
            self._fail_remaining(ops, outbox)

    def _apply(self, ops: list[_Add | _Abort], outbox: _Outbox) -> list[EngineOutput]:
        aborted = []
        for op in ops:
            if isinstance(op, _Add):
                rid = op.stream.request_id
                try:
                    self._engine.add_request(rid, op.prompt, op.params, op.arrival_time, op.priority)
                except Exception as e:  # refused (RequestError), or a bug: this request alone fails
                    if not isinstance(e, RequestError):
                        logger.exception("request %s could not be added", rid)
                    outbox.post(op.stream.loop, _resolve, op.accepted, e)
                    continue
                self._streams[rid] = op.stream
                outbox.post(op.stream.loop, _resolve, op.accepted, None)
            elif op.request_id is None:
                aborted += self._engine.abort_all()
            else:
                out = self._engine.abort_request(op.request_id)
                if out is not None:
                    aborted.append(out)
        return aborted

    def _deliver(self, outputs: list[EngineOutput], outbox: _Outbox) -> None:
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                outbox.post(stream.loop, stream.put, out)

    def _publish(self, applied_adds: list[_Add]) -> None:
        """The engine's state for admission; the adds it now holds (or refused) leave the pending count."""
        snapshot = self._engine.snapshot()
        with self._cond:
            self._snapshot = snapshot
            self._pending.count(applied_adds, sign=-1)

    def _notify_listeners(self, outputs: list[EngineOutput]) -> None:
        if not outputs:
            return
        for listener in self._listeners:
            try:
                listener(outputs)
            except Exception:  # metrics or logging must never take the engine down
                logger.exception("output listener failed")

    def _fail_remaining(self, ops_in_flight: list[_Add | _Abort], outbox: _Outbox) -> None:
        """Whatever still waits on this loop gets an error instead of waiting forever: what the last
        iteration had decided goes out first (an add it accepted stays accepted, then its stream
        fails), and every add it had not answered yet is refused."""
        self._busy_since = None
        with self._cond:
            self._closed = True
            pending, self._ops = self._ops, []
        error = self._stopped_error()
        outbox.flush()
        self._fail_streams(error, ops_in_flight + pending, list(self._streams.values()))
        self._streams.clear()

    @staticmethod
    def _fail_streams(error: EngineDeadError, ops: list[_Add | _Abort], streams: list[RequestStream]) -> None:
        outbox = _Outbox()
        for op in ops:
            if isinstance(op, _Add):
                outbox.post(op.stream.loop, _resolve, op.accepted, error)
        for stream in streams:
            outbox.post(stream.loop, stream.put, error)
        outbox.flush()
