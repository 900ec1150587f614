"""Startup kits as the app loads them (``federation.startup_kit``), from kits ``write_kits`` makes."""

from __future__ import annotations

import ipaddress
import re
import json
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from crypto import load_context, verify_public_context
from crypto.errors import CryptoError
from federation.deploy.provisioning import write_kits
from federation.startup_kit import (
    NODE_SECRETS,
    SERVER_SECRETS,
    KitError,
    Roster,
    load_node_kit,
    load_server_kit,
)


@pytest.fixture(scope="module")
def kits(tmp_path_factory) -> dict[str, Path]:
    return write_kits(tmp_path_factory.mktemp("kits") / "out", 3)


@pytest.fixture
def fresh(tmp_path) -> dict[str, Path]:
    """Kits a test may damage."""
    return write_kits(tmp_path / "out", 2)


def test_round_trip(kits) -> None:
    assert sorted(kits) == ["node-0", "node-1", "node-2", "server"]
    server = load_server_kit(kits["server"])
    assert [e.name for e in server.roster.entries] == ["node-0", "node-1", "node-2"]
    assert server.roster.num_partitions == 3 and len(server.roster.key_id) == 16
    assert Roster.from_json(server.roster.to_json()) == server.roster
    pub, epoch, _ = verify_public_context(server.signed_public_context, server.roster.provisioner_key)
    assert epoch == 0 and load_context(pub).key_id == server.roster.key_id
    assert set(server.auth_public_keys) == {"node-0", "node-1", "node-2"}
    for i in range(3):
        node = load_node_kit(kits[f"node-{i}"])
        assert (node.name, node.partition_id, node.num_partitions) == (f"node-{i}", i, 3)
        assert node.roster == server.roster
        assert node.policy["require-he"] is True
        keys = node.identity(None)
        entry = server.roster.by_name(node.name)
        assert keys.node_id == node.name
        assert (keys.public.kx_public, keys.public.sign_public) == (entry.kx_public, entry.sign_public)
        assert server.auth_public_keys[node.name].read_text().strip() == entry.auth_public
    assert server.roster.by_name("node-9") is None


def test_node_ckks_secret_matches_roster_key_id(kits) -> None:
    node = load_node_kit(kits["node-1"])
    ctx = load_context(node.ckks_secret_bytes(None))
    assert ctx.is_private and ctx.key_id == node.roster.key_id


def test_secret_files_have_mode_0600(kits) -> None:
    for name, folder in kits.items():
        for secret in SERVER_SECRETS if name == "server" else NODE_SECRETS:
            assert stat.S_IMODE((folder / secret).stat().st_mode) == 0o600, folder / secret


def test_server_kit_holds_no_node_secret(kits) -> None:
    node_secrets = []
    for i in range(3):
        node = load_node_kit(kits[f"node-{i}"])
        keys = node.identity(None)
        node_secrets += [keys._kx.private_bytes_raw(), keys._sign.private_bytes_raw(),
                         (node.path / "identity.key").read_bytes()[4:],
                         node.auth_private_key.read_bytes()]
    ckks_secret = load_node_kit(kits["node-0"]).ckks_secret_bytes(None)
    provisioner_key = load_server_kit(kits["server"]).roster.provisioner_key
    files = [p for p in kits["server"].rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"ckks-public.ctx", "server.key", "roster.json"}
    contexts = 0
    for path in files:
        data = path.read_bytes()
        assert ckks_secret not in data and ckks_secret[-4096:] not in data, path
        assert not any(s in data for s in node_secrets), path
        for blob in _contexts_in(data, provisioner_key):
            assert load_context(blob).is_private is False, path
            contexts += 1
    assert contexts == 1  # ckks-public.ctx, and it is public


def _contexts_in(data: bytes, provisioner_key: bytes) -> list[bytes]:
    """Every CKKS context a file holds: as a bare envelope, or inside a signed public context."""
    found = []
    for candidate in (data, _signed_body(data, provisioner_key)):
        if candidate is None:
            continue
        try:
            load_context(candidate)
        except CryptoError:
            continue
        found.append(candidate)
    return found


def _signed_body(data: bytes, key: bytes) -> bytes | None:
    try:
        return verify_public_context(data, key)[0]
    except CryptoError:
        return None


def test_public_context_in_server_kit_is_public(kits) -> None:
    server = load_server_kit(kits["server"])
    pub, _, _ = verify_public_context(server.signed_public_context, server.roster.provisioner_key)
    assert load_context(pub).is_private is False


def test_tampered_roster_is_refused(fresh) -> None:
    for folder, loader in ((fresh["node-0"], load_node_kit), (fresh["server"], load_server_kit)):
        path = folder / "roster.json"
        original = path.read_text()
        d = json.loads(original)
        d["nodes"][1]["sign-public"] = "00" * 32  # swap in a key the provisioner never signed
        path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
        with pytest.raises(KitError, match="signature does not verify"):
            loader(folder)
        path.write_text(original)
        loader(folder)  # the untouched roster loads again


def test_roster_resigned_by_another_key_is_refused(fresh) -> None:
    """An attacker's own signature is no help: the provisioner key is pinned in node.json."""
    folder = fresh["node-1"]
    roster = Roster.from_json((folder / "roster.json").read_text())
    attacker = Ed25519PrivateKey.generate()
    forged = Roster(roster.entries, attacker.public_key().public_bytes_raw(), roster.key_id, roster.num_partitions)
    data = forged.to_json().encode()
    (folder / "roster.json").write_bytes(data)
    (folder / "roster.sig").write_bytes(attacker.sign(data))
    with pytest.raises(KitError, match="signature does not verify"):
        load_node_kit(folder)


def test_wrong_passphrase_is_a_clear_error(tmp_path) -> None:
    kits = write_kits(tmp_path / "out", 1, passphrase=b"correct horse")
    node = load_node_kit(kits["node-0"])
    assert node.identity(b"correct horse").node_id == "node-0"
    assert load_context(node.ckks_secret_bytes(b"correct horse")).key_id == node.roster.key_id
    with pytest.raises(KitError, match="wrong passphrase"):
        node.identity(b"wrong")
    with pytest.raises(KitError, match="no passphrase was given"):
        node.ckks_secret_bytes(None)


def test_missing_file_and_loose_mode_are_refused(fresh) -> None:
    node = fresh["node-0"]
    (node / "identity.key").chmod(0o644)
    with pytest.raises(KitError, match="readable by others"):
        load_node_kit(node)
    (node / "identity.key").chmod(0o600)
    (node / "ckks-secret.ctx").unlink()
    with pytest.raises(KitError, match="missing ckks-secret.ctx"):
        load_node_kit(node)
    (fresh["server"] / "server.key").chmod(0o640)
    with pytest.raises(KitError, match="readable by others"):
        load_server_kit(fresh["server"])
    with pytest.raises(KitError, match="not found"):
        load_node_kit(fresh["server"].parent / "node-7")


def test_write_kits_refuses_a_used_folder(kits) -> None:
    with pytest.raises(KitError, match="not empty"):
        write_kits(kits["server"].parent, 1)


def test_flower_can_read_auth_keys_and_tls(kits) -> None:
    node = load_node_kit(kits["node-0"])
    key = serialization.load_ssh_private_key(node.auth_private_key.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    pub = (node.path / "supernode-auth.pub").read_text()
    assert pub.startswith("ecdsa-sha2-nistp384 ")
    assert isinstance(serialization.load_ssh_public_key(pub.encode()), ec.EllipticCurvePublicKey)
    server = load_server_kit(kits["server"])
    ca = x509.load_pem_x509_certificate(server.tls_root.read_bytes())
    cert = x509.load_pem_x509_certificate(server.tls_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert set(san.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    assert node.tls_root.read_bytes() == server.tls_root.read_bytes()
    assert not (kits["server"].parent / "provisioner").exists()  # no CA / signing key kept


# --- issue 20: local secrets fail loudly, naming the file ----------------------------------------


@pytest.mark.parametrize("name", ["ckks-secret.ctx", "identity.key"])
def test_a_flipped_bit_in_a_kit_secret_is_named_not_loaded(fresh, name) -> None:
    """A bit flipped in ckks-secret.ctx used to load with the same key id and another MAC key:
    every aggregate was rejected and nothing named the file."""
    path = fresh["node-0"] / name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    node = load_node_kit(fresh["node-0"])
    expected = f"{re.escape(str(path))}: key check failed: the file changed since it was written"
    with pytest.raises(KitError, match=expected):
        node.ckks_secret_bytes(None) if name == "ckks-secret.ctx" else node.identity(None)


def test_a_node_store_on_a_kit_names_the_damaged_ckks_secret(fresh) -> None:
    from federation.node_store import NodeStore, ProvisioningError

    path = fresh["node-1"] / "ckks-secret.ctx"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x80
    path.write_bytes(bytes(raw))
    store = NodeStore(fresh["node-1"] / "state" / "run-1", "101", load_node_kit(fresh["node-1"]))
    with pytest.raises((KitError, ProvisioningError), match=rf"{re.escape(str(path))}: key check failed"):
        store.context(0)


def test_a_ckks_secret_from_another_provisioning_is_named(fresh, tmp_path) -> None:
    """An intact secret context of another federation (a kit file copied from the wrong folder)."""
    from federation.node_store import NodeStore, ProvisioningError

    other = write_kits(tmp_path / "other", 1)
    path = fresh["node-0"] / "ckks-secret.ctx"
    path.write_bytes((other["node-0"] / "ckks-secret.ctx").read_bytes())
    store = NodeStore(fresh["node-0"] / "state" / "run-1", "100", load_node_kit(fresh["node-0"]))
    with pytest.raises((KitError, ProvisioningError), match=rf"{re.escape(str(path))}.*key id"):
        store.context(0)
