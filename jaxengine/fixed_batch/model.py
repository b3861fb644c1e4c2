"""The model as `generate` and `score` take it: `ModelFns` and the tokenizer, from a path or an
`LLM`.

`load_model_fns(path)` loads a model for jit research code alone, as `LLM(path)` would load it
(the same weights, dtype and attention kernel) but with no engine and no KV pool;
`model_fns_of(llm)` shares a running `LLM`'s weights instead of loading them again.
"""

from __future__ import annotations

from typing import Any

from jaxengine.config import resolve_dtype
from jaxengine.engine import build
from jaxengine.engine.args import EngineArgs
from jaxengine.loading.load import load_model
from jaxengine.loading.tokenizer import Tokenizer
from jaxengine.model.fns import ModelFns
from jaxengine.model.mesh import engine_devices, make_mesh


def load_model_fns(path: str | None = None, *, dtype: str = "float32",
                   tensor_parallel_size: int = 1, attention_backend: str | None = None,
                   block_size: int = 16, progress: bool | None = None,
                   quantization: str | None = None) -> tuple[ModelFns, Tokenizer]:
    """Load a model's pure functions and tokenizer for `generate` / `score` (never downloads).

    Args:
      path: an HF model directory or a .gguf file; None: the embedded SmolLM2-135M-Instruct.
      dtype: "float32", "bfloat16" or "auto" (= float32), for weights, activations and the
        KV cache.
      tensor_parallel_size: the model is split over the first this many devices ("tp").
      attention_backend: the engine's `attention_backend` ("reference", "cpu", "tpu", "gpu");
        None: the platform's kernel, as `LLM` picks it.
      block_size: the page size the kernel is checked for; pass the same to `generate`.
      progress: a bar over the tensors read; None: only when stderr is a terminal.
      quantization: the weights' format, as `LLM`'s: None (float), "int8" or "fp8".
    Returns:
      (ModelFns, Tokenizer); the functions' `eos_token_ids` are the tokenizer's (where
      `generate` stops by default).
    Raises:
      ModelLoadError (a ValueError): a bad path or files.
      ValueError: a kernel that cannot run the model's shapes, or a bad dtype / tp size /
        quantization.
    """
    args = EngineArgs(model=path, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                      attention_backend=attention_backend, block_size=block_size,
                      quantization=quantization)
    mesh = make_mesh(engine_devices(tensor_parallel_size))
    model, cfg, tokenizer = load_model(path, dtype=resolve_dtype(args.dtype), mesh=mesh,
                                       progress=progress, quantization=args.quantization)
    fns = build.model_fns(model, cfg, attn_impl=build.attention_backend(args, cfg),
                          eos_token_ids=tokenizer.eos_token_ids)
    return fns, tokenizer


def model_fns_of(llm: Any) -> tuple[ModelFns, Any]:
    """The pure functions and tokenizer of a running `LLM`'s model (no copy of the weights).

    With `data_parallel_size` > 1 this is replica 0's model. `generate` and `score` allocate
    their own KV cache beside the engine's pool, which keeps its memory. After
    `llm.update_weights(params)` it returns the same functions with the new weights (a
    `ModelFns` taken before keeps the old ones; the programs compiled for it still serve).

    Args:
      llm: a `jaxengine.LLM`.
    Returns:
      (ModelFns, the LLM's tokenizer or None); the functions' `eos_token_ids` are the
      tokenizer's (none with `skip_tokenizer_init=True`).
    """
    return llm.llm_engine.replicas[0].runner.model, llm.get_tokenizer()
