"""The `jaxengine` command: generate | chat | serve | proxy | bench | replay | export-tokenizer,
and the lab's calibrate | simulate | tune | workload (docs/LAB.md; their parsers and runners are
in `jaxengine/lab/commands.py`).

Engine flags are generated from the `EngineArgs` dataclass, `serve`'s HTTP flags (`--api-key`,
...) from `FrontendArgs` (`jaxengine/flags.py`), so the CLI never drifts from the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import scheduler
from jaxengine import streaming
from jaxengine.engine.args import EngineArgs
from jaxengine.flags import (
    add_engine_flags,
    add_flags,
    args_from,
    engine_args_from,
    policy_argument,
)
from jaxengine.lab import commands as lab_commands
from jaxengine.llm import LLM
from jaxengine.loading import load_tokenizer
from jaxengine.server.args import FrontendArgs, LoRAModulePath, parse_lora_module
from jaxengine.server.run import serve
from scheduler import SamplingParams
from scheduler.replay import main as replay_main

BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "throughput.py"


# ---- sampling flags ------------------------------------------------------------------------

_MODEL_DEFAULT = "default: the model's generation_config.json, else"


def add_sampling_flags(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    """Flags for `SamplingParams` (per request; the engine's --seed seeds unseeded requests).
    A flag not given keeps the model's default (`LLM.get_default_sampling_params()`)."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"most tokens to generate (default: {max_tokens})")
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS before this many tokens")
    g.add_argument("--temperature", type=float, default=None,
                   help=f"0 = greedy ({_MODEL_DEFAULT} 1.0)")
    g.add_argument("--top-p", type=float, default=None, help=f"nucleus mass ({_MODEL_DEFAULT} 1.0)")
    g.add_argument("--top-k", type=int, default=None, help=f"0 = off ({_MODEL_DEFAULT} 0)")
    g.add_argument("--min-p", type=float, default=None, help=f"0 = off ({_MODEL_DEFAULT} 0.0)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeat for several)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request seed (default: derived from the engine's --seed)")


def sampling_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    """The `SamplingParams` fields the sampling flags set, checked now (before any model
    loads): a bad value raises `SamplingParamsError` naming the flag's field."""
    given = dict(max_tokens=ns.max_tokens, min_tokens=ns.min_tokens, temperature=ns.temperature,
                 top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p, stop=tuple(ns.stop),
                 ignore_eos=ns.ignore_eos, seed=ns.sampling_seed)
    given = {k: v for k, v in given.items() if v is not None or k == "seed"}
    SamplingParams(**given)
    return given


# ---- the parser ----------------------------------------------------------------------------

def lora_module_argument(text: str) -> LoRAModulePath:
    """`parse_lora_module` as an argparse `type`: its error is the flag's message."""
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    """The `jaxengine` parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="jaxengine", description="A JAX-native LLM serving engine (vLLM-V1 batching).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="complete prompts offline and print the text",
                         description="Generate completions for PROMPTs with continuous "
                                     "batching; prints one completion per prompt, in prompt "
                                     "order, streamed as it is produced.")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt (text, token ids, finish reason), "
                          "not streamed")
    add_sampling_flags(gen, max_tokens=64)
    add_engine_flags(gen)

    chat = sub.add_parser("chat", help="interactive chat on stdin/stdout",
                          description="Read user turns from stdin (one per line), stream each "
                                      "reply; the conversation and the chat template are kept. "
                                      "Ctrl-C during a reply aborts it; end with EOF (Ctrl-D) "
                                      "or /exit.")
    chat.add_argument("--system", default=None, help="a system message to start with")
    add_sampling_flags(chat, max_tokens=256)
    add_engine_flags(chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Serve MODEL over /v1/completions, /v1/chat/completions "
                                       "(SSE streaming), /v1/models, /health and /metrics.")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="HF directory or .gguf file (default: the embedded SmolLM2)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="interface to listen on (default: %(default)s; 0.0.0.0 for all)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients use (default: the model path)")
    serve.add_argument("--log-interval", type=float, default=10.0,
                       help="seconds between throughput log lines, 0: none (default: 10)")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"),
                       help="log level of uvicorn and jaxengine (default: info)")
    serve.add_argument("--headless", action="store_true",
                       help="multi-host: serve no HTTP, follow process 0's engine step by step "
                            "(processes 1 .. N-1; process 0 serves)")
    serve.add_argument("--lora-modules", nargs="+", type=lora_module_argument, default=(),
                       metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) to serve under their own model "
                            "names, as name=path or JSON '{\"name\": ..., \"path\": ..., "
                            "\"base_model_name\": ...}' (vLLM's forms); needs --enable-lora")
    add_flags(serve.add_argument_group("HTTP server (FrontendArgs)"), FrontendArgs)
    add_engine_flags(serve)

    proxy = sub.add_parser(
        "proxy", help="prefill/decode disaggregation proxy (OpenAI-compatible)",
        description="Send each /v1/completions and /v1/chat/completions request to a prefill "
                    "instance (serve --kv-transfer-config '{\"kv_role\": \"kv_producer\"}') "
                    "with max_tokens=1, then to a decode instance (kv_consumer) with the KV "
                    "handle it returned, streaming the decode instance's answer through.")
    proxy.add_argument("--host", default="127.0.0.1",
                       help="interface to listen on (default: %(default)s)")
    proxy.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                       help="prefill instances' base URLs, e.g. http://127.0.0.1:8100")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL",
                       help="decode instances' base URLs")
    proxy.add_argument("--uvicorn-log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"),
                       help="uvicorn's log level (default: info)")

    bench = sub.add_parser(
        "bench", help="replay a workload for real (--workload), else benchmarks/throughput.py",
        description="With --workload: replay WORKLOAD.json online on a real engine (each "
                    "request added at its arrival_time) and write the per-request results "
                    "(docs/LAB.md). Without it: run benchmarks/throughput.py, passing every "
                    "argument after `bench` to it (`jaxengine bench -- --help` shows its "
                    "flags).", allow_abbrev=False)
    bench.add_argument("--workload", metavar="WORKLOAD.json", help="the workload to replay")
    bench.add_argument("--output", metavar="OUT.json", help="where to write the results")
    add_engine_flags(bench)

    lab_commands.add_parsers(sub)

    replay = sub.add_parser("replay", help="replay a scheduler trace (docs/SCHEDULING.md §10)",
                            description="Drive the scheduler with a fake model over TRACE and "
                                        "print one JSON line per step; when vLLM's steps lie "
                                        "beside it (TRACE.expected.jsonl), end with a verdict "
                                        "on stderr, exit status 1 if they differ.")
    replay.add_argument("trace", metavar="TRACE.json", help="the trace file")
    replay.add_argument("-o", "--output", help="write the JSON lines here instead of stdout")
    replay.add_argument("--scheduling-policy", type=policy_argument, metavar="POLICY",
                        help="replay under this policy instead of the trace's: a registered "
                             "name or MODULE:CLASS (no verdict then)")

    export = sub.add_parser("export-tokenizer", help="write the model's tokenizer as an HF dir",
                            description="Write MODEL's tokenizer (tokenizer.json, "
                                        "tokenizer_config.json with the chat template) to DIR, "
                                        "for clients that need one, e.g. `vllm bench serve "
                                        "--tokenizer DIR`.")
    export.add_argument("directory", metavar="DIR", help="the directory to write (created)")
    export.add_argument("--model", default=None,
                        help="HF directory or .gguf file (default: the embedded SmolLM2)")
    return parser


# ---- commands ------------------------------------------------------------------------------

def _build_llm(args: EngineArgs) -> LLM:
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)}
    return LLM(**fields)


def run_generate(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`jaxengine generate`: stream each prompt's completion as it is produced (with --json:
    one JSON line per prompt once all are done).

    The prompts run batched, but a terminal shows them one after another, in prompt order:
    the first streams live, each later one prints its text so far when the one before it is
    done and streams live from then on. So the output is the same text, in the same order,
    as if nothing streamed (a pipe reading it sees completions whole and in order), and the
    first tokens show as soon as they exist.
    """
    overrides = sampling_overrides(ns)
    llm = _build_llm(engine_args_from(ns, parser))
    params = dataclasses.replace(llm.get_default_sampling_params(), **overrides)
    if not ns.json:
        with streaming.stream(llm, list(ns.prompts), params) as pieces:
            for piece in streaming.in_prompt_order(pieces):
                _write(piece.text + ("\n" if piece.finished else ""))
        return 0
    for out in llm.generate(list(ns.prompts), params, use_tqdm=False):
        c = out.outputs[0]
        print(json.dumps({"prompt": out.prompt, "text": c.text, "token_ids": list(c.token_ids),
                          "finish_reason": c.finish_reason}), flush=True)
    return 0


def run_chat(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`jaxengine chat`: one streamed reply per stdin line, keeping the conversation; Ctrl-C
    during a reply aborts it (the turn is dropped from the conversation), EOF ends."""
    overrides = sampling_overrides(ns)
    llm = _build_llm(engine_args_from(ns, parser))
    params = dataclasses.replace(llm.get_default_sampling_params(), **overrides)
    conversation: list[dict[str, str]] = []
    if ns.system:
        conversation.append({"role": "system", "content": ns.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        conversation.append({"role": "user", "content": line.rstrip("\n")})
        try:
            reply = _stream_reply(llm, conversation, params)
        except ValueError as e:  # e.g. the conversation outgrew max_model_len: say so, go on
            conversation.pop()
            print(f"jaxengine chat: error: {e}", file=sys.stderr, flush=True)
            continue
        if reply is None:
            conversation.pop()
            print("[reply aborted; this turn is not kept]", file=sys.stderr, flush=True)
            continue
        conversation.append({"role": "assistant", "content": reply})


def _stream_reply(llm: LLM, conversation: list[dict[str, str]],
                  params: scheduler.SamplingParams) -> str | None:
    """Write the reply to `conversation` to stdout as it is produced, then a newline.

    Returns:
      The reply's text (what was written), or None if Ctrl-C aborted it.
    Raises:
      ValueError: the engine refused the conversation (nothing was written).
    """
    with (streaming.stream_chat(llm, conversation, params) as pieces,
          _first_sigint_caught() as interrupted):
        reply = ""
        while pieces.live:
            for piece in pieces.step():
                _write(piece.text)
                reply += piece.text
            if interrupted():
                _write("\n")
                return None  # leaving `with` aborts the request and frees its KV blocks
    _write("\n")
    return reply


@contextlib.contextmanager
def _first_sigint_caught() -> Iterator[Callable[[], bool]]:
    """While open, the first SIGINT (Ctrl-C) only sets a flag, read by calling what this
    yields, and puts the previous handler back, so a second Ctrl-C acts as usual.

    Why not let KeyboardInterrupt fly: it could land inside `engine.step()`, between the KV
    cache's donation to the device step and the scheduler's update, and chat goes on using
    that engine. The flag is read between steps, so an abort waits for the step in flight.
    Outside the main thread no handler can be set, and the flag stays False.
    """
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    previous = signal.getsignal(signal.SIGINT)
    previous = signal.default_int_handler if previous is None else previous

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield lambda: bool(caught)
    finally:
        signal.signal(signal.SIGINT, previous)


def _write(text: str) -> None:
    """Write `text` to stdout now (a streamed piece must not wait in the buffer)."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def run_serve(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`jaxengine serve [MODEL]`: blocks until interrupted (with --headless: until process 0
    stops)."""
    flag_model = getattr(ns, "model", None)
    if ns.model_tag is not None and flag_model is not None and ns.model_tag != flag_model:
        parser.error(f"two models given: {ns.model_tag!r} and --model {flag_model!r}")
    args = engine_args_from(ns, parser, model=ns.model_tag)
    if ns.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora (and --max-lora-rank at least the "
                     "adapters' rank)")
    serve(args, host=ns.host, port=ns.port, model_name=ns.served_model_name,
          log_interval=ns.log_interval, log_level=ns.uvicorn_log_level, headless=ns.headless,
          frontend=args_from(FrontendArgs, ns, parser), lora_modules=ns.lora_modules)
    return 0


def run_proxy(ns: argparse.Namespace) -> int:
    """`jaxengine proxy --prefill URL... --decode URL...`: blocks until interrupted."""
    # The serve extra's: imported only by the commands that serve.
    import uvicorn

    from jaxengine.proxy import build_proxy_app

    app = build_proxy_app(ns.prefill, ns.decode)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level)
    return 0


def _bench_passes_through(args: Sequence[str]) -> bool:
    """`jaxengine bench ARGS` runs throughput.py unless ARGS (before any `--`) hold
    --workload, or are just --help."""
    mine = list(args[:list(args).index("--")] if "--" in args else args)
    if mine in (["-h"], ["--help"]):
        return False
    return not any(a == "--workload" or a.startswith("--workload=") for a in mine)


def run_bench(extra: Sequence[str]) -> int:
    """`jaxengine bench ARGS...`: run benchmarks/throughput.py with ARGS in a subprocess."""
    if not BENCH_SCRIPT.is_file():
        print(f"jaxengine bench: {BENCH_SCRIPT} is missing (bench runs it from a source "
              "checkout)", file=sys.stderr)
        return 2
    args = list(extra[1:] if extra[:1] == ["--"] else extra)
    env = dict(os.environ)
    root = str(BENCH_SCRIPT.parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.call([sys.executable, str(BENCH_SCRIPT), *args], env=env)


def run_export_tokenizer(ns: argparse.Namespace) -> int:
    """`jaxengine export-tokenizer DIR [--model PATH]`: print the files written."""
    for path in load_tokenizer(ns.model).save_pretrained(ns.directory):
        print(path)
    return 0


def run_replay(ns: argparse.Namespace) -> int:
    """`jaxengine replay TRACE.json [-o OUT] [--scheduling-policy P]`: scheduler.replay's
    main."""
    policy = ["--scheduling-policy", ns.scheduling_policy] if ns.scheduling_policy else []
    return replay_main([ns.trace, *(["-o", ns.output] if ns.output else []), *policy])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `jaxengine` and `python -m jaxengine`; returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and _bench_passes_through(argv[1:]):
        return run_bench(argv[1:])
    ns, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    try:
        if ns.command in lab_commands.COMMANDS:
            return lab_commands.COMMANDS[ns.command](ns, parser)
        if ns.command == "generate":
            return run_generate(ns, parser)
        if ns.command == "chat":
            return run_chat(ns, parser)
        if ns.command == "serve":
            return run_serve(ns, parser)
        if ns.command == "proxy":
            return run_proxy(ns)
        if ns.command == "export-tokenizer":
            return run_export_tokenizer(ns)
        return run_replay(ns)
    except ValueError as e:  # bad model path, settings or prompt: a message, not a traceback
        print(f"jaxengine {ns.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
