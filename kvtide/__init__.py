"""kvtide: LLM inference and serving with a paged KV cache and continuous batching."""

from kvtide.lora.request import LoRARequest
from kvtide.outputs import CompletionOutput, Logprob, RequestOutput
from kvtide.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it on first use so `import kvtide` stays light.
    if name == "LLM":
        from kvtide.llm import LLM

        return LLM
    raise AttributeError(name)
