"""Continuous batching's host side: which request row each decode slot holds, and the stop strings of those rows.

A generate call's rows (samples) wait in a queue; the decode batch has fewer slots when
``max_running_requests`` caps it. When a row finishes, the host sees it at its next look, takes its result and
loads the next waiting row into the slot (its own prefill), so a long tail of lengths does not leave slots idle.
A row's noise is a function of its own key and token index, so its tokens do not depend on its slot or on when
it started. The host never reads the device to know how far rows can have got: it counts forwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlrun.engine.embedded.decode_batch import DecodeBatch, Finish


class SlotTable:
    """Per slot: the request row it holds (-1: none), its prompt length, the forwards done when it was loaded,
    and its max_new_tokens; enough to bound the cache columns in use and when every row must have ended."""

    def __init__(self, num_slots: int) -> None:
        self.row = [-1] * num_slots
        self.prompt_len = [0] * num_slots
        self.start = [0] * num_slots
        self.max_new = [1] * num_slots
        self._held: set[int] = set()
        """The slots that hold a row, kept by occupy/release: :meth:`filled` runs every forward and reads only
        these (in a long tail most slots are empty)."""

    def occupy(self, slot: int, row: int, prompt_len: int, start: int, max_new: int) -> None:
        self.row[slot], self.prompt_len[slot], self.start[slot], self.max_new[slot] = row, prompt_len, start, max_new
        self._held.add(slot)

    def release(self, slot: int) -> None:
        self.row[slot] = -1
        self._held.discard(slot)

    def move(self, src: int, dst: int) -> None:
        """The row in slot ``src`` now lives in the free slot ``dst``."""
        self.occupy(dst, self.row[src], self.prompt_len[src], self.start[src], self.max_new[src])
        self.release(src)

    def shrink(self, num_slots: int) -> None:
        """Keep the first ``num_slots`` slots (the others must be empty)."""
        assert all(s < num_slots for s in self._held), "rows are moved into the first slots before a shrink"
        for table in (self.row, self.prompt_len, self.start, self.max_new):
            del table[num_slots:]

    @property
    def occupied(self) -> list[int]:
        return sorted(self._held)

    @property
    def free(self) -> list[int]:
        return [s for s, r in enumerate(self.row) if r < 0]

    def filled(self, forwards: int) -> int:
        """Cache columns the ``forwards``-th forward may attend to in a held row: a slot loaded after ``start``
        forwards attends to its prompt plus one column per forward since, and stops moving after ``max_new``
        tokens. Empty slots do not count: their rows are gone, so what they attend to is never read (column 0,
        a prompt's, is always in their mask, so no row is fully masked)."""
        return max((self.prompt_len[s] + min(forwards - self.start[s], self.max_new[s]) for s in self._held), default=1)

    def last_forward(self, slot: int) -> int:
        """The forward after which the slot's row has ended at the latest (its max_new_tokens-th token)."""
        return self.start[slot] + self.max_new[slot] - 1


class _StopStrings:
    """SGLang's stop-string check: after each token, decode the last (longest stop in tokens + 1)
    tokens and look for every stop string in that text (``schedule_batch.py``, ``tail_str``)."""

    def __init__(self, tokenizer, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.window = 1 + max(len(tokenizer.encode(s, add_special_tokens=False)) for s in stops)

    def match(self, output_ids: list[int]) -> str | None:
        tail = self.tokenizer.decode(output_ids[-self.window :])
        return next((s for s in self.stops if s in tail), None)


class StopStringSlots:
    """Stop-string matching of the slots whose rows have stop strings, on the host, a few steps behind the
    device: :meth:`scan` feeds each row's new tokens to its matcher one at a time (so the match is found on the
    exact token that completes it, as SGLang's per-step check does) and cuts the row there. A stop token on that
    same token wins, as it is checked first in SGLang too."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.matchers: dict[int, _StopStrings] = {}
        self.outputs: dict[int, list[int]] = {}
        self.matched: dict[int, str] = {}
        """Slot -> the stop string its row ended on (until :meth:`start` gives the slot a new row)."""

    def start(self, slot: int, stops: Sequence[str]) -> None:
        """The slot holds a new row with these stop strings (none: nothing to match)."""
        self.matched.pop(slot, None)
        self.matchers.pop(slot, None)
        self.outputs.pop(slot, None)
        if stops:
            self.matchers[slot] = _StopStrings(self.tokenizer, stops)
            self.outputs[slot] = []

    def move(self, src: int, dst: int) -> None:
        """The row in slot ``src`` now lives in the free slot ``dst``."""
        _move_key(self.matchers, src, dst)
        _move_key(self.outputs, src, dst)
        _move_key(self.matched, src, dst)

    def scan(self, batch: DecodeBatch) -> None:
        """Match the tokens not scanned yet of every open slot (one host read of those rows)."""
        if not self.matchers:
            return
        slots = sorted(self.matchers)
        index = torch.tensor(slots, device=batch.tokens.device)
        lengths, finish = batch.lengths[index].tolist(), batch.finish[index].tolist()
        tokens = batch.tokens[index, : max(lengths)].tolist()
        for b, row_tokens, length, code in zip(slots, tokens, lengths, finish, strict=True):
            output = self.outputs[b]
            for s in range(len(output), length):
                output.append(row_tokens[s])
                matched = self.matchers[b].match(output)
                if matched is not None:
                    if s < length - 1 or code != Finish.STOP_TOKEN:
                        batch.cut(b, s + 1)
                        self.matched[b] = matched
                    code = Finish.STOP_STRING
                    break
            if code != Finish.RUNNING:
                del self.matchers[b], self.outputs[b]


def _move_key(table: dict, src: int, dst: int) -> None:
    """``table[src]`` (if any) becomes ``table[dst]``, and whatever ``dst`` held is gone."""
    table.pop(dst, None)
    if src in table:
        table[dst] = table.pop(src)
