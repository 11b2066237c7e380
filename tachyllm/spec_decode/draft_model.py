"""A draft model that proposes k tokens per sequence, run in-process with its own paged KV cache.

Each target sequence being speculated has a shadow Sequence here with the same token ids: the
draft's KV covers the first num_computed_tokens of it. Every proposal round first lets the draft
catch up on the tokens the target accepted since the last round (one forward over all of them),
then runs k - 1 single-token steps. Rejected drafts are rolled back by truncating the shadow to the
prefix it still shares with the target and releasing the blocks past it.

Drafts available without a second file: "self:layers=N" (the target's first N layers, its final
norm and head, sharing the target's weights) and "self:int4" (the target re-loaded with int4
weights, LM head included: a GGUF file's own 4-bit blocks packed as they are, anything else
quantized group-wise round-to-nearest).

With "draft_vocab_size" the draft's LM head computes a shortlist of the vocabulary (draft_vocabulary):
the proposer scatters its logits back into the whole vocabulary, the rest at -inf, so the draft never
proposes a token outside the list and the target's verification is unchanged.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from tachyllm.backends.base import Backend
from tachyllm.config import EngineConfig, QuantConfig
from tachyllm.core.block_manager import BlockManager, cdiv
from tachyllm.core.sequence import Sequence
from tachyllm.errors import ConfigError
from tachyllm.loading import Checkpoint, Tokenizer, load_checkpoint
from tachyllm.models.llama import LlamaForCausalLM
from tachyllm.quantization.int4 import ACTIVATION_BITS
from tachyllm.runner import kv_cache
from tachyllm.runner.model_loader import build_model
from tachyllm.runner.model_runner import ModelRunner
from tachyllm.sampling.sampler import Sampler, greedy_tokens
from tachyllm.spec_decode.proposer import Draft, Proposer
from tachyllm.speculative_config import SpeculativeConfig
from tachyllm.step import SamplingInput, ScheduledSeq, StepBatch

logger = logging.getLogger("tachyllm")


def build_draft_model(
    config: EngineConfig,
    target: LlamaForCausalLM,
    ckpt: Checkpoint,
    dtype: torch.dtype,
    backend: Backend,
    max_len: int,
) -> LlamaForCausalLM:
    """The draft for config.speculative_config's 'model' entry; a foreign checkpoint must share the
    tokenizer. Quantized drafts include their LM head: a draft's rounding costs acceptance, never
    output tokens, and the head is a large part of a small model's step."""
    spec = config.speculative_config
    assert isinstance(spec, SpeculativeConfig), "EngineConfig.__post_init__ parses speculative_config"
    assert spec.model is not None, "SpeculativeConfig requires 'model' for method 'draft_model'"
    invariant = config.deterministic
    if spec.model.startswith("self:layers="):
        return _truncated(target, int(spec.model.removeprefix("self:layers=")))
    # A draft's rounding costs acceptance, never output: unset, it keeps 16 bits without the target's
    # check (8 bits saved a Qwen2.5-Coder-0.5B draft no time; docs/speculative_decoding.md).
    bits = ACTIVATION_BITS if config.quant_activation_bits is None else config.quant_activation_bits
    shortlist = None
    if spec.draft_vocab_size is not None and spec.draft_vocab_size < target.config.vocab_size:
        shortlist = draft_vocabulary(ckpt.tokenizer, target.config.vocab_size, spec.draft_vocab_size,
                                     target.config.eos_token_ids)  # fmt: skip
    if spec.model == "self:int4":
        # A GGUF file's own 4-bit weights are packed as they are (the draft then differs from the
        # target only by rounding), a pre-quantized checkpoint keeps its own codes (None: the
        # checkpoint's method); other checkpoints are quantized round-to-nearest.
        method = "gguf" if ckpt.format == "gguf" else None if ckpt.prequantized is not None else "int4"
        draft, _ = build_model(
            ckpt, dtype, backend, max_len, QuantConfig(method=method, skip="none", activation_bits=bits),
            batch_invariant=invariant, head_token_ids=shortlist,
        )  # fmt: skip
        return draft
    draft_ckpt = load_checkpoint(spec.model)
    check_same_vocabulary(ckpt.tokenizer, draft_ckpt.tokenizer, spec.model)
    own = draft_ckpt.prequantized.format.method if draft_ckpt.prequantized is not None else None
    method = draft_quantization(spec.quantization, config.quantization, draft_ckpt.format, spec.model, own is not None)
    # The methods whose kernels round activations: all but int8 / fp8 and a dense draft.
    blocks = method not in ("int8", "fp8") and (method or own) is not None
    if shortlist is not None:
        shortlist = shortlist[shortlist < draft_ckpt.config.vocab_size]
    quant = QuantConfig(
        method=method,
        group_size=config.quant_group_size if method == config.quantization and method in ("int4", "awq") else None,
        skip="none" if method else None,
        activation_bits=bits if blocks else ACTIVATION_BITS,
    )
    draft, weight_bytes = build_model(
        draft_ckpt, dtype, backend, max_len, quant, batch_invariant=invariant, head_token_ids=shortlist
    )
    logger.info(
        "draft model %s: %s, %d layers, quantization %s, LM head over %s tokens, %.1f MiB of weights per step",
        spec.model, draft_ckpt.config.architecture, draft_ckpt.config.num_layers, method or own or "none",
        "all" if shortlist is None else f"{len(shortlist)} of {draft_ckpt.config.vocab_size}", weight_bytes / 2**20,
    )  # fmt: skip
    return draft


def draft_vocabulary(tokenizer: Tokenizer, vocab_size: int, size: int, eos_token_ids: list[int]) -> torch.Tensor:
    """The token ids a draft with draft_vocab_size proposes, ascending: the `size` lowest ids below the
    target's vocab_size and every special token and EOS id (a reply must be able to end). BPE
    vocabularies number their tokens in merge order, most frequent merges first, so the lowest ids
    are the common ones; a target token outside the list costs one rejected draft, never output."""
    ids = set(range(min(size, vocab_size))) | {i for i in (*tokenizer.special_ids, *eos_token_ids) if i < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


def draft_quantization(
    requested: str | None, target: str | None, draft_format: str, name: str, prequantized: bool
) -> str | None:
    """speculative_config's 'quantization' for a draft file, or unset the target's --quantization
    ('gguf' only where the draft is a GGUF file too; a pre-quantized draft's own, as for a target)."""
    if requested == "none":
        return None
    if requested == "gguf" and draft_format != "gguf":
        raise ConfigError(f"speculative_config quantization 'gguf' needs a GGUF draft file; {name} is not one")
    if requested is not None:
        return requested
    if prequantized or (target == "gguf" and draft_format != "gguf"):
        return None
    return target


def _truncated(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    total = target.config.num_layers
    if not 1 <= num_layers < total:
        raise ConfigError(
            f"speculative_config 'self:layers=N' needs 1 <= N < {total} (the target's layers), got {num_layers}"
        )
    draft = copy.copy(target)  # a new module object whose submodules are the target's own
    draft._modules = dict(target._modules)
    draft._modules["layers"] = nn.ModuleList(list(target.layers)[:num_layers])
    draft.config = copy.copy(target.config)
    draft.config.num_layers = num_layers
    return draft


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, name: str) -> None:
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])[:3]
        raise ConfigError(
            f"draft model {name} does not share the target's vocabulary (draft {len(draft_vocab)} tokens, target "
            f"{len(target_vocab)}; differing (token, id) e.g. {differing}); speculative decoding needs the same "
            "tokenizer"
        )


@dataclass(eq=False)
class _Shadow:
    seq: Sequence  # the draft's copy: same token ids as the target's, own block table
    synced: int = 0  # target tokens known to equal the shadow's at the last sync


class DraftModelProposer(Proposer):
    runs_forwards = True

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        sampler: Sampler,
        dtype: torch.dtype,
        backend: Backend,
    ):
        caches = backend.allocate_kv_cache(model.config, num_blocks, block_size, dtype)
        logger.info(
            "draft model: %d layers, KV cache %d blocks (%.1f MiB)", model.config.num_layers, num_blocks,
            num_blocks * kv_cache.bytes_per_block(model.config, block_size, dtype) / 2**20,
        )  # fmt: skip
        # Prefix caching stays off: rolled-back drafts would leave registered blocks behind.
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, caches, block_size, sampler, backend)
        self.sampler = sampler
        self.vocab_size = sampler.vocab_size
        self.head_token_ids = model.head_token_ids  # None: the draft's head covers the whole vocabulary
        self.shadows: dict[int, _Shadow] = {}
        self._released: list[int] = []  # shadows released since the last forward (the runner drops their state)
        self._forward_costs: list[tuple[int, float]] = []

    @property
    def forward_costs(self) -> list[tuple[int, float]]:
        return self._forward_costs

    def lag(self, seq: Sequence) -> int:
        """Tokens of seq the draft has no KV for: what its next round must catch up on first."""
        shadow = self.shadows.get(seq.seq_id)
        return seq.num_tokens - (0 if shadow is None else min(shadow.seq.num_computed_tokens, shadow.synced))

    def release_finished(self, running: list[Sequence]) -> None:
        """Frees the draft KV of sequences that stopped running (finished, aborted or preempted)."""
        live = {s.seq_id for s in running}
        for seq_id in [i for i in self.shadows if i not in live]:
            shadow = self.shadows.pop(seq_id).seq
            self.block_manager.free_seq(shadow)
            self._released.append(shadow.seq_id)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """ks[i] draft tokens for seqs[i] (fewer when the draft's cache is full); for sampling
        requests also the draft's distributions they were drawn from."""
        self._forward_costs = []
        active = [(seq, self._sync(seq), k) for seq, k in zip(seqs, ks)]
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
        probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq in seqs}
        for step in range(max(ks, default=0)):
            active = [(seq, sh, k) for seq, sh, k in active if step < k]
            scheduled = []
            for entry in list(active):
                shadow = entry[1].seq
                n = shadow.num_uncomputed_tokens
                if not self.block_manager.allocate(shadow, n):  # draft cache full: this one stops here
                    active.remove(entry)
                    continue
                scheduled.append(shadow)
            if not scheduled:
                break
            size = sum(shadow.num_uncomputed_tokens for shadow in scheduled)
            t0 = time.perf_counter()
            logits = self._last_token_logits(scheduled)
            for shadow in scheduled:
                shadow.num_computed_tokens = shadow.num_tokens
            tokens, dists = self._sample(logits, scheduled)
            for i, (seq, synced, _) in enumerate(active):
                synced.seq.token_ids.append(tokens[i])
                drafts[seq.seq_id].append(tokens[i])
                if dists is not None and not seq.params.greedy:
                    probs[seq.seq_id].append(dists[i])
            self._forward_costs.append((size, time.perf_counter() - t0))
        return [
            Draft(drafts[seq.seq_id], torch.stack(probs[seq.seq_id]) if probs[seq.seq_id] else None) for seq in seqs
        ]

    def _last_token_logits(self, shadows: list[Sequence]) -> torch.Tensor:
        """The draft's logits after each shadow's last token, computing all its uncomputed tokens."""
        entries = [
            ScheduledSeq(
                seq_id=s.seq_id, request_id=s.request.request_id, start=s.num_computed_tokens,
                token_ids=s.token_ids[s.num_computed_tokens :], num_draft_tokens=0, block_table=s.block_table,
                seq_len=s.num_tokens, completes=True,
            )
            for s in shadows
        ]  # fmt: skip
        # The runner takes decodes first; the logits come back in the shadows' order.
        order = sorted(range(len(entries)), key=lambda i: entries[i].num_new_tokens > 1)
        batch = StepBatch([entries[i] for i in order], self._released)
        self._released = []
        logits = self.runner.last_token_logits(batch)
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        logits = logits[back.to(logits.device)]
        if self.head_token_ids is not None:
            full = logits.new_full((len(order), self.vocab_size), float("-inf"))
            full[:, self.head_token_ids] = logits
            return full
        # Embedding rows past the target's vocabulary (padding of a shared tokenizer) are never proposed.
        return logits[:, : self.vocab_size]

    def _sync(self, seq: Sequence) -> _Shadow:
        """The shadow of seq, truncated to the prefix it shares with the target and extended to match."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = _Shadow(Sequence(seq.request, seq.index, [], seq.num_prompt_tokens, seq.generator))
            self.shadows[seq.seq_id] = shadow
        own, target = shadow.seq.token_ids, seq.token_ids
        common = shadow.synced
        limit = min(len(own), len(target))
        while common < limit and own[common] == target[common]:
            common += 1
        # The draft's next token comes from its logits at the target's last token, so that one is
        # always (re)computed, even when the target happened to append the draft's own guess.
        common = min(common, len(target) - 1)
        shadow.seq.token_ids = list(target)
        shadow.synced = len(target)
        if shadow.seq.num_computed_tokens > common:
            shadow.seq.num_computed_tokens = common
            self.block_manager.trim(shadow.seq, common)
        return shadow

    def _sample(self, logits: torch.Tensor, shadows: list[Sequence]) -> tuple[list[int], torch.Tensor | None]:
        """Greedy requests take the draft's argmax; sampling requests draw from the draft's own
        distribution under their parameters and keep it (q) for the rejection test."""
        inputs = [SamplingInput(s.params, s.token_ids, s.num_prompt_tokens, s.generator) for s in shadows]
        processed = self.sampler.process(logits, inputs)
        tokens = greedy_tokens(processed)
        if all(s.params.greedy for s in inputs):
            return tokens.tolist(), None
        dists = self.sampler.probs(processed, inputs)
        dists = dists / dists.sum(dim=-1, keepdim=True)
        if dists.shape[1] < self.vocab_size:  # a draft with fewer embedding rows never proposes the rest
            dists = torch.nn.functional.pad(dists, (0, self.vocab_size - dists.shape[1]))
        sampled = self.sampler.draw(dists, inputs)
        is_greedy = torch.tensor([s.params.greedy for s in inputs], device=logits.device)
        return torch.where(is_greedy, tokens, sampled).tolist(), dists


def draft_blocks(target_blocks: int, block_size: int, max_model_len: int) -> int:
    """The draft holds as many tokens as the target's cache, and at least one full-length sequence."""
    return max(target_blocks, cdiv(max_model_len, block_size))
