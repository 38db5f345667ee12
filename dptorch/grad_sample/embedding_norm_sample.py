"""Opacus module path of the ``nn.Embedding`` norm sampler (defined in :mod:`.embedding`)."""

from __future__ import annotations

from .embedding import compute_embedding_norm_sample

__all__ = ["compute_embedding_norm_sample"]
