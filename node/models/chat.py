"""How a node turns a conversation into the tokens its model reads, and replies back into text.

A codec per model family (issue 23, item 3):

* ``ByteCodec`` -- the byte-level model's identity framing: text is UTF-8 bytes, a turn feeds
  exactly its bytes, no template, no EOS. ``Sessions`` without a codec behaves this way (and
  this is what the default product model serves; ``tests/node/test_golden_decode.py``).
* ``ChatCodec`` -- a Hugging Face tokenizer with a chat template (``node.models.smollm2`` writes
  ``tokenizer.json`` and ``chat_template.jinja`` into the model directory). The system prompt
  is the templated system message; a user turn is the templated user message plus the
  assistant header (``add_generation_prompt``); a reply ends at an EOS id (the tokenizer's and
  ``generation_config.json``'s), and the end of the assistant turn the template writes after
  the content (for ChatML ``<|im_end|>\\n``; the EOS the model produced is part of it) is fed
  after it. Each piece is the difference between two renderings of the template, so the tokens
  a session feeds are the tokens ``tokenizer.apply_chat_template`` gives for the whole
  conversation.

  Message content is text, never markup: "<|im_end|>\\n<|im_start|>system" typed by a user
  tokenizes as those characters, not as the template's special tokens (which would let a user
  close their turn and write a system message). The template is rendered with a marker in place
  of each content; only the template's own text is read for special tokens, each content is
  tokenized with the plain template text around it up to the nearest special token with
  ``split_special_tokens=True`` -- so a conversation without such text gives the same ids as its
  rendered text (``apply_chat_template``). A template that rewrites content is refused.

"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
from collections.abc import Sequence
from typing import Any

Message = dict[str, str]


class ByteCodec:
    """The byte-level model's framing: identity, no template, no EOS (today's behaviour)."""

    chat = False
    eos_ids: frozenset[int] = frozenset()

    def system(self, prompt: str | bytes) -> list[int]:
        return list(prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt))

    def user(self, messages: Sequence[Message], text: str | bytes) -> list[int]:
        return self.system(text)

    def end_of_reply(self, messages: Sequence[Message], reply: str, eos: bool) -> list[int]:
        return []

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(tokens).decode("utf-8", "replace")


class ChatCodec:
    """A tokenizer with a chat template (see the module docstring)."""

    chat = True

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int] | None = None):
        self.tokenizer = tokenizer
        if eos_ids is None:
            eos_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        if not self.eos_ids:
            raise ValueError("a chat codec needs at least one EOS id")
        self.special_ids: dict[str, int] = {
            str(t): int(i) for i, t in tokenizer.added_tokens_decoder.items()}
        """The tokenizer's added tokens (text -> id): read as such in the template's text only."""

    @functools.cached_property
    def _specials(self) -> re.Pattern[str] | None:
        """Splits text at special-token strings, keeping them (longest first)."""
        names = sorted(self.special_ids, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    @classmethod
    def from_dir(cls, directory: str | os.PathLike | None = None) -> "ChatCodec":
        """The tokenizer of a converted model directory (``node.models.smollm2``; default its
        ``default_dir()``), EOS ids from the tokenizer and ``generation_config.json``: read
        from the files the pinned manifest lists, verified (``node.models.smollm2.small_files``), never
        from whatever else the directory holds."""
        from node.models import smollm2 as models
        files = models.small_files(directory)
        tok = models.tokenizer_from(files)
        eos = {tok.eos_token_id} - {None}
        if "generation_config.json" in files:
            e = json.loads(files["generation_config.json"]).get("eos_token_id")
            eos |= set(e if isinstance(e, list) else [e]) - {None}
        return cls(tok, sorted(eos))

    # -- the template, rendered as text and cut into the pieces a session feeds -------------
    def render(self, messages: Sequence[Message], generation_prompt: bool = False) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Template text to ids (special tokens in it are read as such, none are added): for
        the template's own text, or a prompt whose author may write special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The templated conversation and the assistant header as ids, contents as text."""
        return self._encode_delta([], messages, True)

    def _encode_delta(self, before: Sequence[Message], after: Sequence[Message],
                      generation_prompt: bool) -> list[int]:
        """The ids of what rendering ``after`` adds to rendering ``before`` (a prefix of it),
        message contents tokenized as plain text (see the module docstring)."""
        if not after:
            return []  # nothing rendered (an empty system prompt)
        nonce = secrets.token_hex(8)
        marks = {f"\x00fedkv-{nonce}-{i}\x00": m["content"] for i, m in enumerate(after)}
        marked = [{**m, "content": k} for m, k in zip(after, marks)]
        text = self._delta(self.render(marked[:len(before)]), self.render(marked, generation_prompt))
        find = re.compile("(" + "|".join(map(re.escape, marks)) + ")")
        real = self._delta(self.render(before), self.render(after, generation_prompt))
        if find.sub(lambda m: marks[m.group()], text) != real:
            raise ValueError("the chat template rewrites message content: it cannot be "
                             "tokenized apart from the template's special tokens")
        ids: list[int] = []
        run: list[str] = []  # plain text up to the next template special token
        for i, piece in enumerate(find.split(text)):
            if i % 2:
                run.append(marks[piece])
                continue
            for j, part in enumerate(self._specials.split(piece) if self._specials else [piece]):
                if j % 2:
                    ids += self._plain("".join(run))
                    run = []
                    ids.append(self.special_ids[part])
                else:
                    run.append(part)
        return ids + self._plain("".join(run))

    def _plain(self, text: str) -> list[int]:
        """Text to ids with any special-token text in it split into ordinary tokens."""
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False,
                                   split_special_tokens=True)["input_ids"])

    def _delta(self, before: str, after: str) -> str:
        if not after.startswith(before):
            raise ValueError("the chat template does not extend the conversation by appending")
        return after[len(before):]

    def system(self, prompt: str) -> list[int]:
        """The templated system message: the prefix sessions with this prompt share."""
        return self._encode_delta([], _system(prompt), False)

    def user(self, messages: Sequence[Message], text: str) -> list[int]:
        """The templated user turn and the assistant header, after ``messages``."""
        return self._encode_delta(messages, [*messages, {"role": "user", "content": text}], True)

    def end_of_reply(self, messages: Sequence[Message], reply: str, eos: bool) -> list[int]:
        """What the template writes after the assistant's content (``messages`` ends with the
        user turn), less the EOS the model already produced when ``eos``."""
        mark = "\x00fedkv-reply\x00"
        head = self.render(messages, True)
        tail = self._delta(head, self.render([*messages, {"role": "assistant", "content": mark}]))
        tokens = self.encode(tail[tail.index(mark) + len(mark):])
        if eos and tokens and tokens[0] in self.eos_ids:
            tokens = tokens[1:]
        return tokens

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def conversation_ids(self, messages: Sequence[Message]) -> list[int]:
        """``apply_chat_template`` of ``messages`` as ids: what a session should have fed."""
        out = self.tokenizer.apply_chat_template(list(messages), tokenize=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)


def _system(prompt: str) -> list[Message]:
    return [{"role": "system", "content": prompt}] if prompt else []
