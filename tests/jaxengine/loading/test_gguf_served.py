"""`quantization="gguf"`: a GGUF file served from its blocks gives the outputs of the same file
dequantized to float32, for each type, scanned and looped, on a mesh, with experts; the default
model's greedy tokens and logprobs, through the paged step, `LLM` and generate/score."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from flax import nnx

from jaxengine.engine.args import EngineArgs
from jaxengine.loading import load_model
from jaxengine.loading.gguf_file import GGUFSource, gguf_metadata, open_gguf, read_gguf_config
from jaxengine.loading.gguf_weights import gguf_format
from jaxengine.loading.weights import load_weights
from jaxengine.model.config import ModelLoadError
from jaxengine.model.decoder import Model
from jaxengine.model.quant.gguf import GGUFEmbedder, GGUFExperts, GGUFLinear
from jaxengine.model.step import RequestChunk
from tests.fixtures.model_helpers import FIXTURES, PagedRunner
from tests.jaxengine.loading.test_load import write_gguf
from tests.jaxengine.model.quant.gguf_files import blocks_config, k_m_types, write_blocks_gguf
from tests.parallel_helpers import run_python

Q = gguf.GGMLQuantizationType
PROMPT = [1, 17, 42, 99, 5, 64, 3, 120, 7]


def _logits(model: Model) -> np.ndarray:
    """f32[len(PROMPT), V] logits of PROMPT through shuffled pages."""
    runner = PagedRunner(model)
    return runner.run([RequestChunk(token_ids=PROMPT, start=0, block_table=[3, 1, 2])],
                      num_tokens=16)[0]


def _held(model: Model) -> set[type]:
    """The GGUF module types in `model`."""
    return {type(m) for _, m in nnx.iter_graph(model)
            if isinstance(m, GGUFLinear | GGUFEmbedder | GGUFExperts)}


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_each_type_serves_as_its_float_load(tmp_path: Path, qtype: Q) -> None:
    path = tmp_path / "m.gguf"
    write_blocks_gguf(path, blocks_config(), qtype)
    floats, _, _ = load_model(path, with_tokenizer=False)
    blocks, _, _ = load_model(path, with_tokenizer=False, quantization="gguf")
    assert _held(blocks) == {GGUFLinear, GGUFEmbedder}
    want, got = _logits(floats), _logits(blocks)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


def _logprobs(logits: np.ndarray) -> np.ndarray:
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
                           ) - logits.max(-1, keepdims=True)


def test_a_q4_k_m_mix_serves_as_its_float_load_looped_and_scanned(tmp_path: Path) -> None:
    """llama.cpp's Q4_K_M per-layer types (attn_v Q5_0/Q8_0, ffn_down Q4_K/Q6_K: layer 1 the
    wider) with a Q8_0 embedding: greedy tokens and logprobs of the float32 load, from the
    blocks both in looped layers and in one scan."""
    path, cfg = tmp_path / "m.gguf", blocks_config()
    types = k_m_types(cfg, v=(Q.Q5_0, Q.Q8_0))
    write_blocks_gguf(path, cfg, Q.Q4_K, types=types | {"token_embd.weight": Q.Q8_0})
    reader = open_gguf(str(path))
    cfg = read_gguf_config(reader, gguf_metadata(reader))
    fmt = gguf_format(cfg, GGUFSource(reader, cfg, str(path)), str(path))
    weights = load_weights(cfg, GGUFSource(reader, cfg, str(path)), dtype=np.float32,
                           where=str(path), quantization=fmt)
    scanned = Model(cfg, weights=weights, scan_layers=True, quantization=fmt)
    assert scanned.layers.mlp.down_proj.kernel_qtype[...].tolist() == [0, 1]
    looped, _, _ = load_model(path, with_tokenizer=False, quantization="gguf")
    floats, _, _ = load_model(path, with_tokenizer=False)
    want = _logits(floats)
    for model in (looped, scanned):
        got = _logits(model)
        assert (got.argmax(-1) == want.argmax(-1)).all()
        np.testing.assert_allclose(_logprobs(got), _logprobs(want), rtol=0, atol=1e-3)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_experts_serve_from_their_blocks(tmp_path: Path) -> None:
    """Q8_0 experts whose down projections mix types across layers (Q8_0, then Q4_0), as
    llama.cpp's Q4_K_M recipe mixes `ffn_down_exps`."""
    path = tmp_path / "m.gguf"
    write_gguf(FIXTURES / "tiny" / "qwen2_moe", path, "qwen2moe", experts_as=Q.Q8_0,
               types={"blk.2.ffn_down_exps.weight": Q.Q4_0})
    floats, _, _ = load_model(path, with_tokenizer=False)
    blocks, _, _ = load_model(path, with_tokenizer=False, quantization="gguf")
    assert _held(blocks) == {GGUFExperts}  # the rest of the file is F32
    experts = blocks.layers[2].moe.experts
    assert experts.layouts[2].qtypes == ("Q8_0", "Q4_0") and experts.down_proj_qtype[...] == 1
    np.testing.assert_allclose(_logits(blocks), _logits(floats), rtol=0, atol=1e-5)


def test_experts_partly_quantized_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"  # Mixtral's down rows (F=16) are not whole blocks: left F32
    write_gguf(FIXTURES / "tiny" / "mixtral_moe", path, "llama", experts_as=Q.Q8_0)
    with pytest.raises(ValueError, match="gate, up and down all quantized or all float, but "
                       "the file has Q8_0, Q8_0, float"):
        load_model(path, with_tokenizer=False, quantization="gguf")


def test_bad_files_and_values_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_blocks_gguf(path, blocks_config(), Q.Q8_0, types={
        "blk.0.ffn_up.weight": Q.TQ2_0, "blk.1.ffn_up.weight": Q.TQ2_0})
    with pytest.raises(ModelLoadError, match="blk.0.ffn_up.weight is TQ2_0, which "
                       "quantization='gguf' does not serve"):
        load_model(path, with_tokenizer=False, quantization="gguf")
    load_model(path, with_tokenizer=False)  # the float load dequantizes any type gguf reads
    with pytest.raises(ModelLoadError, match="mistral_gqa: quantization='gguf' serves the "
                       "blocks of a .gguf file, and this is an HF directory"):
        load_model(FIXTURES / "tiny" / "mistral_gqa", quantization="gguf")
    with pytest.raises(ValueError, match="quantization='gguf' serves the blocks of a .gguf"):
        Model(blocks_config(), quantization="gguf")  # no file: never zero blocks


def test_the_knob_takes_gguf() -> None:
    assert EngineArgs(quantization="gguf").quantization == "gguf"
    with pytest.raises(ValueError, match="quantization must be one of int8, fp8, gguf; got 'awq'"):
        EngineArgs(quantization="awq")


MESH_CHECK = """
import gguf, jax, numpy as np
from pathlib import Path
from jaxengine.engine.args import EngineArgs
from jaxengine.loading import load_model
from jaxengine.model.mesh import make_mesh
from jaxengine.model.step import RequestChunk
from tests.fixtures.model_helpers import PagedRunner
from tests.jaxengine.model.quant.gguf_files import blocks_config, k_m_types, write_blocks_gguf
Q = gguf.GGMLQuantizationType
path = Path({tmp!r}) / "m.gguf"
# N*H 512, F 1024: o and down split in whole 256-value blocks over tp=2; the vocabulary
# 126 padded to 128; v and down of llama.cpp's Q4_K_M mix (layer 1 the wider type)
cfg = blocks_config(hidden_size=512, intermediate_size=1024, num_heads=8, vocab_size=126)
write_blocks_gguf(path, cfg, Q.Q4_K, types=k_m_types(cfg, v=(Q.Q5_0, Q.Q8_0)) | {{
    "token_embd.weight": Q.Q8_0}})
def logits(model):
    return PagedRunner(model).run([RequestChunk(token_ids=[1, 5, 9, 3], start=0,
                                                block_table=[1, 2])], num_tokens=8)[0]
one, _, _ = load_model(path, with_tokenizer=False, quantization="gguf")
two, _, _ = load_model(path, with_tokenizer=False, quantization="gguf",
                       mesh=make_mesh(jax.devices()[:2]))
assert two.layers[1].mlp.down_proj.layout.qtypes == ("Q4_K", "Q6_K")  # split in slots
a, b = logits(one), logits(two)
np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(a).max())
assert (a.argmax(-1) == b.argmax(-1)).all()
small = Path({tmp!r}) / "small.gguf"
write_blocks_gguf(small, blocks_config(), Q.Q4_K)  # hidden 256: o_proj's 128 per device
try:
    load_model(small, with_tokenizer=False, quantization="gguf",
               mesh=make_mesh(jax.devices()[:2]))
    raise AssertionError("not refused")
except ValueError as e:
    assert "cannot be split over tensor_parallel_size=2" in str(e), e
print("ok")
"""


def test_on_a_mesh_of_two_the_outputs_of_one(tmp_path: Path) -> None:
    out = run_python(MESH_CHECK.format(tmp=str(tmp_path)), num_devices=2, timeout=300)
    assert out.strip().endswith("ok")


EXPERTS_MESH_CHECK = """
import gguf, jax, numpy as np
from pathlib import Path
from jaxengine.loading import load_model
from jaxengine.model.mesh import make_mesh
from jaxengine.model.step import RequestChunk
from tests.fixtures.model_helpers import FIXTURES, PagedRunner
from tests.jaxengine.loading.test_load import write_gguf
path = Path({tmp!r}) / "m.gguf"
Q = gguf.GGMLQuantizationType
write_gguf(FIXTURES / "tiny" / "qwen2_moe", path, "qwen2moe", experts_as=Q.Q8_0,
           types={{"blk.2.ffn_down_exps.weight": Q.Q4_0}})  # down of mixed types
def logits(model):
    return PagedRunner(model).run([RequestChunk(token_ids=[1, 5, 9, 3, 7], start=0,
                                                block_table=[1, 2])], num_tokens=8)[0]
two = make_mesh(jax.devices()[:2])
one, _, _ = load_model(path, with_tokenizer=False, quantization="gguf")
ep, _, _ = load_model(path, with_tokenizer=False, quantization="gguf", mesh=two,
                      expert_parallel=True)
shard = ep.layers[1].moe.experts.down_proj[...].addressable_shards[0].data.shape
np.testing.assert_allclose(logits(one), logits(ep), rtol=0, atol=1e-5)
try:  # F=32 over tp=2 is 16 values a device: not whole 32-value Q8_0 blocks
    load_model(path, with_tokenizer=False, quantization="gguf", mesh=two)
    raise AssertionError("not refused")
except ValueError as e:
    assert "use enable_expert_parallel" in str(e), e
print(shard)
"""


@pytest.mark.slow  # ~25 s: a child process on two virtual devices
def test_experts_on_a_mesh_of_two(tmp_path: Path) -> None:
    """Expert parallel: each device holds 4 of the 8 experts' blocks whole (down's layers of
    mixed types in slots of Q8_0's bytes), and the outputs are one device's; split over F, the
    down projection's rows are not whole blocks."""
    out = run_python(EXPERTS_MESH_CHECK.format(tmp=str(tmp_path)), num_devices=2, timeout=300)
    assert out.strip().splitlines()[-1] == "(4, 32, 34)"  # [E/tp, D, row_bytes(F)]
