"""What structured outputs cost on the host: compile time, and mask filling per token.

    python -m jaxengine.structured.cost [--steps 200] [--rows 64]

With the embedded SmolLM2 tokenizer (49152 tokens) and random logits: for each kind, the time to
compile a grammar not yet cached, then a generation loop (fill the row, argmax of the masked
random logits, accept the token) that times the fill and the accept of every token; and the
fill of a whole step's bitmask for `--rows` requests at once, serially and with llguidance's
thread pool. Figures are medians in microseconds (docs/DESIGN.md, "Structured outputs").
"""

import argparse
import statistics
import time
from dataclasses import dataclass

import numpy as np

from jaxengine.loading import load_tokenizer
from jaxengine.structured.bitmask import allocate_bitmask, fill_bitmasks
from jaxengine.structured.compiler import GrammarCompiler
from jaxengine.structured.params import StructuredOutputsParams


@dataclass(frozen=True, slots=True, kw_only=True)
class GrammarCost:
    """Host costs of one grammar (times in microseconds)."""

    compile_us: float  # a cache miss: submit to the compiled grammar in hand
    fill_us: float  # median, one row, per token
    accept_us: float  # median, per token
    num_tokens: int  # tokens generated (until the grammar ended or `steps`)


def measure(compiler: GrammarCompiler, params: StructuredOutputsParams, *, steps: int = 200,
            seed: int = 0) -> GrammarCost:
    """Compile `params` (it must not be cached yet) and generate up to `steps` tokens."""
    t = time.perf_counter()
    matcher = compiler.compile(params).matcher()
    compile_us = (time.perf_counter() - t) * 1e6
    rng = np.random.default_rng(seed)
    mask = allocate_bitmask(1, compiler.vocab_size)
    fills, accepts = [], []
    for _ in range(steps):
        t = time.perf_counter()
        fill_bitmasks([matcher], mask)
        fills.append(time.perf_counter() - t)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:compiler.vocab_size]
        logits = rng.standard_normal(compiler.vocab_size).astype(np.float32)
        token = int(np.where(allowed.astype(bool), logits, -np.inf).argmax())
        t = time.perf_counter()
        matcher.accept_tokens([token])
        accepts.append(time.perf_counter() - t)
        if matcher.is_terminated:
            break
    return GrammarCost(compile_us=compile_us, fill_us=statistics.median(fills) * 1e6,
                       accept_us=statistics.median(accepts) * 1e6, num_tokens=len(fills))


def batch_fill_us(compiler: GrammarCompiler, params: StructuredOutputsParams, *, rows: int,
                  repeat: int = 20, parallel: bool) -> float:
    """Median time to fill a step's bitmask of `rows` requests at the start of the grammar."""
    matchers = [compiler.compile(params).matcher() for _ in range(rows)]
    out = allocate_bitmask(rows, compiler.vocab_size)
    executor = compiler.executor if parallel else None
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fill_bitmasks(matchers, out, executor)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _large_schema(num_properties: int) -> dict:
    kinds = ({"type": "string", "maxLength": 30}, {"type": "integer", "minimum": 0},
             {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "number"}})
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(num_properties)}
    return {"type": "object", "properties": props, "required": list(props)}


def main(argv: list[str] | None = None) -> None:
    """Print the figures for each kind, with SmolLM2's tokenizer."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(None)
    t = time.perf_counter()
    compiler = GrammarCompiler(tokenizer)
    print(f"tokenizer for llguidance: {(time.perf_counter() - t) * 1e3:.0f} ms, "
          f"V = {compiler.vocab_size}")
    cases = {
        "json schema": StructuredOutputsParams(json={
            "type": "object", "required": ["name", "age"],
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}),
        "json schema, 400 fields": StructuredOutputsParams(json=_large_schema(400)),
        "json_object": StructuredOutputsParams(json_object=True),
        "regex": StructuredOutputsParams(regex=r"([a-z]+ ){3,40}[0-9]{1,4}"),
        "choice": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
    }
    for name, params in cases.items():
        c = measure(compiler, params, steps=args.steps)
        serial = batch_fill_us(compiler, params, rows=args.rows, parallel=False)
        par = batch_fill_us(compiler, params, rows=args.rows, parallel=True)
        print(f"{name:24s} compile {c.compile_us / 1e3:7.2f} ms   fill {c.fill_us:6.1f} us/token"
              f"   accept {c.accept_us:5.1f} us/token ({c.num_tokens} tokens)   "
              f"{args.rows} rows: {serial:7.0f} us serial, {par:7.0f} us parallel")
    compiler.shutdown()


if __name__ == "__main__":
    main()
