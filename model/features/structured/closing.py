"""A JSON reply that max_tokens would cut is closed in time: its last tokens close what is open, so it still parses.

JSON mode bounds nothing: a sampled row can stay inside one string until max_tokens (OpenAI's docs warn that a JSON
mode reply cut by max_tokens "may be partially complete"; vLLM and llama.cpp's server return it cut). Here, once a
JSON reply's remaining budget is down to the tokens it needs to close plus a small margin, the mask allows exactly
one token per step, the next of a closing plan: the open string is ended, an open key gets a value, open arrays and
objects are closed. The reply then parses; its finish_reason stays "length" (the model did not choose to end it),
and the forced tokens' logprobs are those of the masked distribution: 0.

The plan is found with the grammar itself (an llguidance matcher, copied, never the row's own): greedily, the first
of a short list of closing tokens the grammar accepts, in two orders (a quote first: inside a string "}" is text;
a bracket first: after "{" it closes at once), keeping the shorter plan; where none of them fits (inside `tru`, a
number's `1.`), llguidance's forced tokens. A schema whose required keys are still missing may have no short plan:
then nothing is forced and the reply is cut as elsewhere.
"""

from __future__ import annotations

from model.text.tokenizer import Tokenizer

# Closing texts in the two greedy orders; "," and " " last, for a schema that wants its next required key first.
QUOTE_FIRST = ('"', "}", "]", ":", " ", "0", ",")
BRACKET_FIRST = ("}", "]", '"', ":", " ", "0", ",")
PLAN_LIMIT = 24  # longest plan looked for (each nesting level costs 1-6 tokens)
RETRY_AFTER = 4  # tokens before a row whose plan search failed is searched again
MARGIN = 8  # tokens to spare: one free token can lengthen the plan (`{"` opens a key: quote, colon, value, brace)


class JsonCloser:
    """Closing plans for one vocabulary (its single-token closers)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        def ids(texts: tuple[str, ...]) -> list[int]:
            out = []
            for text in texts:
                enc = tokenizer.encode(text, add_bos=False)
                if len(enc) == 1:  # a closer that is no single token is left out (ff tokens still reach it)
                    out.append(enc[0])
            return out

        self.orders = (ids(QUOTE_FIRST), ids(BRACKET_FIRST))

    def plan(self, matcher) -> list[int] | None:
        """The shortest of the greedy plans from the matcher's state to a complete reply ([] when it is complete
        already); None when neither finds one within PLAN_LIMIT tokens."""
        best = None
        for order in self.orders:
            if best == []:
                break
            p = _greedy(matcher, order, PLAN_LIMIT if best is None else len(best) - 1)
            if p is not None and (best is None or len(p) < len(best)):
                best = p
        return best

    def forced_token(self, matcher, remaining: int, closing: bool) -> int | None | bool:
        """The token a row must take now; None: sample freely; False: no plan was found (a schema whose required
        keys are still missing, say), and the caller waits RETRY_AFTER tokens before looking again (a failed
        search tries every closer at every step of PLAN_LIMIT). remaining: tokens left to max_tokens, this one
        included; closing: whether the row is closing already (then it follows the plan to its end)."""
        if not closing and remaining > PLAN_LIMIT + MARGIN:
            return None
        plan = self.plan(matcher)
        if plan is None:
            return False
        if not plan or (not closing and len(plan) + MARGIN < remaining):
            return None
        return plan[0]


def _greedy(matcher, order: list[int], limit: int) -> list[int] | None:
    m = matcher.deep_copy()
    out: list[int] = []
    while not m.is_accepting():
        if len(out) >= limit or m.is_error():
            return None
        for t in order:
            if m.try_consume_tokens([t]) == 1:
                out.append(t)
                break
        else:
            forced = m.compute_ff_tokens()
            if not forced:
                return None
            m.consume_tokens(forced)
            out += forced
    return out if len(out) <= limit else None
