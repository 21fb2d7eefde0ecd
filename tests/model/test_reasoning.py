"""The reasoning split (model/text/reasoning.py) against vLLM's rules, and streamed equal to whole however the text is
cut: every cut point of each reply, and random cuts into pieces of 1-5 characters (tags straddling them)."""

from __future__ import annotations

import random

import pytest

from model.text.reasoning import ReasoningParser, prompt_closes_reasoning

QWEN3_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_OFF = QWEN3_PROMPT + "<think>\n\n</think>\n\n"  # Qwen3's template with enable_thinking false

# (reply, reasoning, content) as vLLM's Qwen3ReasoningParser.extract_reasoning splits them
CASES = [
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    ("Let me see.</think>The answer.", "Let me see.", "The answer."),  # <think> was in the prompt
    ("<think>cut short by max_tokens", "cut short by max_tokens", ""),  # never closed: all reasoning
    ("<think></think>", "", ""),
    ("<think>a</think>b</think><think>c", "a", "b</think><think>c"),  # after the end every tag is content
    ("<think>x < y and </thin k> </think>ok", "x < y and </thin k> ", "ok"),
    ("no tags: the whole reply was reasoning", "no tags: the whole reply was reasoning", ""),
    ("<th", "<th", ""),  # a tag's start, never finished
    ("日本</think>語 😀", "日本", "語 😀"),
]


def _whole(split, text):
    r, c = split.feed(text)
    r2, c2 = split.finish()
    return r + r2, c + c2


def _streamed(split, pieces):
    r = c = ""
    for p in pieces:
        a, b = split.feed(p)
        r, c = r + a, c + b
    a, b = split.finish()
    return r + a, c + b


@pytest.mark.parametrize("reply,reasoning,content", CASES)
def test_split_streamed_equals_whole(reply, reasoning, content):
    parser = ReasoningParser("qwen3")
    assert _whole(parser.split(QWEN3_PROMPT), reply) == (reasoning, content)
    for cut in range(len(reply) + 1):
        assert _streamed(parser.split(QWEN3_PROMPT), [reply[:cut], reply[cut:]]) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(100):
        pieces, i = [], 0
        while i < len(reply):
            j = i + rng.randint(1, 5)
            pieces.append(reply[i:j])
            i = j
        assert _streamed(parser.split(QWEN3_PROMPT), pieces) == (reasoning, content)


def test_a_tag_cut_across_deltas_is_held_back_until_whole():
    split = ReasoningParser("qwen3").split(QWEN3_PROMPT)
    assert split.feed("<thi") == ("", "")
    assert split.feed("nk>Hm, x</th") == ("Hm, x", "")
    assert split.feed("ink>\n") == ("", "\n")
    assert split.feed("<think>") == ("", "<think>")  # content now: nothing is held
    assert split.finish() == ("", "")


def test_where_the_reasoning_starts():
    qwen3, r1 = ReasoningParser("qwen3"), ReasoningParser("deepseek_r1")
    assert prompt_closes_reasoning(QWEN3_OFF) and not prompt_closes_reasoning(QWEN3_PROMPT)
    assert not prompt_closes_reasoning(QWEN3_OFF + "<think>")
    # enable_thinking false: the template closed the block in the prompt; the reply is all content, tags and all
    assert _whole(qwen3.split(QWEN3_OFF), "<think>a</think>b") == ("", "<think>a</think>b")
    assert _whole(qwen3.split(QWEN3_PROMPT, thinking=False), "plain") == ("", "plain")
    # DeepSeek-R1's template ends the prompt with "<think>\n": the reply opens inside the reasoning
    assert _whole(r1.split("<｜Assistant｜><think>\n"), "a</think>b") == ("a", "b")
    assert _whole(r1.split("", thinking=False), "{\"json\": 1}") == ("", "{\"json\": 1}")
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'"):
        ReasoningParser("granite")
