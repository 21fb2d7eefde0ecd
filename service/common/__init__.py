"""What both faces of the service share: errors, the guard middleware (API key, body size), metrics, /health and
/metrics, the server's state and the routes' view of it (Serving), the request runner, the field types and chat
messages of request models, the OpenAPI document, shutdown, request traces (tracing)."""
