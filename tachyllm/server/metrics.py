"""What the server measures: Prometheus metrics (vLLM's names, prefixed tachy:, or vllm: with vLLM's
labels too, so that vLLM's dashboards work unchanged) and its log lines.

Latency histograms are fed per output on the engine thread, where token times are exact. Counters
mirror engine.stats: each scrape adds the difference since the previous one, so they are never
counted twice and the engine keeps a single source of truth. Each ServerMetrics has its own
registry, so several servers can live in one process (tests) without name clashes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from tachyllm.engine.llm_engine import EngineSnapshot, LoRARequestsInfo
from tachyllm.outputs import ITERATION_TOKEN_BUCKETS, EngineOutput, PoolingRequestOutput, RequestOutput, StepStats

logger = logging.getLogger("tachyllm.server")

# Seconds, roughly 2.5x apart: from a sub-millisecond CPU decode step to a many-minute request.
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 600.0,
)  # fmt: skip


# vLLM's buckets of the request's n and of its preemptions.
_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vLLM's reasons a request waits: for room (all of tachyllm's waiting requests), or deferred by a transient
# constraint (LoRA budget, KV transfer: none here).
_WAITING_REASONS = ("capacity", "deferred")


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's request length buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass
class MetricsOptions:
    """How the server exports its metrics (the --metrics-prefix and --disable-log-requests flags)."""

    # "tachy": tachy: names labelled model_name; "vllm": vLLM's exact names and labels (vllm: prefix,
    # model_name and engine), for vLLM's own dashboards.
    prefix: str = "tachy"
    log_requests: bool = True  # one log line per finished request

    def labels(self, model_name: str) -> dict[str, str]:
        return {"model_name": model_name, "engine": "0"} if self.prefix == "vllm" else {"model_name": model_name}


@dataclass
class _Progress:
    """How far a running request was at the previous output, for per-token intervals."""

    num_tokens: int = 0
    last_token_time: float | None = None


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, options: MetricsOptions | None = None) -> None:
        self.registry = CollectorRegistry()
        self.options = options = options or MetricsOptions()
        self._labels = options.labels(model_name)
        label, values, prefix = list(self._labels), list(self._labels.values()), options.prefix

        def histogram(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            metric = Histogram(f"{prefix}:{name}", doc, label, registry=self.registry, buckets=buckets)
            return metric.labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{prefix}:{name}", doc, label, registry=self.registry).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{prefix}:{name}", doc, label, registry=self.registry).labels(*values)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "Mean time per output token after the first, per request."
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish, per finished request.")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = histogram("request_decode_time_seconds", "First token to last token.")
        self.inference = histogram("request_inference_time_seconds", "First scheduled to finish.")
        lengths = token_buckets(max_model_len)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens per finished sample.", lengths)
        self.generation_len = histogram("request_generation_tokens", "Generated tokens per finished sample.", lengths)
        self.max_generation_len = histogram(
            "request_max_num_generation_tokens", "Generated tokens of a finished request's longest sample.", lengths
        )
        self.params_n = histogram("request_params_n", "The n request parameter of finished requests.", _N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens request parameter of finished requests.", lengths
        )
        self.kv_computed = histogram(
            "request_prefill_kv_computed_tokens",
            "Prompt tokens a finished request's prefill computed (its prompt less the prefix-cache hits).",
            lengths,
        )
        self.request_preemptions = histogram(
            "request_num_preemptions", "Preemptions of each finished request.", _PREEMPTION_BUCKETS
        )
        self.prompt_cached = counter("prompt_tokens_cached", "Prompt tokens served from the prefix cache.")

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Sequences preempted for lack of KV blocks.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Verification steps that carried draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.")
        self._spec_accepted_per_pos = Counter(
            f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft (0 = first).",
            [*label, "position"],
            registry=self.registry,
        )
        self._success = Counter(
            f"{prefix}:request_success",
            "Finished requests by finish reason.",
            [*label, "finished_reason"],
            registry=self.registry,
        )

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.suffix_tree_nodes = gauge(
            "spec_decode_suffix_tree_nodes", "Nodes of the suffix-decoding tree of finished outputs."
        )
        # The name vLLM used before kv_cache_usage_perc, which its older dashboards still query.
        self.kv_usage_old = gauge("gpu_cache_usage_perc", "Same as kv_cache_usage_perc.") if prefix == "vllm" else None
        waiting_by_reason = Gauge(
            f"{prefix}:num_requests_waiting_by_reason",
            "Requests waiting, by reason: capacity (for room to run), deferred (none here); they sum to the waiting.",
            [*label, "reason"],
            registry=self.registry,
        )
        self._waiting_by_reason = {r: waiting_by_reason.labels(*values, r) for r in _WAITING_REASONS}
        self._cache_info_exported = False
        self._iteration_tokens = _IterationTokens(f"{prefix}:iteration_tokens_total", self._labels)
        self.registry.register(self._iteration_tokens)
        self._lora_info = _LoRAInfo(f"{prefix}:lora_requests_info", self._labels)
        self.registry.register(self._lora_info)

        self._exported = StepStats()  # counter values already added to the registry
        self._progress: dict[str, _Progress] = {}  # engine thread only

    # -- engine thread ------------------------------------------------------------------------
    def observe(self, outputs: list[EngineOutput]) -> None:
        """Per-output latencies; an AsyncEngine output listener."""
        for out in outputs:
            if isinstance(out, PoolingRequestOutput):
                self._observe_pooled(out)
                continue
            m = out.metrics
            progress = self._progress.setdefault(out.request_id, _Progress())
            new_tokens = m.num_generated_tokens - progress.num_tokens
            if new_tokens > 0:
                if progress.num_tokens == 0:  # the prefill is done: its cache hits are known
                    self.prompt_cached.inc(out.num_cached_tokens)
                    if m.ttft is not None:
                        self.ttft.observe(m.ttft)
                    new_tokens -= 1  # the first token has no interval before it
                if new_tokens > 0 and progress.last_token_time is not None and m.last_token_time is not None:
                    gap = (m.last_token_time - progress.last_token_time) / new_tokens
                    for _ in range(new_tokens):
                        self.itl.observe(gap)
                progress.num_tokens, progress.last_token_time = m.num_generated_tokens, m.last_token_time
            if out.finished:
                del self._progress[out.request_id]
                self._observe_finished(out)

    def _observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        reason = out.outputs[0].finish_reason if out.outputs else None
        prompt_len, output_len = len(out.prompt_token_ids), m.num_generated_tokens
        if self.options.log_requests:
            ttft = "-" if m.ttft is None else f"{m.ttft * 1000:.1f} ms"
            tpot = "-" if m.mean_tpot is None else f"{m.mean_tpot * 1000:.1f} ms"
            logger.info(
                "request %s finished: %s, prompt %d tokens, output %d tokens, ttft %s, tpot %s",
                out.request_id, reason, prompt_len, output_len, ttft, tpot,
            )  # fmt: skip
        if reason in ("abort", "error", "rejected"):  # a cut-short request would skew the distributions
            return
        # Per sample, as vLLM counts the samples of an n > 1 request (and request_success counts them).
        samples = m.sample_output_tokens or [output_len]
        for tokens in samples:
            self.prompt_len.observe(prompt_len)
            self.generation_len.observe(tokens)
        self.max_generation_len.observe(max(samples))
        if m.first_scheduled_time is not None and m.finished_time is not None:
            self.inference.observe(m.finished_time - m.first_scheduled_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        if m.first_token_time is not None and m.first_scheduled_time is not None:
            self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.last_token_time is not None:
            self.decode.observe(m.last_token_time - m.first_token_time)
        if m.mean_tpot is not None:
            self.tpot.observe(m.mean_tpot)
        self.params_n.observe(m.params_n)
        if m.params_max_tokens is not None:
            self.params_max_tokens.observe(m.params_max_tokens)
        self.kv_computed.observe(prompt_len - out.num_cached_tokens)
        self.request_preemptions.observe(m.num_preemptions)

    def _observe_pooled(self, out: PoolingRequestOutput) -> None:
        """A pooling request's one output: its prompt and its times, as vLLM counts them (its prefill is
        the whole request: scheduled to finished)."""
        m = out.metrics
        if self.options.log_requests:
            outcome = "error" if out.error is not None else "pooled"
            logger.info("request %s finished: %s, prompt %d tokens", out.request_id, outcome, len(out.prompt_token_ids))
        if out.error is not None or m.finished_time is None:  # failed or aborted: it would skew the distributions
            return
        self.prompt_len.observe(len(out.prompt_token_ids))
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
            self.prefill.observe(m.finished_time - m.first_scheduled_time)
            self.inference.observe(m.finished_time - m.first_scheduled_time)

    # -- event loop ---------------------------------------------------------------------------
    def sync(self, snapshot: EngineSnapshot) -> None:
        """Brings counters and gauges up to the snapshot; called before each scrape."""
        now, seen = snapshot.stats, self._exported
        for metric, attr in (
            (self.prompt_tokens, "num_prompt_tokens"),
            (self.generation_tokens, "num_generation_tokens"),
            (self.preemptions, "num_preemptions"),
            (self.prefix_queries, "prefix_cache_queries"),
            (self.prefix_hits, "prefix_cache_hits"),
            (self.spec_drafts, "spec_num_drafts"),
            (self.spec_draft_tokens, "spec_num_draft_tokens"),
            (self.spec_accepted, "spec_num_accepted_tokens"),
        ):
            delta = getattr(now, attr) - getattr(seen, attr)
            if delta > 0:
                metric.inc(delta)
        for position, count in enumerate(now.spec_accepted_per_pos):
            before = seen.spec_accepted_per_pos[position] if position < len(seen.spec_accepted_per_pos) else 0
            if count > before:
                self._spec_accepted_per_pos.labels(*self._labels.values(), str(position)).inc(count - before)
        for reason, count in now.finished_reasons.items():
            delta = count - seen.finished_reasons.get(reason, 0)
            if delta > 0:
                self._success.labels(*self._labels.values(), reason).inc(delta)
        self._exported = now
        self.running.set(snapshot.num_running)
        self.waiting.set(snapshot.num_waiting)
        self._waiting_by_reason["capacity"].set(snapshot.num_waiting)
        self._iteration_tokens.stats = now
        self._lora_info.info = snapshot.lora
        if snapshot.cache_config and not self._cache_info_exported:  # constant: labelled once
            labels = {**snapshot.cache_config, **self._labels}  # vLLM's has no model_name; every series here has
            info = Gauge(
                f"{self.options.prefix}:cache_config_info",
                "Information of the KV cache's configuration (a constant 1 carrying it in its labels).",
                list(labels),
                registry=self.registry,
            )
            info.labels(**labels).set(1)
            self._cache_info_exported = True
        self.kv_usage.set(snapshot.kv_cache_usage)
        self.suffix_tree_nodes.set(now.spec_suffix_tree_nodes)
        if self.kv_usage_old is not None:
            self.kv_usage_old.set(snapshot.kv_cache_usage)

    def render(self, snapshot: EngineSnapshot) -> bytes:
        self.sync(snapshot)
        return generate_latest(self.registry)


def merge_expositions(parts: list[tuple[dict[str, str], bytes]]) -> bytes:
    """Several Prometheus text expositions as one, each sample given its part's extra labels (say, which
    replica it came from): one HELP/TYPE per metric family, as a scraper requires."""
    if len(parts) == 1 and not parts[0][0]:
        return parts[0][1]
    families: dict[str, Metric] = {}
    for labels, text in parts:
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={**sample.labels, **labels}))
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _IterationTokens:
    """The tokens-per-step histogram, read from the engine's counts (StepStats.iteration_token_steps) at each
    scrape: the engine observes every step, which no output listener sees (a step may emit nothing)."""

    def __init__(self, name: str, labels: dict[str, str]) -> None:
        self._name, self._labels = name, labels
        self.stats = StepStats()

    def collect(self) -> list[Metric]:
        family = HistogramMetricFamily(
            self._name, "Histogram of number of tokens per engine step.", labels=list(self._labels)
        )
        cumulative, buckets = 0, []
        for bound, steps in zip(
            [*map(floatToGoString, ITERATION_TOKEN_BUCKETS), "+Inf"], self.stats.iteration_token_steps
        ):
            cumulative += steps
            buckets.append((bound, cumulative))
        family.add_metric(list(self._labels.values()), buckets, self.stats.iteration_tokens)
        return [family]


class _LoRAInfo:
    """vLLM's lora_requests_info: one series whose labels name the adapters of the running and the waiting
    requests (comma-separated) and max_loras, valued at the time it was read; absent without enable_lora."""

    def __init__(self, name: str, labels: dict[str, str]) -> None:
        self._name, self._labels = name, labels
        self.info: LoRARequestsInfo | None = None

    def collect(self) -> list[Metric]:
        info = self.info
        if info is None:
            return []
        names = [*self._labels, "max_lora", "running_lora_adapters", "waiting_lora_adapters"]
        family = GaugeMetricFamily(self._name, "Running stats on LoRA requests.", labels=names)
        values = [*self._labels.values(), str(info.max_loras), ",".join(info.running), ",".join(info.waiting)]
        family.add_metric(values, time.time())
        return [family]


class _Fixed:
    """A collector of metric families that were already gathered."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families
