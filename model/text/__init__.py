"""Text: the tokenizer (HF `tokenizer.json` or a GGUF's embedded vocabulary), the chat template, incremental
detokenization and stop strings."""

from model.text.detokenizer import IncrementalDetokenizer
from model.text.stop_strings import StopStringMatcher
from model.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "Tokenizer"]
