"""The default model as the tests know it: HF transformers as the reference they hold us to (its greedy path with its
own KV cache, the margins along it, the chat prompt both tokenize the same way), and the texts the papers' findings
are checked on (tests/model/test_default_model.py, tests/model/test_paper_findings.py, tests/service/...)."""

from __future__ import annotations

import inspect

import torch

# The chat prompt of the greedy tests: its float32 greedy answer has no step closer than 0.54 nats (top-1 over
# top-2 log-probability). "What is the capital of France?" is no use here: its first token is a near-tie.
CHAT = [{"role": "user", "content": "What is 2+2?"}]
MIN_MARGIN = 0.05  # nats; the reference's top-1 lead at every step of the answers asserted as text


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decode with transformers' own KV cache (its `generate` is several times slower on this CPU)
    -> the tokens and (n, V) log-probabilities each was chosen from."""
    from transformers import DynamicCache

    # The cache argument is `cache` from transformers 5.x on, `past_key_values` before; DynamicCache fills in place.
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache()
    logits = model(torch.tensor([ids]), use_cache=True, **{kw: cache}).logits
    tokens, lps = [], []
    for _ in range(n):
        lps.append(logits[0, -1].float().log_softmax(-1))
        nxt = logits[:, -1:].argmax(-1)  # (1, 1)
        tokens.append(int(nxt))
        logits = model(nxt, use_cache=True, **{kw: cache}).logits
    return tokens, torch.stack(lps)


def top_margins(lp: torch.Tensor) -> torch.Tensor:
    top2 = lp.topk(2, dim=-1).values  # (N, 2)
    return top2[:, 0] - top2[:, 1]


def reference_chat_ids(tok, hf_tok) -> list[int]:
    ids = tok.encode(tok.apply_chat_template(CHAT), add_bos=False)
    theirs = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert ids == list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)  # same template, same tokens
    return ids


# The default model's facts the tests check (docs/inspection.md): its massive activation's prompt, and ordinary text
SUMMER = "Summer is warm. Winter is cold.\n"
SENTENCES = [  # ordinary text of the kind the paper averages over; no BOS, as the tokenizer encodes them
    "The museum opens at nine and closes early on Sundays.",
    "She packed two sandwiches, an apple and a bottle of water for the hike.",
    "Rain is expected tomorrow afternoon, so the match may be postponed.",
    "The committee will announce the results after the last interview.",
    "He fixed the bicycle's chain and rode to the market before noon.",
    "Most plants need sunlight, water and nutrients from the soil to grow.",
]
