"""One line per log record in ``flwr run --stream`` (call ``configure_logging()`` in each app).

Why lines were printed twice: importing Opacus (``opacus/utils/module_utils.py``, reached by
any ``import opacus...``: the server's privacy accountant, DP-SGD on a node) runs
``logging.basicConfig(format="%(asctime)s:%(levelname)s:%(message)s", stream=sys.stderr)``
at import time, which puts a StreamHandler on the *root* logger. Flower's ``flwr`` logger
has its own console handler and propagates to the root, so from that import on every
Flower/fedkv record was printed by both handlers: once as ``INFO :  ...`` and once as
``12/01/2026 07:38:20:INFO:...``, and the root handler (level NOTSET) also printed Flower's
DEBUG records. A ``flwr run`` with dp-mode none never imported Opacus and showed no
duplicates; the main job (distributed DP) did from its first round.

``configure_logging()`` keeps Python's default behaviour for the root logger and makes
Opacus' ``basicConfig`` harmless, whatever the import order:

* if the root logger has no handler, it gets one that behaves like Python's last-resort
  handler (stderr, WARNING and above, bare message), so Opacus' later ``basicConfig`` is a
  no-op (``basicConfig`` does nothing when the root already has a handler);
* that handler, and a plain ``StreamHandler`` that ``basicConfig`` already put on the root
  (Opacus imported first), print only records that no handler below the root printed:
  Flower's records are printed once, by Flower's handler.

Idempotent; touches no other logger and no handler subclass (pytest's capture handlers,
Flower's own handlers).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["configure_logging", "UnhandledOnly"]


class UnhandledOnly(logging.Filter):
    """Pass a record only if no logger between its own and the root has a handler.

    That is the rule of Python's last-resort handler: a record some library's own handler
    already printed (Flower's ``flwr`` logger has one) is not printed again at the root.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        root = logging.getLogger()
        while logger is not None and logger is not root:
            if logger.handlers:
                return False
            if not logger.propagate:
                break
            logger = logger.parent  # type: ignore[assignment]
        return True


class _RootHandler(logging.StreamHandler):
    """fedkv's root handler: the last-resort handler's behaviour, made explicit.

    Like ``logging.lastResort`` it writes to whatever ``sys.stderr`` is at emit time
    (Flower redirects or mirrors the output streams of its app processes).
    """

    def __init__(self) -> None:
        logging.Handler.__init__(self, logging.WARNING)
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


def configure_logging() -> None:
    """Make every log record print once (see the module docstring). Safe to call often."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(_RootHandler())
    for handler in root.handlers:
        if isinstance(handler, _RootHandler) or type(handler) is logging.StreamHandler:
            if not any(isinstance(f, UnhandledOnly) for f in handler.filters):
                handler.addFilter(UnhandledOnly())
