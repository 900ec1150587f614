"""``python -m federation.deploy.provision``: writes the kits and says where each goes."""

from __future__ import annotations

from federation.deploy import provision
from federation.startup_kit import load_node_kit


def test_provision_cli(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("KIT_PASS", "s3cret")
    out = tmp_path / "kits"
    assert provision.main(["--nodes", "2", "--out", str(out), "--passphrase-env", "KIT_PASS",
                           "--host", "link.example", "--host", "10.1.2.3"]) == 0
    text = capsys.readouterr().out
    assert f"{out / 'server'}/  -> the SuperLink machine" in text
    assert f"{out / 'node-1'}/  -> node machine node-1 (partition 1)" in text
    assert "fingerprint" in text and "s3cret" not in text
    assert load_node_kit(out / "node-1").identity(b"s3cret").node_id == "node-1"
    assert provision.main(["--nodes", "1", "--out", str(out)]) == 2  # not empty
