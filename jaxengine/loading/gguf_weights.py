"""A GGUF file's matrices as their blocks, for `quantization="gguf"`: each weight's GGUF types
and its rows of blocks stacked as `load_weight` stacks floats, in the file's weight format
(`gguf_format`, which `load_gguf` hands to the loader and the model).

A weight of the model (module path, scanned layout) is held as blocks when every tensor behind
it is of a quantized type with a dequantizer (jaxengine_kernels/gguf_blocks.py); F32/F16/BF16
tensors stay floats. A projection whose layers mix types (llama.cpp's "_M" mixes: some layers'
`ffn_down` and `attn_v` Q6_K, the rest Q4_K) is one array in the slots of
`gguf_blocks.SlotLayout`, with each layer's type index beside it (`GGUFLinear`, and MoE
experts' `GGUFExperts`). Refused by name: a weight mixing float and quantized layers (it would
be served partly as floats).
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
from jaxengine.model.quant.gguf import GGUFFormat, qtype_name, row_bytes
from jaxengine.model.tensor_parallel import TPLayout
from jaxengine_kernels.gguf_blocks import slot_layout, to_slots

Q = gguf.GGMLQuantizationType


def gguf_weight_types(cfg: ModelConfig, source: GGUFSource, where: str
                      ) -> dict[Path, tuple[Q, ...]]:
    """The GGUF types of each weight of a model of `cfg` the file holds quantized, in the
    order of the first layer of each (one type for most weights).

    Raises:
        ModelLoadError: the layers of one weight are partly float, partly quantized, or a
            quantized type has no dequantizer; the message names the tensors and types.
    """
    fam, shapes = family(cfg.architecture), model_weight_shapes(cfg)
    types = {}
    for path, name in fam.hf_names(cfg).items():
        if path not in shapes:
            continue
        tensors = [t for _, _, t in stacked_tensors(
            name, shapes[path], functools.partial(fam.layer_lacks, cfg, path))
        ] if path[0] == "layers" else [name]
        kinds: dict[Q | None, str] = {}  # each type found -> the first tensor of it
        for tensor in tensors:
            kinds.setdefault(source.qtype(tensor), tensor)
        if len(kinds) > 1 and None in kinds:
            found = " and ".join(f"{t} is {'float' if k is None else k.name}"
                                 for k, t in kinds.items())
            raise ModelLoadError(
                f"{where}: quantization='gguf' holds a weight in blocks in every layer or in "
                f"none, but {found}; load with quantization=None to dequantize the file to "
                "floats")
        if None not in kinds:
            for tensor in kinds.values():
                source.blocks(tensor)  # refuses a type without a dequantizer, by name
            types[path] = tuple(kinds)
    return types


def load_blocks(path: Path, name: str, shape: tuple[int, ...], qtypes: tuple[Q, ...],
                source: GGUFSource, where: str, on_tensor: Callable[[], object] = lambda: None,
                lacks: Callable[[int], bool] = lambda layer: False
                ) -> tuple[np.ndarray, np.ndarray | None]:
    """The blocks of the weight at module `path` (float `shape` [..., I, O], or [V, D] for the
    embedding), checkpoint tensor `name` (`{layer}`, `{expert}` as `load_weight`'s), of GGUF
    types `qtypes`, and each layer's type when they are several.

    Returns:
        (rows, which): rows u8[..., O, row_bytes(I)] with layers on axis 0, then experts (a
        mix of types in `gguf_blocks.SlotLayout`'s slots); which i32[Ly] each layer's type as
        an index into `qtypes` for a mix, else None. A layer for which `lacks(layer)` holds
        zero blocks (type 0). `on_tensor()` is called after each tensor is read.
    Raises:
        ModelLoadError: a tensor is missing, of another type, or of the wrong shape.
    """
    # HF's [out, in] rows: the embedding's [V, D] as it is, a kernel [in, out] transposed
    rows, values = shape[-2:] if path[-1] == "embedding" else shape[:-3:-1]
    lead = () if path[0] != "layers" else shape[:-2]
    layout = slot_layout(qtypes)
    out = np.zeros((*lead, rows, row_bytes(values, qtypes)), np.uint8)
    which = np.zeros(lead[:1], np.int32) if len(qtypes) > 1 else None
    tensors = ([(None, None, name)] if path[0] != "layers"
               else stacked_tensors(name, shape, lacks))
    for layer, e, tensor in tensors:
        held = source.blocks(tensor)
        if (held is None or held[0] not in qtypes
                or held[1].shape != (rows, row_bytes(values, held[0]))):
            got = "missing" if held is None else f"{held[0].name} {held[1].shape}"
            raise ModelLoadError(f"{where}: tensor {tensor} is {got}, but the model holds "
                                 f"{'/'.join(t.name for t in qtypes)} rows of {values} "
                                 "values; the file does not match its own config")
        index = () if layer is None else (layer,) if e is None else (layer, e)
        out[index] = to_slots(held[1], held[0], layout)
        if which is not None:
            which[layer] = qtypes.index(held[0])
        on_tensor()
    return out, which


def gguf_format(cfg: ModelConfig, source: GGUFSource, where: str) -> GGUFFormat:
    """The weight format "gguf" of the file behind `source`: its quantized weights' types,
    each read as blocks laid out for the mesh.

    Raises:
        ModelLoadError: as `gguf_weight_types`.
    """
    types = gguf_weight_types(cfg, source, where)

    def read(path: Path, name: str, shape: tuple[int, ...], layout: TPLayout, *,
             lacks: Callable[[int], bool], on_tensor: Callable[[], object]
             ) -> dict[Path, np.ndarray]:
        rows, which = load_blocks(path, name, shape, types[path], source, where,
                                  on_tensor=on_tensor, lacks=lacks)
        arrays = {path: to_layout(path, rows, layout, cfg.head_dim, out_axis=-2)}
        if which is not None:
            arrays[(*path[:-1], qtype_name(path[-1]))] = which
        return arrays

    return GGUFFormat(types=types, read=read)
