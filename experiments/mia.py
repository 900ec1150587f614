"""Membership inference: the empirical side of the privacy story.

A loss-threshold attack (Yeom et al., 2018): training samples tend to have lower loss than
unseen ones, so ``-loss`` is a membership score; its ROC AUC over members (training samples)
and non-members (held-out samples) is 0.5 for a model that leaks nothing and 1.0 for one that
memorised its data. sklearn computes the AUC; the attack itself is the per-sample loss.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.metrics import roc_auc_score
from torch import nn


@torch.no_grad()
def per_sample_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """Cross-entropy of each sample (classifier logits [n, classes])."""
    model.eval()
    logits = model(x)
    return nn.functional.cross_entropy(logits, y, reduction="none").numpy()


def loss_threshold_auc(member_losses: np.ndarray, nonmember_losses: np.ndarray) -> float:
    """ROC AUC of the score ``-loss`` separating members from non-members."""
    member_losses = np.asarray(member_losses, dtype=np.float64)
    nonmember_losses = np.asarray(nonmember_losses, dtype=np.float64)
    if member_losses.size == 0 or nonmember_losses.size == 0:
        raise ValueError("membership inference needs at least one member and one non-member")
    if not (np.isfinite(member_losses).all() and np.isfinite(nonmember_losses).all()):
        raise ValueError("losses must be finite")
    labels = np.r_[np.ones(member_losses.size), np.zeros(nonmember_losses.size)]
    scores = -np.r_[member_losses, nonmember_losses]
    return float(roc_auc_score(labels, scores))


def attack_auc(
    model: nn.Module,
    members: tuple[torch.Tensor, torch.Tensor],
    nonmembers: tuple[torch.Tensor, torch.Tensor],
    max_samples: int | None = None,
) -> float:
    """Loss-threshold attack AUC against ``model`` with balanced member/non-member sets."""
    n = min(len(members[1]), len(nonmembers[1]), max_samples or 1 << 62)
    m = per_sample_loss(model, members[0][:n], members[1][:n])
    o = per_sample_loss(model, nonmembers[0][:n], nonmembers[1][:n])
    return loss_threshold_auc(m, o)
