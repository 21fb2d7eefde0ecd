"""The serving face: OpenAI-compatible APIs."""
