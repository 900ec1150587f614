"""Specific errors of the cache engine; each message names the offending value."""


class CacheError(Exception):
    """Base class of every error the cache raises."""


class ConfigError(CacheError, ValueError):
    """A CacheConfig value is out of range or inconsistent."""


class CacheFullError(CacheError, MemoryError):
    """No block can be allocated: every block is referenced by a live session."""


class UnknownSessionError(CacheError, KeyError):
    """A session id that was never opened."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown session"


class ClosedSessionError(UnknownSessionError):
    """A session that was closed: its table is gone, so the cache no longer knows it (a
    subclass, so callers that handle unknown ids handle closed ones too; as in node.engine.sessions)."""


class StaleSessionError(CacheError):
    """A session whose K/V were computed under an older model version."""


class LayerIndexError(CacheError, IndexError):
    """A layer index outside [0, num_layers)."""


class ShapeMismatchError(CacheError, ValueError):
    """A K/V tensor whose shape does not match the cache geometry or reservation."""


class TensorDTypeError(CacheError, TypeError):
    """A tensor of a dtype the cache cannot store (e.g. integer K/V)."""


class ReservationError(CacheError):
    """Writes that do not match the reserved tokens (nothing reserved, layer written twice)."""


class UnknownTensorError(CacheError, KeyError):
    """A tensor-store name that holds nothing, or a namespace that does not exist."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown tensor"
