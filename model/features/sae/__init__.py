"""Sparse autoencoders and transcoders: the dictionary math (dictionary.py) and the files it is read from (SAELens,
sparsify, Llama Scope, Gemma Scope; load.py picks the reader). Where a dictionary reads and writes is a Hook of
model/hook_names.py."""

from model.features.sae.dictionary import ACTIVATIONS, Dictionary, DictionaryError, top_features
from model.features.sae.files import allowed_path
from model.features.sae.load import FORMATS, detect_format, load_dictionary
from model.features.sae.steer import FeatureClamp
from model.features.sae.store import DictionaryStore, StoreLimits

__all__ = ["ACTIVATIONS", "FORMATS", "Dictionary", "DictionaryError", "DictionaryStore", "FeatureClamp", "StoreLimits", "allowed_path", "detect_format",
           "load_dictionary", "top_features"]
