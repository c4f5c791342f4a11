"""Fit/apply feature encoders: categorify, normalize, fill-missing.

One implementation (Polars expressions, ``Preprocessor.expressions``) is used by training to encode
its examples and by the feature service to encode the tables it serves from, so the two cannot drift.
"""

from recpipe.preprocess.config import PreprocessConfig
from recpipe.preprocess.encoders import EncodedTable, Preprocessor

__all__ = ["EncodedTable", "PreprocessConfig", "Preprocessor"]
