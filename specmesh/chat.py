"""Chat templates without transformers: a model directory's Jinja template rendered in jinja2's sandbox.

Hugging Face checkpoints keep the template in ``chat_template.jinja`` or under ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of named templates of which ``default`` is used). It
renders with the same variables and helpers transformers gives it (``messages``,
``add_generation_prompt``, the special-token strings, ``raise_exception``, ``strftime_now``,
``tojson``); the rendered text already holds the special tokens, so it is tokenized without adding
any (``TextTokenizer.encode(text, add_special_tokens=False)``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or a message is malformed)."""


def _token_text(value) -> str | None:
    if isinstance(value, Mapping):  # {"content": "<s>", ...} in older tokenizer configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def _override_source(override: str) -> str:
    """A --chat-template value: a file's text, or the value itself when it reads as a Jinja template."""
    file = Path(override).expanduser()
    if "{" not in override and len(override) < 4096:
        try:
            return file.read_text()
        except OSError as exc:
            raise ChatTemplateError(f"--chat-template {override}: not a readable file ({exc.strerror}) nor a "
                                    "Jinja template") from None
    return override


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        import jinja2
        import jinja2.meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        self.special_tokens = dict(special_tokens or {})

    def reads(self, variable: str) -> bool:
        """Whether the template reads ``variable`` (e.g. ``tools``: a template without it never shows them)."""
        return variable in self._variables

    @classmethod
    def load(cls, model_dir: str | Path, override: str | None = None) -> ChatTemplate | None:
        """The directory's chat template, or None when it has none; ``override`` (`serve --chat-template`, as
        vLLM's): a template file, or the template itself, used instead (with the directory's special tokens).
        ChatTemplateError when the override is neither, or does not parse."""
        path = Path(model_dir)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates
            source = {t.get("name"): t.get("template") for t in source}.get("default")
        if (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text()
        if override is not None:
            source = _override_source(override)
        if not isinstance(source, str) or not source.strip():
            return None
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        special = {n: t for n in names if (t := _token_text(config.get(n))) is not None}
        try:
            return cls(source, special)
        except Exception as exc:  # jinja2's TemplateSyntaxError
            raise ChatTemplateError(f"the chat template does not parse: {exc}") from None

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text for ``messages`` (OpenAI's shape: role + content, content a string or text parts);
        ``variables``: more of the template's (``tools``)."""
        import jinja2

        plain = []
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if any(not isinstance(p, Mapping) or p.get("type") != "text" for p in content):
                    raise ChatTemplateError(f"messages[{i}]: only text content parts are supported")
                content = "".join(p.get("text", "") for p in content)
            plain.append({**message, "content": content if content is not None else ""})
        try:
            return self._template.render(messages=plain, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template refused the messages: {exc}") from None
