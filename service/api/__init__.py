"""The serving face: the OpenAI-compatible API (openai/) and Anthropic's Messages API (anthropic/)."""
