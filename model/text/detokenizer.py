"""Incremental detokenization: the text a stream of token ids adds, emitted as soon as it is stable."""

from __future__ import annotations

from model.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Streaming decode of one sequence by decoding a short window of recent ids (vLLM's prefix/read offsets).

    feed(id) returns the new text; it is held back while the window decodes to a trailing U+FFFD (a UTF-8
    character split across tokens). All deltas + flush() == tokenizer.decode(all ids, skip_special_tokens).
    One exception, inherent to streaming: with SentencePiece byte fallback, `tokenizers`' ByteFallback decoder
    turns a whole run of <0xXX> tokens into U+FFFD if any part of it is invalid UTF-8, so valid characters
    already streamed from such a run show as U+FFFD in decode(). Valid text and byte-level BPE are exact.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: ids[prefix_offset:read_offset] is already-emitted context
        self.read_offset = 0  # ids before this have been emitted

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def feed(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        # The new context ids[read_offset:] produced text, so decoders that treat the first character of a decode
        # specially (SentencePiece's Strip(left=1)) see the same first character in both decodes above.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end decodes as U+FFFD, as decode() does)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]
