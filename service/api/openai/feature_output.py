"""The `features` a generation choice returns (llamascope extension, docs/api.md#features): each generated token's
top features at the dictionary's site, aligned with the tokens as logprobs are, and the prompt rows read before
them. Streamed, each token's chunk carries its own; collected, the choice carries them all."""

from __future__ import annotations

from model.engine import RequestOutput
from model.features.sae import FeatureActivations, TokenFeatures


def activations(a: FeatureActivations) -> dict:
    """One row: its position, its top features (id, activation) largest first, the inactive ones left out, the
    request's `ids` (each, active or not), and the reconstruction error's norm where asked."""
    out: dict = {"position": a.position,
                 "top": [{"id": i, "activation": v} for i, v in zip(a.ids, a.values) if v != 0.0]}
    if a.id_values:
        out["ids"] = a.id_values
    if a.error_norm is not None:
        out["error_norm"] = a.error_norm
    return out


def token_value(out: RequestOutput) -> TokenFeatures | None:
    """The features value of an output's token (the engine sends one token a delta when a request reads them)."""
    return out.features.get("features")


class ChoiceFeatures:
    """One choice's features, collected: the prompt rows, then one entry (or None) per generated token."""

    def __init__(self, sae: str) -> None:
        self.sae = sae
        self.prompt: list[dict] = []
        self.tokens: list[dict | None] = []

    def add(self, value: TokenFeatures | None) -> None:
        if value is None:
            return
        self.prompt += [activations(a) for a in value.prompt]
        self.tokens.append(activations(value.own) if value.own is not None else None)

    def as_dict(self) -> dict:
        return {"sae": self.sae, "prompt": self.prompt, "tokens": self.tokens}


def chunk_features(value: TokenFeatures) -> dict:
    """A streamed chunk's `features`: its token's entry (None where the positions leave it out), and the prompt rows
    read since the last chunk."""
    return {"prompt": [activations(a) for a in value.prompt],
            "tokens": [activations(value.own) if value.own is not None else None]}
