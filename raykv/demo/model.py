"""A real (small, randomly initialised) Llama model and the glue to reuse its KV.

Used by tests, benchmarks and the TTFT demo to show that KV stored as raykv chunk
payloads and loaded back gives the same logits and generations as a full prefill.
The model is `transformers.LlamaForCausalLM` built from a config with seeded random
weights: nothing is downloaded. Its KV lives in a `transformers.DynamicCache`,
whose per-layer `keys`/`values` are `[batch=1, num_kv_heads, seq_len, head_dim]`;
the connector's ``hf`` layout reads and writes exactly those tensors.

Needs the optional dependency: `pip install "raykv[demo]"` (transformers).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from raykv.connector import GPUConnector
from raykv.errors import InvalidInputError

if TYPE_CHECKING:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

# A Llama-architecture model small enough for a 2-core CPU yet with real GQA and RoPE.
DEMO_CONFIG: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 16384,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # an install hint, not a traceback
        raise ImportError('raykv.demo.model needs transformers: pip install "raykv[demo]"') from exc
    return transformers


def build_demo_model(
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` with seeded random weights (`DEMO_CONFIG` updated by `overrides`).

    The same seed and config give bit-identical weights; the global torch RNG is left
    untouched. SDPA is the default: on CPU its blocked kernel gives each query row the
    same result whatever the number of rows, so a suffix-only prefill over reused KV
    reproduces a full prefill's logits bit for bit ("eager" differs by ~1e-6).
    """
    tf = _transformers()
    fields = {**DEMO_CONFIG, **overrides}
    config = tf.LlamaConfig(**fields, attn_implementation=attn_implementation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def save_demo_model(
    directory: str | os.PathLike[str], seed: int = 0, *, tokenizer: bool = False, **overrides: Any
) -> str:
    """Save a seeded random demo Llama in Hugging Face format; returns the directory.

    For engines that load a model from disk (vLLM): nothing is downloaded. Weights are
    drawn with `initializer_range` 0.2 (unless overridden) so the logits are peaked
    rather than flat, and a changed KV changes the greedy tokens. With `tokenizer`, a
    word tokenizer is saved beside it (`save_word_tokenizer`), so text prompts work.
    """
    model = build_demo_model(seed, **{"initializer_range": 0.2, **overrides})
    model.save_pretrained(directory)
    if tokenizer:
        save_word_tokenizer(directory, model.config.vocab_size)
    return os.fspath(directory)


def word_text(tokens: Sequence[int]) -> str:
    """The text that `save_word_tokenizer`'s tokenizer encodes to exactly `tokens`."""
    return " ".join(f"w{int(t)}" for t in tokens)


def save_word_tokenizer(directory: str | os.PathLike[str], vocab_size: int) -> None:
    """Save a Hugging Face tokenizer whose word `w<i>` is token id i (whitespace split, no
    special tokens): text prompts (`word_text`) round-trip to token ids exactly, so a
    random-weight model can be served and routed like a real one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tf = _transformers()
    vocab = {f"w{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0")
    fast.save_pretrained(directory)


def kv_geometry(model_or_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a Llama model or config."""
    cfg = getattr(model_or_config, "config", model_or_config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim


def _as_input_ids(tokens: Any, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(tokens, dtype=torch.long, device=device)
    if ids.dim() != 1 or ids.numel() == 0:
        raise InvalidInputError(f"tokens must be a non-empty 1-D sequence, got {list(ids.shape)}")
    return ids.unsqueeze(0)


@torch.inference_mode()
def prefill(
    model: LlamaForCausalLM, tokens: Any, *, logits_to_keep: int = 0
) -> tuple[torch.Tensor, DynamicCache]:
    """Run a full prefill; returns logits `[n, vocab]` and the model's `DynamicCache`.

    `logits_to_keep=k` keeps only the last k positions' logits (0: all), which saves
    the vocab projection of a long prompt.
    """
    tf = _transformers()
    ids = _as_input_ids(tokens, model.device)
    cache = tf.DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits[0], out.past_key_values


def cache_connector(cache: DynamicCache) -> GPUConnector:
    """A connector in the ``hf`` layout matching a filled cache's shapes, dtype and device."""
    keys = cache.layers[0].keys
    if keys is None or keys.dim() != 4:
        raise InvalidInputError("the cache is empty: run a prefill first")
    return GPUConnector(
        num_layers=len(cache.layers),
        num_kv_heads=keys.shape[1],
        head_dim=keys.shape[3],
        dtype=keys.dtype,
        device=keys.device,
        layout="hf",
    )


def kv_to_chunks(
    cache: DynamicCache, spans: Sequence[Any], connector: GPUConnector | None = None
) -> list[torch.Tensor]:
    """The KV of token spans (`(start, end)` or `ChunkSpan`) as `KV_2LTD` CPU tensors."""
    conn = connector or cache_connector(cache)
    buffers = [(layer.keys, layer.values) for layer in cache.layers]
    return conn.to_payloads(buffers, spans)


def chunks_to_cache(
    chunks: Sequence[Any],
    config: LlamaConfig,
    *,
    device: torch.device | str = "cpu",
) -> DynamicCache:
    """A `DynamicCache` holding the prefix covered by consecutive chunks from token 0.

    Each chunk is a `KV_2LTD` tensor or a `(uint8 buffer, PayloadMeta)` pair; they are
    placed back to back from token 0, so pass them in order with no chunk missing (a
    hole would silently corrupt attention). The cache gets the chunks' dtype, on `device`.
    """
    if not chunks:
        raise InvalidInputError("need at least one chunk to rebuild a cache")
    first = chunks[0]
    sample = first[0] if isinstance(first, tuple) else first
    meta = first[1] if isinstance(first, tuple) else None
    shape = tuple(meta.shape) if meta is not None else tuple(sample.shape)
    if len(shape) != 4 or shape[0] != 2:
        raise InvalidInputError(f"chunks must be KV_2LTD [2, L, T, hidden], got {list(shape)}")
    num_layers, hidden = shape[1], shape[3]
    dtype = getattr(torch, meta.dtype) if meta is not None else sample.dtype
    want_layers, kv_heads, head_dim = kv_geometry(config)
    if (want_layers, kv_heads * head_dim) != (num_layers, hidden):
        raise InvalidInputError(
            f"chunks have {num_layers} layers x {hidden} hidden, the model needs "
            f"{want_layers} x {kv_heads * head_dim}"
        )
    starts, total = [], 0
    for j, chunk in enumerate(chunks):
        shape_j = tuple(chunk[1].shape if isinstance(chunk, tuple) else chunk.shape)
        if len(shape_j) != 4:
            raise InvalidInputError(f"chunk {j} must be KV_2LTD, got shape {list(shape_j)}")
        starts.append(total)
        total += shape_j[2]
    conn = GPUConnector(num_layers, kv_heads, head_dim, dtype, device, layout="hf")
    buffers = conn.allocate_buffers(total)
    conn.from_payloads(chunks, buffers, starts)
    return cache_from_buffers(buffers, config)


def cache_from_buffers(buffers: Sequence[Any], config: LlamaConfig) -> DynamicCache:
    """A `DynamicCache` over filled ``hf``-layout buffers (one `(keys, values)` per layer).

    The cache copies them once (`DynamicCache` concatenates on its first update).
    """
    tf = _transformers()
    want = kv_geometry(config)[0]
    if len(buffers) != want:
        raise InvalidInputError(f"expected buffers for {want} layers, got {len(buffers)}")
    return tf.DynamicCache(ddp_cache_data=[(k, v) for k, v in buffers], config=config)


@torch.inference_mode()
def prefill_suffix(
    model: LlamaForCausalLM,
    cache: DynamicCache,
    suffix_tokens: Any,
    start_pos: int | None = None,
    *,
    logits_to_keep: int = 0,
) -> tuple[torch.Tensor, DynamicCache]:
    """Prefill only the suffix on top of a cache holding the first `start_pos` tokens.

    Returns the suffix positions' logits `[n, vocab]` and the extended cache (the same
    object). `start_pos` defaults to the cache length and must equal it when given.
    """
    cached = cache.get_seq_length()
    if start_pos is None:
        start_pos = cached
    if start_pos != cached:
        raise InvalidInputError(f"start_pos={start_pos} but the cache holds {cached} tokens")
    ids = _as_input_ids(suffix_tokens, model.device)
    positions = torch.arange(start_pos, start_pos + ids.shape[1], device=model.device)
    out = model(
        input_ids=ids,
        past_key_values=cache,
        position_ids=positions.unsqueeze(0),
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits[0], out.past_key_values


@torch.inference_mode()
def greedy_generate(
    model: LlamaForCausalLM,
    tokens: Any,
    max_new_tokens: int,
    cache: DynamicCache | None = None,
) -> list[int]:
    """Greedy decoding of `max_new_tokens` tokens after `tokens`; returns the new token ids.

    With `cache` holding the KV of a prefix of `tokens` (shorter than `tokens`), only
    the rest is prefilled. The cache is extended in place.
    """
    ids = torch.as_tensor(tokens, dtype=torch.long)
    if cache is None:
        logits, cache = prefill(model, ids, logits_to_keep=1)
    else:
        start = cache.get_seq_length()
        if not 0 <= start < ids.numel():
            raise InvalidInputError(
                f"the cache holds {start} tokens; it must hold fewer than the {ids.numel()} "
                "prompt tokens (the last prompt token is needed to predict the next)"
            )
        logits, cache = prefill_suffix(model, cache, ids[start:], start, logits_to_keep=1)
    out: list[int] = []
    for step in range(max_new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        if step + 1 < max_new_tokens:
            logits, cache = prefill_suffix(model, cache, [token], logits_to_keep=1)
    return out


__all__ = [
    "DEMO_CONFIG",
    "build_demo_model",
    "cache_connector",
    "cache_from_buffers",
    "chunks_to_cache",
    "greedy_generate",
    "kv_geometry",
    "kv_to_chunks",
    "prefill",
    "prefill_suffix",
    "save_word_tokenizer",
    "word_text",
]
