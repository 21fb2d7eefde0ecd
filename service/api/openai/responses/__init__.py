"""/v1/responses: its request models, the request as a chat request, output items and events, the store."""
