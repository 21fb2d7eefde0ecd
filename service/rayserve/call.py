"""What the ingress hands a replica: one HTTP request, whole, as a plain picklable record.

Ray's HTTP proxy streams a request's body to the replica that takes it, so a request router placed right behind the
proxy chooses a replica before any of the body exists (ray/serve/_private/proxy.py, `receive_asgi_messages`). The
ingress reads the body first and forwards this record through a deployment handle, whose router sees the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class ReplicaCall:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    route_prefix: str = ""  # the application's route prefix, which `path` is below (for the replica listing's paths)
    # Route to this replica (its Ray Serve unique id) and no other: how /replicas/{id}/metrics reaches one replica
    target_replica: str | None = None
    # Set by the router on a `/replicas` listing call: the unique ids it routes among right now
    replica_ids: list[str] | None = None

    def prefix_text(self) -> str | None:
        """The text whose prefix decides where the KV blocks are: a completion's prompt, a chat's messages in order
        (role and content, as the chat template lays them out); /inspect takes either. None: nothing to match."""
        if self.method != "POST" or not self.body or len(self.body) > (8 << 20):
            return None
        try:
            body = json.loads(self.body)
        except ValueError:
            return None
        if not isinstance(body, dict):
            return None
        if isinstance(body.get("messages"), list):
            return "".join(f"<{m.get('role', '')}>{_text(m.get('content'))}\x00" for m in body["messages"] if isinstance(m, dict))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return prompt[0]  # a batch of prompts: the first one decides
        return None


def _text(content) -> str:
    """A message's content: a string, or OpenAI content parts whose `text` fields are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""
