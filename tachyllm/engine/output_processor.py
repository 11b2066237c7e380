"""Turns what each sequence gained in a step (token ids and logprobs, from the scheduler) into
RequestOutputs: incremental detokenization, stop strings, logprob entries, and the request's
output kind (cumulative, delta or final only). Per request and step it costs O(new tokens), except
for CUMULATIVE outputs, which copy the whole completion by definition."""

from __future__ import annotations

from dataclasses import dataclass, field

from tachyllm import faults
from tachyllm.core.scheduler import Scheduler, SeqUpdate
from tachyllm.core.sequence import Request, Sequence
from tachyllm.detokenizer import IncrementalDetokenizer
from tachyllm.loading.tokenizer import Tokenizer
from tachyllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from tachyllm.sampling_params import RequestOutputKind
from tachyllm.step import LogprobInfo


@dataclass(eq=False)
class _SeqOutput:
    """What one sample has produced so far, and how much of it was already handed out (DELTA)."""

    detokenizer: IncrementalDetokenizer
    stop_strings: list[str]
    include_stop: bool  # the stop string that ends the text stays in it
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    pieces: list[str] = field(default_factory=list)  # the text, as detokenized
    num_chars: int = 0
    # The newest characters, where a stop string can still be completing (stop-string requests).
    tail: str = ""
    unsent: str = ""  # text not handed out yet (DELTA)
    num_sent_tokens: int = 0
    # Tokens whose text is not made yet, or None: a FINAL_ONLY sample without stop strings shows its
    # text only at the end, so it is detokenized once then, not token by token. That is the same text
    # (the detokenizer's deltas add up to the whole decode), except where a SentencePiece byte-fallback
    # run holds invalid UTF-8: decoded whole, as here, each of its bytes is U+FFFD.
    deferred: list[int] | None = None

    @property
    def max_stop_len(self) -> int:
        return max(map(len, self.stop_strings))

    def add_text(self, delta: str) -> None:
        if delta:
            self.pieces.append(delta)
            self.num_chars += len(delta)
            self.unsent += delta
            if self.stop_strings:
                self.tail += delta

    def find_stop(self, new_chars: int) -> tuple[int, str] | None:
        """The earliest stop string that the newest characters complete: (its position in the text, it)."""
        window_start = max(0, len(self.tail) - new_chars - self.max_stop_len + 1)
        best = None
        for stop in self.stop_strings:
            idx = self.tail.find(stop, window_start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        keep = self.max_stop_len - 1
        offset = self.num_chars - len(self.tail)
        self.tail = self.tail[len(self.tail) - keep :] if keep else ""
        return None if best is None else (offset + best[0], best[1])

    def truncate(self, num_chars: int) -> None:
        """Cuts the text at the end of the output (at a stop string, or after it)."""
        sent = self.num_chars - len(self.unsent)
        self.pieces = ["".join(self.pieces)[:num_chars]]
        self.unsent = self.unsent[: num_chars - sent]
        self.num_chars = num_chars

    def held_back(self, finished: bool) -> int:
        """Characters not shown yet: a possible stop-string prefix until it is confirmed or ruled out
        (shown at once when a stop string stays in the text: what precedes it is output either way)."""
        return 0 if finished or not self.stop_strings or self.include_stop else self.max_stop_len - 1

    def text(self, finished: bool) -> str:
        text = self.pieces[0] if len(self.pieces) == 1 else "".join(self.pieces)
        self.pieces = [text]
        return text[: max(0, self.num_chars - self.held_back(finished))]

    def take_delta(self, finished: bool) -> tuple[str, list[int], list[dict[int, Logprob]]]:
        """The text, tokens and logprobs not handed out before."""
        visible = max(0, len(self.unsent) - self.held_back(finished))
        text, self.unsent = self.unsent[:visible], self.unsent[visible:]
        start, self.num_sent_tokens = self.num_sent_tokens, len(self.token_ids)
        return text, self.token_ids[start:], self.logprobs[start:] if self.want_logprobs else []


@dataclass(eq=False)
class _RequestOutputs:
    request: Request
    kind: RequestOutputKind
    seqs: list[_SeqOutput]
    prompt_logprobs: PromptLogprobs | None = None  # made once all are known (a DELTA output hands them out once)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestOutputs] = {}

    def add_request(self, req: Request) -> None:
        params = req.params
        seqs = [
            _SeqOutput(
                IncrementalDetokenizer(
                    self.tokenizer,
                    req.prompt_token_ids,
                    params.skip_special_tokens,
                    params.spaces_between_special_tokens,
                ),
                params.stop_strings,
                params.include_stop_str_in_output,
                params.logprobs is not None,
                deferred=[] if params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop_strings else None,
            )
            for _ in req.seqs
        ]
        self._requests[req.request_id] = _RequestOutputs(req, params.output_kind, seqs)

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def apply(self, update: SeqUpdate, scheduler: Scheduler) -> None:
        """Detokenizes the new tokens of one sequence and ends it at a stop string (through the
        scheduler, which drops any tokens after it)."""
        seq = update.seq
        out = self._requests[seq.request.request_id].seqs[seq.index]
        params = seq.params
        last = len(update.token_ids) - 1
        for i, (token, logprob) in enumerate(zip(update.token_ids, update.logprobs)):
            out.token_ids.append(token)
            if logprob is not None:
                self._add_logprob(out, token, logprob)
            faults.check("detokenize", (seq,))
            stop_token = _ended_by(seq, token, i == last)
            if stop_token and not out.include_stop:
                continue  # as vLLM: the stop token's text is not output, unless asked for
            if out.deferred is not None:
                out.deferred.append(token)
                continue
            delta = out.detokenizer.add_tokens([token])
            out.add_text(delta)
            if not out.stop_strings or len(out.token_ids) < params.min_tokens or stop_token:
                continue
            hit = out.find_stop(len(delta))
            if hit is not None:
                position, stop = hit
                out.truncate(position + len(stop) if out.include_stop else position)
                scheduler.finish_at_stop_string(seq, stop, len(out.token_ids))
                return

    def _add_logprob(self, out: _SeqOutput, token: int, info: LogprobInfo) -> None:
        out.logprobs.append(self._logprob_entry(token, info))
        out.cumulative_logprob += info[0]

    def _logprob_entry(self, token: int, info: LogprobInfo) -> dict[int, Logprob]:
        """token id -> Logprob: the top-N, then the scored token itself (with its own rank)."""
        chosen_lp, rank, top_ids, top_lps = info
        entry = {tid: Logprob(lp, r + 1, self._token_text(tid)) for r, (tid, lp) in enumerate(zip(top_ids, top_lps))}
        entry[token] = Logprob(chosen_lp, rank, self._token_text(token))
        return entry

    def _prompt_logprobs(self, state: _RequestOutputs) -> PromptLogprobs | None:
        """The request's prompt logprobs for this output: None until all are known (and, for DELTA,
        after the output that carried them)."""
        req = state.request
        if req.params.prompt_logprobs is None or len(req.prompt_logprobs) < len(req.prompt_token_ids) - 1:
            return None
        if state.prompt_logprobs is None:
            entries = zip(req.prompt_token_ids[1:], req.prompt_logprobs)
            state.prompt_logprobs = [None] + [self._logprob_entry(token, info) for token, info in entries]
        elif state.kind is RequestOutputKind.DELTA:
            return None
        return state.prompt_logprobs

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def make_output(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """The request's output now, as its output kind asks (None: a FINAL_ONLY request still running).
        With `error`, the request failed: every sample reports finish_reason "error"."""
        state = self._requests[request_id]
        req = state.request
        finished = req.finished or error is not None
        if state.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if error is None:
            faults.check("output", req.seqs)
        completions = []
        for seq, out in zip(req.seqs, state.seqs):
            if out.deferred:
                tokens, out.deferred = out.deferred, []  # taken first: a failure here is not repeated
                out.add_text(out.detokenizer.add_tokens(tokens))
            reason, stop_reason = ("error", None) if error is not None else (seq.finish_reason, seq.stop_reason)
            done = finished or seq.is_finished
            if state.kind is RequestOutputKind.DELTA:
                text, token_ids, logprobs = out.take_delta(done)
            else:
                text, logprobs = out.text(done), out.logprobs
                token_ids = out.token_ids if finished else list(out.token_ids)
                logprobs = logprobs if finished else list(logprobs)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=token_ids,
                    finish_reason=reason,
                    stop_reason=stop_reason,
                    logprobs=logprobs if out.want_logprobs else None,
                    cumulative_logprob=out.cumulative_logprob if out.want_logprobs else None,
                )
            )
        if finished:
            del self._requests[request_id]
            req.metrics.sample_output_tokens = [seq.num_output_tokens for seq in req.seqs]
            # A rejected request's samples end together (Scheduler._advance_grammar), each with the reason.
            error = error or next(
                (
                    seq.stop_reason
                    for seq in req.seqs
                    if seq.finish_reason == "rejected" and isinstance(seq.stop_reason, str)
                ),
                None,
            )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=req.metrics,
            error=error,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=self._prompt_logprobs(state),
        )


def _ended_by(seq: Sequence, token: int, is_last: bool) -> bool:
    """Whether this token ended the sequence as a stop token (EOS or stop_token_ids): its text then
    completes no stop string."""
    return is_last and seq.finish_reason == "stop" and seq.stop_reason == token
