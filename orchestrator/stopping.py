"""Stop conditions: max_new_tokens, EOS / stop token ids, stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specmesh.sampling import SamplingParams


class StopChecker:
    """Feeds newly committed tokens; says which of them to emit and whether generation ends.

    Stop strings need ``decode`` (token ids -> text). When a stop string appears,
    generation ends after the token that completed it and ``text_limit`` says where
    the returned text must be cut.
    """

    def __init__(self, sampling: SamplingParams, eos_token_ids: Sequence[int], decode: Callable[[list[int]], str] | None):
        self.max_new_tokens = sampling.max_new_tokens
        self.stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids))
        self.stop_strings = sampling.stop
        if self.stop_strings and decode is None:
            raise ValueError("stop strings need a tokenizer to decode with")
        self.decode = decode
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.text_limit: int | None = None
        self._text_len = 0  # length of the text decoded so far

    def push(self, tokens: Sequence[int]) -> list[int]:
        """Append ``tokens`` one by one; return the ones to emit (none after a condition fires).

        Conditions are checked after every token, exactly as plain decoding would, so a
        speculative step that commits several tokens stops at the same token.
        """
        emitted: list[int] = []
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
        text = self.decode(self.generated)
        # only text the newest token can have touched needs a search
        tail_start = max(0, self._text_len - max(len(s) for s in self.stop_strings))
        self._text_len = len(text)
        hits = [i for i in (text.find(s, tail_start) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text_limit = min(hits)
        return bool(hits)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)


class TextStream:
    """Incremental detokenization. Text is emitted once stable: never half a multi-byte character,
    and never the last len(longest stop string) - 1 characters, which could still turn out to begin
    a stop string (text once streamed cannot be taken back). ``flush`` emits the rest at the end."""

    def __init__(self, decode, stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.printed = ""

    def push(self, ids: Sequence[int], text_limit: int | None) -> str:
        self.ids += ids
        text = self._text(text_limit)
        if self.holdback:
            text = text[: max(len(self.printed), len(text) - self.holdback)]
        return self._emit(text)

    def flush(self, text_limit: int | None) -> str:
        return self._emit(self._text(text_limit))

    def _text(self, text_limit: int | None) -> str:
        text = self.decode(self.ids)
        return text[:text_limit] if text_limit is not None else text

    def _emit(self, text: str) -> str:
        if not text.startswith(self.printed) or text.endswith("\ufffd"):
            return ""
        new, self.printed = text[len(self.printed):], text
        return new
