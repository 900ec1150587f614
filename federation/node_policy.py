"""A node's own privacy policy: floors that a run config cannot lower.

The run config is written by whoever submits the run, i.e. the server side. A node that only
took part under encryption and noise must not be talked out of them by ``--run-config
"he=false"``. Its floors come from its node config (``--node-config "require-he=true
min-noise-multiplier=0.5 he-security='post-quantum'"``) and, in deployment, from the
``node-policy.json`` of its kit; the stricter of the two wins. A run that asks for less is refused before the node does anything, on
every path (the fedkv handlers and Flower's array handlers of the flower-central baseline).

Defaults, one rule: a node with a kit (deployment) starts from ``KIT_DEFAULTS``, so
``require-he`` is on unless the provisioner wrote ``"require-he": false`` into its
node-policy.json; a node without a kit (simulation, ``flwr run .``, tests) starts from
``NodePolicy()``, nothing required, and the run config decides (``he=false`` baselines run).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from federation.config import HE_SECURITIES, RunConfig

DP_STRENGTH = {"none": 0, "flower-central": 0, "local": 1, "distributed": 1}


KIT_DEFAULTS: dict[str, object] = {"require-he": True, "min-noise-multiplier": 0.0}
"""A kit's policy where its node-policy.json is silent (``startup_kit.DEFAULT_POLICY``): with
he=false the server sees every update in clear and steers the model within the public bound."""


class PolicyError(RuntimeError):
    """The run asks a node for less protection than its policy allows."""


def _bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return bool(value)


def _security(value: Any) -> str:
    text = str(value).strip().lower()
    if text not in HE_SECURITIES:
        raise ValueError(f"he-security {str(value)[:30]!r} is not one of {list(HE_SECURITIES)}")
    return text


@dataclass(frozen=True)
class NodePolicy:
    require_he: bool = False
    """Refuse runs with he=false (the server would see single updates). Off without a kit, on
    with one (``KIT_DEFAULTS``)."""
    min_noise_multiplier: float = 0.0
    """Refuse runs whose noise multiplier is lower (and, when > 0, runs without client DP)."""
    min_clients: int = 1
    """Refuse to decrypt an aggregate of fewer updates than this (a small sum says more about each)."""
    he_security: str = "classical"
    """``post-quantum``: refuse runs under he-security classical, and (``federation.key_service``)
    refuse to make or take a CKKS key outside the HE standard's post-quantum column."""

    @classmethod
    def of(cls, node_config: Mapping[str, Any], kit_policy: Mapping[str, Any] | None = None) -> NodePolicy:
        """The stricter of the node config's and the kit's floors (``KIT_DEFAULTS`` under the
        kit's own entries; no kit, no kit floors)."""
        sources = [dict(node_config)]
        if kit_policy is not None:
            sources.append({**KIT_DEFAULTS, **kit_policy})
        try:
            return cls(
                require_he=any(_bool(s.get("require-he", False)) for s in sources),
                min_noise_multiplier=max(float(s.get("min-noise-multiplier", 0.0)) for s in sources),
                min_clients=max(int(s.get("min-clients", 1)) for s in sources),
                he_security=max((_security(s.get("he-security", "classical")) for s in sources),
                                key=HE_SECURITIES.index),
            )
        except (TypeError, ValueError) as err:
            raise PolicyError(f"bad node policy value: {err}") from None

    def check(self, cfg: RunConfig) -> None:
        """Raise PolicyError naming the first floor the run config goes below."""
        if self.require_he and not cfg.he:
            raise PolicyError("node policy requires he=true; this run asks for he=false")
        if self.min_noise_multiplier > 0:
            if DP_STRENGTH.get(cfg.dp_mode, 0) == 0:
                raise PolicyError(f"node policy requires client DP noise; this run has dp-mode={cfg.dp_mode}")
            if cfg.noise_multiplier < self.min_noise_multiplier:
                raise PolicyError(
                    f"node policy requires noise-multiplier >= {self.min_noise_multiplier:g}; "
                    f"this run asks for {cfg.noise_multiplier:g}"
                )
        if cfg.he and self.he_security == "post-quantum" and cfg.he_security != "post-quantum":
            raise PolicyError(f"node policy requires he-security=post-quantum; this run asks for {cfg.he_security}")
        if cfg.min_clients < self.min_clients:
            raise PolicyError(f"node policy requires min-clients >= {self.min_clients}; this run has {cfg.min_clients}")
