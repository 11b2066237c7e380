"""The HTTP side of `tachy bench serve`: one streaming request at a time over a shared aiohttp session
(the client vLLM's benchmark uses), timestamped on arrival of every server-sent event (an embeddings
request: on its whole answer), and a /metrics scraper.

aiohttp, not httpx: httpx's AsyncClient spent ~2 ms of CPU per embeddings request against ~0.6 ms here,
and writes a request's headers and body in two sends, the first of which wakes the server before the
body is there; on a machine whose cores the client shares with the server, both are in the measured
latency (docs/design_measurements.md#served-embedding-latency)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tachyllm.bench.metrics import CounterKey, RequestResult
from tachyllm.errors import TachyError

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}
# Counter names shared by tachy's and vLLM's /metrics (after the prefix and the _total suffix).
SCRAPED_COUNTERS = frozenset(
    {
        "prefix_cache_queries",
        "prefix_cache_hits",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
    }
)
METRIC_PREFIXES = ("tachy:", "vllm:")
# Longest server-sent event line read (aiohttp's default stops at 512 KiB): a server may send many
# tokens in one event (tachy serve sends whatever its event loop has not sent yet).
MAX_EVENT_BYTES = 64 << 20

Prompt = str | list[dict[str, str]]  # completion text or chat messages


def root_url(base_url: str) -> str:
    """The server root; a base URL given with OpenAI's /v1 suffix is accepted too."""
    return base_url.rstrip("/").removesuffix("/v1")


@dataclass
class Endpoint:
    base_url: str
    kind: str  # completions | chat | embeddings
    model: str | None  # None: the first name the server lists
    api_key: str | None = None
    ignore_eos: bool = False
    timeout: float = 600.0  # whole request, seconds


class BenchClient:
    def __init__(self, endpoint: Endpoint, max_connections: int) -> None:
        if endpoint.kind not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint.kind!r}; choose from {', '.join(ENDPOINTS)}")
        self.endpoint = endpoint
        self.root = root_url(endpoint.base_url)
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self.http = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(limit=max_connections),
            # The per-request deadline is enforced around the whole exchange (send); a per-read timeout
            # would also fire on a long wait in the server's queue.
            timeout=aiohttp.ClientTimeout(total=None),
            trust_env=True,  # HTTP(S)_PROXY / NO_PROXY, as httpx and vLLM's benchmark honour them
        )

    async def aclose(self) -> None:
        await self.http.close()

    def url(self, path: str) -> str:
        return self.root + path

    async def check_reachable(self) -> None:
        """Raises TachyError when nothing answers at the base URL (the server is down, or the URL is wrong),
        before any workload is built. Any HTTP answer will do: not every server has /health."""
        try:
            async with self.http.get(self.url("/v1/models"), timeout=aiohttp.ClientTimeout(total=10.0)) as response:
                await response.read()
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise TachyError(f"no server answers at {self.root} ({reason}); is it running?") from None

    async def model_name(self) -> str:
        if self.endpoint.model:
            return self.endpoint.model
        return (await self.served_models())[0]

    async def served_models(self) -> list[str]:
        """The model ids of GET /v1/models."""
        async with self.http.get(self.url("/v1/models")) as response:
            text = await response.text()
            if response.status != 200:
                raise TachyError(
                    f"GET /v1/models answered {response.status} ({error_message(text)}); "
                    "give --model (and --api-key if the server needs one)"
                )
        return [card["id"] for card in json.loads(text)["data"]]

    def payload(self, model: str, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,  # the older name, which llama.cpp and vLLM both still accept for chat
            "temperature": 0.0,  # greedy: sampling choices should not vary the load between runs
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body["messages" if self.endpoint.kind == "chat" else "prompt"] = prompt
        if self.endpoint.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def send(self, model: str, prompt: Prompt, max_tokens: int) -> RequestResult:
        """Never raises: a failure is a result with `error` set. prompt_len is left for the caller,
        which tokenizes after the run rather than while requests are timed."""
        result = RequestResult(prompt_len=0)
        result.start = time.perf_counter()
        if self.endpoint.kind == "embeddings":
            exchange = self._embed(model, prompt, result)
        else:
            exchange = self._stream(model, prompt, max_tokens, result)
        try:
            await asyncio.wait_for(exchange, self.endpoint.timeout)
        except asyncio.TimeoutError:
            result.error = f"timed out after {self.endpoint.timeout:g} s"
        # ValueError: a malformed JSON event; HttpProcessingError: a malformed response (or an event over
        # MAX_EVENT_BYTES).
        except (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError, OSError, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        result.end = time.perf_counter()
        return result

    async def _stream(self, model: str, prompt: Prompt, max_tokens: int, result: RequestResult) -> None:
        body = self.payload(model, prompt, max_tokens)
        async with self.http.post(self.url(ENDPOINTS[self.endpoint.kind]), json=body) as response:
            if response.status != 200:
                result.error = (
                    f"HTTP {response.status}: {error_message((await response.read()).decode(errors='replace'))}"
                )
                return
            pieces: list[str] = []
            last_event = ""  # named in the error if the stream never carries text
            while raw_line := await response.content.readline(max_line_length=MAX_EVENT_BYTES):
                now = time.perf_counter()
                line = raw_line.decode()
                data = line.removeprefix("data:").strip() if line.startswith("data:") else None
                if not data:
                    continue  # blank separators, comments and other SSE fields
                if data == "[DONE]":
                    break
                last_event = data
                event = json.loads(data)
                if "error" in event or event.get("object") == "error":  # OpenAI's shape, or vLLM's older one
                    result.error = error_message(data)
                    return
                piece = chunk_text(event)
                if piece:
                    pieces.append(piece)
                    result.chunk_times.append(now)
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_len = int(usage["completion_tokens"])
            result.text = "".join(pieces)
            if not pieces and result.output_len:
                # E.g. only special tokens, which servers leave out of the text: nothing to time TTFT by.
                result.error = (
                    f"the stream carried no text, though the server reports {result.output_len} output tokens"
                )
            elif not pieces:
                result.error = f"the stream ended without any generated text (last event: {last_event[:300] or 'none'})"

    async def _embed(self, model: str, prompt: Prompt, result: RequestResult) -> None:
        """One input's embedding, answered whole: its arrival is the request's only time (no output tokens)."""
        async with self.http.post(
            self.url(ENDPOINTS["embeddings"]), json={"model": model, "input": prompt}
        ) as response:
            answer = await response.read()
            result.chunk_times.append(time.perf_counter())
        text = answer.decode(errors="replace")
        if response.status != 200:
            result.error = f"HTTP {response.status}: {error_message(text)}"
        elif not json.loads(answer).get("data"):
            result.error = f"the answer carried no embedding: {text[:300]}"

    async def scrape(self) -> dict[CounterKey, float] | None:
        """The counters this benchmark reports, by series; None without /metrics."""
        try:
            async with self.http.get(self.url("/metrics"), timeout=aiohttp.ClientTimeout(total=10.0)) as response:
                if response.status != 200:
                    return None
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        return parse_counters(text)


def parse_counters(text: str) -> dict[CounterKey, float] | None:
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:  # not Prometheus text after all
        return None
    counters: dict[CounterKey, float] = {}
    for family in families:
        for sample in family.samples:
            prefix = next((p for p in METRIC_PREFIXES if sample.name.startswith(p)), None)
            if prefix is None or not sample.name.endswith("_total"):
                continue
            name = sample.name[len(prefix) : -len("_total")]
            if name in SCRAPED_COUNTERS:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "position"))
                counters[(name, sample.labels.get("position"), labels)] = sample.value
    return counters


def chunk_text(event: dict[str, Any]) -> str:
    """The generated text in one completion or chat chunk ('' for role-only and usage chunks)."""
    parts = []
    for choice in event.get("choices") or []:
        if "text" in choice:
            parts.append(choice.get("text") or "")
        delta = choice.get("delta") or {}
        # Reasoning models stream their thinking separately; it is generated text all the same.
        parts.append((delta.get("reasoning_content") or "") + (delta.get("content") or ""))
    return "".join(parts)


def error_message(body: str) -> str:
    """OpenAI's {"error": {"message": ...}}, llama.cpp's and vLLM's variants, or the raw body."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:500] or "(empty body)"
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(error)
