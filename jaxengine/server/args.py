"""`FrontendArgs`: the HTTP server's own settings (vLLM's name for them), apart from the engine's.

They guard the server's edge: who may call it (`api_key`), how big a request may be, how long a
client may take to send one or stay idle, whether a request may bring its own chat template, and
how long a shutdown waits for running requests.
`jaxengine serve` makes one flag per field (`--api-key`, `--shutdown-timeout`, ...), with the
help text each field declares. The LoRA adapters it serves are `--lora-modules` entries
(`LoRAModulePath`), and whether they may change at run time is the environment's
(`runtime_lora_updating`), as in vLLM.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from jaxengine.engine.args import arg

API_KEY_ENV = "JAXENGINE_API_KEY"  # vLLM's VLLM_API_KEY: a key that should not show in `ps`
# vLLM's variable that allows loading LoRA adapters at run time, and this project's name for it
RUNTIME_LORA_ENVS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JAXENGINE_ALLOW_RUNTIME_LORA_UPDATING")

# 32 MiB, the body limit of vLLM's Rust frontend (its Python one has none): at 32 bytes a token
# (a token id and its comma, or a few characters of JSON-escaped text) that is a million tokens,
# room for any prompt max_model_len allows, or a list of them, and still a bound on what one
# request makes the server buffer and parse.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FrontendArgs:
    """HTTP settings of `jaxengine serve`; validated when constructed."""

    # repr=False: the key must not reach a log line or a traceback
    api_key: str | None = arg(
        None, "clients must send `Authorization: Bearer KEY` on every route but /health, /ping "
              f"and /metrics; None: ${API_KEY_ENV} if set, else no key", repr=False)
    max_request_body_bytes: int = arg(
        DEFAULT_MAX_REQUEST_BODY_BYTES, "largest request body in bytes; a larger one is a 413, "
                                        "refused before it is read whole")
    timeout_keep_alive: float = arg(5.0, "seconds an idle connection stays open after a "
                                         "response (uvicorn's timeout_keep_alive)")
    timeout_headers: float = arg(10.0, "seconds a client has to send a request's headers, "
                                       "from the connection's start or the previous response; "
                                       "then the connection is closed")
    trust_request_chat_template: bool = arg(
        False, "render the chat_template a request sends (Jinja the server runs: vLLM's flag); "
               "off, such a request is a 400")
    shutdown_timeout: float = arg(10.0, "on SIGTERM or Ctrl-C, seconds to wait for running "
                                        "requests to finish before aborting the rest (0: "
                                        "abort at once)")

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise ValueError("api_key is empty or starts or ends with whitespace, which an "
                             "Authorization header cannot carry: give the key itself, or leave "
                             "it out to serve without one")
        if (not isinstance(self.max_request_body_bytes, int)
                or isinstance(self.max_request_body_bytes, bool)
                or self.max_request_body_bytes < 1):
            raise ValueError(f"max_request_body_bytes must be an integer >= 1, got "
                             f"{self.max_request_body_bytes!r}")
        for name in ("timeout_keep_alive", "timeout_headers"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a number of seconds > 0, got "
                                 f"{getattr(self, name)!r}")
        if not 0 <= self.shutdown_timeout < float("inf"):
            raise ValueError(f"shutdown_timeout must be a number of seconds >= 0, got "
                             f"{self.shutdown_timeout!r}")

    def with_env_api_key(self, environ: Mapping[str, str]) -> FrontendArgs:
        """These settings with the key from `environ[API_KEY_ENV]` when none is set (the flag
        wins; an empty variable counts as unset)."""
        if self.api_key is not None or not environ.get(API_KEY_ENV):
            return self
        return dataclasses.replace(self, api_key=environ[API_KEY_ENV])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's): the adapter's served name, its directory, and the
    model `/v1/models` lists as its parent (None: the served base model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """A `--lora-modules` value in either of vLLM's forms: `name=path`, or a JSON object
    `{"name": ..., "path": ..., "base_model_name": ...}` (base_model_name optional).

    Raises:
      ValueError: neither form, or a JSON object with a missing, empty or unknown field.
    """
    if "=" in text and "," not in text and not text.lstrip().startswith("{"):
        name, _, path = text.partition("=")
        fields: object = {"name": name, "path": path}
    else:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"--lora-modules {text!r}: want name=path or a JSON object "
                             '{"name": ..., "path": ..., "base_model_name": ...}') from None
    if not isinstance(fields, dict):
        raise ValueError(f"--lora-modules {text!r}: want name=path or a JSON object")
    known = {f.name for f in dataclasses.fields(LoRAModulePath)}
    unknown = sorted(fields.keys() - known)
    if unknown:
        raise ValueError(f"--lora-modules {text!r}: unknown field {unknown[0]!r} (fields: "
                         "name, path, base_model_name)")
    for field in ("name", "path"):
        if not isinstance(fields.get(field), str) or not fields[field]:
            raise ValueError(f"--lora-modules {text!r}: {field} must be a non-empty string")
    return LoRAModulePath(**fields)


def runtime_lora_updating(environ: Mapping[str, str]) -> bool:
    """Whether `environ` allows loading and unloading adapters at run time (vLLM's rule for its
    variable: "1" or "true", any case)."""
    return any(environ.get(name, "0").strip().lower() in ("1", "true")
               for name in RUNTIME_LORA_ENVS)
