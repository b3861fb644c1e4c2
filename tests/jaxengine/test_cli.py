"""The `jaxengine` command: help, flags from EngineArgs, replay, bench, generate, chat, serve."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import httpx
import pytest

import scheduler
from jaxengine.cli import build_parser, main
from jaxengine.engine.args import ATTENTION_BACKENDS, DTYPES, EngineArgs
from jaxengine.flags import add_flags, args_from, engine_args_from
from jaxengine.server.args import FrontendArgs
from tests.server_processes import free_port, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "fixtures" / "tiny" / "llama_tied_mha"
CONFORMANCE = ROOT / "tests" / "scheduler" / "conformance"
SMALL = ["--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--block-size", "4",
         "--max-model-len", "128", "--num-gpu-blocks-override", "80"]


@pytest.mark.parametrize("argv", [[], ["generate"], ["chat"], ["serve"], ["bench"], ["replay"],
                                  ["export-tokenizer"], ["calibrate"], ["simulate"], ["tune"],
                                  ["workload"]])
def test_help_exits_zero(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    assert "usage: jaxengine" in capsys.readouterr().out


def test_every_engine_arg_has_a_flag_with_vllms_name() -> None:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {s for a in serve._actions for s in a.option_strings}
    helps = {s: a.help for a in serve._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        assert flag in flags, f.name
        assert helps[flag].startswith(f.metadata["help"]) and len(f.metadata["help"]) > 10
    for bool_flag in ("--no-enable-prefix-caching", "--no-enable-chunked-prefill"):
        assert bool_flag in flags


def _serve_actions() -> dict[str, argparse.Action]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return {a.dest: a for a in serve._actions}


def test_each_field_flag_keeps_its_name_default_help_and_value_type() -> None:
    """Every EngineArgs and FrontendArgs field: its flag, no parser default (the dataclass
    keeps its own), the field's help with its default, and a value type that gives back the
    field's default from its text."""
    actions = _serve_actions()
    for cls in (EngineArgs, FrontendArgs):
        for f in dataclasses.fields(cls):
            action = actions[f.name]
            assert action.option_strings[0] == "--" + f.name.replace("_", "-")
            assert action.default is argparse.SUPPRESS
            assert action.help == f"{f.metadata['help']} (default: {f.default})"
            if isinstance(f.default, bool):
                assert isinstance(action, argparse.BooleanOptionalAction), f.name
            elif f.default is not None:
                assert action.type is not None and action.type(str(f.default)) == f.default
    assert actions["dtype"].choices == DTYPES
    assert actions["attention_backend"].choices == ATTENTION_BACKENDS
    assert list(actions["scheduling_policy"].choices or ()) == list(scheduler.POLICIES)
    assert actions["max_model_len"].metavar == "MAX_MODEL_LEN"


SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'


def test_optional_fields_parse_the_type_beside_their_none() -> None:
    parser = build_parser()
    ns = parser.parse_args(["serve", "--max-model-len", "64", "--kv-offloading-size", "0.5",
                            "--speculative-config", SPEC, "--no-precompile",
                            "--attention-backend", "cpu", "--api-key", "k"])
    args = engine_args_from(ns, parser)
    assert (args.max_model_len, args.kv_offloading_size) == (64, 0.5)
    assert (args.precompile, args.attention_backend) == (False, "cpu")
    assert args_from(FrontendArgs, ns, parser).api_key == "k"
    assert ns.speculative_config == json.loads(SPEC)
    for bad in (["--max-model-len", "1.5"], ["--speculative-config", "[1]"],
                ["--attention-backend", "cuda"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])


def test_a_literal_field_is_a_flag_with_its_values_as_choices() -> None:
    @dataclasses.dataclass
    class Picky:
        mode: Literal["a", "b"] | None = dataclasses.field(default=None, metadata={"help": "m"})
        level: Literal[1, 2] = dataclasses.field(default=1, metadata={"help": "l"})

    parser = argparse.ArgumentParser()
    add_flags(parser, Picky)
    assert vars(parser.parse_args(["--mode", "b", "--level", "2"])) == {"mode": "b", "level": 2}
    assert vars(parser.parse_args([])) == {}
    for bad in (["--mode", "c"], ["--level", "3"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_a_field_type_without_a_flag_mapping_is_an_error_naming_it() -> None:
    @dataclasses.dataclass
    class Odd:
        sizes: list[int] = dataclasses.field(default_factory=list, metadata={"help": "?"})

    with pytest.raises(TypeError, match="'sizes'"):
        add_flags(argparse.ArgumentParser(), Odd)


def test_flags_given_reach_engine_args_and_the_rest_keep_defaults() -> None:
    parser = build_parser()
    ns = parser.parse_args(["serve", "--max-num-seqs", "3", "--no-enable-prefix-caching",
                            "--scheduling-policy", "priority", "--dtype", "bfloat16",
                            "--long-prefill-token-threshold", "8",
                            "--max-num-scheduled-tokens", "1536"])
    args = engine_args_from(ns, parser)
    assert (args.max_num_seqs, args.enable_prefix_caching) == (3, False)
    assert (args.scheduling_policy, args.dtype, args.long_prefill_token_threshold) == (
        "priority", "bfloat16", 8)
    assert args.block_size == EngineArgs().block_size
    assert (args.max_num_batched_tokens, args.max_num_scheduled_tokens) == (None, 1536)


def test_serve_trusts_request_chat_templates_only_when_told() -> None:
    parser = build_parser()

    def frontend(*flags: str) -> FrontendArgs:
        return args_from(FrontendArgs, parser.parse_args(["serve", *flags]), parser)

    assert frontend().trust_request_chat_template is False
    assert frontend("--trust-request-chat-template").trust_request_chat_template is True


def test_bad_engine_values_exit_with_the_engines_message(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--max-num-seqs", "0"])
    assert info.value.code == 2
    assert "max_num_seqs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--dtype", "float64"])


def test_replay_prints_the_expected_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(CONFORMANCE / "c001.json")]) == 0
    printed = capsys.readouterr()
    expected = (CONFORMANCE / "c001.expected.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in printed.out.splitlines()] == [json.loads(x) for x in expected]
    assert f"matches vLLM's {len(expected)} steps" in printed.err
    assert main(["replay", str(CONFORMANCE / "c001.json"), "--scheduling-policy", "las"]) == 0
    assert "no verdict: vLLM's steps" in capsys.readouterr().err


def test_bench_passes_its_arguments_through(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    script = tmp_path / "throughput.py"
    script.write_text("import sys, json\nprint(json.dumps(sys.argv[1:]))\n"
                      "sys.exit(3 if '--fail' in sys.argv else 0)\n")
    monkeypatch.setattr("jaxengine.cli.BENCH_SCRIPT", script)
    assert main(["bench", "--num-prompts", "5", "--fail"]) == 3
    assert main(["bench", "--", "--help"]) == 0
    monkeypatch.setattr("jaxengine.cli.BENCH_SCRIPT", tmp_path / "missing.py")
    assert main(["bench"]) == 2


def test_generate_on_the_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "hello", "a second prompt", "--model", str(TINY), "--max-tokens", "5",
            "--temperature", "0", "--ignore-eos", "--json", *SMALL]
    assert main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["prompt"] for x in lines] == ["hello", "a second prompt"]
    assert all(len(x["token_ids"]) == 5 and x["finish_reason"] == "length" for x in lines)
    assert all(isinstance(x["text"], str) for x in lines)


def test_generate_streams_exactly_the_final_texts_on_the_tiny_model(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from jaxengine import streaming

    finals, pieces, real = [], [], streaming.in_prompt_order

    def spy(deltas):  # type: ignore[no-untyped-def]
        for d in real(deltas):
            pieces.append(d.text)
            if d.finished:
                finals.append(d.output.outputs[0].text)
            yield d

    monkeypatch.setattr(streaming, "in_prompt_order", spy)
    argv = ["generate", "hello", "a second prompt", "--model", str(TINY), "--max-tokens", "12",
            "--temperature", "0", "--ignore-eos", *SMALL]
    assert main(argv) == 0
    assert capsys.readouterr().out == "".join(t + "\n" for t in finals)  # a real BPE's bytes
    assert len(finals) == 2 and len(pieces) > 4


def test_generate_keeps_the_models_sampling_defaults_for_flags_not_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "tiny"
    shutil.copytree(TINY, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    runs = []
    for seed in ("1", "2"):  # greedy from the model's default: the seed cannot matter
        argv = ["generate", "hello", "--model", str(model), "--max-tokens", "8", "--ignore-eos",
                "--json", "--sampling-seed", seed, *SMALL]
        assert main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert runs[0] == runs[1] and len(runs[0]) == 8


def test_a_bad_sampling_flag_is_refused_before_any_model_loads(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--model", "/nonexistent/model", "--top-p", "2"]) == 1
    err = capsys.readouterr().err
    assert "top_p" in err and "does not exist" not in err


def test_generate_reports_a_bad_model_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--model", "/nonexistent/model"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_chat_keeps_the_conversation(monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[list[dict[str, str]]] = []
    from jaxengine import streaming

    real_stream_chat = streaming.stream_chat

    def spy(llm, messages, *a, **kw):  # type: ignore[no-untyped-def]
        seen.append([dict(m) for m in messages])
        return real_stream_chat(llm, messages, *a, **kw)

    monkeypatch.setattr(streaming, "stream_chat", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n\nok\n/exit\nnot read\n"))
    argv = ["chat", "--model", str(TINY), "--system", "be brief", "--max-tokens", "4",
            "--temperature", "0", "--ignore-eos", *SMALL]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert len(seen) == 2, printed
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]
    assert seen[1][1]["content"] == "hi" and seen[1][3]["content"] == "ok"
    assert printed.startswith(seen[1][2]["content"] + "\n")  # the first reply, as printed


def test_serve_subprocess_answers_and_logs_throughput(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "jaxengine", "serve", str(TINY), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "tiny", "--log-interval", "1", *SMALL]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, [proc], log.read_text)
        r = httpx.post(f"{base}/v1/completions", trust_env=False, timeout=120, json={
            "model": "tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + 20
        while "Avg generation throughput" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
    finally:
        stop(proc)
    text = log.read_text()
    for part in ("Running: ", "GPU KV cache usage: ", "Prefix cache hit rate: "):
        assert part in text


def test_the_command_loads_without_the_optional_extras() -> None:
    """uvicorn (the `serve` extra) and matplotlib (the `lab` extra) are imported only by the
    commands that use them: without them `jaxengine generate` and friends still load."""
    code = ("import sys\n"
            "sys.modules['uvicorn'] = sys.modules['matplotlib'] = None  # as if not installed\n"
            "from jaxengine.cli import build_parser\n"
            "build_parser().parse_args(['simulate', '--help'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
