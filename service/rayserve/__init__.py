"""llamascope on Ray Serve (`pip install .[ray]`): an ingress that forwards each HTTP request whole to a replica
deployment, each replica the unchanged llamascope ASGI app with its own engine, and a prefix-aware request router
between them. docs/deployment.md#ray-serve says how to run it and when to choose it."""
