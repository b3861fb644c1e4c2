"""A GGUF file's matrices as their blocks, for `quantization="gguf"`: each weight's GGUF type
and its rows of blocks stacked as `load_weight` stacks floats, in the file's weight format
(`gguf_format`, which `load_gguf` hands to the loader and the model).

A weight of the model (module path, scanned layout) is held as blocks when every tensor behind
it is of one quantized type (jaxengine_kernels/gguf_blocks.py); F32/F16/BF16 tensors stay
floats. A stacked weight is one array, so its layers must share a type: a file that mixes
types across the layers of one weight (llama.cpp's "_M" mixes do, for some `ffn_down` and
`attn_v`) is refused by name rather than served partly as floats.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import gguf
import numpy as np

from jaxengine.loading.gguf_file import GGUFSource
from jaxengine.loading.weights import model_weight_shapes, stacked_tensors, to_layout
from jaxengine.model.config import ModelConfig, ModelLoadError
from jaxengine.model.families import family
from jaxengine.model.families.family import Path
from jaxengine.model.quant.gguf import GGUFFormat, row_bytes
from jaxengine.model.tensor_parallel import TPLayout

Q = gguf.GGMLQuantizationType


def gguf_weight_types(cfg: ModelConfig, source: GGUFSource, where: str
                      ) -> dict[Path, Q]:
    """The GGUF type of each weight of a model of `cfg` the file holds quantized.

    Raises:
        ModelLoadError: the layers (or experts) of one weight are of different types, or of
            a quantized type without a dequantizer; the message names the tensors and types.
    """
    fam, shapes = family(cfg.architecture), model_weight_shapes(cfg)
    types = {}
    for path, name in fam.hf_names(cfg).items():
        if path not in shapes:
            continue
        tensors = [t for _, _, t in stacked_tensors(
            name, shapes[path], functools.partial(fam.layer_lacks, cfg, path))
        ] if path[0] == "layers" else [name]
        found = {t: source.qtype(t) for t in tensors}
        kinds: dict[str, str] = {}  # each type found -> the first tensor of it
        for tensor, qtype in found.items():
            kinds.setdefault("float" if qtype is None else qtype.name, tensor)
        if len(kinds) > 1:
            raise ModelLoadError(
                f"{where}: quantization='gguf' holds each stacked weight in one type, but "
                f"{' and '.join(f'{t} is {k}' for k, t in kinds.items())}; load with "
                "quantization=None to dequantize the file to floats")
        qtype = next(iter(found.values()), None)
        if qtype is not None:
            source.blocks(tensors[0])  # refuses a type without a dequantizer, by name
            types[path] = qtype
    return types


def load_blocks(path: Path, name: str, shape: tuple[int, ...], qtype: Q, source: GGUFSource,
                where: str, on_tensor: Callable[[], object] = lambda: None,
                lacks: Callable[[int], bool] = lambda layer: False) -> np.ndarray:
    """The blocks of the weight at module `path` (float `shape` [..., I, O], or [V, D] for the
    embedding), checkpoint tensor `name` (`{layer}`, `{expert}` as `load_weight`'s), in
    u8[..., O, row_bytes(I)] with layers on axis 0, then experts; a layer for which
    `lacks(layer)` holds zero blocks. `on_tensor()` is called after each tensor is read.

    Raises:
        ModelLoadError: a tensor is missing, of another type, or of the wrong shape.
    """
    # HF's [out, in] rows: the embedding's [V, D] as it is, a kernel [in, out] transposed
    rows, values = shape[-2:] if path[-1] == "embedding" else shape[:-3:-1]
    lead = () if path[0] != "layers" else shape[:-2]
    out = np.zeros((*lead, rows, row_bytes(values, qtype)), np.uint8)
    tensors = ([(None, None, name)] if path[0] != "layers"
               else stacked_tensors(name, shape, lacks))
    for layer, e, tensor in tensors:
        held = source.blocks(tensor)
        if held is None or held[0] != qtype or held[1].shape != out.shape[len(lead):]:
            got = "missing" if held is None else f"{held[0].name} {held[1].shape}"
            raise ModelLoadError(f"{where}: tensor {tensor} is {got}, but the model holds "
                                 f"{qtype.name} {out.shape[len(lead):]}; the file does not "
                                 "match its own config")
        index = () if layer is None else (layer,) if e is None else (layer, e)
        out[index] = held[1]
        on_tensor()
    return out


def gguf_format(cfg: ModelConfig, source: GGUFSource, where: str) -> GGUFFormat:
    """The weight format "gguf" of the file behind `source`: its quantized weights' types,
    each read as blocks laid out for the mesh.

    Raises:
        ModelLoadError: as `gguf_weight_types`.
    """
    types = gguf_weight_types(cfg, source, where)

    def read(path: Path, name: str, shape: tuple[int, ...], layout: TPLayout, *,
             lacks: Callable[[int], bool], on_tensor: Callable[[], object]) -> np.ndarray:
        rows = load_blocks(path, name, shape, types[path], source, where, on_tensor=on_tensor,
                           lacks=lacks)
        return to_layout(path, rows, layout, cfg.head_dim, out_axis=-2)

    return GGUFFormat(types=types, read=read)
