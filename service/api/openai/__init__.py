"""The OpenAI-compatible serving API (with vLLM's extensions): completions, chat, responses, models, adapters."""
