"""The embedded engine's slot table (``decode_slots.SlotTable``): after any sequence of occupy/release, its held
and free slots and the cache columns a forward may attend to equal a recomputation from every slot's state."""

from __future__ import annotations

import random

from rlrun.engine.embedded.decode_slots import SlotTable


def test_slot_table_tracks_held_slots_and_filled_columns():
    rng, table = random.Random(0), SlotTable(8)
    state: dict[int, tuple[int, int, int]] = {}  # slot -> (prompt_len, start, max_new), the reference
    for forwards in range(200):
        slot = rng.randrange(8)
        if slot in state and rng.random() < 0.5:
            table.release(slot)
            del state[slot]
        elif slot not in state:
            state[slot] = (rng.randint(1, 30), forwards, rng.randint(1, 40))
            table.occupy(slot, rng.randrange(100), *state[slot])
        want = max((p + min(forwards - s, m) for p, s, m in state.values()), default=1)
        assert table.occupied == sorted(state) and table.free == [s for s in range(8) if s not in state]
        assert table.filled(forwards) == want
