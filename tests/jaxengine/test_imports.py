"""`import jaxengine` leaves the heavy libraries that only some paths use unimported, so a start
pays for them only when it uses them (docs/BENCHMARKS.md §14)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# each imported only by the code that needs it: transformers by an HF config, an HF directory's
# tokenizer and a chat template (not by the server's app: a GGUF model's server imports it
# beside the model's build), llguidance.hf by the first structured-outputs grammar, the others by
# the server's app (not by `jaxengine.server` or its `serve`, which import it on a thread beside
# the build) and the lab
DEFERRED = ("transformers", "llguidance.hf", "fastapi", "uvicorn", "starlette", "matplotlib",
            "torch")

# One interpreter (each costs seconds): the deferred modules loaded after each step.
PROBE = f"""
import json, sys
def loaded():
    return sorted(set({DEFERRED!r}) & set(sys.modules))
steps = []
import jaxengine
jaxengine.LLM, jaxengine.SamplingParams, jaxengine.Tokenizer
steps.append(loaded())
tok = jaxengine.Tokenizer.from_gguf_metadata({{
    "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<e>"],
    "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1, 3],
    "tokenizer.ggml.eos_token_id": 3, "tokenizer.chat_template": "{{{{ messages[0].content }}}}"}})
assert tok.decode(tok.encode("ab<e>"), skip_special_tokens=False) == "ab<e>"
steps.append(loaded())
import jaxengine.server, jaxengine.server.run
steps.append(loaded())
jaxengine.server.build_app
steps.append(loaded())
assert tok.apply_chat_template([{{"role": "user", "content": "ab"}}]) == "ab"
steps.append(loaded())
print(json.dumps(steps))
"""


def test_heavy_libraries_are_imported_where_they_are_used_only() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    after_import, after_gguf_tokenizer, after_serve, after_app, after_chat = json.loads(
        done.stdout.splitlines()[-1])
    assert after_import == after_gguf_tokenizer == []  # `tokenizers` encodes and decodes
    assert after_serve == []
    assert "transformers" not in after_app and "fastapi" in after_app
    assert "transformers" in after_chat  # its `apply_chat_template` renders
