"""Sparse autoencoders and transcoders: the dictionary math (dictionary.py) and the files it is read from (SAELens,
sparsify, Llama Scope, Gemma Scope; load.py picks the reader), the store a server serves them from (store.py), and the
per-row feature that streams their features with every token (options.py, feature.py), and steering by a feature
(steer.py). Where a dictionary reads and writes is a Hook of model/hook_names.py."""

from model.features.sae.dictionary import ACTIVATIONS, ENCODERS, Dictionary, DictionaryError, top_features
from model.features.sae.feature import FeatureActivations, TokenFeatures
from model.features.sae.files import allowed_path
from model.features.sae.load import FORMATS, detect_format, load_dictionary
from model.features.sae.options import MAX_TOP_K, READ_SITES, FeatureReadOptions
from model.features.sae.steer import FeatureClamp
from model.features.sae.store import DictionaryStore, StoreLimits

__all__ = ["ACTIVATIONS", "ENCODERS", "FORMATS", "MAX_TOP_K", "READ_SITES", "Dictionary", "DictionaryError", "DictionaryStore",
           "FeatureActivations", "FeatureClamp", "FeatureReadOptions", "StoreLimits", "TokenFeatures", "allowed_path",
           "detect_format", "load_dictionary", "top_features"]
