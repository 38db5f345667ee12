"""Helpers for ``torch.nn.utils.rnn.PackedSequence`` (Opacus ``opacus.utils.packed_sequences``)."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

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


def _gen_packed_data(
    minibatch_size: int,
    max_seq_length: int,
    input_dim: int,
    batch_first: bool,
    sorted_: bool | None = False,
) -> PackedSequence:
    """A random ``PackedSequence`` of ``minibatch_size`` sequences (Opacus's test helper): each
    sequence has a uniform length in ``[1, max_seq_length]`` and standard normal entries of
    dimension ``input_dim``. ``sorted_``: the sequences are generated longest first (no
    ``sorted_indices``); otherwise in random order. ``batch_first`` is the layout of the padded
    tensor the sequence is packed from; the packed result is the same either way."""
    lengths = torch.randint(1, max_seq_length + 1, (minibatch_size,))
    if sorted_:
        lengths = lengths.sort(descending=True).values
    padded = torch.randn(minibatch_size, int(lengths.max()), input_dim)
    mask = torch.arange(padded.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    padded = padded * mask.unsqueeze(-1)
    if not batch_first:
        padded = padded.transpose(0, 1)
    return pack_padded_sequence(
        padded, lengths, batch_first=batch_first, enforce_sorted=bool(sorted_)
    )

