"""recpipe: a recommender latency pipeline service."""

__version__ = "0.1.0"
