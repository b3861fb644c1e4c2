"""`make_speculator`: the engine's speculator for a `speculative_config`'s method (n-gram
prompt lookup in `speculator.py`, a draft model in `draft_model.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxengine.config.speculative import SpeculativeConfig
from jaxengine.spec.draft_model import DraftModelSpeculator
from jaxengine.spec.speculator import Speculator

if TYPE_CHECKING:
    from jaxengine.model.fns import ModelFns
    from jaxengine.runner.runner import Runner


def make_speculator(config: SpeculativeConfig, *, runner: Runner, draft: ModelFns | None,
                    max_model_len: int, eos_token_id: int | None,
                    async_scheduling: bool = False) -> Speculator:
    """The engine's speculator for `config.method` (for "draft_model", over the `draft`
    model's functions, which the engine's build loaded; under `async_scheduling` its proposal
    runs one greedy step more, for the token in flight).

    Raises:
      ValueError: "draft_model" without `draft`, or a draft whose vocabulary is not the
        target's.
    """
    if config.method != "draft_model":
        return Speculator(config, max_model_len=max_model_len, eos_token_id=eos_token_id)
    if draft is None:
        raise ValueError("speculative_config: method 'draft_model' needs the draft model's "
                         "functions (jaxengine.engine.build.load_draft loads them)")
    return DraftModelSpeculator(config, draft, runner, max_model_len=max_model_len,
                                eos_token_id=eos_token_id, async_scheduling=async_scheduling)
