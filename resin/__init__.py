"""Resin: an LLM inference engine with a hardware abstraction layer."""
from resin.core.outputs import CompletionOutput, Logprob, RequestOutput
from resin.core.sampling_params import SamplingParams
from resin.core.structured_output import StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in the model stack; import it on first use so `import resin` stays light.
    if name == "LLM":
        from resin.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
