"""HTTP edge: FastAPI app (main.py), settings, OpenAI schemas, errors, metrics, routes. `python -m service`."""
