"""Torch helpers shared by the model stages (retrieval, ranking): device choice, pinned transfers,
CUDA graphs, and the options they share. Nothing here imports gRPC. ``options``, ``device`` and
``cuda_graphs`` import without torch (they load it when a device is resolved through torch or a graph
is captured), so a stage deciding it runs on the CPU without torch can use them; ``transfer`` imports it."""
