"""Torch-only helpers shared by the model stages (retrieval, ranking): device choice, pinned transfers,
CUDA graphs, and the options they share. Nothing here imports gRPC; only ``options`` is light enough to
import without torch."""
