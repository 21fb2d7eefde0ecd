"""What both faces of the service share: errors, the guard middleware, metrics, the server's state and the routes' view of it, the run and SSE glue, the OpenAPI document, shutdown."""
