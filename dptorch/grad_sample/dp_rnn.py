"""Grad sampler of :class:`dptorch.layers.dp_rnn.RNNLinear`: the one of ``nn.Linear``.

``DPRNN`` / ``DPGRU`` / ``DPLSTM`` call each ``RNNLinear`` once per forward on the whole
sequence ``(B, T, in)``, so its per-sample gradient is ``nn.Linear``'s (summed over ``T``).
"""

from __future__ import annotations

from ..layers.dp_rnn import RNNLinear
from .linear import compute_linear_grad_sample
from .registry import register_grad_sampler

register_grad_sampler(RNNLinear)(compute_linear_grad_sample)
