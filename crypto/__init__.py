"""Privacy core: CKKS aggregation, key provisioning, clipping, noise, accounting."""

from crypto.ckks import (
    AggregateDecryptor,
    AggregateResult,
    CkksAggregator,
    RawAggregate,
    EncryptReport,
    UpdateEncryptor,
    ciphertext_info,
)
from crypto.context import (
    DEFAULT_PRESET,
    PRESETS,
    CkksContext,
    CkksParams,
    SecretContext,
    load_context,
    make_secret_context,
    public_context_bytes,
)
from crypto import errors
from crypto.errors import *  # noqa: F403 - the exception hierarchy is part of the API
from crypto.keys import (
    Dealer,
    NodeKeys,
    NodePublicKeys,
    SignedUpdate,
    UpdateVerifier,
    WrappedKeyBundle,
    sign_update,
    unwrap_bundle,
    verify_public_context,
)
from crypto.layout import Layout, flatten
from crypto.packing import PackingConfig, suggest_clip_range
from crypto.privacy import (
    ClipResult,
    PrivacyAccountant,
    clip_update,
    client_sample_rate,
    gaussian_noise,
    global_l2_norm,
    noise_multiplier_for,
    noise_std,
)

__all__ = [
    *errors.__all__,
    "errors",
    "AggregateDecryptor",
    "AggregateResult",
    "CkksAggregator",
    "CkksContext",
    "CkksParams",
    "ClipResult",
    "DEFAULT_PRESET",
    "Dealer",
    "EncryptReport",
    "Layout",
    "NodeKeys",
    "NodePublicKeys",
    "PRESETS",
    "PackingConfig",
    "PrivacyAccountant",
    "RawAggregate",
    "SecretContext",
    "SignedUpdate",
    "UpdateEncryptor",
    "UpdateVerifier",
    "WrappedKeyBundle",
    "ciphertext_info",
    "client_sample_rate",
    "clip_update",
    "flatten",
    "gaussian_noise",
    "global_l2_norm",
    "load_context",
    "make_secret_context",
    "noise_multiplier_for",
    "noise_std",
    "public_context_bytes",
    "sign_update",
    "suggest_clip_range",
    "unwrap_bundle",
    "verify_public_context",
]
