"""Constrained output: OpenAI's ``response_format`` (``json_schema``, ``json_object``) as a
grammar that masks each token's logits, through llguidance (a dependency of fedkv; a server
whose install lacks it answers ``response_format`` with a 400 naming it).

``parse_response_format`` checks the request field (a ``FormatError`` names the part that is
wrong); a ``GrammarCompiler`` per vocabulary (a Hugging Face fast tokenizer, or the byte model's
ids-are-bytes) compiles it to a ``Grammar``, shared by a request's samples; each sample gets
its own ``Matcher``: ``mask(logits)`` sets every token the grammar does not allow next to -inf
(None when it allows none of the model's: the output is complete), ``accept(token)`` advances
it. EOS is allowed only where the grammar is complete; a vocabulary without an EOS (the byte
model) gets a virtual one past its last id, so a complete output masks every real token and
the backend finishes the sample ``stop``. JSON is compact (no free whitespace: a small model
can otherwise loop on spaces). A reply cut by ``max_tokens`` is cut JSON, as OpenAI's is.
"""

# Why llguidance: measured ~70 us/token mask+accept on SmolLM2's vocab (1 CPU thread) vs xgrammar ~220 us, outlines-core ~0.7-2 ms.

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import torch

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


class StructuredOutputUnavailable(RuntimeError):
    """The grammar library is not installed (the server answers 400 with this text)."""


class FormatError(ValueError):
    """A ``response_format`` this server cannot take; ``param`` names the part."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ResponseFormat:
    """A checked ``response_format`` other than ``text``: the JSON schema the output follows
    (``json_object``: any object)."""

    type: str
    schema_text: str
    """The schema as JSON text (compared and hashed as text)."""


def parse_response_format(v: Any) -> ResponseFormat | None:
    """OpenAI's ``response_format`` checked; None for ``text`` or absent."""
    p = "response_format"
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise FormatError(p, f"'{p}' must be an object with a 'type' in {list(RESPONSE_FORMATS)}")
    if v["type"] not in RESPONSE_FORMATS:
        raise FormatError(f"{p}.type", f"'{p}.type' must be one of {list(RESPONSE_FORMATS)}, "
                                       f"got {v['type']!r}")
    if v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return ResponseFormat("json_object", json.dumps({"type": "object"}))
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise FormatError(f"{p}.json_schema", f"'{p}.json_schema' must be an object "
                                              "{name, schema, strict?}")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise FormatError(f"{p}.json_schema.schema",
                          f"'{p}.json_schema.schema' must be a JSON schema object")
    return ResponseFormat("json_schema", json.dumps(schema))


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise StructuredOutputUnavailable(
            "response_format needs the grammar library llguidance, not installed on this "
            "server (pip install llguidance)") from None
    return llguidance


class _ByteVocab:
    """llguidance's view of a vocabulary whose ids are bytes, with a virtual EOS after them."""

    def __init__(self, vocab_size: int):
        self.eos_token_id, self.bos_token_id = vocab_size, None
        self.tokens = [bytes([i]) for i in range(vocab_size)] + [b"<eos>"]
        self.special_token_ids = [vocab_size]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


class GrammarCompiler:
    """Compiles response formats for one vocabulary (build it once: ~0.5 s for SmolLM2's)."""

    def __init__(self, tokenizer: Any):
        """``tokenizer``: an ``llguidance.LLTokenizer`` (``for_hf``, ``for_bytes`` build one)."""
        self.tokenizer = tokenizer
        self.n_vocab = tokenizer.vocab_size

    @classmethod
    def for_hf(cls, hf_tokenizer: Any, vocab_size: int | None = None) -> "GrammarCompiler":
        """A Hugging Face fast tokenizer's vocabulary (its EOS ends a complete output)."""
        return cls(_llguidance().hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size))

    @classmethod
    def for_bytes(cls, vocab_size: int = 256) -> "GrammarCompiler":
        """Ids ``0 .. vocab_size - 1`` are the bytes themselves (the byte model)."""
        lg = _llguidance()
        return cls(lg.LLTokenizer(lg.TokenizerWrapper(_ByteVocab(vocab_size)),
                                  n_vocab=vocab_size + 1))

    def compile(self, fmt: ResponseFormat) -> "Grammar":
        """The format's grammar; ``FormatError`` when the schema is not one llguidance takes."""
        lg = _llguidance()
        try:
            grammar = lg.LLMatcher.grammar_from_json_schema(
                fmt.schema_text, defaults={"whitespace_flexible": False})
            error = lg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        except (ValueError, TypeError, RuntimeError) as e:
            error = str(e)
        if error:
            raise FormatError("response_format.json_schema.schema" if fmt.type == "json_schema"
                              else "response_format", f"the JSON schema cannot be used: "
                                                      f"{error[:300]}")
        return Grammar(self, grammar)


class Grammar:
    """A compiled format; ``matcher()`` gives each sample its own state."""

    def __init__(self, compiler: GrammarCompiler, grammar: str):
        self.compiler, self.grammar = compiler, grammar

    def matcher(self) -> "Matcher":
        lg = _llguidance()
        return Matcher(lg.LLMatcher(self.compiler.tokenizer, self.grammar),
                       self.compiler.n_vocab)


class Matcher:
    """One sample's position in the grammar."""

    def __init__(self, matcher: Any, n_vocab: int):
        self._m = matcher
        self.failed = False
        """The grammar refused a token (llguidance's limits): the sample stops, nothing else."""
        self._bitmask = torch.full(((n_vocab + 31) // 32,), -1, dtype=torch.int32)

    def allowed(self, vocab: int) -> torch.Tensor:
        """A bool ``[vocab]`` mask of the model's tokens the grammar allows next."""
        b = self._bitmask
        self._m.unsafe_compute_mask_ptr(b.data_ptr(), b.numel() * b.element_size())
        bits = ((b.unsqueeze(-1) & _BITS) != 0).flatten()
        if bits.numel() < vocab:
            bits = torch.cat([bits, bits.new_zeros(vocab - bits.numel())])
        return bits[:vocab]

    def mask(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``logits`` with what the grammar forbids at -inf; None when it allows none."""
        allowed = None if self.failed else self.allowed(logits.shape[-1])
        if allowed is None or not bool(allowed.any()):
            return None
        return logits.float().masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past ``token``; a refusal (it was allowed, so only a parser limit) marks the
        matcher ``failed`` rather than raising on the decode thread, where it would fail every
        request of the step."""
        if not self._m.consume_token(int(token)):
            self.failed = True


class CompilerCache:
    """One ``GrammarCompiler`` built on first use, from any thread."""

    def __init__(self, build):
        self._build, self._compiler = build, None
        self._lock = threading.Lock()

    def get(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._build()
            return self._compiler
