"""The serving APIs other than OpenAI's, each a package: anthropic/ (the Messages API)."""
