"""Continuous batching over the paged KV cache, in the nano-vllm / vLLM shape.

A ``Scheduler`` keeps a waiting queue and a running set; ``step()`` is schedule -> run ->
postprocess. *Schedule* applies cancellations (and finishes ``timeout`` the sequences whose
request's deadline has passed), then a pending weight update, then admits waiting sequences
while the pool has blocks for them, longest cached prefix first (as SGLang does; the probe
walks the cache's prefix index without touching it). *Run* is one forward
(``model.forward_mixed``) over every running sequence past its prefill (a decode row) and the
prefill chunks that fit what is left of ``token_budget`` (chunked prefill, so a long prompt
never stalls the others' decoding; several waiting prompts prefill in the same step), packed so
each weight matrix is read once per step, not once per chunk; the output projection runs only
for the rows a step samples from. *Postprocess* samples, streams, and retires finished
sequences (their full blocks stay as prefix-cache entries).

Block bookkeeping stays the cache's: the scheduler never counts blocks itself beyond the
admission estimate. When an allocation fails (``CacheFullError``; ``begin_batch`` and
``reserve`` are all-or-nothing) the newest running sequence is preempted and the step goes on:
``swap`` closes its session (full blocks stay cached, demoted to the warm tier under
pressure) and resumes through ``match_prefix`` on prompt + generated tokens; ``recompute``
drops its K/V and recomputes them. A request is never dropped because the pool is full; one
that could not fit even alone in an empty pool is refused at ``add``.

A weight update (``update_weights``) runs at a step boundary; running sequences restart under
the new version: their K/V are recomputed from prompt + generated tokens, so every token is
computed entirely under one version (``Sequence.token_versions``). Tokens already streamed are
kept.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from cache import CacheFullError, KVCache
from node.engine.generation import GenerationRequest, TokenStream
from node.models.interface import CachedLM, MixedBatch
from node.engine.sampling import Sampler

PREEMPT_MODES = ("swap", "recompute")


@dataclass
class SchedulerConfig:
    """Limits of one step."""

    max_running: int = 16
    """Sequences holding a cache session at once (vLLM's ``max_num_seqs``)."""
    token_budget: int = 2048
    """Tokens one step computes: one per decode row plus the prefill chunks (vLLM's
    ``max_num_batched_tokens``, whose default for its CPU OpenAI server this is); a prompt
    longer than what is left is prefilled in chunks. A smaller budget bounds the stall a long
    prompt's step puts on the running streams' next tokens and delays that prompt's first
    token: each chunk is one more pass through the weights."""
    preempt_mode: str = "swap"
    """``swap``: a preempted sequence's session is closed, its full blocks stay cached (the
    warm tier takes them under pressure when the cache has ``warm_bytes``) and it resumes
    through ``match_prefix``; ``recompute``: its K/V are dropped and recomputed on resume."""
    probe_window: int = 64
    """Waiting sequences whose cached prefix is probed per step (the rest wait in order)."""

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if self.preempt_mode not in PREEMPT_MODES:
            raise ValueError(f"preempt_mode must be one of {PREEMPT_MODES}, "
                             f"got {self.preempt_mode!r}")
        if self.probe_window < 1:
            raise ValueError(f"probe_window must be >= 1, got {self.probe_window}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One sample of a request; also its ``node.engine.generation.GenerationHandle``."""

    request: GenerationRequest
    sampling: Sampler
    """This sample's token picker (``node.engine.sampling``): its own generator and penalty state."""
    request_id: str
    arrival: int
    parent: "Sequence | None" = None
    """For fork i > 0 of an ``n > 1`` request: the sample whose prefill it forks."""
    status: Status = Status.WAITING
    sid: int | None = None
    computed: int = 0
    """Tokens of ``context`` whose K/V the session holds."""
    generated: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    """The model version each generated token was computed under (one per token)."""
    finish_reason: str | None = None
    error: str | None = None
    model_version: int | None = None
    """The first token's version (``token_versions`` has every token's)."""
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    resumed: int = 0
    cancel_requested: bool = False
    on_cancel: Callable[[], None] | None = None
    _out: TokenStream = field(default_factory=TokenStream, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt)

    @property
    def context(self) -> list[int]:
        """Prompt + generated tokens: what the session's K/V cover once computed."""
        return list(self.request.prompt) + self.generated

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def tokens(self, timeout: float | None = None) -> Iterator[int]:
        """The generated tokens as produced; ``TimeoutError`` after ``timeout`` s of none."""
        return self._out.tokens(timeout)

    def cancel(self) -> None:
        """Ask the scheduler to stop this sample at the next step boundary."""
        self.cancel_requested = True
        if self.on_cancel is not None:
            self.on_cancel()


@dataclass(frozen=True)
class StepEvent:
    """What a step did to one sequence: a token streamed and/or the sequence finished."""

    seq: Sequence
    token: int | None
    finish_reason: str | None
    version: int


def _sampler(request: GenerationRequest, i: int) -> Sampler:
    """Fork ``i``'s picker: the request's params, its own generator (seeded, else from the OS)."""
    return Sampler(request.sampling, request.prompt,
                   request.seeds[i] if request.seeds is not None else None)


class Scheduler:
    """Continuous batching of generation requests over one model and one cache."""

    def __init__(self, model: CachedLM, cache: KVCache, config: SchedulerConfig | None = None):
        self.model, self.cache = model, cache
        self.config = config or SchedulerConfig()
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.counters = dict.fromkeys(
            ("steps", "preemptions", "resumes", "resume_cached_tokens", "resume_computed_tokens",
             "prefill_chunks", "decode_rows", "forwards", "restarts"), 0)
        self.forward_seconds: list[float] = [0.0, 0.0]
        """[sum, max] of the forwards' wall seconds: a step that stalls shows as a max far
        above sum / forwards (``experiments.serve_load`` reports both per cell)."""
        self._update: tuple[Callable[[CachedLM], None], int | None] | None = None
        self._lock = threading.Lock()  # guards ``_update`` only: set from any thread

    # -- submitting ------------------------------------------------------------------------
    def prepare(self, request: GenerationRequest) -> list[Sequence]:
        """The request's samples, checked (``ValueError`` for one the model or the pool can
        never take), not yet queued; touches no scheduler state, so any thread may call it."""
        self._check(request)
        rid = f"gen-{next(_ids)}"
        arrival = next(_ids)
        seqs = [Sequence(request, _sampler(request, i), f"{rid}-{i}" if request.n > 1 else rid,
                         arrival) for i in range(request.n)]
        for s in seqs[1:]:
            s.parent = seqs[0]
        return seqs

    def enqueue(self, seqs: list[Sequence]) -> list[StepEvent]:
        """Queue prepared samples (the loop thread's half of ``add``)."""
        events = []
        for s in seqs:
            if s.request.max_tokens == 0:
                events.append(self._finish(s, "length"))
            else:
                self.waiting.append(s)
        return events

    def add(self, request: GenerationRequest) -> list[Sequence]:
        """Queue ``request``; one ``Sequence`` (a generation handle) per sample."""
        seqs = self.prepare(request)
        self.enqueue(seqs)
        return seqs

    def _check(self, request: GenerationRequest) -> None:
        total = len(request.prompt) + request.max_tokens
        if total > self.model.context_len:
            raise ValueError(f"prompt ({len(request.prompt)}) + max_tokens "
                             f"({request.max_tokens}) = {total} tokens exceeds the model's "
                             f"context of {self.model.context_len}")
        vocab = getattr(getattr(self.model, "cfg", None), "vocab_size", None)
        bad = [t for t in request.prompt if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} outside the vocabulary [0, {vocab})")
        B, pool = self.cache.config.block_size, self.cache.full_precision_blocks
        need = -(-total // B) + 1  # + 1: room to copy a shared last block (copy-on-write)
        if need > pool:
            raise ValueError(f"prompt + max_tokens = {total} tokens needs {need} blocks of "
                             f"{B} tokens, more than the whole KV pool ({pool} blocks): this "
                             f"request can never be served by this pool")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._update is not None)

    def update_weights(self, apply: Callable[[CachedLM], None], version: int | None = None) -> None:
        """Run ``apply(model)`` (load new weights) at the next step boundary, then move the
        cache to ``version`` (default: the next one); running sequences restart under it."""
        with self._lock:
            self._update = (apply, version)

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Schedule (cancellations, weight update, admission), run (one forward of the decode
        rows and the prefill chunks under the token budget), postprocess (sample, stream,
        retire)."""
        self.counters["steps"] += 1
        events = self._apply_cancellations()
        self._apply_update()
        self._admit()
        decode, chunks = self._plan()
        with torch.no_grad():
            results = self._run(decode, chunks)
        for seq, logits in results:
            events.extend(self._postprocess(seq, logits))
        return events

    def _apply_cancellations(self) -> list[StepEvent]:
        """Cancelled sequences, and those past their request's deadline (``timeout``)."""
        return [self._finish(s, "cancelled" if s.cancel_requested else "timeout")
                for s in self.waiting + self.running
                if s.cancel_requested or s.request.expired()]

    def _apply_update(self) -> None:
        with self._lock:
            update, self._update = self._update, None
        if update is None:
            return
        apply, version = update
        apply(self.model)
        self.cache.set_version(self.cache.version + 1 if version is None else version)
        for s in self.running + self.waiting:  # old K/V: recompute prompt + generated
            if s.sid is not None:
                self.cache.reset_session(s.sid)
                s.computed = 0
                self.counters["restarts"] += s.status is Status.RUNNING

    def _admit(self) -> None:
        """Admit waiting sequences, longest cached prefix first, while blocks allow."""
        ready = [s for s in self.waiting[: self.config.probe_window] if self._ready(s)]
        B = self.cache.config.block_size
        scored = sorted(((self._probe(s), s.arrival, s) for s in ready),
                        key=lambda t: (-t[0], t[1]))
        for _, _, s in scored:
            if len(self.running) >= self.config.max_running:
                return
            need = -(-len(s.context) // B) + 1  # cached blocks count too: hot ones are
            if self.running and need > self.cache.free_blocks():  # in free_blocks, warm ones need room
                return
            self.waiting.remove(s)
            self._start(s)

    @staticmethod
    def _ready(s: Sequence) -> bool:
        """A fork waits for its first sibling's prefill (to share it) unless that one
        already sampled, finished or was preempted: then it is admitted on its own."""
        p = s.parent
        return p is None or bool(p.generated) or p.status in (Status.FINISHED, Status.PREEMPTED)

    def _probe(self, s: Sequence) -> int:
        if self.config.preempt_mode == "recompute" and s.preemptions:
            return 0  # its resume recomputes everything
        return self.cache.cached_prefix_tokens(s.context, s.request.tenant)

    def _start(self, s: Sequence) -> None:
        """Give ``s`` a session: new (match_prefix) or, after a recompute preemption, its own."""
        resuming = s.preemptions > 0
        if s.sid is None:
            s.sid = self.cache.open_session(namespace=s.request.tenant)
            s.computed = self.cache.match_prefix(s.sid, s.context)
        if resuming:
            self.counters["resumes"] += 1
            s.resumed += 1
            self.counters["resume_cached_tokens"] += s.computed
            self.counters["resume_computed_tokens"] += len(s.context) - s.computed
        else:
            s.cached_prompt_tokens = s.computed
        s.status = Status.RUNNING
        self.running.append(s)

    def _plan(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """Decode rows (one token left to feed) then prefill chunks, within the budget."""
        budget = self.config.token_budget
        decode = [s for s in self.running if len(s.context) - s.computed == 1][:budget]
        budget -= len(decode)
        chunks = []
        for s in self.running:
            left = len(s.context) - s.computed
            if left > 1 and budget > 0:
                n = min(left, budget)
                chunks.append((s, n))
                budget -= n
        return decode, chunks

    def _run(self, decode: list[Sequence], chunks: list[tuple[Sequence, int]]):
        """The step's rows in one forward (``model.forward_mixed``): slots first, so a full pool
        preempts before anything is computed; then (sequence, logits) of each decode row and
        of each chunk that completes its prompt (a partial chunk's logits are not sampled)."""
        batch, decode, chunks = self._reserve(decode, chunks)
        if batch is None:
            return []
        t0 = time.perf_counter()
        logits = self.model.forward_mixed(batch, self.cache)
        took = time.perf_counter() - t0
        self.forward_seconds = [self.forward_seconds[0] + took, max(self.forward_seconds[1], took)]
        self.counters["forwards"] += 1
        self.counters["decode_rows"] += len(decode)
        self.counters["prefill_chunks"] += len(chunks)
        out = []
        for (s, n), row in zip([(s, 1) for s in decode] + chunks, logits):
            s.computed += n
            if s.computed == len(s.context):
                out.append((s, row))
        return out

    def _reserve(self, decode: list[Sequence], chunks: list[tuple[Sequence, int]]):
        """Slots for the step: each chunk's reservation, then the decode rows' batch step -- in
        this order because ``begin_batch`` plans where the rows read and write, and a
        reservation after it could move what it planned (a greedy token then differed from
        the cache-free forward's). Out of blocks, the newest whose chunk is not reserved yet
        (chunks, this one last) or the newest running sequence (decode rows) is preempted and
        the step goes on without it. A lone decode row with no chunk is reserved as its
        session's one-token chunk: ``forward_mixed`` then runs it as ``forward_cached``, which
        a model may take in one call (``node.models.decode_step``)."""
        done: list[tuple[Sequence, int]] = []
        for i, (s, n) in enumerate(chunks):
            while s.status is Status.RUNNING:
                try:
                    self.cache.reserve(s.sid, s.context[s.computed : s.computed + n])
                    done.append((s, n))
                    break
                except CacheFullError:
                    self._preempt_newest([c for c, _ in chunks[i:] if c.status is Status.RUNNING])
        step = None
        lone = len(decode) == 1 and not done
        while decode:
            try:
                if lone:  # its session's one-token step: no batch to plan
                    self.cache.reserve(decode[0].sid, [decode[0].context[-1]])
                else:
                    step = self.cache.begin_batch([s.sid for s in decode],
                                                  [s.context[-1] for s in decode])
                break
            except CacheFullError:
                victim = self._preempt_newest()
                decode = [s for s in decode if s is not victim]
                done = [(c, n) for c, n in done if c is not victim]
        if step is None and not done and not (lone and decode):
            return None, [], []
        if lone and decode:  # as a one-token chunk: model.forward_mixed runs it as forward_cached
            return MixedBatch(None, (), ((decode[0].sid, (decode[0].context[-1],)),)), decode, done
        rows = tuple((s.sid, tuple(s.context[s.computed : s.computed + n])) for s, n in done)
        return MixedBatch(step, tuple(s.context[-1] for s in decode), rows), decode, done

    # -- preemption and retiring -------------------------------------------------------------
    def _preempt_newest(self, among: list[Sequence] | None = None) -> Sequence:
        """Move the newest running sequence (of ``among``) back to waiting, releasing its
        blocks."""
        victim = max(self.running if among is None else among, key=lambda s: s.arrival)
        self.running.remove(victim)
        if self.config.preempt_mode == "swap":
            self.cache.close_session(victim.sid)  # full blocks stay cached (warm tier)
            victim.sid = None
        else:
            self.cache.reset_session(victim.sid)  # drop the K/V: recompute on resume
        victim.computed = 0
        victim.status = Status.PREEMPTED
        victim.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.insert(0, victim)
        return victim

    def _postprocess(self, s: Sequence, logits: torch.Tensor) -> list[StepEvent]:
        """Sample the next token of ``s`` (forking waiting siblings off a finished prefill)."""
        events = self._fork_children(s, logits) if s.parent is None and not s.generated else []
        return events + self._accept(s, s.sampling.pick(logits))

    def _fork_children(self, s: Sequence, logits: torch.Tensor) -> list[StepEvent]:
        """``n > 1``: siblings still waiting share ``s``'s prefill by copy-on-write forks."""
        events = []
        for c in [c for c in self.waiting if c.parent is s and not c.preemptions]:
            if len(self.running) >= self.config.max_running:
                break  # admitted later through the prefix cache instead
            self.waiting.remove(c)
            c.sid, c.computed = self.cache.fork(s.sid), s.computed
            c.cached_prompt_tokens = s.cached_prompt_tokens
            c.status = Status.RUNNING
            self.running.append(c)
            events.extend(self._accept(c, c.sampling.pick(logits)))
        return events

    def _accept(self, s: Sequence, token: int | None) -> list[StepEvent]:
        """Stream ``token`` (None: the grammar allows none, its output is complete: stop)."""
        version = self.cache.version
        if token is None or token in s.request.stop_token_ids:
            return [self._finish(s, "stop")]
        s.generated.append(token)
        s.token_versions.append(version)
        if s.model_version is None:
            s.model_version = version
        s._out.put(token)
        if len(s.generated) >= s.request.max_tokens:
            return [StepEvent(s, token, None, version), self._finish(s, "length")]
        return [StepEvent(s, token, None, version)]

    def _finish(self, s: Sequence, reason: str, error: str | None = None) -> StepEvent:
        """Retire ``s``: close its session (full blocks stay as prefix-cache entries)."""
        if s in self.running:
            self.running.remove(s)
        if s in self.waiting:
            self.waiting.remove(s)
        if s.sid is not None:
            self.cache.close_session(s.sid)
            s.sid = None
        s.status, s.finish_reason, s.error = Status.FINISHED, reason, error
        s._out.end()
        return StepEvent(s, None, reason, self.cache.version)

    def fail_all(self, error: str) -> list[StepEvent]:
        """Finish every live sequence with ``error`` (a step raised)."""
        return [self._finish(s, "error", error) for s in self.waiting + self.running]

    def cancel_all(self) -> list[StepEvent]:
        """Finish every live sequence as cancelled, freeing its blocks (shutdown)."""
        return [self._finish(s, "cancelled") for s in self.waiting + self.running]
