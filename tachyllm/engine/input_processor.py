"""InputProcessor: a request's prompt (chat template, tokenization) and every check that it can run, written once.

LLMEngine.add_request runs it on whatever it is given; the server runs it off the event loop and hands the
engine the ProcessedRequest, which the engine queues without checking again. It holds the tokenizer (whose
encode and apply_chat_template leave it unchanged) and plain numbers, so any thread may use it while the
engine thread steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tachyllm.errors import RequestError
from tachyllm.loading.tokenizer import Tokenizer
from tachyllm.lora.request import LoRARequest
from tachyllm.pooling_params import PoolingParams
from tachyllm.sampling_params import MAX_LOGPROBS, SamplingParams
from tachyllm.structured_output.compiler import CompiledGrammar, ConstraintLimits, GrammarCompiler, GrammarError


@dataclass(frozen=True)
class InputLimits:
    """What an engine can hold: the vocabulary, the context, the KV cache, one step's prompt tokens."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_logprobs: int = MAX_LOGPROBS  # alternatives a request may ask for per token (--max-logprobs)

    @property
    def context_limit(self) -> int:
        """Prompt and output tokens together: what the context and the KV cache both hold."""
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)


@dataclass(frozen=True)
class PoolingLimits:
    """What a pooling engine serves (docs/pooling.md): its tasks, its embeddings' size, whether they may be
    truncated (`dimensions`), and how an over-long input is cut when truncation is asked."""

    tasks: frozenset[str]
    embedding_dim: int | None
    matryoshka: bool
    # The most tokens one input may have: the model's limit, and for an encoder (whose whole input runs in
    # one step) the step's token budget.
    max_input_tokens: int
    # An encoder's text is framed by its tokenizer's special tokens ([CLS] ... [SEP]), and truncation keeps
    # its first tokens and the final one, as that tokenizer's own truncation does; a causal model's text is
    # framed as its prompts are, and truncation keeps the last tokens.
    encoder: bool


@dataclass
class Prompt:
    """A checked prompt: its token ids (never empty, each in the vocabulary) and its text when it came as text."""

    text: str | None
    token_ids: list[int]


@dataclass(frozen=True)
class ProcessedRequest:
    """A request the engine can run as it is: made by InputProcessor.process/process_request."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)
    # A pooling request's token type of each prompt token (a cross-encoder's (query, document) pair:
    # 0 then 1); None: all 0.
    token_type_ids: list[int] | None = None

    @property
    def is_pooling(self) -> bool:
        return isinstance(self.params, PoolingParams)


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    *,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    template_vars: dict[str, Any] | None = None,
) -> list[int]:
    """The token ids of a conversation in the model's chat template, or `chat_template` (with the tools
    it renders, if any); the other options are Tokenizer.apply_chat_template's."""
    if continue_final_message:
        if add_generation_prompt:
            raise RequestError(
                "continue_final_message and add_generation_prompt cannot both be true: continuing the final "
                "message adds no new assistant turn (set add_generation_prompt to false)",
                param="continue_final_message",
            )
        if not messages or messages[-1].get("role") != "assistant":
            raise RequestError(
                "continue_final_message needs the last message to be the assistant's", param="continue_final_message"
            )
    token_ids = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        continue_final_message=continue_final_message,
        chat_template=chat_template,
        template_vars=template_vars,
        tokenize=True,
    )
    assert isinstance(token_ids, list), "tokenize=True returns token ids"
    return token_ids


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: InputLimits,
        eos_token_ids: list[int] | None = None,
        constraint_limits: ConstraintLimits | None = None,
        pooling: PoolingLimits | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.pooling = pooling  # None: a generation engine, which takes no pooling request
        self.grammars = GrammarCompiler(tokenizer, limits.vocab_size, eos_token_ids or [], constraint_limits)

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled grammar of the request's structured outputs (None without them); compiled once
        per constraint, then cached. Raises RequestError for a constraint that cannot be compiled, fails at
        its first token, or is beyond the constraint limits (its size, its compile time)."""
        if params.structured_outputs is None:
            return None
        try:
            return self.grammars.compile(params.structured_outputs)
        except GrammarError as e:
            kind = params.structured_outputs.kind
            raise RequestError(f"structured outputs ({kind}): {e}", param="structured_outputs") from None

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """The token sequences that spell each word: as written (leading spaces dropped) and after a space,
        where that is a different sequence of as many tokens (vLLM's rule: a word at the start of the text and
        in the middle of it)."""
        sequences = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(plain)
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        return sequences

    def encode(self, text: str) -> list[int]:
        """The token ids of a text prompt (a BOS first, when the model wants one)."""
        return self.tokenizer.encode(text)

    def chat_prompt_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_options: Any,
    ) -> list[int]:
        """`template_options`: chat_prompt_ids'."""
        return chat_prompt_ids(self.tokenizer, messages, add_generation_prompt, tools, **template_options)

    def process(self, prompt: str | list[int], params: SamplingParams | PoolingParams) -> ProcessedRequest:
        """Tokenizes and checks a request; raises RequestError when it can never run."""
        if isinstance(params, PoolingParams):
            return self.process_pooling(prompt, params)
        if self.pooling is not None:
            raise RequestError(
                "this model is served by the pooling runner (embeddings, scores): it does not generate text",
                param="model",
            )
        return self.process_request(self.process_prompt(prompt), params)

    def process_pooling(
        self, prompt: str | list[int], params: PoolingParams, text_pair: str | None = None
    ) -> ProcessedRequest:
        """Tokenizes (an encoder's text with its tokenizer's special tokens: [CLS] text [SEP] pair [SEP]; a
        causal model's as its prompts, with a BOS where it wants one) and
        checks a pooling request: its params for this model, token ids in the vocabulary, not empty, and
        within the model's limit, or cut to it when truncate_prompt_tokens asks. Raises RequestError naming
        the field at fault."""
        pooling = self.pooling
        if pooling is None:
            raise RequestError(
                "this model generates text: embeddings and scores need a model served by the pooling runner",
                param="model",
            )
        params.verify(pooling.tasks, pooling.embedding_dim, pooling.matryoshka)
        token_types = None
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("input is empty", param="input")
            if text_pair is not None and not text_pair:
                raise RequestError("the second text of the pair is empty", param="input")
            text: str | None = prompt
            if pooling.encoder:  # its tokenizer's own framing ([CLS] ... [SEP]), pairs included
                token_ids, token_types = self.tokenizer.encode_pair(prompt, text_pair)
            elif text_pair is not None:
                raise RequestError("text pairs are scored by a cross-encoder, not a causal embedder", param="input")
            else:  # a causal model: framed as its prompts are (a BOS where the model wants one)
                token_ids = self.encode(prompt)
        else:
            if text_pair is not None:
                raise RequestError("a text pair is given as text, not token ids", param="input")
            vocab_size = self.limits.vocab_size
            text, token_ids = None, list(prompt)
            bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"input token ids must be in [0, {vocab_size}), got {bad[:3]}", param="input")
        if not token_ids:
            raise RequestError("input is empty (no tokens)", param="input")
        limit = pooling.max_input_tokens
        if params.truncate_prompt_tokens is not None:
            keep = min(limit, len(token_ids) if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens)
            if len(token_ids) > keep:
                text = None  # the text no longer matches the ids
                if pooling.encoder:
                    kept = list(range(keep - 1)) + [len(token_ids) - 1] if keep > 1 else [0]
                else:
                    kept = list(range(len(token_ids) - keep, len(token_ids)))
                token_ids = [token_ids[i] for i in kept]
                token_types = [token_types[i] for i in kept] if token_types is not None else None
        if len(token_ids) > limit:
            raise RequestError(
                f"input has {len(token_ids)} tokens, more than this model's limit ({limit}); set "
                "truncate_prompt_tokens to cut it",
                param="input",
            )
        if token_types is not None and not any(token_types):
            token_types = None
        return ProcessedRequest(text, token_ids, params, token_type_ids=token_types)

    def process_prompt(self, prompt: str | list[int]) -> Prompt:
        """A text prompt tokenized, or token ids checked against the vocabulary; neither may be empty."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            text, token_ids = prompt, self.encode(prompt)
        else:
            vocab_size = self.limits.vocab_size
            text, token_ids = None, list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:3]}", param="prompt")
        if not token_ids:
            raise RequestError("prompt is empty (no tokens)", param="prompt")
        return Prompt(text, token_ids)

    def process_request(self, prompt: Prompt, params: SamplingParams) -> ProcessedRequest:
        """Checks what `params` name (token ids) and ask for (room in the context and the KV cache); cuts the
        prompt to its truncate_prompt_tokens and tokenizes its bad_words (the ProcessedRequest's params are
        then a copy)."""
        limits = self.limits
        if unknown := params.token_ids_at_or_above(limits.vocab_size):
            name, token = unknown[0]
            raise RequestError(
                f"{name}: token id {token} is not in the vocabulary (ids 0 to {limits.vocab_size - 1})", param=name
            )
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(params, name)
            if wanted is not None and wanted > limits.max_logprobs:
                raise RequestError(
                    f"{name}: {wanted} alternatives per token were requested, more than this engine's max_logprobs "
                    f"({limits.max_logprobs})",
                    param=name,
                )
        if params.truncate_prompt_tokens is not None:
            keep = limits.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if len(prompt.token_ids) > keep:  # the text no longer matches the ids: not kept
                prompt = Prompt(None, prompt.token_ids[-keep:])
        if bad_words := params.bad_words:
            params = replace(params)
            params.bad_words_token_ids = self.bad_words_token_ids(bad_words)
            if any(t >= limits.vocab_size for word in params.bad_words_token_ids for t in word):
                raise RequestError("bad_words: a word's tokens are not in the model's vocabulary", param="bad_words")
        prompt_len = len(prompt.token_ids)
        total = prompt_len + params.max_tokens
        if total > limits.max_model_len:
            raise RequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len ({limits.max_model_len})"
            )
        blocks = -(-total // limits.block_size)
        if blocks > limits.num_kv_blocks:
            raise RequestError(
                f"prompt + max_tokens = {total} tokens needs {blocks} KV blocks but the cache has only "
                f"{limits.num_kv_blocks}; raise kv_cache_memory or lower max_tokens"
            )
        if not limits.enable_chunked_prefill and prompt_len > limits.max_num_batched_tokens:
            raise RequestError(
                f"prompt ({prompt_len} tokens) exceeds max_num_batched_tokens ({limits.max_num_batched_tokens}) "
                "and chunked prefill is disabled"
            )
        self.compile_grammar(params)
        return ProcessedRequest(prompt.text, prompt.token_ids, params)
