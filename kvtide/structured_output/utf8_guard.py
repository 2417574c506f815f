"""Utf8Guard: keeps constrained output valid UTF-8 where xgrammar 0.2.9's matcher does not.

After the lead bytes E0, ED, F0 and F4 the matcher accepts any continuation byte, but UTF-8 allows
only part of that range there: E0 A0-BF (no overlong 3-byte forms), ED 80-9F (no surrogates),
F0 90-BF (no overlong 4-byte forms), F4 80-8F (nothing above U+10FFFF). With a vocabulary that
holds single bytes (every byte-level BPE), a grammar's strings then admit byte runs that decode to
replacement characters (which also break maxLength). After such a lead byte the guard masks the
tokens whose first byte is a continuation byte outside the allowed range.
"""

from __future__ import annotations

import numpy as np
import torch

SECOND_BYTE_RANGE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
"""Lead byte -> the range UTF-8 allows for the byte after it (narrower than 80-BF)."""


class Utf8Guard:
    def __init__(self, token_bytes: list[bytes], vocab_size: int) -> None:
        self.token_bytes = token_bytes
        words = (vocab_size + 31) // 32
        self.masks: dict[int, torch.Tensor] = {}
        """lead byte -> allowed-token bitmask row (xgrammar's layout: bit i of word i // 32)."""
        for lead, (low, high) in SECOND_BYTE_RANGE.items():
            allowed = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
            for token, data in enumerate(token_bytes[:vocab_size]):
                if data and 0x80 <= data[0] <= 0xBF and not low <= data[0] <= high:
                    allowed[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
            self.masks[lead] = torch.from_numpy(allowed.view(np.int32))

    def lead_after(self, token_id: int) -> int | None:
        """The lead byte a token ends with, if it restricts the next byte."""
        data = self.token_bytes[token_id] if token_id < len(self.token_bytes) else b""
        return data[-1] if data and data[-1] in SECOND_BYTE_RANGE else None

    def allows(self, lead: int | None, token_id: int) -> bool:
        if lead is None:
            return True
        data = self.token_bytes[token_id] if token_id < len(self.token_bytes) else b""
        low, high = SECOND_BYTE_RANGE[lead]
        return not (data and 0x80 <= data[0] <= 0xBF and not low <= data[0] <= high)

    def restrict(self, bitmask: torch.Tensor, row: int, lead: int | None) -> None:
        if lead is not None:
            bitmask[row] &= self.masks[lead]
