"""The runner's side of penalties and biases: the device tables, their slots, and each batch's
`LogitsAdjustments` (`jaxengine/sampling/request_tables.py` has the tables,
`jaxengine/sampling/logits_processors.py` their use in the sampler).

Per step the runner hands over the sampling rows; `PenaltyInputs.adjustments` gives each request
that needs one a slot (writing its rows with a small jitted program, precompiled like the
runner's others), arms its multi-token bad words, and notes where its token in flight is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Sharding

from jaxengine.runner.bucket_programs import make_program, spec
from jaxengine.sampling.bad_words import BadWordBan, armed_bans
from jaxengine.sampling.logits_processors import LogitsAdjustments, build_adjustments
from jaxengine.sampling.request_tables import (
    RequestTables,
    init_tables,
    slot_rows,
    uses_table,
    write_slot,
)
from jaxengine.sampling.rows import SamplingRow

WRITE_SLOT_NAME = "jaxengine_write_slot"


class TableSlots:
    """Host bookkeeping: which request holds which slot.

    A request keeps its slot until the scheduler reports it finished. Preempted requests keep
    theirs too, so live requests may outnumber the slots: then a request outside the batch
    being packed loses its slot, and gets its rows rebuilt from the host's tokens (exact: see
    `write_slot`) when it samples again.
    """

    def __init__(self, num_slots: int) -> None:
        """All `num_slots` slots free."""
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first
        self._slots: dict[str, int] = {}

    def get(self, request_id: str) -> int | None:
        """The request's slot, or None if it has none."""
        return self._slots.get(request_id)

    def assign(self, request_id: str, batch: Iterable[str]) -> int:
        """A slot for a request that has none; if none is free, one taken from a request not
        in `batch` (the ids sampling in the step being packed, at most `num_slots`)."""
        if not self._free:
            keep = set(batch)
            victim = next(r for r in self._slots if r not in keep)
            self._free.append(self._slots.pop(victim))
        slot = self._free.pop()
        self._slots[request_id] = slot
        return slot

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the slots of finished requests (ids without a slot are ignored)."""
        for r in request_ids:
            slot = self._slots.pop(r, None)
            if slot is not None:
                self._free.append(slot)

    def __len__(self) -> int:
        """Slots in use."""
        return len(self._slots)


class PenaltyInputs:
    """The tables on the device (`tables`, replaced by each call that updates them) and the
    slots of the requests that use them."""

    def __init__(self, num_slots: int, vocab_size: int, *,
                 put: Callable[[np.ndarray], jax.Array], sharding: Sharding | None) -> None:
        """Empty tables of [num_slots, vocab_size], placed on the device by `put` (with
        `sharding`, which the precompiled programs are built for)."""
        self.vocab_size = vocab_size
        self.sharding = sharding
        self.tables: RequestTables = jax.tree.map(put, init_tables(num_slots, vocab_size))
        self.slots = TableSlots(num_slots)
        # The slot writer: jitted until `precompile_write_slot` gives its executable, which is
        # called from then on. The tables come back from the sampler committed to the weights'
        # devices, which a jit cache entry lowered for unplaced shapes does not match: the
        # jitted writer would compile again (docs/JAX_NOTES.md, "Counting compilations").
        self._write_slot: Callable[..., RequestTables] = _jitted_write_slot

    def spec(self) -> RequestTables:
        """The tables as `ShapeDtypeStruct`s, for lowering the programs that take them."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=self.sharding), self.tables)

    def precompile_write_slot(self, prev_tokens: jax.ShapeDtypeStruct, *,
                              signature: str | None, devices: Sequence[jax.Device]) -> None:
        """Make the slot writer's executable, which later writes call (`prev_tokens`: the spec
        of a step's token array), as the runner makes its other programs (`make_program`:
        loaded whole when saved before; `signature` and `devices` as there)."""
        V = self.vocab_size
        args = (self.spec(), spec(np.int32(0)), spec(np.zeros(V, np.float32)),
                spec(np.zeros(V, bool)), spec(np.zeros(V, np.int32)), prev_tokens,
                spec(np.int32(0)))
        self._write_slot = make_program("the penalty slot writer", WRITE_SLOT_NAME,
                                        _jitted_write_slot, args, {}, signature=signature,
                                        devices=devices)

    def adjustments(self, sampling_ids: Sequence[str], rows: Mapping[str, SamplingRow],
                    size: int, in_prev: Mapping[str, int], prev_tokens: jax.Array
                    ) -> LogitsAdjustments:
        """The batch's penalty inputs (numpy, R = `size`): a slot for each request that uses one
        (written on its first draw, or again after losing it), its armed bad-word bans, and its
        entry in `prev_tokens` (i32[R'], the tokens of the step in flight; `in_prev`: the row
        of each request it samples) when the host lacks its newest output.

        Raises:
          ValueError: a row lacks outputs on the host that the step in flight does not sample.
        """
        slots: list[int] = []
        bans: list[tuple[BadWordBan, ...]] = []
        prev_rows: list[int] = []
        for rid in sampling_ids:
            row = rows[rid]
            slot, prev_row, table = -1, -1, uses_table(row.params, row.bad_words_token_ids)
            # Only these rows read their outputs (the others need not pass them).
            if (table or row.bad_words_token_ids) and row.position > len(row.output_token_ids):
                if rid not in in_prev:
                    raise ValueError(f"request {rid!r} has {len(row.output_token_ids)} outputs "
                                     f"on the host of {row.position}, and the step before "
                                     f"does not sample it")
                prev_row = in_prev[rid]
            if table:
                slot = self.slots.get(rid)
                if slot is None:
                    slot = self.slots.assign(rid, sampling_ids)
                    self._write(slot, row, prev_tokens, prev_row)
            slots.append(slot)
            bans.append(armed_bans(row.bad_words_token_ids, row.output_token_ids, row.position)
                        if row.bad_words_token_ids else ())
            prev_rows.append(prev_row)
        return build_adjustments([rows[r].params for r in sampling_ids], slots, bans, prev_rows,
                                 size)

    def _write(self, slot: int, row: SamplingRow, prev_tokens: jax.Array, prev_row: int) -> None:
        bias, prompt, counts = slot_rows(row.params, row.prompt_token_ids, row.output_token_ids,
                                         row.bad_words_token_ids, self.vocab_size)
        self.tables = self._write_slot(self.tables, np.int32(slot), bias, prompt, counts,
                                       prev_tokens, np.int32(prev_row))


def jaxengine_write_slot(tables: RequestTables, slot: jax.Array, bias: jax.Array,
                         prompt_mask: jax.Array, output_counts: jax.Array,
                         prev_tokens: jax.Array, prev_row: jax.Array) -> RequestTables:
    """`request_tables.write_slot` under the name the compile counter knows."""
    return write_slot(tables, slot, bias, prompt_mask, output_counts, prev_tokens, prev_row)


# The tables are donated: a slot's rows are written in place.
_jitted_write_slot = jax.jit(jaxengine_write_slot, donate_argnames=("tables",))
