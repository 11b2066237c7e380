"""tachyllm: a fast, small LLM inference and serving engine on PyTorch."""

from tachyllm.entrypoints.llm import LLM
from tachyllm.outputs import CompletionOutput, RequestOutput
from tachyllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
