"""`AsyncEngine.add_all`: several requests join one step as a `RequestGroup`, or none does."""

from __future__ import annotations

import asyncio

import pytest

from jaxengine.model.fake import fake_greedy
from tests.jaxengine.engine.test_llm_engine import PROMPTS, V
from tests.jaxengine.server.test_async_engine import GREEDY, LONG, _all_blocks_free, _run, _started


def test_a_group_yields_each_requests_outputs_and_finishes_with_all() -> None:
    async def scenario() -> None:
        engine = await _started()
        group = await engine.add_all([("g-0", {"prompt_token_ids": PROMPTS[0]}, GREEDY),
                                      ("g-1", {"prompt_token_ids": PROMPTS[2]}, GREEDY)])
        assert group.index("g-1") == 1 and not group.finished
        finals = await group.final_all()
        assert finals is not None and [f.request_id for f in finals] == ["g-0", "g-1"]
        assert [list(f.outputs[0].token_ids) for f in finals] == [
            fake_greedy(PROMPTS[0], 8, V), fake_greedy(PROMPTS[2], 8, V)]
        assert group.finished and engine.num_unfinished() == 0 and _all_blocks_free(engine)
        await engine.stop()

    _run(scenario())


def test_a_refused_member_leaves_nothing_behind() -> None:
    async def scenario() -> None:
        engine = await _started()
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await engine.add_all([("ok", {"prompt_token_ids": PROMPTS[0]}, LONG),
                                  ("bad", {"prompt_token_ids": [V + 5]}, LONG)])
        assert not engine.engine.has_unfinished_requests() and engine.num_unfinished() == 0
        assert "ok" not in engine.live_request_ids()
        await engine.stop()

    _run(scenario())


def test_aborting_a_group_stops_every_member() -> None:
    async def scenario() -> None:
        engine = await _started()
        group = await engine.add_all([(f"a-{i}", {"prompt_token_ids": PROMPTS[0]}, LONG)
                                      for i in range(3)])
        await anext(aiter(group))
        group.abort()
        assert group.finished and engine.num_unfinished() == 0
        for _ in range(100):  # the loop applies the aborts before its next step
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not engine.engine.has_unfinished_requests() and _all_blocks_free(engine)
        await engine.stop()

    _run(scenario())
