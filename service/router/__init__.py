"""Router mode: several models behind one port, each in a `python -m service` process of its own on a loopback
port, the front proxying every request by its `model` field (llama.cpp's tools/server router mode:
server-models.cpp, server.cpp's `/models/load` and `/models/unload`).

options.py   the command line: which models, how many at once, the memory budget, what every child is given
catalog.py   the models found (`--model` given more than once, `--models-dir`), their names and memory estimates
child.py     one model's process: spawned, watched, stopped; its state and its requests in flight
pool.py      the models together: load on first use, least-recently-used eviction, the memory check, restarts
proxy.py     a request passed to its model's process, streamed through as it comes
metrics.py   the children's /metrics, each sample labelled with its model, and the router's own counters
compare.py   /inspect/compare across models: the differences of one /inspect on each
app.py       the front's FastAPI app and `main`
"""
