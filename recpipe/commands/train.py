"""Fit preprocessing, train two-tower retrieval and DLRM ranking, build the FAISS index."""

from __future__ import annotations

import argparse

from recpipe.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise UsageError("not implemented yet")
