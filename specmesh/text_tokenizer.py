"""Text <-> token ids without transformers (and torch): `specmesh serve`, which runs no model, and the embedded
commands, which run the fast path without transformers' import cost.

A model directory's ``tokenizer.json`` is read with the ``tokenizers`` library, which is what
transformers' fast tokenizers run underneath; for the tokenizer classes that add nothing on the
Python side (``PreTrainedTokenizerFast``, ``TokenizersBackend``, no clean-up of spaces) the ids and
the text are the same (tests/test_text_tokenizer.py checks both bundled vocabularies). Any other
tokenizer is loaded through transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

PLAIN_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


class TextTokenizer:
    """``encode`` / ``decode`` of transformers' tokenizers, on ``tokenizers.Tokenizer`` alone."""

    def __init__(self, tokenizer_json: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))

    def encode(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> list[int]:
        """``verbose``: transformers' switch for its too-long-prompt warning; nothing is warned about here."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included (as transformers' ``get_vocab``)."""
        return self._tokenizer.get_vocab(with_added_tokens=True)


def load_text_tokenizer(path: str | Path):
    """A TextTokenizer when the directory's tokenizer needs nothing of transformers, else transformers' own."""
    path = Path(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if ((path / "tokenizer.json").is_file() and config.get("tokenizer_class") in PLAIN_CLASSES
            and not config.get("clean_up_tokenization_spaces", False)):
        return TextTokenizer(path / "tokenizer.json")
    from specmesh.models import load_tokenizer

    return load_tokenizer(path)
