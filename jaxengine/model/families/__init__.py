"""The decoder families the engine serves, by HF `model_type`.

Adding a family is adding a module here that builds a `Family` (its block, its config fields,
its tensor names) and listing it in `_FAMILIES`; the decoder, the loaders and the engine find it
through `family`.
"""

from __future__ import annotations

from jaxengine.model.config import ModelLoadError
from jaxengine.model.families.family import Family
from jaxengine.model.families.gemma import GEMMA
from jaxengine.model.families.llama import LLAMA
from jaxengine.model.families.moe import MOE

_FAMILIES = (LLAMA, GEMMA, MOE)
_BY_MODEL_TYPE = {t: f for f in _FAMILIES for t in f.model_types}
MODEL_TYPES: tuple[str, ...] = tuple(_BY_MODEL_TYPE)
GGUF_ARCHS: dict[str, str] = {a: t for f in _FAMILIES for a, t in f.gguf_archs.items()}
# a file of one of these architectures with experts is this model_type (Mixtral as "llama")
GGUF_EXPERT_ARCHS: dict[str, str] = {
    a: t for f in _FAMILIES for a, t in f.gguf_expert_archs.items()}


def family(model_type: str) -> Family:
    """The family registered under `model_type`.

    Raises:
        ModelLoadError: no family reads it; the message lists the ones that exist.
    """
    found = _BY_MODEL_TYPE.get(model_type)
    if found is None:
        raise ModelLoadError(f"unsupported architecture {model_type!r}; supported model_type "
                             f"values: {', '.join(MODEL_TYPES)}")
    return found


__all__ = ["GGUF_ARCHS", "GGUF_EXPERT_ARCHS", "MODEL_TYPES", "Family", "family"]
