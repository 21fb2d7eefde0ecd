"""`FeatureReadOptions`: what a request asks its tokens to carry of a dictionary's features (the request's
`features` field; the computation is feature.py beside it). The dictionary is resolved by name where the request
enters (the server's `DictionaryStore`) and kept here as the object itself, so unloading the name never changes a
running request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model.features.protocol import InvalidOption
from model.interventions import SITES

MAX_TOP_K = 64
MAX_IDS = 256
POSITION_MODES = ("generated", "prompt", "all")
# the sites every execution path reads a row at (model/edits.py's StepEdits reads): a block's every D-wide site
READ_SITES = SITES


@dataclass(frozen=True, eq=False)
class FeatureReadOptions:
    """`features: {"sae": NAME, "top_k": 8, "positions": "generated", "ids": [], "error_norm": false}`.

    positions: which rows are encoded. Row p is position p's forward (its input token is token p). A generated
    token carries the row that produced it (position P - 1 + i for the i-th, P prompt tokens: the row its logprobs
    come from); rows of the prompt before P - 1 come in the choice's `prompt` list. "generated": the rows that
    produced the generated tokens; "prompt": rows 0 .. P - 1 (P - 1 produced the first token, so it comes with
    it); "all": every row; a list: those positions."""

    sae: str
    dictionary: Any  # model.features.sae.Dictionary, resolved by name at the edge
    top_k: int = 8
    positions: str | tuple[int, ...] = "generated"
    ids: tuple[int, ...] = ()
    error_norm: bool = False
    _explicit: frozenset[int] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.positions, str):
            object.__setattr__(self, "positions", tuple(self.positions))
            object.__setattr__(self, "_explicit", frozenset(self.positions))
        object.__setattr__(self, "ids", tuple(self.ids))

    def validate(self) -> None:
        """InvalidOption naming the field (`features.<name>`) for a value no engine serves."""
        d = self.dictionary
        k = self.top_k
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_TOP_K:
            raise InvalidOption("features.top_k", f"features.top_k must be an integer in [1, {MAX_TOP_K}], got {k!r}")
        if isinstance(self.positions, str):
            if self.positions not in POSITION_MODES:
                raise InvalidOption("features.positions", f"features.positions: one of {list(POSITION_MODES)} or a "
                                                          f"list of token positions, got {self.positions!r}")
        elif not self.positions or any(not isinstance(p, int) or isinstance(p, bool) or p < 0 for p in self.positions):
            raise InvalidOption("features.positions", "features.positions: token positions must be integers >= 0")
        if len(self.ids) > MAX_IDS:
            raise InvalidOption("features.ids", f"features.ids: at most {MAX_IDS} ids, got {len(self.ids)}")
        bad = [i for i in self.ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < d.d_sae]
        if bad:
            raise InvalidOption("features.ids", f"features.ids: {bad[0]!r} is not a feature of {self.sae!r} "
                                                f"(ids are in [0, {d.d_sae}))")
        if d.hook_in.site not in READ_SITES:
            raise InvalidOption("features.sae", f"features.sae: {self.sae!r} reads {d.hook_in.site} of layer "
                                                f"{d.hook_in.layer}, a site the engine does not read yet (served: "
                                                f"{list(READ_SITES)})")
        if self.error_norm and d.transcoder:
            raise InvalidOption("features.error_norm", f"features.error_norm: {self.sae!r} is a transcoder, whose "
                                                       f"output is another site's: it reconstructs no input")

    def wants(self, position: int, num_prompt_tokens: int) -> bool:
        """Whether row `position` is encoded for a request of `num_prompt_tokens` prompt tokens."""
        if self.positions == "all":
            return True
        if self.positions == "generated":
            return position >= num_prompt_tokens - 1
        if self.positions == "prompt":
            return position < num_prompt_tokens
        return position in self._explicit

    def first_prompt_position(self, num_prompt_tokens: int, read_from: int) -> int | None:
        """The first row in [read_from, P - 1) still to be encoded (the prefix cache must not skip it), or None."""
        end = num_prompt_tokens - 1
        if self.positions == "generated":
            return None
        if self.positions in ("all", "prompt"):
            return read_from if read_from < end else None
        early = [p for p in self._explicit if read_from <= p < end]
        return min(early) if early else None
