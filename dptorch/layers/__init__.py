"""Layers with exact per-sample gradients that replace torch layers with fused kernels."""

from .dp_multihead_attention import DPMultiheadAttention, SequenceBias
from .dp_rnn import DPGRU, DPLSTM, DPRNN
from .param_rename import RenameParamsMixin

__all__ = [
    "DPRNN",
    "DPGRU",
    "DPLSTM",
    "DPMultiheadAttention",
    "RenameParamsMixin",
    "SequenceBias",
]
