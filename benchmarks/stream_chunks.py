"""The server's cost per streamed chunk: building its response body and the SSE line.

Each case streams 100 choices of 100 outputs (10,000 chunks) through `CompletionFormatter` or
`ChatFormatter` and `sse`, as `serving.py` does, with a stand-in tokenizer; logprobs cases
carry 5 alternatives per token. Runs are interleaved and the best is kept, so a busy machine
shows its quietest moment.

    PYTHONPATH=. python benchmarks/stream_chunks.py [--trials 100]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from jaxengine.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxengine.server.responses import ChatFormatter, CompletionFormatter, Formatter, sse

STEPS = 100  # outputs per choice
STREAMS = 100  # choices per case
BATCH = 5  # choices per timed run (short runs: the best of many is robust to noise)


class _Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return f" w{ids[0]}"


def _outputs(logprobs: bool) -> list[RequestOutput]:
    """One choice's outputs as the engine sends them: the text so far, one token longer each."""
    outs = []
    for k in range(1, STEPS + 1):
        entries = [{t: Logprob(-0.5, 1), **{t + j: Logprob(-1.0 - j, j + 1) for j in range(1, 6)}}
                   for t in range(k)] if logprobs else None
        c = CompletionOutput(0, "".join(f" w{t}" for t in range(k)), tuple(range(k)), None,
                             entries, "length" if k == STEPS else None, None)
        outs.append(RequestOutput("r", None, [1, 2, 3], [c], k == STEPS, RequestMetrics(0.0)))
    return outs


def _run(make: Callable[[], Formatter], outs: list[RequestOutput], logprobs: bool) -> float:
    """Seconds to stream BATCH choices."""
    start = time.perf_counter()
    for _ in range(BATCH):
        fmt = make()
        for body in fmt.first_chunks(1):
            sse(body)
        for out in outs:
            if (body := fmt.chunk(0, out, with_logprobs=logprobs)) is not None:
                sse(body)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100, help="timed runs per case")
    args = parser.parse_args()
    tok = _Tokenizer()
    cases = {
        "chat": (lambda: ChatFormatter(model="m", tokenizer=tok, request_id="chatcmpl-x"), False),
        "chat+logprobs": (lambda: ChatFormatter(model="m", tokenizer=tok, request_id="chatcmpl-x",
                                                top_logprobs=5), True),
        "completion": (lambda: CompletionFormatter(model="m", tokenizer=tok,
                                                   request_id="cmpl-x"), False),
        "completion+logprobs": (lambda: CompletionFormatter(model="m", tokenizer=tok,
                                                            request_id="cmpl-x"), True),
    }
    outs = {False: _outputs(False), True: _outputs(True)}
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.trials):
        for name, (make, logprobs) in cases.items():
            best[name] = min(best[name], _run(make, outs[logprobs], logprobs))
    chunks = STEPS * STREAMS
    each = {name: seconds * STREAMS / BATCH / chunks for name, seconds in best.items()}
    for name, seconds in each.items():
        print(f"{name:20s} {seconds * chunks * 1e3:7.1f} ms per {chunks} chunks "
              f"({seconds * 1e6:.2f} us each)")
    print(f"summary: a streamed chunk costs {each['chat'] * 1e6:.2f} us (chat), "
          f"{each['chat+logprobs'] * 1e6:.2f} us with 5 logprobs per token")


if __name__ == "__main__":
    main()
