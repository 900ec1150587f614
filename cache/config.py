"""Engine configuration: one dataclass, every default documented."""

from __future__ import annotations

from dataclasses import dataclass

from cache.errors import ConfigError
from cache.fsperm import LOCK_TIMEOUT_S
from cache.tunables import TUNABLES, validate_tunable

KV_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4")
TAIL_DTYPES = ("fp32", "bf16")
"""``batch_tail_dtype`` choices."""
QUANT_SCHEMES = ("kivi", "per_layer")
SCALE_FORMATS = ("fp16", "log8")


@dataclass
class CacheConfig:
    """Geometry and policy of one KV cache.

    The fields named in ``cache.tunables.TUNABLES`` (warmup_ratio, evict_batch,
    prefetch_degree, coherence_protocol, low_watermark, cooldown_s, eviction_policy) may be
    changed on a live engine (``KVCache.set_tunable``, ``python -m cache set``); the engine
    reads them from this object, the one place they live.

    ``pool_bytes`` is split into a full-precision TokenArena (head-major, so a session's
    consecutive blocks are read as views; ``cache/token_arena.py``) and, in int8/int4 caches,
    a pool of quantized blocks: managed blocks (slabs) cut into slots of the block's byte size
    rounded up to a 64 B page, so an int8 or int4 block takes about half or a quarter of an
    fp16 block (see ``cache/pool.py`` for the measurements, and
    ``cache.sizing.arena_bytes_per_token``).
    """

    num_layers: int
    num_heads: int
    head_dim: int
    block_size: int = 16
    """Tokens per KV block (vLLM's default is 16)."""
    kv_dtype: str = "fp32"
    """Storage of blocks that left the full-precision window: fp32, bf16, fp16, int8 or int4.
    ``bf16`` keeps the whole arena in bf16: exact for a model whose K/V are bf16 values (bf16
    or weight-only int8 weights; ``node.models.llama.LlamaModel.cache_config`` picks it there,
    as vLLM's ``--kv-cache-dtype auto`` follows the model), and half the bytes a decode step's
    attention reads."""
    fp_window: int = 32
    """Newest tokens kept at full precision (KIVI's residual window); quantized modes only.
    The last, partial block is always full precision because key scales are per block."""
    quant_scheme: str = "kivi"
    """``kivi``: keys per-channel, values per-token scales; ``per_layer``: one scale per layer
    and per K/V in each block (the article's scheme; smallest metadata, largest error)."""
    scale_format: str = "log8"
    """How KIVI scales are stored: ``log8`` (a uint8 log-code per group under one fp16
    reference per layer and K/V; see ``cache/quant.py``) or ``fp16`` (2 B per group). At
    16-token blocks only ``log8`` brings int4 to <= 0.30x of fp16."""
    tail_granule: int = 4
    """A session's partly filled last block takes arena pages of this many tokens and grows
    in place page by page (moved only when the next page is taken), so it wastes fewer than
    ``tail_granule`` token positions instead of up to ``block_size - 1``. Must divide
    ``block_size``; 0 (or ``block_size``) gives every block a whole block of room."""
    requant_error_threshold: float = 0.25
    """If a block's relative quantization error (||x - q(x)|| / ||x||) passes this, the block
    is kept at full precision instead (``stats()['kept_full_precision_blocks']``). The error is
    accumulated (root of summed squares) over every encoding of the block, so a block that is
    re-encoded (a later tier's demotion) is kept from its full-precision source once the sum
    passes the threshold."""
    pool_bytes: int = 64 << 20
    """Arena size, preallocated at construction."""
    read_buffer_fraction: float = 0.35
    """int8/int4 caches: share of ``pool_bytes`` held at full precision (the TokenArena); the
    rest holds quantized blocks. The arena holds what is not quantized yet: each open
    session's fresh window (``fp_window`` plus its partial last block) and the prompt being
    prefilled (a whole prompt is written at full precision before its old blocks are
    quantized). Room left over keeps decoded read buffers of quantized blocks (no decode per
    step); any allocation drops them, and reads then decode quantized blocks per layer into
    a scratch tensor freed after the read. 0.35 gave the most active context for both
    int8 and int4 (SmolLM2 geometry, 512-token sessions, 256-512 MiB pools: ``python -m
    experiments.kv_capacity``; int8 peaks near 0.3, int4 near 0.4). fp32/fp16 caches use
    the whole pool at full precision."""
    low_watermark: float = 0.2
    """Free full-precision arena share below which a reserve triggers a (lazy) compaction
    that restores sessions' contiguous runs (``cache/compaction.py``)."""
    batch_tail_buffer: bool = True
    """Batched decode keeps a contiguous copy of each session's own tokens from step to step
    and appends the new ones, instead of gathering every tail every step: faster steps for
    about the tails' bytes again (``stats()['batch_tail_buffer_bytes']``; experiments.bench_kv
    reports both, ``batched.tail_buffer_speedup``). Attention over strided views of the arena
    (no copy at all) measured slower than the gather here."""
    batch_tail_dtype: str = "fp32"
    """Element type of that copy: ``fp32`` or ``bf16``. A decode step's attention reads every
    session's tail once per layer, so ``bf16`` halves those bytes. K/V a bf16 model computed
    are bf16 values already and lose nothing (``node.models.llama.LlamaModel.cache_config``
    picks ``bf16`` for bf16 and int8 weights); fp32 K/V are rounded to bf16 there."""
    eviction_policy: str = "lru"
    """Which cached block leaves hot first: ``lru``, ``lfu``, ``hybrid``, ``arc`` or
    ``adaptive`` (``cache/policy.py``; measured on real traces by experiments.eviction).
    Switching it at runtime (``KVCache.set_tunable``) hands the cached blocks to the new
    policy in the old one's eviction order."""
    evict_batch: int = 16
    """Blocks demoted per round when free hot memory is below ``low_watermark`` (SGLang's
    ``evict_batch``; one ``victims`` call). A single allocation still evicts one block."""
    warm_bytes: int = 0
    """Warm tier: CPU bytes for prefix-cache blocks evicted from hot, each in its own storage
    format; 0 = no warm tier (evicted blocks are freed, unless a cold store is attached:
    ``KVCache.open``)."""
    cooldown_s: float = 60.0
    """A block that moved tier is not moved again by memory pressure for this long (seed 004),
    unless nothing else can go."""
    warmup_ratio: float = 0.3
    """Warm restart (``KVCache.open``): share of ``warm_bytes`` filled at once with the
    hottest cold blocks; the rest come back lazily on a prefix hit."""
    prefetch_degree: int = 2
    """Blocks the prefetcher (``cache/prefetch/``) moves to hot ahead of use per access;
    0 turns prefetch off."""
    prefetch_mode: str = "none"
    """Which prefetcher runs after each prefix lookup of a tiered cache: ``none``,
    ``sequential`` (the block chain: conversations), ``heat`` (knowledge retrieval),
    ``hybrid`` or ``lstm`` (measured on the Mooncake trace by experiments.prefetch)."""
    coherence_protocol: int = 2
    """Coherence between agents sharing the cache (``cache/coherence*.py``): 2 = strong MESI
    (a write returns once every holder has invalidated), 1 = relaxed (batched
    invalidations)."""
    managed_block_bytes: int | None = None
    """Slab size of the quantized pool; ``None`` means 128 KB, or the next power of two
    holding 8 fp32 blocks."""
    page_bytes: int = 64
    """Slot granule of the quantized pool (a multiple of 4 bytes). 4 KB pages made int8
    cost as much as fp16."""
    lock_timeout_s: float = LOCK_TIMEOUT_S
    """Longest wait for the cache directory's lock (``KVCache.open``/``attach``) while another
    process holds it; then ``StoreLockedError`` names the lock file instead of a hang."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "block_size", "page_bytes"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.batch_tail_dtype not in TAIL_DTYPES:
            raise ConfigError(f"batch_tail_dtype must be one of {TAIL_DTYPES}, got "
                              f"{self.batch_tail_dtype!r}")
        if self.quant_scheme not in QUANT_SCHEMES:
            raise ConfigError(
                f"quant_scheme must be one of {QUANT_SCHEMES}, got {self.quant_scheme!r}"
            )
        if self.page_bytes % 4:
            raise ConfigError(f"page_bytes must be a multiple of 4, got {self.page_bytes}")
        if self.scale_format not in SCALE_FORMATS:
            raise ConfigError(
                f"scale_format must be one of {SCALE_FORMATS}, got {self.scale_format!r}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for int4 packing, got {self.head_dim}")
        if self.tail_granule < 0 or (self.tail_granule and self.block_size % self.tail_granule):
            raise ConfigError(f"tail_granule must be 0 or divide block_size {self.block_size}, "
                              f"got {self.tail_granule}")
        if not (isinstance(self.lock_timeout_s, (int, float)) and 0 <= self.lock_timeout_s < 1e9):
            raise ConfigError(f"lock_timeout_s must be a number of seconds >= 0, got "
                              f"{self.lock_timeout_s!r}")
        if self.warm_bytes < 0:
            raise ConfigError(f"warm_bytes must be >= 0, got {self.warm_bytes}")
        for name in TUNABLES:  # the runtime knobs: one validator (cache/tunables.py)
            setattr(self, name, validate_tunable(name, getattr(self, name)))
        if not 0 < self.read_buffer_fraction < 1:
            raise ConfigError(
                f"read_buffer_fraction must be in (0, 1), got {self.read_buffer_fraction}")
        if self.fp_window < 0:
            raise ConfigError(f"fp_window must be >= 0, got {self.fp_window}")
        if self.managed_block_bytes is None:
            # >= 8 full-precision blocks per slab, so the unusable tail of a slab (slots of
            # other sizes rarely divide it) stays a few percent
            need = 8 * self.block_bytes_fp32
            mb = 128 << 10
            while mb < need:
                mb *= 2
            self.managed_block_bytes = mb
        if self.managed_block_bytes % self.page_bytes:
            raise ConfigError(
                f"managed_block_bytes {self.managed_block_bytes} is not a multiple of "
                f"page_bytes {self.page_bytes}"
            )
        if self.pool_bytes < self.managed_block_bytes:
            raise ConfigError(
                f"pool_bytes {self.pool_bytes} is smaller than one managed block "
                f"({self.managed_block_bytes})"
            )

    @property
    def block_bytes_fp32(self) -> int:
        return 2 * self.num_layers * self.num_heads * self.block_size * self.head_dim * 4
