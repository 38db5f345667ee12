"""Helpers for ``torch.nn.utils.rnn.PackedSequence`` (Opacus ``opacus.utils.packed_sequences``)."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

__all__ = ["compute_seq_lengths", "unpack_packed_sequence"]


def compute_seq_lengths(batch_sizes: torch.Tensor) -> list[int]:
    """Sequence lengths, longest first, from the ``batch_sizes`` of a packed sequence.

    ``batch_sizes[t]`` counts the sequences still running at step ``t``, so the ``i``-th longest
    sequence has as many steps as there are ``t`` with ``batch_sizes[t] > i``.
    """
    sizes = torch.as_tensor(batch_sizes).to("cpu", torch.long)
    if sizes.numel() == 0:
        return []
    n = int(sizes[0])
    idx = torch.arange(n).unsqueeze(1)
    return (sizes.unsqueeze(0) > idx).sum(dim=1).tolist()


def unpack_packed_sequence(
    packed: PackedSequence, batch_first: bool = True
) -> tuple[torch.Tensor, list[int]]:
    """The padded tensor of ``packed`` (in the original order) and the sequence lengths."""
    padded, lengths = pad_packed_sequence(packed, batch_first=batch_first)
    return padded, lengths.tolist()
