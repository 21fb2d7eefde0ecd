"""Reasoning output: the `<think>...</think>` text a thinking model writes before its answer, split from the answer as
the text streams (vLLM's `--reasoning-parser`: vllm/reasoning/qwen3_reasoning_parser.py and
deepseek_r1_reasoning_parser.py, over basic_parsers.BaseThinkingReasoningParser).

The split works on text, not token ids, so it holds whether the tags are single tokens (Qwen3's vocabulary) or
several, and a tag cut across two deltas is held back until it is whole. Streaming and the whole reply give the
same split: the whole reply is the stream fed at once.

Where reasoning starts:
- qwen3: in the reasoning unless the request turned thinking off (`chat_template_kwargs: {"enable_thinking":
  false}`), or the rendered prompt already closed it (Qwen3's template writes `<think>\\n\\n</think>\\n\\n` then);
  a `<think>` the model writes itself is dropped (the templates before 2507 leave it to the model).
- deepseek_r1: in the reasoning (DeepSeek-R1's template ends the prompt with `<think>\\n`), whatever the request.
A reply that never closes its reasoning is all reasoning (cut by max_tokens), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def prompt_closes_reasoning(prompt_text: str) -> bool:
    """Whether the prompt ends inside an answer, not a reasoning block: its last think tag is a closing one (vLLM's
    `is_reasoning_end` over the prompt ids)."""
    return prompt_text.rfind(END) > prompt_text.rfind(START)


@dataclass
class ReasoningParser:
    """One parser per server (`--reasoning-parser NAME`); `split()` gives each choice its own state."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.name!r}; known: {', '.join(REASONING_PARSERS)}")

    def split(self, prompt_text: str, thinking: bool = True) -> ReasoningSplit:
        """`thinking`: false when the request turned thinking off (qwen3's `enable_thinking`), or when its output is
        constrained by a grammar, which leaves no room for a reasoning block."""
        if self.name == "qwen3":
            in_reasoning = thinking and not prompt_closes_reasoning(prompt_text)
        else:
            in_reasoning = thinking
        return ReasoningSplit(in_reasoning)


class ReasoningSplit:
    """feed(delta) -> (reasoning, content) text of that delta, holding back what may be the start of a tag;
    finish() -> what was held back. All reasoning parts joined, and all content parts, are the whole reply's."""

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self._seen_start = False  # a <think> is dropped once, at the start of the reasoning
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        reasoning, content = [], []
        while text:
            if not self.in_reasoning:
                content.append(text)
                break
            tags = [(text.find(END), END)] + ([] if self._seen_start else [(text.find(START), START)])
            found = [(i, t) for i, t in tags if i >= 0]
            if found:
                i, tag = min(found)
                reasoning.append(text[:i])
                text = text[i + len(tag):]
                if tag == START:
                    self._seen_start = True
                else:
                    self.in_reasoning = False
                continue
            keep = _partial_tag(text, END if self._seen_start else (END, START))
            reasoning.append(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The text held back as a possible tag start: it was not one."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)


def _partial_tag(text: str, tags: str | tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in (tags,) if isinstance(tags, str) else tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best
