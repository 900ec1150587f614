"""The serving agent's auth and tenancy pieces (node.serving.serve_auth), without a server."""

from __future__ import annotations

import re

import pytest

from node.serving.serve_auth import (DEFAULT_TENANT, NoSuchSession, QuotaExceeded, SessionRegistry, Tenants,
                             TokenFileError, check_bind, default_token_file, ensure_token_file,
                             parse_tokens)

A, B = "a" * 43, "b" * 20 + "-_" + "c" * 21


def test_first_start_writes_one_private_token_and_never_overwrites_it(tmp_path):
    path = default_token_file(tmp_path / "node" / "kv-cache")
    assert path == tmp_path / "node" / "serve-token"
    assert ensure_token_file(path) is True
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    token = path.read_text().strip()
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", token)
    assert ensure_token_file(path) is False and path.read_text().strip() == token
    tenants = Tenants.from_file(path)
    assert tenants.names == {DEFAULT_TENANT}
    assert tenants.authenticate(f"Bearer {token}") == DEFAULT_TENANT
    assert ensure_token_file(tmp_path / "other" / "serve-token")
    assert (tmp_path / "other" / "serve-token").read_text().strip() != token


def test_tenants_and_the_bearer_header():
    tenants = Tenants(parse_tokens(f"# tenants\nalice:{A}\n\nbob:{B}\nbob:{'d' * 32}\n"))
    assert tenants.names == {"alice", "bob"}
    assert tenants.authenticate(f"Bearer {A}") == "alice"
    assert tenants.authenticate(f"bearer {B}") == "bob"
    assert tenants.authenticate(f"Bearer {'d' * 32}") == "bob"
    for bad in (None, "", A, f"Basic {A}", f"Bearer {A} ", f"Bearer  {A}", f"Bearer {A[:-1]}",
                f"Bearer {A}x", "Bearer ", f"Bearer alice:{A}", "Bearer é"):
        assert tenants.authenticate(bad) is None, bad


@pytest.mark.parametrize("text, match", [
    ("", "no token"), ("# only a comment\n", "no token"), ("alice:short\n", "16 to 512"),
    (f"al ice:{A}\n", "tenant"), (f":{A}\n", "tenant"), (f"alice:{A}\nbob:{A}\n", "twice"),
    (f"alice:{A} x\n", "16 to 512"),
])
def test_malformed_token_files_are_refused(text, match):
    with pytest.raises(TokenFileError, match=match):
        parse_tokens(text)


def test_a_token_file_open_to_others_or_in_a_shared_directory_is_refused(tmp_path):
    path = tmp_path / "serve-token"
    path.write_text(f"alice:{A}\n")
    for mode in (0o644, 0o640, 0o604, 0o660):
        path.chmod(mode)
        with pytest.raises(TokenFileError, match="open to others"):
            Tenants.from_file(path)
    path.chmod(0o600)
    assert Tenants.from_file(path).names == {"alice"}
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(TokenFileError, match="writable by others"):
        ensure_token_file(shared / "serve-token")
    assert not (shared / "serve-token").exists()
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(TokenFileError, match="regular file"):
        Tenants.from_file(link)
    with pytest.raises(TokenFileError):
        Tenants.from_file(tmp_path / "missing")


def test_session_ids_are_random_bound_to_their_tenant_and_quota_limited():
    now = [0.0]
    reg = SessionRegistry(max_per_tenant=2, idle_expiry_s=10, clock=lambda: now[0])
    ids = []
    for _ in range(2):
        ids.append(reg.new_id("alice"))
        reg.add("alice", ids[-1])
    assert all(re.fullmatch(r"[0-9a-f]{32}", s) for s in ids) and ids[0] != ids[1]
    with pytest.raises(QuotaExceeded, match="quota.*'alice' holds 2.*at most 2"):
        reg.new_id("alice")
    reg.add("bob", reg.new_id("bob"))  # another tenant's quota is its own
    assert reg.use("alice", ids[0]) == ids[0]
    for tenant, sid in (("bob", ids[0]), ("alice", "0" * 32), ("alice", None), ("Alice", ids[0])):
        with pytest.raises(NoSuchSession) as e:
            reg.use(tenant, sid)
        assert str(e.value) == "no such session"
    reg.remove(ids[1])
    with pytest.raises(NoSuchSession):
        reg.use("alice", ids[1])
    reg.add("alice", reg.new_id("alice"))  # room again


def test_idle_sessions_are_reported_by_last_use():
    now = [0.0]
    reg = SessionRegistry(idle_expiry_s=10, clock=lambda: now[0])
    a, b = reg.new_id("t"), None
    reg.add("t", a)
    now[0] = 5
    b = reg.new_id("t")
    reg.add("t", b)
    now[0] = 12
    assert reg.idle() == [a]
    reg.use("t", a)
    now[0] = 16
    assert reg.idle() == [b]


def test_only_loopback_binds_without_tls():
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost"):
        check_bind(host, None, None)
    for host in ("0.0.0.0", "::", "10.0.0.1", "192.0.2.1", "example.org", "localhost.example.org"):
        with pytest.raises(ValueError, match="without TLS"):
            check_bind(host, None, None)
        check_bind(host, "c.pem", "k.pem")
    with pytest.raises(ValueError, match="both"):
        check_bind("127.0.0.1", "c.pem", None)


def test_a_planted_symlink_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    (tmp_path / "serve-token").symlink_to(target)
    assert ensure_token_file(tmp_path / "serve-token") is False
    assert not target.exists()
    with pytest.raises(TokenFileError):
        Tenants.from_file(tmp_path / "serve-token")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve-token"]  # no temporary left
