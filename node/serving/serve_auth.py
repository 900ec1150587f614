"""Authentication and tenancy of a serving agent on a shared host, in small reusable pieces.

``node.serving.serve`` uses them; an OpenAI-compatible front end can use the same ones.

* ``Tenants`` and the token file: bearer tokens. A token file holds one ``tenant:token`` per
  line (``#`` comments and blank lines skipped; a bare ``token`` is the tenant ``default``). It
  must be the caller's own, mode 0600 (no group/other bits), in a directory others cannot
  write. ``ensure_token_file`` makes one on first start: a bare ``secrets.token_urlsafe(32)``,
  0600, linked into place whole (never over a file or a symlink), its directory made 0700 when
  missing, so ``curl -H "Authorization: Bearer $(cat serve-token)"`` works. Tokens are
  compared with ``hmac.compare_digest`` against every token (no early exit).
* ``SessionRegistry``: session ids of 128 random bits (``secrets.token_hex(16)``), each bound to
  the tenant that made it; a per-tenant quota of open sessions and an idle expiry. Another
  tenant's id, a closed one and one never issued are the same ``NoSuchSession`` (no oracle).
* ``check_bind`` / ``tls_context``: a non-loopback address only with TLS (>= 1.2).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import secrets
import ssl
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

TOKEN_FILE_NAME = "serve-token"
"""Default token file, beside the node's cache directory (like ``kv-cache.key``), or in the
server's own directory (``server_token_file``): never one file for every server."""
DEFAULT_TENANT = "default"
_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TOKEN = re.compile(r"[A-Za-z0-9_.~+/=-]{16,512}")


class TokenFileError(Exception):
    """A token file that cannot be used: missing, open to others, or malformed."""


class QuotaExceeded(Exception):
    """The tenant already holds its quota of open sessions."""


class NoSuchSession(KeyError):
    """No open session of this id *for this tenant*: never issued, closed, expired or another
    tenant's -- one answer for all, so a tenant learns nothing about ids it does not hold."""

    def __str__(self) -> str:
        return "no such session"


# -- tokens ------------------------------------------------------------------------------------
def default_token_file(cache_dir: str | os.PathLike) -> Path:
    """``<cache-dir>/../serve-token``."""
    return Path(os.path.abspath(cache_dir)).parent / TOKEN_FILE_NAME


def server_token_file(name: str) -> Path:
    """``~/.cache/fedkv/<name>/serve-token``: a server's own token file when it has no cache
    directory (``name`` says which server, e.g. ``openai-8471``); ``ensure_token_file`` makes
    the directory 0700. A token opens only its own server, not every one of the account."""
    if not _TENANT.fullmatch(name):
        raise ValueError(f"a server name matches {_TENANT.pattern}, got {name!r}")
    return Path.home() / ".cache" / "fedkv" / name / TOKEN_FILE_NAME


def _check_private(path: Path) -> None:
    """The file is ours and 0600-or-stricter; its directory is not writable by others."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise TokenFileError(f"token file {path} is not a regular file")
    if st.st_uid != os.getuid():
        raise TokenFileError(f"token file {path} belongs to uid {st.st_uid}, not to us")
    if st.st_mode & 0o077:
        raise TokenFileError(f"token file {path} is open to others (mode {st.st_mode & 0o777:o}); "
                             "chmod 600 it")
    _check_dir(path.parent)


def _check_dir(folder: Path) -> None:
    st = folder.stat()
    if st.st_mode & 0o022:
        raise TokenFileError(f"directory {folder} of the token file is writable by others "
                             f"(mode {st.st_mode & 0o777:o}): they could replace the file")


def ensure_token_file(path: str | os.PathLike) -> bool:
    """Write a fresh token to ``path`` (0600; its directory made 0700) unless it exists.
    Returns True when it wrote one. The file appears whole or not at all (written aside, then
    hard-linked: a link never replaces an existing file or follows a planted symlink)."""
    path = Path(path)
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    _check_dir(path.parent)
    if os.path.lexists(path):
        return False
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:  # another agent made it meanwhile: use that one
            return False
    finally:
        os.unlink(tmp)
    return True


def parse_tokens(text: str) -> list[tuple[str, str]]:
    """``[(tenant, token)]`` from a token file's text; refuses malformed lines and a token
    given twice."""
    out: list[tuple[str, str]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, token = line.partition(":")
        if not sep:
            tenant, token = DEFAULT_TENANT, line
        if not _TENANT.fullmatch(tenant):
            raise TokenFileError(f"line {n}: tenant must match {_TENANT.pattern}")
        if not _TOKEN.fullmatch(token):
            raise TokenFileError(f"line {n}: a token is 16 to 512 characters of [A-Za-z0-9_.~+/=-]")
        out.append((tenant, token))
    if not out:
        raise TokenFileError("no token in the token file")
    if len({t for _, t in out}) != len(out):
        raise TokenFileError("a token is given twice")
    return out


class Tenants:
    """Bearer tokens -> tenant names (a tenant may hold several tokens)."""

    def __init__(self, pairs: Iterable[tuple[str, str]]):
        self._tokens = [(tenant, token.encode("ascii")) for tenant, token in pairs]

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tenants:
        path = Path(path)
        try:
            _check_private(path)
            return cls(parse_tokens(path.read_text()))
        except (OSError, UnicodeDecodeError) as e:
            raise TokenFileError(f"token file {path}: {e}") from e

    @property
    def names(self) -> set[str]:
        return {t for t, _ in self._tokens}

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer <token>`` header value, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.encode("utf-8", "replace")
        found = None
        for tenant, known in self._tokens:  # every token compared: the time says nothing
            if hmac.compare_digest(given, known):
                found = tenant
        return found


# -- sessions ----------------------------------------------------------------------------------
@dataclass
class _Owned:
    tenant: str
    last_used: float


class SessionRegistry:
    """Open session ids, each bound to its tenant; quota and idle expiry per session."""

    def __init__(self, max_per_tenant: int = 16, idle_expiry_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_per_tenant < 1 or idle_expiry_s <= 0:
            raise ValueError("max_per_tenant must be >= 1 and idle_expiry_s > 0")
        self.max_per_tenant, self.idle_expiry_s, self.clock = max_per_tenant, idle_expiry_s, clock
        self._open: dict[str, _Owned] = {}

    def new_id(self, tenant: str) -> str:
        """A fresh id for ``tenant`` (registered by ``add`` once the session exists), or
        QuotaExceeded."""
        held = self.count(tenant)
        if held >= self.max_per_tenant:
            raise QuotaExceeded(
                f"session quota reached: tenant {tenant!r} holds {held} open sessions (at most "
                f"{self.max_per_tenant}); close one (DELETE /v1/sessions/<id>) or let one expire "
                f"({self.idle_expiry_s:g} s idle)")
        while True:
            sid = secrets.token_hex(16)
            if sid not in self._open:
                return sid

    def add(self, tenant: str, sid: str) -> None:
        self._open[sid] = _Owned(tenant, self.clock())

    def use(self, tenant: str, sid: object) -> str:
        """``sid`` when ``tenant`` holds it open (its idle clock restarts), else NoSuchSession."""
        owned = self._open.get(sid) if isinstance(sid, str) else None
        if owned is None or owned.tenant != tenant:
            raise NoSuchSession(sid)
        owned.last_used = self.clock()
        return sid

    def remove(self, sid: str) -> None:
        self._open.pop(sid, None)

    def count(self, tenant: str) -> int:
        return sum(1 for o in self._open.values() if o.tenant == tenant)

    def owner(self, sid: str) -> str:
        return self._open[sid].tenant

    def idle(self) -> list[str]:
        """Ids idle for longer than the expiry (still registered: the caller closes them)."""
        limit = self.clock() - self.idle_expiry_s
        return [sid for sid, o in self._open.items() if o.last_used < limit]

    def __len__(self) -> int:
        return len(self._open)


# -- binding -----------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


def check_bind(host: str, tls_cert: str | os.PathLike | None, tls_key: str | os.PathLike | None) -> None:
    """Raise ValueError for a non-loopback ``host`` without both TLS files, or half a pair."""
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("give both --tls-cert and --tls-key, or neither")
    if not is_loopback(host) and tls_cert is None:
        raise ValueError(f"refusing to serve on non-loopback address {host!r} without TLS: "
                         "give --tls-cert and --tls-key (bearer tokens must not cross a network "
                         "in clear), or bind 127.0.0.1")


def tls_context(cert: str | os.PathLike, key: str | os.PathLike) -> ssl.SSLContext:
    """A server context: TLS 1.2 or newer, the system's default ciphers."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
    return ctx


def load_tenants(path: str | os.PathLike, announce: Callable[[str], None]) -> Tenants:
    """The tenants of the token file ``path``, written with one fresh token when missing
    (``announce`` is told where, never the token); an unreadable or malformed file is a
    ``SystemExit`` naming the problem. What every server's CLI does at start."""
    try:
        if ensure_token_file(path):
            announce(f"wrote a new bearer token to {path} (mode 0600)")
        return Tenants.from_file(path)
    except (OSError, TokenFileError) as e:
        raise SystemExit(f"token file: {e}") from e
