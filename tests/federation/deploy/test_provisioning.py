"""Provisioning builders (``federation.deploy.provisioning``): each artefact alone, the kits a
Provisioner writes without one of them, and what no kit may hold."""

from __future__ import annotations

import ipaddress
import json
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from crypto import load_context, verify_public_context
from crypto.at_rest import read_secret_file
from crypto.errors import CryptoError
from federation.deploy.provisioning import (
    CKKSBuilder,
    IdentityBuilder,
    NodePolicyBuilder,
    PinnedKeyBuilder,
    Project,
    ProvisionContext,
    ProvisionError,
    Provisioner,
    RosterBuilder,
    SuperNodeAuthBuilder,
    TLSBuilder,
    default_builders,
    write_kits,
)
from federation.startup_kit import (
    DEFAULT_POLICY,
    NODE_FILES,
    SERVER_FILES,
    KitError,
    Roster,
    load_node_kit,
    load_server_kit,
)

PROJECT = Project.of(2)


class _Spy:
    """Records the context it runs in (a test-only builder)."""

    ctx: ProvisionContext | None = None
    signer_raw: bytes = b""

    def build(self, project: Project, ctx: ProvisionContext) -> None:
        self.ctx = ctx
        self.signer_raw = ctx.signing_key().private_bytes_raw()


class _SeedRosterInputs:
    """What the identity, auth key and CKKS builders would leave for the roster (fixed bytes)."""

    def build(self, project: Project, ctx: ProvisionContext) -> None:
        for i, name in project.partitions():
            ctx.identity_public[name] = (bytes([i]) * 32, bytes([100 + i]) * 32)
            ctx.auth_public[name] = f"ecdsa-sha2-nistp384 AAAA{i}"
        ctx.key_id = b"k" * 16


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_tls_builder_alone_issues_a_server_cert_for_the_hosts(tmp_path) -> None:
    project = Project.of(1, hosts=("link.example", "10.1.2.3"))
    kits = Provisioner([TLSBuilder()]).provision(project, tmp_path / "out")
    assert _files(kits["server"]) == {"ca.crt", "server.crt", "server.key"}
    assert _files(kits["node-0"]) == {"ca.crt"}
    ca = x509.load_pem_x509_certificate((kits["node-0"] / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((kits["server"] / "server.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["link.example"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.1.2.3")]
    key = serialization.load_pem_private_key((kits["server"] / "server.key").read_bytes(), None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    assert _mode(kits["server"] / "server.key") == 0o600


def test_auth_key_builder_alone_registers_each_nodes_own_key(tmp_path) -> None:
    spy = _Spy()
    kits = Provisioner([SuperNodeAuthBuilder(), spy]).provision(PROJECT, tmp_path / "out")
    assert _files(kits["server"]) == {"supernode-auth/node-0.pub", "supernode-auth/node-1.pub"}
    pubs = set()
    for name in PROJECT.nodes:
        assert _files(kits[name]) == {"supernode-auth.key", "supernode-auth.pub"}
        key = serialization.load_ssh_private_key((kits[name] / "supernode-auth.key").read_bytes(), None)
        derived = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        registered = (kits["server"] / "supernode-auth" / f"{name}.pub").read_text().strip()
        assert derived.decode() == registered == spy.ctx.auth_public[name]
        assert _mode(kits[name] / "supernode-auth.key") == 0o600
        pubs.add(registered)
    assert len(pubs) == 2


def test_identity_builder_alone_seals_the_keys_it_hands_the_roster(tmp_path) -> None:
    spy = _Spy()
    project = Project.of(2, passphrase=b"pass")
    kits = Provisioner([IdentityBuilder(), spy]).provision(project, tmp_path / "out")
    assert _files(kits["server"]) == set()
    for name in project.nodes:
        path = kits[name] / "identity.key"
        assert _files(kits[name]) == {"identity.key"} and _mode(path) == 0o600
        with pytest.raises(CryptoError):
            read_secret_file(path, None)  # sealed: no passphrase, no keys
        blob = json.loads(read_secret_file(path, b"pass"))
        kx = serialization.load_pem_private_key(blob["kx"].encode(), None)
        sign = serialization.load_pem_private_key(blob["sign"].encode(), None)
        raw = (kx.public_key().public_bytes_raw(), sign.public_key().public_bytes_raw())
        assert blob["name"] == name and raw == spy.ctx.identity_public[name]


def test_ckks_builder_puts_no_secret_key_in_the_servers_folder(tmp_path) -> None:
    spy = _Spy()
    kits = Provisioner([CKKSBuilder(), spy]).provision(PROJECT, tmp_path / "out")
    assert _files(kits["server"]) == {"ckks-public.ctx"}
    signed = (kits["server"] / "ckks-public.ctx").read_bytes()
    pub, epoch, _ = verify_public_context(signed, spy.ctx.verify_key)
    public = load_context(pub)
    assert epoch == 0 and not public.is_private and public.key_id == spy.ctx.key_id
    with pytest.raises(CryptoError):
        load_context(signed)  # the file is no bare context (secret or not) either
    for name in PROJECT.nodes:
        secret = load_context(read_secret_file(kits[name] / "ckks-secret.ctx", None))
        assert secret.is_private and secret.key_id == spy.ctx.key_id
        assert _mode(kits[name] / "ckks-secret.ctx") == 0o600


def test_roster_builder_signs_what_the_pinned_key_verifies(tmp_path) -> None:
    kits = Provisioner([_SeedRosterInputs(), RosterBuilder(), PinnedKeyBuilder()]).provision(PROJECT, tmp_path / "out")
    for party, folder in kits.items():
        data, sig = (folder / "roster.json").read_bytes(), (folder / "roster.sig").read_bytes()
        meta = json.loads((folder / ("server.json" if party == "server" else "node.json")).read_text())
        pinned = Ed25519PublicKey.from_public_bytes(bytes.fromhex(meta["provisioner-key"]))
        pinned.verify(sig, data)
        with pytest.raises(InvalidSignature):
            pinned.verify(sig, data.replace(b"node-1", b"node-9"))
        roster = Roster.from_json(data)
        assert [(e.name, e.partition_id) for e in roster.entries] == [("node-0", 0), ("node-1", 1)]
        assert roster.key_id == b"k" * 16 and roster.provisioner_key == bytes.fromhex(meta["provisioner-key"])


def test_policy_and_pinned_key_builders_write_the_nodes_files(tmp_path) -> None:
    project = Project.of(2, policy={"min-noise-multiplier": 0.5})
    kits = Provisioner([NodePolicyBuilder(), PinnedKeyBuilder()]).provision(project, tmp_path / "out")
    assert _files(kits["server"]) == {"server.json"}
    pinned = json.loads((kits["server"] / "server.json").read_text())["provisioner-key"]
    for i, name in project.partitions():
        assert json.loads((kits[name] / "node-policy.json").read_text()) == {**DEFAULT_POLICY, "min-noise-multiplier": 0.5}
        meta = json.loads((kits[name] / "node.json").read_text())
        assert meta == {"name": name, "partition-id": i, "num-partitions": 2, "provisioner-key": pinned}


@pytest.mark.parametrize("left_out, node_missing, server_missing", [
    (TLSBuilder, "ca.crt", "ca.crt"),
    (RosterBuilder, "roster.json", "roster.json"),
    (NodePolicyBuilder, "node-policy.json", None),
    (PinnedKeyBuilder, "node.json", "server.json"),
])
def test_a_kit_without_a_builders_artefact_is_refused_naming_the_file(
        tmp_path, left_out, node_missing, server_missing) -> None:
    builders = [b for b in default_builders() if not isinstance(b, left_out)]
    kits = Provisioner(builders).provision(Project.of(1), tmp_path / "out")
    with pytest.raises(KitError, match=rf"is missing .*\b{node_missing}\b"):
        load_node_kit(kits["node-0"])
    if server_missing is None:
        load_server_kit(kits["server"])
    else:
        with pytest.raises(KitError, match=rf"is missing .*\b{server_missing}\b"):
            load_server_kit(kits["server"])


@pytest.mark.parametrize("left_out", [IdentityBuilder, SuperNodeAuthBuilder, CKKSBuilder])
def test_the_roster_names_a_builder_it_needs_and_no_half_kit_stays(tmp_path, left_out) -> None:
    builders = [b for b in default_builders() if not isinstance(b, left_out)]
    out = tmp_path / "out"
    with pytest.raises(ProvisionError, match=rf"the {left_out.__name__} must run before"):
        Provisioner(builders).provision(Project.of(1), out)
    assert list(out.iterdir()) == []  # the secrets written before the failure are gone


def test_kits_hold_exactly_the_loaders_files_and_never_the_signing_key(tmp_path) -> None:
    spy = _Spy()
    kits = Provisioner([*default_builders(), spy]).provision(PROJECT, tmp_path / "out")
    assert spy.ctx.signer is None  # dropped when provisioning returned
    with pytest.raises(ProvisionError, match="signing key is gone"):
        spy.ctx.signing_key()
    assert _files(kits["server"]) == {*SERVER_FILES, "supernode-auth/node-0.pub", "supernode-auth/node-1.pub"}
    for name in PROJECT.nodes:
        assert _files(kits[name]) == set(NODE_FILES)
        assert stat.S_IMODE(kits[name].stat().st_mode) == 0o700
    for folder in kits.values():
        for path in folder.rglob("*"):
            assert not path.is_file() or spy.signer_raw not in path.read_bytes(), path
    load_server_kit(kits["server"])
    assert load_node_kit(kits["node-1"]).identity(None).node_id == "node-1"


def test_a_project_says_what_is_wrong(tmp_path) -> None:
    with pytest.raises(ValueError, match="num_nodes must be >= 1"):
        write_kits(tmp_path / "out", 0)
    with pytest.raises(ValueError, match="distinct and not 'server'"):
        Project(("node-0", "server"))
    with pytest.raises(ValueError, match="distinct"):
        Project(("a", "a"))
