"""Incremental detokenization with stop strings.

Text is produced a token at a time, but a token may end in the middle of a UTF-8 character (byte-level
BPE) and a stop string may span several tokens. So text is only released once it is complete, and the
tail that could still be the start of a stop string is held back until the next token settles it.
"""

from __future__ import annotations

from runtime.engine.tokenizer import Tokenizer

# Decoding starts a few prompt tokens back so the first output token gets its leading space right
# (SentencePiece decoders drop the space of a token that starts a decoded text).
_PROMPT_CONTEXT = 5


class OutputText:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self.text = ""
        self._released = 0

    def add_token(self, token_id: int) -> bool:
        """Append one generated token; True when the text now contains a stop string (it is cut there)."""
        self._ids.append(token_id)
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete character: wait for the next token
        searched_from = max(0, len(self.text) - max((len(s) for s in self._stop), default=0) + 1)
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._cut_at_stop(searched_from)

    def _cut_at_stop(self, start: int) -> bool:
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def release(self, final: bool) -> str:
        """Text not handed out yet that can no longer change (all of it when `final`)."""
        end = len(self.text) if final else len(self.text) - self._held_back()
        end = max(end, self._released)
        delta, self._released = self.text[self._released:end], end
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
