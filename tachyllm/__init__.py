"""tachyllm: a fast, small LLM inference and serving engine on PyTorch."""

from tachyllm.entrypoints.llm import LLM
from tachyllm.outputs import CompletionOutput, RequestOutput
from tachyllm.sampling_params import SamplingParams, StructuredOutputsParams
from tachyllm.version import __version__

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]
