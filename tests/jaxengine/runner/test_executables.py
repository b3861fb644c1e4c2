"""Executables saved whole (jaxengine/runner/executables.py): a second process loads every
program without tracing and samples the same tokens; a changed key, a replaced model function
or a corrupt file compiles instead; and a step that needs a program still being made in the
background waits for it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxengine.engine.build import model_fns
from jaxengine.loading.load import load_model
from jaxengine.loading.lora import load_peft_adapter
from jaxengine.model.fake import fake_model
from jaxengine.model.fns import sign, signature
from jaxengine.model.mesh import make_mesh
from jaxengine.runner import executables
from jaxengine.runner.compilation_cache import configure
from jaxengine.runner.compiles import cache_hit_count, compile_count
from jaxengine.runner.lora_inputs import WRITE_LORA_NAME
from jaxengine.runner.penalty_inputs import WRITE_SLOT_NAME
from jaxengine.runner.programs import SAMPLE_NAME, STEP_NAME
from jaxengine.runner.runner import Runner
from tests.jaxengine.runner import executables_child as child
from tests.jaxengine.runner.executables_child import CONFIG, VOCAB, run

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """A cache directory a cold runner in this process filled, and that runner's outputs."""
    cache = tmp_path_factory.mktemp("executables")
    configure(str(cache))
    runner = Runner(fake_model.__wrapped__(VOCAB), CONFIG)  # a model object of its own
    runner.precompile(progress=False)
    yield cache, run(runner)
    configure(None)


def _child(cache: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(Path(child.__file__)), str(cache)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_every_program_whole_without_tracing(
        filled: tuple[Path, dict]) -> None:
    cache, cold = filled
    saved = sorted(p.name.split("-")[0] for p in (cache / executables.SUBDIR).iterdir())
    # token buckets 1 and 2, a request bucket, the penalty-slot writer
    assert saved == [STEP_NAME] * 2 + [SAMPLE_NAME, WRITE_SLOT_NAME]
    warm = _child(cache)
    assert warm["traces"] == 0  # neither the step, the sampler nor the writer was traced
    assert warm["made"] >= warm["programs"] == warm["loaded"] == 4  # all loaded whole
    assert warm["outputs"] == cold  # the same tokens and logprobs, sampled at temperature 1
    assert warm["donated"] and warm["after_warmup"] == 0  # KV pool, counts updated in place


def test_the_key_covers_shapes_shardings_statics_model_and_devices() -> None:
    devices = jax.devices()[:1]
    x = jax.ShapeDtypeStruct((4, 8), np.float32)
    key = lambda args, statics=None, sig="m", devs=devices: executables.program_key(  # noqa: E731
        "f", args, statics or {"n": 1}, signature=sig, devices=devs)
    base = key((x,))
    assert base == key((jax.ShapeDtypeStruct((4, 8), np.float32),))  # stable
    mesh = make_mesh(devices)
    others = [key((jax.ShapeDtypeStruct((4, 16), np.float32),)),  # another bucket or width
              key((jax.ShapeDtypeStruct((4, 8), jax.numpy.bfloat16),)),  # another dtype
              key((jax.ShapeDtypeStruct((4, 8), np.float32,
                                        sharding=NamedSharding(mesh, PartitionSpec())),)),
              key([x]),  # another tree
              key((x,), {"n": 2}),  # another static argument
              key((x,), sig="other model"),
              key((x,), devs=[])]
    assert len({base, *others}) == 1 + len(others)


def test_a_replaced_model_function_is_never_keyed_as_the_old_one() -> None:
    fake = fake_model(VOCAB)
    assert signature(fake) is not None
    assert signature(fake_model.__wrapped__(VOCAB + 1)) != signature(fake)
    assert signature(dataclasses.replace(fake, step=lambda p, kv, b: (kv, b.input_ids))) is None
    # What a function closes over is keyed in full, arrays too (numpy would print these two
    # alike, eliding the middle), and an object whose repr is only its address is no key.
    a, b = np.zeros(2000), np.zeros(2000)
    b[1000] = 1
    logits = [sign(lambda p, h: h, x) for x in (a, b, object())]
    signatures = [signature(dataclasses.replace(fake, compute_logits=f)) for f in logits]
    assert None not in signatures[:2] and signatures[0] != signatures[1]
    assert signatures[2] is None


def test_another_pool_size_misses_and_compiles(filled: tuple[Path, dict]) -> None:
    _, cold = filled  # its directory is the process's cache
    config = dataclasses.replace(CONFIG, num_blocks=CONFIG.num_blocks + 1)  # the steps' KV pool
    steps, samples = compile_count(STEP_NAME), compile_count(SAMPLE_NAME)
    step_hits, sample_hits = cache_hit_count(STEP_NAME), cache_hit_count(SAMPLE_NAME)
    runner = Runner(fake_model.__wrapped__(VOCAB), config)
    runner.precompile(progress=False)
    assert compile_count(STEP_NAME) - steps == 2  # both token buckets ...
    assert cache_hit_count(STEP_NAME) == step_hits  # ... compiled: another key
    assert compile_count(SAMPLE_NAME) - samples == 1  # the sampler's key is the same ...
    assert cache_hit_count(SAMPLE_NAME) - sample_hits == 1  # ... loaded whole
    assert run(runner) == cold


def test_a_corrupt_file_is_compiled_instead_with_a_log_line(
        filled: tuple[Path, dict], caplog: pytest.LogCaptureFixture) -> None:
    cache, cold = filled
    path = max((cache / executables.SUBDIR).glob(f"{STEP_NAME}-*"), key=lambda p: p.stat().st_size)
    data = path.read_bytes()
    path.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])  # one bit flipped
    steps, hits = compile_count(STEP_NAME), cache_hit_count(STEP_NAME)
    with caplog.at_level(logging.WARNING, logger="jaxengine.runner"):
        runner = Runner(fake_model.__wrapped__(VOCAB), CONFIG)
        runner.precompile(progress=False)
    assert caplog.text.count("cannot load the saved executable") == 1
    assert "checksum" in caplog.text and path.name in caplog.text
    # The other step loaded whole; this one read from JAX's cache (the fixture's compile had
    # written it there), which cannot be saved whole, so compiled for real once more.
    assert (compile_count(STEP_NAME) - steps, cache_hit_count(STEP_NAME) - hits) == (3, 2)
    assert run(runner) == cold
    key = path.name.removeprefix(f"{STEP_NAME}-").removesuffix(".exe")
    assert executables.load(str(cache), STEP_NAME, key, jax.devices()[:1]) is not None  # saved
    whole = path.read_bytes()
    path.write_bytes(whole[:1000])  # cut short
    with caplog.at_level(logging.WARNING, logger="jaxengine.runner"):
        assert executables.load(str(cache), STEP_NAME, key, jax.devices()[:1]) is None
    assert caplog.text.count("cannot load the saved executable") == 2
    path.write_bytes(whole)


def test_a_step_waits_for_a_program_still_made_in_the_background(
        filled: tuple[Path, dict]) -> None:
    _, cold = filled
    runner = Runner(fake_model.__wrapped__(VOCAB), CONFIG)
    release, make = threading.Event(), runner._make_program_counted

    def held(bucket: tuple[str, int]) -> Any:  # the background's maker, once released
        assert release.wait(timeout=120)
        return make(bucket)

    runner._make_program_counted = held  # type: ignore[method-assign]
    runner.precompile(progress=False, background=True)
    assert runner.warm  # ready: the smallest step and sampler are made
    with ThreadPoolExecutor(1) as pool:
        # The prompts' prefills need the step of 2 tokens, left to the background.
        outputs = pool.submit(run, runner)
        time.sleep(0.5)
        assert not outputs.done()  # waiting, not compiling them itself
        release.set()
        assert outputs.result(timeout=120) == cold
    runner.wait_for_programs()
    assert runner.stats.compilations_after_warmup == 0  # debug_recompiles: would have raised


def test_the_lora_slot_writer_is_loaded_whole_and_writes_without_compiling(
        tmp_path: Path) -> None:
    """The LoRA writer is made as the runner's other programs: a second runner loads it
    whole, and an adapter written through it lands in its slot with nothing compiled."""
    model, cfg, _ = load_model(str(FIXTURES / "tiny" / "llama3_gqa"))
    config = dataclasses.replace(CONFIG, max_loras=1, max_lora_rank=8)
    adapter = load_peft_adapter(FIXTURES / "lora" / "llama3_gqa" / "mlp", cfg, max_lora_rank=8)
    configure(str(tmp_path))
    try:
        cold = Runner(model_fns(model, cfg, attn_impl="reference", lora=True), config)
        cold.precompile(progress=False, background=False)
        saved = sorted(p.name.split("-")[0] for p in (tmp_path / executables.SUBDIR).iterdir())
        assert WRITE_LORA_NAME in saved
        hits = cache_hit_count(WRITE_LORA_NAME)
        warm = Runner(model_fns(model, cfg, attn_impl="reference", lora=True), config)
        warm.precompile(progress=False, background=False)
        assert cache_hit_count(WRITE_LORA_NAME) - hits == 1  # read from the saved file
        compiles = compile_count(WRITE_LORA_NAME)
        assert warm.lora.use(7, adapter.weights, adapter.scaling, keep=()) == 1
        assert compile_count(WRITE_LORA_NAME) == compiles  # the loaded executable wrote it
    finally:
        configure(None)
    a, _ = warm.lora.layout.slot_arrays(adapter.weights, 8)
    written = np.asarray(warm.lora.slots.a["down_proj"])[:, :, 8:16]  # slot 1 of rank 8
    np.testing.assert_array_equal(written, a["down_proj"])
    assert float(warm.lora.slots.scaling[1]) == pytest.approx(adapter.scaling)


def test_a_program_whose_arguments_hold_a_mesh_is_saved_and_loaded_whole(
        tmp_path: Path) -> None:
    """A parameter's metadata may hold its mesh (an HF checkpoint's and a GGUF model's do), so
    the argument tree holds devices, which plain pickle refuses: they go by id."""
    devices = jax.devices()[:1]
    params = {"w": nnx.Param(jnp.arange(4.0), sharding_names=(None,), mesh=make_mesh(devices))}
    jitted = jax.jit(lambda p, x: p["w"][...] * x)
    compiled = jitted.lower(params, jnp.float32(2)).compile()
    key = executables.program_key("mesh_probe", params, {}, signature="m", devices=devices)
    executables.save(str(tmp_path), "mesh_probe", key, compiled)
    loaded = executables.load(str(tmp_path), "mesh_probe", key, devices)
    assert loaded is not None
    np.testing.assert_array_equal(np.asarray(loaded(params, jnp.float32(2))), [0, 2, 4, 6])
