"""Stop conditions (max_new_tokens, EOS / stop token ids, stop strings) and incremental detokenization.

Text is decoded a few tokens at a time (``IncrementalText``), never the whole output again: a request's
text costs O(1) decoding per token, and a stop string is searched for only in the text the newest token
added (plus the few characters before it that a stop string can span)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specmesh.sampling import SamplingParams

REPLACEMENT = "\ufffd"  # what a decoder shows for the bytes of a character not complete yet


class IncrementalText:
    """The text of a growing token sequence, decoded incrementally: each ``push`` decodes only a window of
    the newest tokens (those not yet turned into text, after the ones of the last piece as context), once
    with and once without the unread ones, and returns the difference (the method of Hugging Face TGI's and
    vLLM's detokenizers). The window's context keeps what a tokenizer does at the start of a decode (a
    SentencePiece decoder drops the first token's leading space) out of the pieces. Text that ends in an
    incomplete multi-byte character is held until the character completes; ``flush`` returns what is left as
    the decoder shows it. The pieces joined equal ``decode(ids)`` for the byte-level BPE and SentencePiece
    tokenizers (tests check it token by token on real text), and do not depend on how ids are grouped into
    pushes as long as they are pushed one at a time (the stop checker and the text stream both do)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # the window: ids[prefix:], of which ids[prefix:read] are text already
        self.read = 0
        self.length = 0  # characters returned so far

    def push(self, token: int) -> str:
        """Append one token; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token)
        seen = self._seen()
        text = self.decode(self.ids[self.prefix :])
        if len(text) <= len(seen) or text.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        self.length += len(text) - len(seen)
        return text[len(seen) :]

    def flush(self) -> str:
        """The text of the tokens not returned yet, an incomplete last character shown as the decoder shows it."""
        if self.read == len(self.ids):
            return ""
        text = self.decode(self.ids[self.prefix :])[len(self._seen()) :]
        self.prefix = self.read = len(self.ids)
        self.length += len(text)
        return text

    def _seen(self) -> str:
        """The window's context as text: its tokens already returned."""
        return self.decode(self.ids[self.prefix : self.read]) if self.read > self.prefix else ""


class StopChecker:
    """Feeds newly committed tokens; says which of them to emit and whether generation ends.

    Stop strings need ``decode`` (token ids -> text). When a stop string appears,
    generation ends after the token that completed it and ``text_limit`` says where
    the returned text must be cut: before the stop string, or after it with
    ``include_stop_str_in_output``.
    """

    def __init__(self, sampling: SamplingParams, eos_token_ids: Sequence[int], decode: Callable[[list[int]], str] | None):
        self.max_new_tokens = sampling.max_new_tokens
        self.stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids))
        self.stop_strings = sampling.stop
        self.include_stop = sampling.include_stop_str_in_output
        if self.stop_strings and decode is None:
            raise ValueError("stop strings need a tokenizer to decode with")
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.text_limit: int | None = None
        self._text = IncrementalText(decode) if self.stop_strings else None
        self._span = max((len(s) for s in self.stop_strings), default=1) - 1  # characters a match can reach back
        self._tail = ""  # the last _span characters of the text so far

    def push(self, tokens: Sequence[int]) -> list[int]:
        """Append ``tokens`` one by one; return the ones to emit (none after a condition fires).

        Conditions are checked after every token, exactly as plain decoding would, so a
        speculative step that commits several tokens stops at the same token.
        """
        if (self.finish_reason is None and not self.stop_strings and self.stop_ids.isdisjoint(tokens)
                and len(self.generated) + len(tokens) < self.max_new_tokens):  # no condition can fire: all at once
            emitted = [int(tok) for tok in tokens]
            self.generated += emitted
            return emitted
        emitted = []
        for tok in tokens:
            if self.finish_reason is not None:
                break
            self.generated.append(int(tok))
            emitted.append(int(tok))
            if tok in self.stop_ids or (self.stop_strings and self._stop_string_completed()):
                self.finish_reason = "stop"
            elif len(self.generated) >= self.max_new_tokens:
                self.finish_reason = "length"
        return emitted

    def _stop_string_completed(self) -> bool:
        """Whether the newest token's text completed a stop string: searched in that text and the characters
        before it that a stop string can span; ``text_limit`` is then where the match starts in the text."""
        start = self._text.length
        piece = self._text.push(self.generated[-1])
        if not piece:
            return False
        window = self._tail + piece
        hits = [(i, -len(s)) for s in self.stop_strings if (i := window.find(s)) >= 0]
        if hits:
            at, minus_length = min(hits)  # the earliest match (the longest of those starting there)
            self.text_limit = start - len(self._tail) + at - (minus_length if self.include_stop else 0)
            return True
        self._tail = window[max(0, len(window) - self._span) :]
        return False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)


class TextStream:
    """Streamed text (``IncrementalText``, one token at a time, as ``StopChecker`` decodes it, so that its
    ``text_limit`` indexes this text). Text is emitted once stable: never half a multi-byte character, and never
    the last len(longest stop string) - 1 characters, which could still turn out to begin a stop string (text
    once streamed cannot be taken back). ``flush`` emits the rest at the end."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.text = IncrementalText(decode)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.pending = ""  # decoded, not emitted
        self.emitted = 0  # characters emitted

    def push(self, ids: Sequence[int], text_limit: int | None) -> str:
        for token in ids:
            self.pending += self.text.push(int(token))
        if text_limit is not None:
            return self._emit(max(0, text_limit - self.emitted))
        return self._emit(max(0, len(self.pending) - self.holdback))

    def flush(self, text_limit: int | None) -> str:
        self.pending += self.text.flush()
        return self._emit(len(self.pending) if text_limit is None else max(0, text_limit - self.emitted))

    def _emit(self, count: int) -> str:
        out, self.pending = self.pending[:count], self.pending[count:]
        self.emitted += len(out)
        return out
