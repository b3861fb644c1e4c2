"""The cost of a GGUF file whose layers mix types (docs/BENCHMARKS.md §2, "GGUF layers of
mixed types").

    python benchmarks/gguf_mixed.py [--repeats 2]

Writes two 30-layer files of random blocks at tiny sizes (D 256, F 512, the test files of
tests/jaxengine/model/quant/gguf_files.py): every matrix Q4_K, and llama.cpp's Q4_K_M mix
(attn_v and ffn_down Q6_K in the layers `use_more_bits` picks). For each file, scanned and
looped layers, a fresh child process loads it with quantization="gguf" and times lowering
(trace) and compiling the paged step of one 16-token bucket; then the bytes of its weights.
The cases alternate, `--repeats` rounds, so load from other work falls on all of them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [(f, layers) for layers in ("scanned", "looped") for f in ("Q4_K", "Q4_K_M")]


def one_case(path: Path, layers: str) -> str:
    """Trace and compile seconds of the step of the file at `path`, and its weights' MB."""
    import jax
    from flax import nnx

    from jaxengine.loading.gguf_file import (
        GGUFSource,
        gguf_metadata,
        open_gguf,
        read_gguf_config,
    )
    from jaxengine.loading.gguf_weights import gguf_format
    from jaxengine.loading.weights import load_weights
    from jaxengine.model.decoder import Model
    from jaxengine.model.step import RequestChunk
    from tests.fixtures.model_helpers import PagedRunner, pack_batch

    reader = open_gguf(str(path))
    cfg = read_gguf_config(reader, gguf_metadata(reader))
    fmt = gguf_format(cfg, GGUFSource(reader, cfg, str(path)), str(path))
    weights = load_weights(cfg, GGUFSource(reader, cfg, str(path)), dtype=jax.numpy.float32,
                           where=str(path), quantization=fmt, progress=False)
    model = Model(cfg, weights=weights, scan_layers=layers == "scanned", quantization=fmt)
    mb = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))) / 1e6
    runner = PagedRunner(model)
    batch = pack_batch([RequestChunk(token_ids=[1, 2, 3], start=0, block_table=[1])],
                       num_tokens=16, max_seqs=4, max_blocks=16, block_size=4)
    start = time.perf_counter()
    lowered = runner.step.lower(runner.state, runner.kv, batch)
    traced = time.perf_counter()
    lowered.compile()
    return (f"trace {traced - start:.2f} s, compile {time.perf_counter() - traced:.2f} s, "
            f"weights {mb:.2f} MB")


def write_files(folder: Path) -> None:
    """The uniform and the Q4_K_M file, 30 layers each."""
    import gguf

    from tests.jaxengine.model.quant.gguf_files import blocks_config, k_m_types, write_blocks_gguf

    cfg = blocks_config(num_layers=30)
    write_blocks_gguf(folder / "Q4_K.gguf", cfg, gguf.GGMLQuantizationType.Q4_K)
    write_blocks_gguf(folder / "Q4_K_M.gguf", cfg, gguf.GGMLQuantizationType.Q4_K,
                      types=k_m_types(cfg))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--case", nargs=2, metavar=("FILE", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(one_case(Path(args.case[0]), args.case[1]), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        write_files(Path(tmp))
        for _ in range(args.repeats):
            for name, layers in CASES:
                out = subprocess.run(
                    [sys.executable, __file__, "--case", f"{tmp}/{name}.gguf", layers],
                    capture_output=True, text=True, check=True, cwd=ROOT,
                    env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
                print(f"{name:7s} {layers:8s} {out.stdout.strip().splitlines()[-1]}",
                      flush=True)


if __name__ == "__main__":
    main()
