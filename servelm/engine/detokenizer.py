"""Incremental detokenization and stop strings, one IncrementalDetokenizer per request.

Invariants:
- ``text`` is the decoded completion so far, cut at a matched stop string (which is left out
  unless include_stop_str_in_output).
- Text is released to the client only once no stop string can still begin inside it: while a
  request runs, the last ``max_stop_len - 1`` characters are held back. Streamed pieces therefore
  concatenate to exactly the non-streamed text.
- A piece that decodes to an incomplete UTF-8 sequence ("\\ufffd" at the end) waits for the next
  token, so multi-byte characters split across tokens are never emitted broken.
"""

from __future__ import annotations

from typing import Any

from servelm.sampling.params import SamplingParams

# Prompt tokens decoded with the first output tokens so that tokenizers that drop a leading space
# when decoding a lone token (SentencePiece-style) produce the right first piece.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a request's new token ids into new text and finds its stop strings."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._sent_chars = 0
        self._checked_chars = 0
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._num_output_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(
            ids,
            skip_special_tokens=self._params.skip_special_tokens,
            spaces_between_special_tokens=self._params.spaces_between_special_tokens,
        )
        return text

    @property
    def num_output_tokens(self) -> int:
        """Output tokens decoded: after a stop-string match, those up to the one completing it."""
        return self._num_output_tokens

    def add_tokens(self, output_token_ids: list[int]) -> str | None:
        """Decode the output tokens not seen yet; returns the stop string matched, else None.

        Several new tokens (speculative decoding accepts runs) are checked one at a time, so the
        match is found at the token plain decoding would have stopped at: ``num_output_tokens``
        then says how many tokens the output keeps. After a match the text is cut there and
        later calls change nothing.
        """
        new_ids = output_token_ids[self._num_output_tokens:]
        for token_id in new_ids:
            self._num_output_tokens += 1
            self._ids.append(token_id)
            prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full_text = self._decode(self._ids[self._prefix_offset:])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                self.text += full_text[len(prefix_text):]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
                stop = self._find_stop()
                if stop is not None:
                    return stop
        return None

    def _find_stop(self) -> str | None:
        if not self._max_stop_len:
            return None
        search_from = max(0, self._checked_chars - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._params.stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        self._checked_chars = len(self.text)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self._params.include_stop_str_in_output else index
        self.text = self.text[:end]
        return stop

    def take_new_text(self, is_finished: bool) -> str:
        """Text not yet sent that can no longer turn into part of a stop string."""
        limit = len(self.text)
        if not is_finished and self._max_stop_len > 1:
            limit = max(self._sent_chars, limit - (self._max_stop_len - 1))
        piece = self.text[self._sent_chars:limit]
        self._sent_chars = limit
        return piece
