"""Chat messages -> prompt text, and the served model's end-of-sequence ids.

Owns: the byte model's fixed tagged format (it has no template of its own) and, for `hf`
checkpoints, the checkpoint's own Jinja chat template from `tokenizer_config.json`,
rendered the way `transformers` renders it (a sandboxed environment, `messages`,
`add_generation_prompt`, the special tokens, `raise_exception`); plus the checkpoint's
EOS ids (config.json / generation_config.json), which end a request unless the client
sets `ignore_eos`.

It must never load weights or a tokenizer: only small JSON files are read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from preempt.core.config import EngineConfig


class ChatTemplateError(ValueError):
    """The template refused the conversation (its own `raise_exception`)."""


def render_tagged(messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    """The byte model's format: one tagged block per message, then the assistant's tag."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def _token_text(value: Any) -> str:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    """A checkpoint's Jinja chat template (`tokenizer_config.json` "chat_template")."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateError as err:
            raise ValueError(f"the checkpoint's chat_template does not parse: {err}") from None
        self._special_tokens = special_tokens

    def render(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(
                messages=[{"role": role, "content": content} for role, content in messages],
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from None

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> ChatTemplate | None:
        """The template of a checkpoint directory, or None when it has none."""
        path = Path(directory) / "tokenizer_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: use "default"
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return cls(source, {name: _token_text(config.get(name)) for name in names})


class ChatFormat:
    """How this server turns messages into a prompt."""

    def __init__(self, template: ChatTemplate | None) -> None:
        self.template = template

    def render(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> str:
        if self.template is None:
            return render_tagged(messages, add_generation_prompt)
        return self.template.render(messages, add_generation_prompt)


def chat_format_for(config: EngineConfig) -> ChatFormat:
    if config.model.backend == "hf" and config.model.checkpoint:
        return ChatFormat(ChatTemplate.from_checkpoint(config.model.checkpoint))
    return ChatFormat(None)


def eos_token_ids(config: EngineConfig) -> frozenset[int]:
    """The checkpoint's EOS ids (generation_config.json first, then config.json); none
    for the byte model, whose length always comes from max_tokens."""
    if config.model.backend != "hf" or not config.model.checkpoint:
        return frozenset()
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(config.model.checkpoint) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
