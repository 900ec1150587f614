"""docs/privacy.md's per-observer ε and canary-audit table ("ε per observer at these points"),
recomputed from the code: the ledger the run uses and the audit privacy_accuracy runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from experiments.canary_audit import AuditConfig, run_canary_audit
from federation.privacy_ledger import OBSERVERS, PrivacyLedger, RoundRelease

pytest.importorskip("dp_accounting")

PRIVACY_DOC = Path(__file__).resolve().parents[2] / "docs" / "privacy.md"
POINTS = {"fixed, ε = 2": ("fixed", 9.094), "fixed, ε = 8": ("fixed", 3.039), "Poisson, ε = 8": ("poisson", 1.069)}
N, K, ROUNDS = 100, 32, 12


def _doc_rows() -> dict[str, list[str]]:
    rows = {}
    for line in PRIVACY_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in POINTS:
            rows[cells[0]] = cells[1:]
    return rows


def _epsilons(sampling: str, sigma: float) -> dict[str, float]:
    ledger = PrivacyLedger(sampling, N, 1e-5, "distributed", True, colluding=2)
    for _ in range(ROUNDS):
        release = RoundRelease(K, {n: 1 for n in range(K)})
        if sampling == "poisson":
            ledger.record(release, sigma, sample_rate=K / N)
        else:
            ledger.record(release, sigma, sample_size=K)
    return ledger.epsilons()


def _fmt(v: float) -> str:
    return f"{v:.3g}" if v >= 10 else f"{v:.2f}"


@pytest.mark.parametrize("point", list(POINTS))
def test_privacy_doc_observer_and_audit_figures(point: str) -> None:
    sampling, sigma = POINTS[point]
    row = _doc_rows()[point]
    assert float(row[0]) == sigma
    eps = _epsilons(sampling, sigma)
    assert row[1:5] == [_fmt(eps[o]) for o in OBSERVERS]
    audit = run_canary_audit(AuditConfig(dim=4810, population=N, fraction=K / N, sampling=sampling, rounds=ROUNDS,
                                         sigma=sigma, clip_norm=1.0, trials=1000, delta=1e-5, seed=0))
    point_est, lower = re.fullmatch(r"([0-9.]+) \(([0-9.]+)\)", row[5]).groups()
    assert float(point_est) == pytest.approx(audit.epsilon, abs=0.006)
    assert float(lower) == pytest.approx(audit.epsilon_lower, abs=0.006)
    assert audit.epsilon_lower <= eps["third_party"]
