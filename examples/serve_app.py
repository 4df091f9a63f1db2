"""The demo model behind Ray Serve: 2 replicas sharing raykv, routed to the cached prefix.

Start it (Ray starts locally if none runs; HTTP on 127.0.0.1:8000):

    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
    serve run examples/serve_app.py:app

Query it (tokens are ids below the model's vocab size, 1024 for the tiny model):

    curl -X POST http://127.0.0.1:8000/ -d '{"tokens": [1, 2, 3, 4], "max_new_tokens": 4}'
    python examples/serve_app.py --query 2048   # two requests sharing a 2048-token prefix

The answer is `{"tokens": [...], "hit_tokens": h, "ttft_s": t, "replica": id, ...}`; a
request sharing a cached prefix (>= one chunk) goes to the replica that served it and
reports `hit_tokens > 0`. Stop with Ctrl-C (or `serve shutdown -y`).

Environment: SERVE_DEMO_MODEL=tiny|demo (default tiny: 2 layers, hidden 64;
demo: `raykv.model.DEMO_CONFIG`, 8 layers, hidden 512, vocab 32000),
SERVE_DEMO_REPLICAS (2), SERVE_DEMO_ROUTER=cache_aware|pow2|random,
SERVE_DEMO_CHUNK_SIZE (64), SERVE_DEMO_CACHE_SCOPE=shared|replica; raykv's own
RAYKV_* variables (e.g. RAYKV_MAX_LOCAL_CPU_SIZE) configure the cache as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import urllib.request

from raykv.serve import app_from_env

app = app_from_env()


def query(url: str, prefix_len: int) -> None:
    """Send two prompts sharing a `prefix_len`-token prefix; print both answers."""
    vocab = 1024 if os.environ.get("SERVE_DEMO_MODEL", "tiny") == "tiny" else 32000
    rng = random.Random(0)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    for turn in range(2):
        body = {"tokens": prefix + [rng.randrange(vocab) for _ in range(16)], "max_new_tokens": 4}
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
        print(
            f"request {turn}: replica={out['replica']} hit_tokens={out['hit_tokens']} "
            f"ttft_s={out['ttft_s']:.4f} tokens={out['tokens']}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--query", type=int, metavar="PREFIX_LEN", default=2048)
    parser.add_argument("--url", default="http://127.0.0.1:8000/")
    args = parser.parse_args()
    query(args.url, args.query)
