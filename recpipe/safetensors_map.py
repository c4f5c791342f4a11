"""Read a safetensors file as numpy arrays without torch: ``map_safetensors``.

The format is a little-endian u64 header length, a JSON header (dtype, shape and byte offsets of each
tensor, optional string metadata) and the raw bytes, so a memory mapping is a few lines. The feature
stage maps its precomputed rows with it, the retrieval stage reads its user tower and item embeddings
(a CPU retrieval process never imports torch, whose import alone costs seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from recpipe.errors import ArtifactMismatch

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
           "BOOL": np.bool_}


def map_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(arrays, metadata) of a safetensors file, each array a read-only view of the memory-mapped file
    (safetensors' own numpy loader copies every tensor into memory). ``ArtifactMismatch`` names a file
    that is not one."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None) or {}
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        arrays = {}
        for name, entry in header.items():
            start, end = (8 + n + int(o) for o in entry["data_offsets"])
            arrays[name] = mapped[start:end].view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArtifactMismatch(f"{path}: unreadable safetensors ({e!r})") from None
    return arrays, {str(k): str(v) for k, v in meta.items()}
