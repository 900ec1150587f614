"""A serving process that follows the node's trainer: it holds ``param`` shared in the node's
coherence directory, notices each write-back (the trainer's exclusive take drops it) and loads
the parameters the trainer published (``node.serving.param_channel``) into its model.

One follower per serving process, whatever serves (the session agent ``node.serving.serve``, the
OpenAI-compatible server ``node.serving.openai_api``): it says *that* new weights are due (``poll``)
and loads them (``load``); when to swap -- between tokens, between scheduler steps -- and what
to do with K/V computed under the old ones is the server's call.

While it follows, the process holds a lease on the cache directory (``node.serving.dir_lease``): the
run's retention (``federation.run_retention``) never removes a directory a live server serves
from, however old its run (issue 30). ``leave`` releases it; a killed process's lease is stale.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cache.coherence import Mode
from cache.coherence_file import FileDirectory
from crypto import Layout
from node.serving import dir_lease, param_channel
from node.serving.param_channel import COHERENCE_DIR, PARAM_ENTRY
from node.tasks.tasks import load_parameters

_log = logging.getLogger("fedkv.serve")


def _lease_purpose() -> str:
    """``serving.<main module>`` (``serving.node.openai_api``): retention names who holds a run."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = spec.name if spec is not None else ""
    return f"serving.{name}" if re.fullmatch(r"[a-z0-9_.]{1,30}", name) else "serving"


@dataclass
class FollowerCounters:
    """The model's history as a server saw it: what every tenant may see."""

    reloads: int = 0
    invalidations: int = 0
    """``param`` invalidations received (each one a trainer write-back)."""
    versions_seen: list[int] = field(default_factory=list)


class ParamFollower:
    """``param`` held shared by ``agent_name`` in ``cache_dir``'s coherence directory.

    ``own_weights``: the model arrives with its weights (SmolLM2 from its directory): serve
    them without waiting for published parameters, and take published ones only when every
    entry of ``layout`` fits the model (a chat task's adapters on the same base do)."""

    def __init__(self, cache_dir: str | os.PathLike, key: bytes | None, model, layout: Layout,
                 *, agent_name: str = "serve", mode: Mode = Mode.STRONG,
                 timeout_s: float = 30.0, wait_s: float = 60.0, own_weights: bool = False):
        self.cache_dir, self.key = Path(cache_dir), key
        self.model, self.layout, self.own_weights = model, layout, own_weights
        self.counters = FollowerCounters()
        self.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.lease = dir_lease.take(self.cache_dir, _lease_purpose())
        try:
            self.directory = FileDirectory(self.cache_dir / COHERENCE_DIR, mode=mode,
                                           timeout_s=timeout_s)
            self.agent = self.directory.join(agent_name)
        except BaseException:
            self.lease.release()
            raise
        self.wait_s = wait_s

    def poll(self) -> bool:
        """ACK pending invalidations; True when ``param`` was dropped (new weights are due:
        stop using the old ones, then ``load``)."""
        if PARAM_ENTRY in self.agent.poll():
            self.counters.invalidations += 1
            return True
        return False

    def load(self, serving: int) -> int | None:
        """Take ``param`` shared again and load the published parameters into the model:
        their version, or None when the model keeps what it has (none published yet for a
        model with its own weights, an older file than ``serving``, or parameters of another
        model). The first parameters are waited for *before* taking ``param``: a reader that
        held it while sleeping would hold the trainer's first write up."""
        deadline = time.monotonic() + self.wait_s
        while not param_channel.path_in(self.cache_dir).exists():
            if self.own_weights:
                self.agent.acquire_read(PARAM_ENTRY)  # a reader all the same: ACKs write-backs
                return None
            if time.monotonic() > deadline:
                raise param_channel.PublishedParamsError(
                    f"no parameters were published in {self.cache_dir} within {self.wait_s} s")
            time.sleep(0.1)  # the node has not written its parameters yet
        self.agent.acquire_read(PARAM_ENTRY)
        try:
            state, version = param_channel.load(self.cache_dir, self.key, at_least=serving)
        except param_channel.ParamRollbackError as err:
            _log.error("%s", err)  # keeps serving the version it has
            return None
        if not self._fits(state, version):
            return None
        load_parameters(self.model, state, self.layout)
        self.counters.reloads += 1
        self.counters.versions_seen.append(version)
        _log.info("serving model version %d", version)
        return version

    def _fits(self, state: dict, version: int) -> bool:
        """Published parameters a model with its own weights can take: every entry present
        with its shape (the trainer's may be another model's: then keep these, whole)."""
        if not self.own_weights:
            return True
        own = self.model.state_dict()
        unfit = [n for n in self.layout.names
                 if n not in state or n not in own or tuple(state[n].shape) != tuple(own[n].shape)]
        if unfit:
            _log.warning("published parameters (version %d) do not fit the served model "
                         "(%d entries absent or of another shape, e.g. %r); serving its own "
                         "weights", version, len(unfit), unfit[0])
            return False
        return True

    def leave(self) -> None:
        try:
            self.agent.leave()
        finally:
            self.lease.release()
