"""RequestGrammar: one request's grammar matcher, advanced by the tokens the request emits.

The matcher follows the request's output tokens, which survive preemption (only their KV is
recomputed), so a preempted request resumes with its grammar where it was. Drafts are tried on
the matcher and rolled back; only emitted tokens stay accepted.

Under a byte-level vocabulary the matcher admits a few invalid UTF-8 byte runs; the Utf8Guard
masks them (utf8_guard.py).

With a reasoning section (`reasoning_end_token_ids`), the grammar is dormant until the output
holds that token sequence and applies to every token after it.
"""

from __future__ import annotations

from kvtide.structured_output.utf8_guard import Utf8Guard


class RequestGrammar:
    def __init__(self, compiled, stop_token_ids: list[int], reasoning_end_token_ids: list[int] | None,
                 utf8_guard: Utf8Guard | None = None) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self._guard = utf8_guard
        self._lead: int | None = None
        """A lead byte the last token ended with, which narrows the next byte (utf8_guard.py)."""
        self._reasoning_end = list(reasoning_end_token_ids or [])
        self.active = not self._reasoning_end
        self._recent: list[int] = []
        """The last tokens seen while dormant (to find the end of the reasoning section)."""

    def fork(self) -> RequestGrammar:
        """An independent copy at the same state (a beam continuing from this one)."""
        other = RequestGrammar.__new__(RequestGrammar)
        other.matcher = self.matcher.fork()
        other._guard, other._lead = self._guard, self._lead
        other._reasoning_end = self._reasoning_end
        other.active = self.active
        other._recent = list(self._recent)
        return other

    def accept(self, token_id: int) -> bool:
        """Advance over an emitted token; False when the grammar forbids it (or has ended)."""
        if not self.active:
            self._recent = (self._recent + [token_id])[-len(self._reasoning_end):]
            self.active = self._recent == self._reasoning_end
            return True
        if not self._allows(self._lead, token_id) or not self.matcher.accept_token(token_id):
            return False
        self._lead = self._lead_after(token_id)
        return True

    def _allows(self, lead: int | None, token_id: int) -> bool:
        return self._guard is None or self._guard.allows(lead, token_id)

    def _lead_after(self, token_id: int) -> int | None:
        return self._guard.lead_after(token_id) if self._guard is not None else None

    def _restrict(self, bitmask, row: int, lead: int | None) -> None:
        if self._guard is not None:
            self._guard.restrict(bitmask, row, lead)

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted its stop token: the output is complete."""
        return self.active and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]; False when every token is allowed
        (dormant, or the grammar allows anything here) so the row need not be masked."""
        if not self.active:
            return False
        needed = self.matcher.fill_next_token_bitmask(bitmask, row)
        if self._lead is None:
            return needed
        self._restrict(bitmask, row, self._lead)
        return True

    def check_drafts(self, drafts: list[int], bitmask, first_row: int) -> int:
        """Fill bitmask rows first_row .. first_row + len(drafts) for the positions after each
        draft prefix, trying the drafts on the matcher and rolling them back. Returns how many
        leading drafts the grammar allows; the rows after the first forbidden draft repeat the
        mask of its position (the verifier rejects it there, so they are never read)."""
        if not self.active:
            return len(drafts)
        num_ok = 0
        lead = self._lead
        for j, token in enumerate(drafts):
            self.matcher.fill_next_token_bitmask(bitmask, first_row + j)
            self._restrict(bitmask, first_row + j, lead)
            if not self._allows(lead, token) or not self.matcher.accept_token(token):
                for rest in range(j + 1, len(drafts) + 1):
                    bitmask[first_row + rest] = bitmask[first_row + j]
                break
            lead = self._lead_after(token)
            num_ok += 1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, first_row + len(drafts))
            self._restrict(bitmask, first_row + len(drafts), lead)
        if num_ok:
            self.matcher.rollback(num_ok)
        return num_ok

    def jump_forward_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (keys, punctuation, fixed strings),
        accepted on the matcher: the request appends them without sampling each one. xgrammar
        stops before a token that a longer vocabulary token could extend, so the model keeps
        its choice at the boundary."""
        if not self.active or limit <= 0 or self.matcher.is_terminated():
            return []
        tokens = self.matcher.find_jump_forward_tokens()[:limit]
        accepted = []
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted.append(token)
            self._lead = self._lead_after(token)
        return accepted
