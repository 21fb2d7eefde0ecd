"""Stored responses (`store: true`, OpenAI's default): what `previous_response_id` continues and
`GET /v1/responses/{id}` returns, in memory, at most `--max-stored-responses` of them.

Eviction is least recently used: storing a response past the bound drops the one that was stored, read or continued
from longest ago (reading it by GET or naming it as `previous_response_id` counts as a use). vLLM's store
(serving_responses.py, `VLLM_ENABLE_RESPONSES_API_STORE`) keeps every response until the process ends; a bound
keeps a server that runs for weeks from growing without end.

Each entry holds the response object and its whole conversation as plain items (service/api/openai/responses/input.py): the
conversation it continued, its own input and its output. A continuation reads one entry, never a chain, so evicting
an older response of the same conversation does not break a newer one. An entry's conversation fits the context
(it was run), so an entry is bounded by about `max_model_len` tokens of text.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as it was returned
    conversation: list[dict]  # every item up to and including its output


class ResponseStore:
    def __init__(self, max_responses: int) -> None:
        self.max_responses = max_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # routes run on the event loop; the lock keeps the store safe off it too

    def put(self, entry: StoredResponse) -> None:
        with self._lock:
            if self.max_responses <= 0:
                return
            self._entries[entry.response["id"]] = entry
            self._entries.move_to_end(entry.response["id"])
            while len(self._entries) > self.max_responses:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, marked as just used; None if it was never stored, was deleted or was evicted."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
