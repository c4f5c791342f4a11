"""Scores candidates with a trained DLRM under ``eval()`` + ``torch.inference_mode()``.

The user's part of a request is the same for all k candidates; it is broadcast, not copied per item.
"""

from __future__ import annotations

import numpy as np
import torch

from recpipe.ranking.model import DLRM


class Predictor:
    def __init__(self, model: DLRM, device: torch.device) -> None:
        self.model = model.to(device).eval()
        self.device = device

    def _t(self, a: np.ndarray, dtype: np.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(self.device)

    def predict(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        """dense (B, Dd) float32 + sparse (B, F) int64 -> (B,) float32 click probabilities."""
        with torch.inference_mode():
            logits = self.model(self._t(dense, np.dtype(np.float32)), self._t(sparse, np.dtype(np.int64)))
            return torch.sigmoid(logits).float().cpu().numpy()

    def score_candidates(
        self, user_dense: np.ndarray, user_sparse: np.ndarray, item_dense: np.ndarray, item_sparse: np.ndarray
    ) -> np.ndarray:
        """(Du,), (44,), (k, Di), (k, 16) -> (k,) float32 probabilities."""
        k = item_dense.shape[0]
        if k == 0:
            return np.zeros(0, np.float32)
        with torch.inference_mode():
            ud = self._t(user_dense, np.dtype(np.float32)).expand(k, -1)
            us = self._t(user_sparse, np.dtype(np.int64)).expand(k, -1)
            dense = torch.cat([ud, self._t(item_dense, np.dtype(np.float32))], dim=1)
            sparse = torch.cat([us, self._t(item_sparse, np.dtype(np.int64))], dim=1)
            return torch.sigmoid(self.model(dense, sparse)).float().cpu().numpy()
