"""Privacy core: CKKS aggregation, MAC, signatures, key wrapping, secrets at rest; DP in ``crypto.dp``."""

from crypto.dp.adaptive_clipping import AdaptiveClipping
from crypto.aggregate_bound import MeanBound
from crypto.ckks import (
    AggregateDecryptor,
    AggregateResult,
    CkksAggregator,
    RawAggregate,
    EncryptReport,
    UpdateEncryptor,
    ciphertext_coefficients,
    last_modulus,
)
from crypto.header_check import ciphertext_info, update_header_problem
from crypto.slot_plan import AUTO_PRESETS, PQ_AUTO_PRESETS, preset_for, update_bytes_estimate
from crypto.at_rest import (
    PASSPHRASE_ENV, passphrase_from_env, read_secret_file, seal, unseal, write_public_file,
    write_secret_file,
)
from crypto.binding import (
    CONTRIBUTION_NOISE, CONTRIBUTION_UPDATE, AggregateMac, Manifest, ManifestEntry, payload_digest, tag_problem,
)
from crypto.context import (
    DEFAULT_PRESET,
    PRESETS,
    CkksContext,
    CkksParams,
    SecretContext,
    load_context,
    load_public_context,
    make_secret_context,
    public_context_bytes,
    secret_events,
)
from crypto import errors
from crypto.errors import *  # noqa: F403 - the exception hierarchy is part of the API
from crypto.key_wrap import Dealer, WrappedKeyBundle, unwrap_bundle, verify_public_context
from crypto.signing import NO_KEY_ID, NodeKeys, NodePublicKeys, SignedUpdate, UpdateVerifier, sign_update
from crypto.layout import Layout, flatten
from crypto.packing import PackingConfig, suggest_clip_range
from crypto.dp.privacy import (
    ClipResult,
    clip_and_noise,
    clip_update,
    dp_sgd_epsilon,
    dp_sgd_noise_multiplier,
    gaussian_noise,
    global_l2_norm,
    noise_std,
    privacy_claim,
)
from crypto.dp.saturation import (
    SATURATION_DELTA_SHARE,
    delta_total,
    dp_clip_range,
    saturation_budget,
    saturation_delta,
)

__all__ = [
    *errors.__all__,
    "AdaptiveClipping",
    "MeanBound",
    "AggregateMac",
    "CONTRIBUTION_NOISE",
    "CONTRIBUTION_UPDATE",
    "Manifest",
    "ManifestEntry",
    "payload_digest",
    "tag_problem",
    "update_header_problem",
    "NO_KEY_ID",
    "ciphertext_coefficients",
    "last_modulus",
    "preset_for",
    "AUTO_PRESETS",
    "PQ_AUTO_PRESETS",
    "update_bytes_estimate",
    "load_public_context",
    "read_secret_file",
    "PASSPHRASE_ENV",
    "passphrase_from_env",
    "seal",
    "secret_events",
    "unseal",
    "write_public_file",
    "write_secret_file",
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
    "RawAggregate",
    "SecretContext",
    "SignedUpdate",
    "UpdateEncryptor",
    "UpdateVerifier",
    "WrappedKeyBundle",
    "ciphertext_info",
    "clip_and_noise",
    "clip_update",
    "dp_sgd_epsilon",
    "dp_sgd_noise_multiplier",
    "flatten",
    "gaussian_noise",
    "global_l2_norm",
    "load_context",
    "make_secret_context",
    "noise_std",
    "privacy_claim",
    "public_context_bytes",
    "sign_update",
    "suggest_clip_range",
    "SATURATION_DELTA_SHARE",
    "delta_total",
    "dp_clip_range",
    "saturation_budget",
    "saturation_delta",
    "unwrap_bundle",
    "verify_public_context",
]
