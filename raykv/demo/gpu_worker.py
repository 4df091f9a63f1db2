"""A GPU worker actor: owns a model, its KV and a connector, and serves `generate` with raykv.

`generate` does what a serving engine does with a KV cache: look up the prompt's
cached prefix (pinning it), retrieve that prefix's KV straight into the model's
own cache buffers through the connector, prefill only the suffix, store the
prompt's new chunks, then decode greedily. TTFT is the time until the first new
token's logits exist. On a machine without a GPU it runs the same code on CPU.

On CPU, Ray caps an actor's torch threads at its `num_cpus` (1 unless reserved), so a
CPU-only worker would prefill on one core: pass `num_threads` to use more.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray
import torch

from raykv.client.kvcache import KVCache, connect
from raykv.client.layout import KVTarget
from raykv.config import RayKVConfig
from raykv.connector import GPUConnector
from raykv.errors import InvalidInputError
from raykv.keys import as_token_array

# The dtypes the demo model computes in (its KV is stored in the same dtype).
DEMO_DTYPES = ("float32", "float16", "bfloat16")


class ModelWorker:
    """The plain worker: a demo Llama model plus a raykv client (wrapped by `GPUWorker`)."""

    def __init__(
        self,
        config: RayKVConfig,
        seed: int = 0,
        *,
        num_threads: int | None = None,
        **model_overrides: Any,
    ) -> None:
        from raykv.demo import model as demo

        if num_threads is not None:
            if not isinstance(num_threads, int) or num_threads < 1:
                raise InvalidInputError(f"num_threads must be an int >= 1, got {num_threads!r}")
            torch.set_num_threads(num_threads)
        if config.kv_dtype not in DEMO_DTYPES:
            raise InvalidInputError(
                f"the demo model runs in {', '.join(DEMO_DTYPES)}, not kv_dtype={config.kv_dtype!r}"
            )
        self._demo = demo
        # One generate at a time, whatever its caller does: a Serve request cancelled
        # while its thread runs must not let the next one share the connector's staging.
        self._serial = threading.Lock()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = getattr(torch, config.kv_dtype)
        self.model = demo.build_demo_model(seed, dtype=dtype, device=self.device, **model_overrides)
        num_layers, kv_heads, head_dim = demo.kv_geometry(self.model)
        self.connector = GPUConnector(
            num_layers, kv_heads, head_dim, dtype, self.device, layout="hf"
        )
        self.kv: KVCache = connect(config)
        self.chunk_size = config.chunk_size

    def _cached_prefix(self, tokens: torch.Tensor) -> tuple[Any, int, dict[str, int]]:
        """A model cache with the longest cached prefix (at most len-1 tokens), its length,
        and the hit tokens per tier they came from."""
        n = len(tokens)
        # Keep at least one token to prefill: its logits predict the first new token.
        usable = ((n - 1) // self.chunk_size) * self.chunk_size
        if usable == 0:
            return None, 0, {}
        prefix = tokens[:usable]
        hit = min(self.kv.lookup(prefix, pin=True), usable)
        if hit == 0:
            return None, 0, {}
        buffers = self._empty_buffers(hit)
        mask, tiers = self.kv.retrieve(
            prefix[:hit], KVTarget(self.connector, buffers), return_tiers=True
        )
        got = int(mask.sum())
        if got == 0:
            return None, 0, {}
        if got < hit:  # a chunk vanished between lookup and retrieve: use what arrived
            buffers = [(k[:, :, :got], v[:, :, :got]) for k, v in buffers]
        return self._demo.cache_from_buffers(buffers, self.model.config), got, tiers

    def _empty_buffers(self, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Uninitialised ``hf`` buffers: the retrieve overwrites every row the model will see
        (a short retrieve is sliced off), so zero-filling them would be wasted bandwidth."""
        _, kv_heads, head_dim = self._demo.kv_geometry(self.model)
        shape = (1, kv_heads, num_tokens, head_dim)
        kw = {"dtype": self.connector.dtype, "device": self.device}
        return [
            (torch.empty(shape, **kw), torch.empty(shape, **kw))
            for _ in range(self.connector.num_layers)
        ]

    @torch.inference_mode()
    def generate(
        self, prompt_tokens: Any, max_new_tokens: int = 16, *, return_logits: bool = False
    ) -> dict[str, Any]:
        """See `_generate`; one at a time per worker."""
        with self._serial:
            return self._generate(prompt_tokens, max_new_tokens, return_logits=return_logits)

    def _generate(
        self, prompt_tokens: Any, max_new_tokens: int = 16, *, return_logits: bool = False
    ) -> dict[str, Any]:
        """Greedy generation using raykv for the prompt's prefix; returns tokens and timings.

        The result holds `tokens` (new ids), `ttft_s`, `load_s` (lookup + retrieve),
        `hit_tokens`, `hit_tiers` (hit tokens per tier they came from), `prompt_tokens`
        and `stored_tokens`; with `return_logits`, also `logits`: the CPU float tensor
        `[vocab]` that predicted the first new token (to compare warm and cold paths).
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        tokens = torch.from_numpy(as_token_array(prompt_tokens).astype("int64"))
        if len(tokens) == 0:
            raise InvalidInputError("prompt_tokens is empty")
        t0 = time.perf_counter()
        cache, hit, tiers = self._cached_prefix(tokens)
        t_loaded = time.perf_counter()
        if cache is None:
            logits, cache = self._demo.prefill(self.model, tokens, logits_to_keep=1)
        else:
            logits, cache = self._demo.prefill_suffix(
                self.model, cache, tokens[hit:], hit, logits_to_keep=1
            )
        first = int(logits[-1].argmax())
        ttft = time.perf_counter() - t0
        stored = self._store_new_chunks(tokens, cache, hit)
        out = [first]
        if max_new_tokens > 1:
            out += self._demo.greedy_generate(
                self.model, torch.cat([tokens, torch.tensor([first])]), max_new_tokens - 1, cache
            )
        result = {
            "tokens": out,
            "ttft_s": ttft,
            "load_s": t_loaded - t0,
            "hit_tokens": hit,
            "hit_tiers": tiers,
            "prompt_tokens": len(tokens),
            "stored_tokens": stored,
        }
        if return_logits:
            result["logits"] = logits[-1].float().cpu()
        return result

    def _store_new_chunks(self, tokens: torch.Tensor, cache: Any, hit: int) -> int:
        """Store the prompt's chunks after the `hit` already cached ones (mask skips those)."""
        spans = self.kv.spans(tokens)
        if not spans or spans[-1].end <= hit:
            return 0
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[hit:] = True
        new = [s for s in spans if s.start >= hit]
        chunks = self._demo.kv_to_chunks(cache, new, self.connector)
        return self.kv.store(tokens, chunks, mask=mask)

    def stats(self) -> dict[str, Any]:
        """The cache's stats (per tier)."""
        return self.kv.stats()


@ray.remote(max_restarts=-1, max_task_retries=-1)
class GPUWorker(ModelWorker):
    """`ModelWorker` as a Ray actor; create it with `create_gpu_worker`."""


def create_gpu_worker(
    config: RayKVConfig, seed: int = 0, *, num_threads: int | None = None, **model_overrides: Any
) -> Any:
    """Start a `GPUWorker` reserving `config.worker_num_gpus` GPUs (0 on CPU-only nodes).

    `num_threads` sets the worker's torch threads (CPU prefill; Ray's default there is 1).
    """
    return GPUWorker.options(num_gpus=config.worker_num_gpus).remote(
        config, seed, num_threads=num_threads, **model_overrides
    )
