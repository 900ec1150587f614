"""Wire format of the fedkv messages (one place, so server and client cannot drift).

Our opaque-bytes protocol uses its own message *actions* (``train.fedkv``,
``evaluate.fedkv``) so the default ``train``/``evaluate`` handlers stay free for
Flower's array strategies (the ``flower-central`` DP baseline).

Bytes travel as 1-D uint8 ``Array``s inside an ``ArrayRecord``: unlike bytes in a
``ConfigRecord``, Flower chunks Arrays (5 MB pieces), so large ciphertexts are fine.

Before a node takes part it is enrolled (and, with he=true, provisioned with the CKKS key):
``query.fedkv_enroll`` / ``query.fedkv_provision``, see ``federation/provisioning.py``.

server -> client (train/evaluate):
    ArrayRecord "aggregates": {"v<k>": aggregate bytes that produce global version k}
        for every version the node may be missing (it applies them in order); with
        he=true these are CKKS aggregate ciphertexts only the nodes can decrypt
    ConfigRecord "config": server-round, target-version, num-sampled
client -> server (train):
    ArrayRecord "update": {"update": crypto.SignedUpdate bytes = node id, round, key epoch,
        payload (CKKS update ciphertext, or the plaintext codec's bytes with he=false),
        Ed25519 signature over (node id, round, epoch, SHA-256(payload))}
    MetricRecord "metrics": see ``TRAIN_METRICS``
client -> server (evaluate):
    MetricRecord "metrics": see ``EVAL_METRICS``
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord

TRAIN = "train.fedkv"
EVALUATE = "evaluate.fedkv"

AGGREGATES = "aggregates"
CONFIG = "config"
UPDATE = "update"
METRICS = "metrics"

TRAIN_METRICS = (
    "num-examples", "train-loss", "upload-bytes", "clipped", "delta-norm", "epsilon-sample",
    "num-values", "saturated", "weight-capped",
    "train-s", "encrypt-s", "sign-s", "decrypt-s", "writeback-s", "version", "node-source", "pid",
)
EVAL_METRICS = ("num-examples", "eval-loss", "eval-metric", "decrypt-s", "writeback-s", "eval-s",
                "version", "node-source", "pid")


def bytes_to_array(blob: bytes) -> Array:
    return Array(np.frombuffer(bytes(blob), dtype=np.uint8))


def array_to_bytes(arr: Array) -> bytes:
    data = arr.numpy()
    if data.dtype != np.uint8 or data.ndim != 1:
        raise ValueError(f"expected a 1-D uint8 array, got {data.dtype} {data.shape}")
    return data.tobytes()


def pack_aggregates(history: list[bytes], from_version: int) -> ArrayRecord:
    """Aggregates for versions from_version+1 .. len(history) (history[k-1] makes v k)."""
    return ArrayRecord(
        {f"v{k}": bytes_to_array(history[k - 1]) for k in range(from_version + 1, len(history) + 1)}
    )


def unpack_aggregates(record: ArrayRecord | None) -> list[tuple[int, bytes]]:
    """[(version, bytes)] sorted by version."""
    if record is None:
        return []
    out = []
    for key, arr in record.items():
        if not key.startswith("v") or not key[1:].isdigit():
            raise ValueError(f"unexpected aggregate key {key!r}")
        out.append((int(key[1:]), array_to_bytes(arr)))
    return sorted(out)
