"""vLLM's import path for the request parameters (`from vllm.sampling_params import
SamplingParams, StructuredOutputsParams`): the same names, defined where they live —
`SamplingParams` in the pure scheduler package (`scheduler/sampling_params.py`) and
`StructuredOutputsParams` with the grammars (`jaxengine/structured/params.py`)."""

from jaxengine.structured.params import StructuredOutputsParams
from scheduler.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError

__all__ = ["RequestOutputKind", "SamplingParams", "SamplingParamsError",
           "StructuredOutputsParams"]
