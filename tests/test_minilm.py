"""The real all-MiniLM-L6-v2 (a sentence-transformers folder) against sentence-transformers' own encode."""

from __future__ import annotations

import pytest
import torch
from helpers.minilm import corpus_sentences, minilm_path

from tachyllm import LLM

# The sentence-transformers reference in fp32 against tachyllm in each dtype: the cosine each must reach.
MIN_COSINE = {"float32": 0.99999, "bfloat16": 0.999}


@pytest.fixture(scope="module")
def reference() -> tuple[list[str], torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    sentences = corpus_sentences(100)
    model = SentenceTransformer(str(minilm_path()), device="cpu")
    return sentences, model.encode(sentences, batch_size=32, convert_to_tensor=True).float()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(MIN_COSINE))
def test_minilm_matches_sentence_transformers(reference: tuple[list[str], torch.Tensor], dtype: str) -> None:
    sentences, expected = reference
    llm = LLM(model=str(minilm_path()), dtype=dtype)
    assert llm.engine.runner_type == "pooling"
    outputs = llm.embed(sentences)
    embeddings = torch.tensor([o.outputs.embedding for o in outputs])
    assert embeddings.shape == expected.shape == (100, 384)
    # Varied lengths, not one padded length: tokenizer.json's own padding to 128 must not leak in.
    assert len({len(o.prompt_token_ids) for o in outputs}) > 10
    cosine = torch.nn.functional.cosine_similarity(embeddings, expected, dim=-1)
    assert cosine.min().item() >= MIN_COSINE[dtype], f"worst sentence: {sentences[int(cosine.argmin())]!r}"
    assert torch.allclose(embeddings.norm(dim=-1), torch.ones(100), atol=1e-3)  # the Normalize module
