"""duet: a disaggregated prefill/decode LLM engine. Offline API: ``from duet import LLM, SamplingParams``."""

from duet.outputs import CompletionOutput, RequestOutput
from duet.sampling_params import SamplingParams
from duet.structured_output import StructuredOutputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # The engine imports torch and transformers: load it only when asked for.
    if name == "LLM":
        from duet.llm import LLM

        return LLM
    raise AttributeError(f"module 'duet' has no attribute {name!r}")
