"""Learning while serving: the OpenAI server on the scheduler follows a node's trainer.

A live server (on a thread) joins a node cache directory's coherence directory; the test is the
trainer, publishing parameters as ``CacheNode._write_params`` does (``exclusive_params`` +
``param_channel.publish``). While a long greedy completion streams, one write-back happens.
Checked: the stream completes; each token was computed under one version, the old one before
the write-back and the new one after (every token recomputed with a cache-free forward under
the weights of its version); chunk fingerprints and ``/v1/models`` show the new version; and
no scheduler step ran on the old weights after the trainer was let write (strong coherence:
its write waits for the server's ACK). A negative control runs the same scenario on a server
that does not follow the node and checks that the same checks fail.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

openai = pytest.importorskip("openai")

from cache import KVCache  # noqa: E402
from node.serving import param_channel  # noqa: E402
from node.serving.param_channel import exclusive_params  # noqa: E402
from node.serving.openai_api import APIConfig, OpenAIServer  # noqa: E402
from node.serving.openai_follow import follow, join_node  # noqa: E402
from node.serving.openai_protocol import PromptCodec  # noqa: E402
from node.engine.scheduler_backend import ScheduledBackend  # noqa: E402
from node.serving.serve_auth import Tenants  # noqa: E402
from node.tasks.tasks import federated_state, lm_model, parameter_layout  # noqa: E402
from tests.hang_guard import HANG_GUARD_S  # noqa: E402
from tests.node.live_server import running  # noqa: E402

KEY = bytes(range(1, 33))
TOKEN = "alice-token-0123456789"
PROMPT, MAX_TOKENS = "The node says: ", 100
STEP_SLEEP_S = 0.01
"""Each scheduler step sleeps this long, so the 100-token stream outlasts the write-back."""


def _states() -> dict[int, dict[str, torch.Tensor]]:
    """The trainer's parameters per version: 0 the initial model, 1 after a write-back."""
    model = lm_model(seed=1)
    s0 = {n: t.clone() for n, t in federated_state(model, parameter_layout(model)).items()}
    g = torch.Generator().manual_seed(2)
    return {0: s0, 1: {n: t + 0.3 * torch.randn(t.shape, generator=g) for n, t in s0.items()}}


def _fingerprint(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


@dataclass
class Run:
    """What one scenario saw."""

    handles: list = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)
    """(end time, fingerprint of the weights the step's forward used)."""
    fingerprints: list[str] = field(default_factory=list)
    """``system_fingerprint`` of every chunk with text."""
    finish: str | None = None
    t_write: float | None = None
    """When the trainer was let write (every reader had ACKed)."""
    models_versions: tuple[int, int] = (-1, -1)
    invalidations: int = 0


@contextlib.contextmanager
def _serving(cache_dir, follow_node: bool, run: Run, initial: dict[str, torch.Tensor]):
    """A live server on the scheduler; ``follow_node``: joined to ``cache_dir``'s node (else it
    starts from ``initial``, the node's first parameters, and never hears of the node again)."""
    model = lm_model(seed=99).eval()  # the node's parameters replace these
    if not follow_node:
        model.load_state_dict(initial, strict=False)
    cache = KVCache(model.cache_config(pool_bytes=1 << 21))
    follower = join_node(cache_dir, KEY, model, cache, wait_s=5) if follow_node else None
    backend = ScheduledBackend(model, cache, model_id="fedkv-byte")
    hook = follow(backend, follower) if follower is not None else None
    step = backend.scheduler.step

    def slow_step():  # on the loop thread: weights do not change during a step
        time.sleep(STEP_SLEEP_S)
        events = step()
        run.steps.append((time.monotonic(), _fingerprint(model)))
        return events
    backend.scheduler.step = slow_step
    submit = backend.submit
    backend.submit = lambda r: run.handles.extend(hs := submit(r)) or hs
    try:
        server = OpenAIServer(("127.0.0.1", 0), backend, PromptCodec(None), Tenants([("alice", TOKEN)]),
                              APIConfig(max_tokens=MAX_TOKENS), context_len=model.context_len)
        server.history = hook.history if hook else None
        with running(server):
            yield server
    finally:
        backend.close()
        if hook is not None:
            hook.close()


def _write_back(cache_dir, state, version: int, run: Run) -> None:
    """The trainer's side of a write-back (``CacheNode._write_params``)."""
    with exclusive_params(cache_dir, timeout_s=20) as invalidated:
        run.t_write = time.monotonic()
        param_channel.publish(cache_dir, KEY, state, version)
    run.invalidations = invalidated


def _scenario(tmp_path, follow_node: bool) -> Run:
    cache_dir, states, run = tmp_path / "kv-cache", _states(), Run()
    cache_dir.mkdir(mode=0o700)
    param_channel.publish(cache_dir, KEY, states[0], 0)  # the node's first parameters
    with _serving(cache_dir, follow_node, run, states[0]) as server:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1",
                          api_key=TOKEN, max_retries=0, timeout=60)
        before = c.models.list().data[0].version
        trainer = None
        for chunk in c.completions.create(model="fedkv-byte", prompt=PROMPT, stream=True,
                                          max_tokens=MAX_TOKENS, temperature=0):
            choice = chunk.choices[0]
            if choice.text:
                run.fingerprints.append(chunk.system_fingerprint)
            run.finish = choice.finish_reason or run.finish
            if trainer is None and len(run.fingerprints) >= 20:  # mid-stream
                trainer = threading.Thread(target=_write_back,
                                           args=(cache_dir, states[1], 1, run))
                trainer.start()
        trainer.join(30)
        run.models_versions = (before, c.models.list().data[0].version)
    return run


@torch.no_grad()
def _problems(run: Run) -> list[str]:
    """Everything that says the server did not learn while serving (empty: it did)."""
    refs = {}
    for v, state in _states().items():
        refs[v] = lm_model().eval()
        refs[v].load_state_dict(state, strict=False)
    (h,) = run.handles
    out = []
    if run.finish != "length" or len(h.generated) != MAX_TOKENS:
        out.append(f"the stream did not complete ({run.finish}, {len(h.generated)} tokens)")
    versions = list(h.token_versions)
    if not (versions and versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)):
        out.append(f"token versions are not 0 then 1: {sorted(set(versions))}")
    ids = list(h.request.prompt)
    for i, (token, v) in enumerate(zip(h.generated, versions)):
        want = int(refs[v](torch.tensor([ids]))[0, -1].argmax())
        if token != want:
            out.append(f"token {i} is not version {v}'s greedy token")
            break
        ids.append(token)
    if set(run.fingerprints) - {"fedkv-v0", "fedkv-v1"} or run.fingerprints[-1:] != ["fedkv-v1"]:
        out.append(f"chunk fingerprints {sorted(set(run.fingerprints))}")
    if run.models_versions != (0, 1):
        out.append(f"/v1/models versions {run.models_versions}")
    old = _fingerprint(refs[0])
    late = [t for t, fp in run.steps if abs(fp - old) < 1e-6 and t > (run.t_write or 0)]
    if run.t_write is None or late:
        out.append(f"{len(late)} steps used the old weights after the trainer was let write")
    return out


def test_a_write_back_during_a_stream_restarts_it_under_the_new_version(tmp_path, one_thread):
    run = _scenario(tmp_path, follow_node=True)
    assert run.invalidations == 1  # the trainer had to invalidate the server
    assert _problems(run) == []
    assert run.fingerprints[0] == "fedkv-v0"  # the stream started on the old weights


def test_negative_control_a_server_that_ignores_the_node_fails_the_checks(tmp_path, one_thread):
    run = _scenario(tmp_path, follow_node=False)
    problems = _problems(run)
    assert any("token versions" in p for p in problems), problems
    assert any("/v1/models" in p for p in problems), problems
    assert any("after the trainer was let write" in p for p in problems), problems


@pytest.mark.slow  # a server process (~20 s on 2 loaded cores)
def test_the_cli_follows_a_cache_node_through_a_write_back(tmp_path, one_thread):
    """``python -m node.serving.openai_api --cache-dir`` beside a real ``CacheNode`` (the trainer):
    its key and token file beside the cache directory, the node's write-back waits for the
    server's ACK, and the replies, ``/v1/models`` and ``/v1/stats`` move to the new version."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    from crypto import write_secret_file
    from node.cache_node import CacheNode, NodeSpec

    tmp_path.chmod(0o700)
    cache_dir, ready = tmp_path / "kv-cache", tmp_path / "ready.json"
    write_secret_file(tmp_path / "kv-cache.key", KEY)
    (tmp_path / "serve-token").write_text(f"alice:{TOKEN}\n")
    (tmp_path / "serve-token").chmod(0o600)
    node = CacheNode(NodeSpec(0, 5, "lm"), cache_dir=cache_dir, cache_key=KEY)
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.serving.openai_api", "--cache-dir", str(cache_dir), "--port", "0",
         "--ready-file", str(ready), "--wait-s", "30"], cwd=root, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "node.serving.openai_api did not start"
            time.sleep(0.05)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{json.loads(ready.read_text())['port']}/v1",
                          api_key=TOKEN, max_retries=0, timeout=60)

        def ask() -> tuple[str, int]:
            r = c.completions.create(model="fedkv-byte", prompt=PROMPT, max_tokens=4)
            return r.system_fingerprint, c.models.list().data[0].version
        assert ask() == ("fedkv-v0", 0)
        node.apply_mean_update(np.random.default_rng(1).normal(0, 0.05, node.layout.size), 1)
        assert node.agents_invalidated == 1  # the write-back waited for the server's ACK
        assert ask() == ("fedkv-v1", 1)
        stats = c.get("/stats", cast_to=object)
        assert (stats["versions_seen"], stats["invalidations"], stats["version"]) == ([0, 1], 1, 1)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        node.release()


def test_a_load_that_fails_after_the_ack_is_retried_at_the_next_boundary():
    """The ACK cannot be taken back: a ``load`` that raised (the trainer held ``param`` past
    the timeout) must be tried again, not forgotten until the next write-back."""
    from node.serving.openai_follow import WeightFollower

    class Follower:
        polls, loads = [True, False, False], []

        def poll(self) -> bool:
            return self.polls.pop(0)

        def load(self, serving: int) -> int:
            self.loads.append(serving)
            if len(self.loads) == 1:
                raise TimeoutError("param still held by the trainer")
            return 5

    class Backend:
        version, updates = 4, []

        def update_weights(self, apply, version) -> None:
            self.updates.append(version)

    hook, backend = WeightFollower(Follower(), Backend()), Backend()
    hook.backend = backend
    with pytest.raises(TimeoutError):
        hook()
    hook()  # no new invalidation, but the ACKed one is still due
    hook()  # nothing due
    assert hook.follower.loads == [4, 4] and backend.updates == [5]
