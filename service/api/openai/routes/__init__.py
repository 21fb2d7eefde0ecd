"""HTTP routes: thin translations between OpenAI's JSON and the engine's requests and outputs."""
