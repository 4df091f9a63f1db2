# The demo model behind Ray Serve: 2 replicas sharing raykv, routed to the cached prefix.
#
# Start it from the repository root (Ray starts locally if none runs; HTTP on
# 127.0.0.1:8000):
#
#     export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
#     serve run examples/serve_app.py          # or: serve run examples.serve_app:app
#
# Query it (tokens are ids below the model's vocab size, 1024 for the tiny model):
#
#     curl -X POST http://127.0.0.1:8000/ -d '{"tokens": [1, 2, 3, 4], "max_new_tokens": 4}'
#     python examples/serve_app.py --query 4096   # two requests sharing a 4096-token prefix
#
# The answer is {"tokens": [...], "hit_tokens": h, "ttft_s": t, "replica": id, ...}; a
# request sharing a cached prefix (>= one chunk) goes to the replica that served it and
# reports hit_tokens > 0. Stop with Ctrl-C (or `serve shutdown -y`). Those cache details
# are on here (args below) because this is a demo on loopback: they tell one user whether
# another's prompt is cached, so an app that tenants share leaves them off (the default).
#
# Settings: SERVE_DEMO_MODEL=tiny|demo (default tiny: 2 layers, hidden 64; demo:
# raykv.demo.model.DEMO_CONFIG, 8 layers, hidden 512, vocab 32000), SERVE_DEMO_REPLICAS (2),
# SERVE_DEMO_ROUTER=cache_aware|pow2|random, SERVE_DEMO_CHUNK_SIZE (64),
# SERVE_DEMO_CACHE_SCOPE=shared|replica, SERVE_DEMO_CACHE_DETAILS=true|false, or the same names (model, replicas, ...) under
# the "args" below; raykv's own RAYKV_* variables configure the cache as usual (e.g.
# RAYKV_ENABLE_CONTROLLER=true on a multi-node cluster: the router then also asks the
# KVController which node holds a prompt's prefix). Variables reach the deployment when
# `serve run` starts Ray itself; for a running cluster put them in a runtime_env.
#
# Why this file looks odd: `serve run PATH` reads an existing file as a YAML Serve
# config, while `serve run module:app` imports a Python module. This file is both.
# To YAML the four lines below are the config (one application built by
# raykv.demo.serve_app.demo_app, HTTP on 127.0.0.1:8000) and two keys Serve ignores; to Python
# they are two annotations (no effect) and two `if` statements: `app` when imported,
# the HTTP client when run as a script. Keep each line valid in both languages
# (tests/integration/test_serve_example.py checks both readings).

http_options: {"host": "127.0.0.1", "port": 8000}
applications: [{"name": "raykv-demo", "route_prefix": "/", "import_path": "raykv.demo.serve_app:demo_app", "args": {"cache_details": "true"}}]
if __name__ != "__main__": from raykv.demo.serve_app import app_from_env; app = app_from_env()
if __name__ == "__main__": from raykv.demo.serve_app import demo_client; demo_client()
