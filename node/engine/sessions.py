"""Chat sessions on a node: a system prompt, then turns of user text and greedy replies.

Framing: a conversation is one token sequence. For the byte-level model it is a byte string:
text goes in as bytes (``str`` is UTF-8 encoded) and replies come out as raw bytes
(``TurnResult.reply``), because a byte model can stop in the middle of a UTF-8 character;
decode with ``reply.decode("utf-8", "replace")`` for display. A model with a tokenizer
(``node.models.llama``) takes its token ids instead (any sequence of ints, e.g. a chat template's
``input_ids``) and its reply is ``TurnResult.tokens``; ``Sessions`` itself never tokenizes.
Nothing is inserted between turns: the session's tokens are exactly
``system_prompt + text_1 + reply_1 + text_2 + reply_2 + ...``, so a caller that wants
"User:"/"Assistant:" markers writes them into its text.

Every token of the conversation, the last reply byte included, is in the cache, and the session
keeps the logits that follow it: a turn feeds only its new text (or nothing, to let the model go
on), and ``cache.tokens(sid)`` is the conversation. A system prompt is prefilled once per session
through the engine's prefix index, so sessions that start with the same system prompt share its
full blocks. After a federated write-back (``cache.bump_version``) a session's K/V is stale; its
next turn recomputes the whole conversation under the new weights.

Decoding: ``Sessions.turn`` is the node's decode loop (greedy, one ``model.forward_cached`` of
the last token per step) and ``Sessions.turn_batch`` its batched form (one ``model.forward_batch``
per step over several sessions); nothing else in the node decodes.

Speaking the model's language (``node.models.chat``): ``Sessions(model, cache, codec=ChatCodec(...))``
templates a ``str`` turn: the system prompt is the templated system message (the shared prefix:
sessions with one system prompt share its full blocks), a turn feeds the templated user message
and the assistant header, decodes until an EOS id, a stop string or ``max_new_tokens``, and then
feeds the template's end of the assistant turn, so the session's tokens are
``tokenizer.apply_chat_template`` of the conversation. Token ids are still fed as they are.
Without a codec (the byte model) nothing is templated and no token ends a reply. ``sampling``
(``Sampling``) is greedy unless asked for temperature / top-p; a stop string ends the reply before
it (``TurnResult.text``) while the cache keeps every token that was fed.

Ids are ``chat-<n>`` from a counter, so a closed id is told apart from one never issued without
remembering closed ids: ``Sessions`` holds open sessions only. A serving agent on a shared host
names its sessions itself (random ids, ``node.serving.serve_auth``) and opens each tenant's in the
tenant's prefix namespace: sessions share system-prompt blocks only within one namespace.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from cache import KVCache
from node.models.chat import ByteCodec, Message
from node.models.interface import CachedLM

_ID = re.compile(r"chat-(\d+)")


@dataclass(frozen=True)
class Sampling:
    """How a turn picks each token from the logits. ``temperature <= 0`` is greedy (argmax,
    the default, exactly the old decode loop); otherwise softmax(logits / temperature)
    restricted to the smallest set of tokens whose probability reaches ``top_p`` (nucleus),
    drawn with ``generator`` (seed it for a repeatable sample)."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from ``logits`` ``[vocab]``."""
        if self.greedy:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            p, idx = probs.sort(descending=True)
            # keep a token while the mass before it is below top_p (the first always stays)
            keep = (p.cumsum(0) - p) < self.top_p
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], p[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))


GREEDY = Sampling()


class UnknownSessionError(KeyError):
    """A session id this node does not hold open (never created here, or closed)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown session"


class ClosedSessionError(UnknownSessionError):
    """A session id that ``create_session`` issued and ``close`` has since closed."""


@dataclass
class ChatSession:
    """One open conversation: its cache session and what is needed to continue it."""

    sid: int
    """The engine's session holding the conversation's K/V and tokens."""
    system: tuple[int, ...]
    """The system prompt's tokens, kept so ``reset_conversation`` can restore exactly this prefix."""
    logits: torch.Tensor | None = None
    """Next-byte logits after the last token; valid while the cache session is not stale."""
    lost: list[int] | None = None
    """The conversation while it is not in the cache: its K/V were dropped to be recomputed
    and the recompute failed (e.g. a full pool). The next turn recomputes from here."""
    messages: list[Message] = field(default_factory=list)
    """The conversation as chat messages (a chat codec's sessions only): what the template
    renders the next turn after."""


@dataclass(frozen=True)
class TurnResult:
    tokens: tuple[int, ...]
    """The reply's token ids (bytes for the byte-level model)."""
    nll: float
    """Summed log-loss (nats) of the turn's text tokens given everything before them."""
    scored: int
    """Text tokens in ``nll`` (a text token taken from the prefix cache has no logits here)."""
    recomputed: int
    """Tokens of the conversation recomputed because the session's K/V were stale."""
    text: str | None = None
    """The reply as text, cut before a stop string and without the EOS (set when the
    session has a codec or the turn had stop strings)."""
    stop_reason: str = "length"
    """Why the reply ended: ``"length"`` (max_new_tokens), ``"eos"`` or ``"stop"``."""

    @property
    def reply(self) -> bytes:
        """The reply as bytes: the byte-level model's framing (a ValueError for token ids
        past 255: read ``tokens`` and detokenize)."""
        return bytes(self.tokens)


def _log_loss(prev: torch.Tensor | None, logits: torch.Tensor, text: list[int]) -> tuple[float, int]:
    """Log-loss of the last ``len(text)`` tokens fed: token i is predicted by the row before
    it (the first by ``prev``, the logits the session held). Rows are right-aligned with the
    tokens fed, so tokens reused from the prefix cache (at the front) are simply not scored."""
    rows = torch.cat([prev[None], logits]) if prev is not None else logits
    n = min(len(text), rows.shape[0] - 1)
    if n <= 0:
        return 0.0, 0
    target = torch.as_tensor(text[len(text) - n :], dtype=torch.long)
    pred = rows[-n - 1 : -1]
    return float(torch.nn.functional.cross_entropy(pred, target, reduction="sum")), n


def as_bytes(text: str | bytes | bytearray) -> bytes:
    """The byte framing: ``str`` is UTF-8 encoded, bytes pass through."""
    if isinstance(text, str):
        return text.encode("utf-8")
    if isinstance(text, (bytes, bytearray)):
        return bytes(text)
    raise TypeError(f"text must be str or bytes, got {type(text).__name__}")


Text = str | bytes | bytearray | Sequence[int]


def as_tokens(text: Text) -> list[int]:
    """A turn's tokens: ``str``/bytes in the byte framing (``as_bytes``), or token ids as
    they are (a sequence of ints, for a model with a tokenizer)."""
    if isinstance(text, (str, bytes, bytearray)):
        return list(as_bytes(text))
    if isinstance(text, torch.Tensor):
        text = text.reshape(-1).tolist()
    if isinstance(text, Sequence) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in text):
        if any(t < 0 for t in text):
            raise ValueError("token ids must be >= 0")
        return list(text)
    raise TypeError(f"text must be str or bytes (or token ids), got {type(text).__name__}")


class Sessions(Mapping[str, int]):
    """The node's open chat sessions, read as ``{session id: cache session id}``.

    Closing removes an entry, so the mapping holds open sessions only and never grows with
    history. Looking up an id that is not open raises ``UnknownSessionError`` (a KeyError,
    so ``Mapping.get`` and ``in`` behave as for a dict) or its subclass ``ClosedSessionError``.
    """

    def __init__(self, model: CachedLM, cache: KVCache, codec=None):
        self.model = model
        self.cache = cache
        self.codec = codec
        """``None`` (bytes or token ids as they are), ``node.models.chat.ByteCodec`` (the same) or
        ``node.models.chat.ChatCodec`` (a ``str`` is templated; see the module docstring)."""
        self._open: dict[str, ChatSession] = {}
        self._issued = 0
        self.before_token: Callable[[], None] | None = None
        """Called before a turn feeds its text and before each decode step; a serving agent
        polls its coherence directory here (and raises to abandon a turn, see ``rollback``)."""

    # -- Mapping[str, int] ----------------------------------------------------------------
    def __getitem__(self, session_id: str) -> int:
        return self.session(session_id).sid

    def __iter__(self) -> Iterator[str]:
        return iter(self._open)

    def __len__(self) -> int:
        return len(self._open)

    def session(self, session_id: str) -> ChatSession:
        """The open session ``session_id``, or the error that says why there is none."""
        chat = self._open.get(session_id) if isinstance(session_id, str) else None
        if chat is not None:
            return chat
        if self.was_closed(session_id):
            raise ClosedSessionError(f"session {session_id!r} was closed")
        raise UnknownSessionError(f"session {session_id!r} was never created on this node")

    def was_closed(self, session_id: object) -> bool:
        """True for an id ``create`` issued that is no longer open (derived from the counter,
        so closed ids cost no memory)."""
        m = _ID.fullmatch(session_id) if isinstance(session_id, str) else None
        return m is not None and int(m.group(1)) < self._issued and session_id not in self._open

    # -- lifecycle ------------------------------------------------------------------------
    def create(self, system_prompt: Text = b"", session_id: str | None = None, *,
               namespace: bytes | str = b"") -> str:
        """Open a session and prefill its system prompt (sharing cached full blocks with
        sessions of the same prefix ``namespace`` only)."""
        messages: list[Message] = []
        if self._templated(system_prompt):
            system = tuple(self.codec.system(system_prompt))
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        else:
            system = tuple(as_tokens(system_prompt))
        self._check_fits(len(system))
        if session_id is None:
            session_id = self._new_id()
        elif session_id in self._open:
            raise ValueError(f"session {session_id!r} is already open")
        chat = ChatSession(self.cache.open_session(namespace=namespace), system,
                           messages=messages)
        try:
            self._prefill_system(chat)
        except BaseException:  # e.g. CacheFullError: leave no half-made session behind
            self.cache.close_session(chat.sid)
            raise
        self._open[session_id] = chat
        return session_id

    def _new_id(self) -> str:
        """The next ``chat-<n>``; skips a name a legacy ``generate`` call already took."""
        while True:
            session_id = f"chat-{self._issued}"
            self._issued += 1
            if session_id not in self._open:
                return session_id

    def _prefill_system(self, chat: ChatSession) -> None:
        """Encode the system prompt into an empty cache session; ``prefill`` reuses the full
        blocks other sessions already computed for the same prompt."""
        chat.logits = None
        if chat.system:
            chat.logits = self.model.prefill(list(chat.system), self.cache, chat.sid)

    def close(self, session_id: str) -> None:
        """Free the session's blocks (shared ones stay for their other holders) and forget it."""
        chat = self.session(session_id)
        del self._open[session_id]
        self.cache.close_session(chat.sid)

    def reset_conversation(self, session_id: str) -> None:
        """Drop the conversation but its system prompt; the prompt's full blocks come back
        from the prefix cache, only its partial last block is recomputed."""
        chat = self.session(session_id)
        self.cache.reset_session(chat.sid)
        chat.lost = None
        chat.messages = [m for m in chat.messages if m["role"] == "system"]
        self._prefill_system(chat)

    def history(self, session_id: str) -> bytes:
        """The whole conversation so far (system prompt, texts and replies) as bytes."""
        return bytes(self._tokens(self.session(session_id)))

    def tokens(self, session_id: str) -> list[int]:
        """The whole conversation so far as token ids (``history`` for a tokenized model)."""
        return self._tokens(self.session(session_id))

    def _tokens(self, chat: ChatSession) -> list[int]:
        return list(chat.lost) if chat.lost is not None else self.cache.tokens(chat.sid)

    # -- turns ----------------------------------------------------------------------------
    def send(self, session_id: str, text: Text, max_new_tokens: int = 32, **options) -> bytes:
        """Append ``text`` and decode a reply of at most ``max_new_tokens`` tokens through the
        cache; both stay in the session. Empty text lets the model continue its last reply.
        ``options`` are ``turn``'s (``sampling``, ``stop``)."""
        return self.turn(session_id, text, max_new_tokens, **options).reply

    def _templated(self, text: object) -> bool:
        return self.codec is not None and getattr(self.codec, "chat", False) \
            and isinstance(text, str)

    @torch.no_grad()
    def turn(self, session_id: str, text: Text, max_new_tokens: int = 32, *,
             sampling: Sampling | None = None, stop: Sequence[str] = ()) -> TurnResult:
        """``send`` that also says what the turn cost: the text's log-loss under the cached
        context (perplexity measured in the decode loop) and the tokens recomputed because
        a write-back made the session's K/V stale. ``sampling`` picks each token (greedy by
        default); the reply ends at the codec's EOS, a ``stop`` string or ``max_new_tokens``."""
        chat, fed, user = self._start(session_id, text, max_new_tokens)
        sampling = sampling or GREEDY
        eos = self._eos()
        reply: list[int] = []
        reason = "length"
        for _ in range(max_new_tokens):
            self._before_token()
            reply.append(sampling.pick(chat.logits))
            chat.logits = self.model.forward_cached(reply[-1:], self.cache, chat.sid)[-1]
            reason = self._ended(reply, eos, stop)
            if reason != "length":
                break
        return self._finish(chat, fed, user, reply, reason, stop)

    def _eos(self) -> frozenset[int]:
        return frozenset(self.codec.eos_ids) if self.codec is not None else frozenset()

    def _decode(self, tokens: Sequence[int]) -> str:
        return (self.codec or ByteCodec()).decode(tokens)

    def _ended(self, reply: list[int], eos: frozenset[int], stop: Sequence[str]) -> str:
        if reply[-1] in eos:
            return "eos"
        if stop:
            text = self._decode(reply)
            if any(s and s in text for s in stop):
                return "stop"
        return "length"

    def _start(self, session_id: str, text: Text,
               max_new_tokens: int) -> tuple[ChatSession, TurnResult, Message | None]:
        """Feed a turn's text (a stale session recomputed first): the session, a result
        holding the text's log-loss, and the user message a templated turn adds."""
        chat = self.session(session_id)
        user: Message | None = None
        extra = 0
        if self._templated(text):
            new = self.codec.user(chat.messages, text)
            user = {"role": "user", "content": text}
            extra = len(self.codec.end_of_reply([*chat.messages, user], "", False))
        else:
            new = as_tokens(text)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self._check_fits(len(self._tokens(chat)) + len(new) + max_new_tokens + extra)
        self._before_token()
        recomputed = 0
        if chat.lost is not None or self.cache.is_stale(chat.sid):
            # written back since (or a recompute failed): recompute under the new weights
            old = self._tokens(chat)
            self.cache.reset_session(chat.sid)
            recomputed, new, chat.logits, chat.lost = len(old), old + new, None, old
        nll, scored = 0.0, 0
        if new:
            prev, logits = chat.logits, self._feed(chat.sid, new)
            nll, scored = _log_loss(prev, logits, new[recomputed:])
            chat.logits = logits[-1]
        chat.lost = None
        if chat.logits is None:
            raise ValueError(f"session {session_id!r} is empty: send some text first")
        return chat, TurnResult((), nll, scored, recomputed), user

    def _finish(self, chat: ChatSession, fed: TurnResult, user: Message | None,
                reply: list[int], reason: str, stop: Sequence[str]) -> TurnResult:
        """The turn's result; a templated turn also feeds the end of the assistant turn."""
        text = None
        if user is not None or stop:
            text = self._decode(reply[:-1] if reason == "eos" else reply)
            cuts = [text.find(s) for s in stop if s and s in text]
            if cuts:
                text = text[:min(cuts)]
        if user is not None:
            end = self.codec.end_of_reply([*chat.messages, user], text, reason == "eos")
            if end:
                chat.logits = self.model.forward_cached(end, self.cache, chat.sid)[-1]
            chat.messages += [user, {"role": "assistant", "content": text}]
        return TurnResult(tuple(reply), fed.nll, fed.scored, fed.recomputed, text, reason)

    @torch.no_grad()
    def turn_batch(self, session_ids: Sequence[str], texts: Sequence[Text],
                   max_new_tokens: int = 32, *, sampling: Sampling | None = None,
                   stop: Sequence[str] = ()) -> list[TurnResult]:
        """``turn`` for several distinct sessions, their replies decoded together: each
        session's text is fed as ``turn`` feeds it (a stale session recomputed first), then
        every step is one ``model.forward_batch`` over the sessions still decoding (a prefix
        they share is attended once; one that reached EOS or a stop string drops out). In an
        int8/int4 cache a session may attend a prefix another session quantized, so a reply
        can differ from its one-at-a-time ``turn`` within the bound ``Pressure.quantize_old``
        documents. Refused before anything is written if a conversation would pass the
        context."""
        if len(texts) != len(session_ids):
            raise ValueError(f"{len(session_ids)} sessions but {len(texts)} texts")
        if len(set(session_ids)) != len(session_ids):
            raise ValueError("a batched turn takes each session once")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        chats = [self.session(s) for s in session_ids]
        for chat, text in zip(chats, texts):
            n = len(self.codec.user(chat.messages, text)) if self._templated(text) \
                else len(as_tokens(text))
            self._check_fits(len(self._tokens(chat)) + n + max_new_tokens)
        started = [self._start(s, text, max_new_tokens) for s, text in zip(session_ids, texts)]
        sampling = sampling or GREEDY
        eos = self._eos()
        replies: list[list[int]] = [[] for _ in chats]
        reasons = ["length"] * len(chats)
        for _ in range(max_new_tokens if chats else 0):
            live = [i for i, r in enumerate(reasons) if r == "length"]
            if not live:
                break
            self._before_token()
            nxt = [sampling.pick(chats[i].logits) for i in live]
            logits = self.model.forward_batch(nxt, self.cache, [chats[i].sid for i in live])
            for i, token, row in zip(live, nxt, logits):
                replies[i].append(token)
                chats[i].logits = row
                reasons[i] = self._ended(replies[i], eos, stop)
        return [self._finish(chat, fed, user, reply, reason, stop)
                for (chat, fed, user), reply, reason in zip(started, replies, reasons)]

    def _before_token(self) -> None:
        if self.before_token is not None:
            self.before_token()

    @torch.no_grad()
    def rollback(self, session_id: str, length: int) -> None:
        """Cut the conversation back to its first ``length`` tokens (a turn abandoned half
        way) and recompute them under the current weights (kept in ``lost`` until they are:
        a full pool leaves the session whole, to be recomputed by its next turn)."""
        chat = self.session(session_id)
        tokens = self._tokens(chat)
        self.cache.reset_session(chat.sid)
        if not 0 <= length <= len(tokens):
            raise ValueError(f"cannot roll session {session_id!r} back to {length} tokens")
        chat.lost, chat.logits = tokens[:length], None
        if length:
            chat.logits = self._feed(chat.sid, tokens[:length])[-1]
        chat.lost = None

    def _feed(self, sid: int, tokens: list[int]) -> torch.Tensor:
        """Logits [n, vocab] after ``tokens`` appended to the session (rows for tokens taken
        from the prefix cache are absent: n may be < len(tokens)); an empty session goes
        through the prefix cache so a cached prefix is reused instead of recomputed."""
        if self.cache.length(sid) == 0:
            reused = self.cache.match_prefix(sid, tokens)
            return self.model.forward_cached(tokens[reused:], self.cache, sid)
        return self.model.forward_cached(tokens, self.cache, sid)

    def _check_fits(self, n_tokens: int) -> None:
        """Refuse a turn that would pass the model's context before anything is written, so
        a refused turn leaves the session as it was."""
        limit = self.model.context_len
        if n_tokens > limit:
            raise ValueError(f"conversation of {n_tokens} tokens exceeds context_len {limit}")
