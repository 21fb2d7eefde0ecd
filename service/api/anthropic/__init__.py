"""Anthropic's Messages API over the chat machinery: schemas.py (the requests), conversion.py (a request as a chat
completion request), reply.py (content blocks and stream events from the engine's outputs), stream.py (the SSE
stream), errors.py (Anthropic's error envelope for everything under /v1/messages), route.py (POST /v1/messages and
/v1/messages/count_tokens). docs/api.md says what is supported and what is ignored."""
