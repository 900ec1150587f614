"""One OpenAI completion request from its prompt ids to its reply, streamed or whole.

The backend's handles block (a queue per choice), so their tokens are read on worker threads
(``run_in_threadpool``; a stream through Starlette's ``StreamingResponse``, which reads a sync
iterator on the thread pool and stops when the client hangs up); admission and the reply's
shape are on the event loop. However a request ends -- finished, failed, timed out, or the
client gone mid-stream -- ``_finish`` runs once: its forks are cancelled (their KV blocks
freed), its slots go back to ``node.serving.fair_gate``, the tenant's counters are updated.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from node.engine.generation import GenerationHandle, GenerationRequest
from node.serving.openai_protocol import MAX_SEED, APIError, Params, TextStream, bad
from node.serving.serve_metrics import RequestRecord
from node.serving.openai_state import OpenAIState
from node.serving.sampling_fields import LogprobsWriter


def context_error(context_len: int, prompt: int, asked: int | None, param: str) -> APIError:
    """The 400 for a prompt and ``max_tokens`` over the context; it names the flags that
    make room (``--pool-mib`` sizes the KV pool, ``--max-context`` the context it allows)."""
    return APIError(400, f"this model's maximum context length is {context_len} tokens; the "
                         f"prompt has {prompt} and max_tokens asks for {asked or 1} (the server "
                         "sets it with --max-context and --pool-mib)", param,
                    "context_length_exceeded")


class _Stream(StreamingResponse):
    """A ``StreamingResponse`` that calls ``finish`` once it ends, however it ends."""

    def __init__(self, content: Iterator[str], finish) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.finish = finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.finish()


def _event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Completion:
    """One request (see the module docstring)."""

    def __init__(self, st: OpenAIState, rec: RequestRecord, tenant: str, params: Params,
                 chat: bool):
        self.st, self.rec, self.tenant, self.p, self.chat = st, rec, tenant, params, chat
        self.model = params.model or st.models.base_id
        self.backend = st.models.backend_for(self.model)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self._used: list[int] = []
        """Tokens each choice consumed (the usage's completion tokens)."""
        self.deadline = time.monotonic() + st.config.request_deadline_s
        self._handles: list[GenerationHandle] = []
        self._slots = 0
        self._done = False

    def _request(self, prompt: list[int]) -> GenerationRequest:
        """The backend's request; 400 when the prompt and ``max_tokens`` overflow the context."""
        room, asked = self.st.context_len - len(prompt), self.p.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise context_error(self.st.context_len, len(prompt), asked,
                                "messages" if self.chat else "prompt")
        n, seed = self.p.n, self.p.seed
        seeds = None if seed is None else tuple((seed + i) & MAX_SEED for i in range(n))
        return GenerationRequest(
            tuple(prompt), min(room, self.st.max_tokens()) if asked is None else asked,
            self.st.codec.sampling(self.p), stop_token_ids=self.st.codec.eos_ids,
            tenant=self.st.models.namespace(self.tenant, self.model), n=n, seeds=seeds,
            deadline=self.deadline)

    async def run(self, prompt: list[int]) -> Response:
        request = self._request(prompt)
        self.st.admit(self.tenant)
        try:
            self._slots = await self.st.gate.acquire(self.tenant, request.n)
            try:
                self._handles = self.backend.submit(request)
            except ValueError as e:
                raise bad("messages" if self.chat else "prompt", str(e)) from None
            except RuntimeError as e:  # closing
                raise APIError(503, str(e), None, "unavailable", "server_error") from None
            if self.p.stream:
                return _Stream(self._stream(self._handles), self._finish)
            body = await run_in_threadpool(self._whole, self._handles)
            return JSONResponse(body)
        except BaseException:
            self._finish()
            raise
        finally:
            if not self.p.stream:
                self._finish()

    def _finish(self) -> None:
        """Once: cancel the forks (a no-op once finished), give back slots, count."""
        if self._done:
            return
        self._done = True
        for h in self._handles:
            h.cancel()
        if self._slots:
            self.st.gate.release(self.tenant, self._slots)
        self.st.gate.leave(self.tenant)
        if self._handles:
            self._account(self._handles, self._used)

    def _choice(self, h: GenerationHandle, ts: TextStream) -> Iterator[str]:
        """The choice's text deltas; afterwards ``_reason`` says why it ended."""
        try:
            for token in h.tokens(timeout=self.st.config.request_timeout_s):
                self.rec.token()
                if time.monotonic() >= self.deadline:  # tokens keep coming, but time is up
                    raise self._past_deadline()
                if delta := ts.push(token):
                    yield delta
                if ts.stopped:
                    h.cancel()  # the text ended at a stop string: its fork need not go on
                    return
        except TimeoutError:
            raise APIError(503, "generation timed out", None, "timeout", "server_error") from None
        if h.finish_reason == "timeout":
            raise self._past_deadline()
        if h.finish_reason not in ("stop", "length"):
            raise APIError(503, f"generation failed: {h.error or h.finish_reason}", None,
                           "generation_failed", "server_error", {"Retry-After": "1"})
        if tail := ts.finish():
            yield tail

    def _past_deadline(self) -> APIError:
        return APIError(503, f"the request ran past its deadline "
                             f"({self.st.config.request_deadline_s:g} s)", None, "timeout",
                        "server_error")

    @staticmethod
    def _reason(h: GenerationHandle, ts: TextStream) -> str:
        return "stop" if ts.stopped or h.finish_reason == "stop" else "length"

    def _streams(self, handles: list[GenerationHandle]) -> list[TextStream]:
        streams = [TextStream(self.st.codec.decode, self.p.stop) for _ in handles]
        self._used = [0] * len(handles)
        self._lp = LogprobsWriter.for_streams(streams, self.p.sampling, self.chat, self.st.codec)
        return streams

    def _whole(self, handles: list[GenerationHandle]) -> dict[str, Any]:
        streams, choices = self._streams(handles), []
        for i, (h, ts) in enumerate(zip(handles, streams)):
            text = "".join(self._choice(h, ts))
            self._used[i] = len(ts.ids)
            body = {"message": {"role": "assistant", "content": text}} if self.chat else \
                {"text": text}
            choices.append({"index": i, **body, "logprobs": self._lp[i].take(len(ts.ids)),
                            "finish_reason": self._reason(h, ts)})
        return {**self._head(self._newest(handles), chunk=False), "choices": choices,
                "usage": self._usage(handles)}

    def _stream(self, handles: list[GenerationHandle]) -> Iterator[str]:
        streams = self._streams(handles)
        usage = {"usage": None} if self.p.include_usage else {}
        try:
            for i, (h, ts) in enumerate(zip(handles, streams)):
                if self.chat:
                    yield self._chunk(handles, i, {"role": "assistant", "content": ""}, None, usage)
                for delta in self._choice(h, ts):
                    self._used[i] = len(ts.ids)
                    yield self._chunk(handles, i, {"content": delta} if self.chat else delta, None,
                                      usage)
                self._used[i] = len(ts.ids)
                yield self._chunk(handles, i, {} if self.chat else "", self._reason(h, ts), usage)
        except APIError as e:  # headers are sent: the error is the stream's last event
            self.rec.error = e.code
            for h in handles:  # freed before the client learns: its slots are free when it retries
                h.cancel()
            yield _event(e.body())
            return
        if self.p.include_usage:
            yield _event({**self._head(self._newest(handles), chunk=True), "choices": [],
                          "usage": self._usage(handles)})
        yield _event("[DONE]")

    def _chunk(self, handles, i: int, delta: dict | str, reason: str | None, usage: dict) -> str:
        body = {"delta" if self.chat else "text": delta, "logprobs": self._lp[i].take(self._used[i])}
        return _event({**self._head(_version_at(handles[i], self._used[i]), chunk=True), **usage,
                       "choices": [{"index": i, **body, "finish_reason": reason}]})

    def _newest(self, handles: list[GenerationHandle]) -> int | None:
        """The newest version among the tokens sent (the whole reply's fingerprint)."""
        return max((v for h, n in zip(handles, self._used) if (v := _version_at(h, n)) is not None),
                   default=None)

    def _head(self, version: int | None, chunk: bool) -> dict[str, Any]:
        """``version``: the model version of the tokens in the object (None: none yet)."""
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        if version is None:
            version = self.backend.version
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": f"fedkv-v{version}"}

    def _usage(self, handles: list[GenerationHandle]) -> dict[str, Any]:
        prompt, done = handles[0].prompt_tokens, sum(self._used)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": handles[0].cached_prompt_tokens}}

    def _account(self, handles: list[GenerationHandle], used: list[int]) -> None:
        st = self.st.stats[self.tenant]
        st.requests += 1
        st.prompt_tokens += handles[0].prompt_tokens
        st.cached_prompt_tokens += handles[0].cached_prompt_tokens
        st.completion_tokens += sum(used)
        self.rec.prompt_tokens = handles[0].prompt_tokens
        self.rec.generated_tokens = sum(used)


def _version_at(h: GenerationHandle, n: int) -> int | None:
    """The version of ``h``'s ``n``-th token (the last one a chunk holds): a backend that
    restarts running requests under new weights lists each token's (``token_versions``,
    appended before the token is queued); the serial one has one per request."""
    versions = getattr(h, "token_versions", None)
    return versions[n - 1] if versions and 0 < n <= len(versions) else h.model_version
