"""Recurrent layers with exact per-sample gradients: ``DPRNN``, ``DPGRU``, ``DPLSTM``.

Drop-in replacements for ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` (same arguments, forward,
parameter names and state dict), built from :class:`RNNLinear` (an ``nn.Linear``) so that
``GradSampleModule`` computes their per-sample gradients.

How a layer (one direction) is computed, for inputs ``x`` of shape ``(B, T, I)``:

1. *values*: the recurrence runs without autograd and records the state fed to the hidden
   projection at every step, ``Hprev`` ``(B, T, H)`` (and, for ``proj_size > 0``, the
   pre-projection outputs ``M``).
2. *graph*: ``ih(x)`` and ``hh(Hprev)`` are each **one** call of an ``RNNLinear`` on the whole
   sequence, so their per-sample gradients are one ``einsum`` over ``(B, T)``. The recurrence is
   then replayed with autograd: step ``t`` takes ``hh(Hprev)[:, t]`` as the value of
   ``W_hh h_{t-1} + b_hh`` and routes the gradient ``g_t W_hh`` back to ``h_{t-1}`` (a
   zero-cost tie), so back-propagation through time is exact while ``W_hh`` gets its gradient
   (and per-sample gradient ``sum_t g_t^T h_{t-1}``) from the single batched call.

Variable-length ``PackedSequence`` batches are unpacked into ``(B, T, I)`` in the original
sample order; every step runs on all ``B`` samples and a sample's state is frozen once its
sequence has ended (reverse direction: until it has started), so per-sample gradients come out
in the original order and are exact. Outputs are packed again with the input's metadata.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from .param_rename import RenameParamsMixin

State = tuple[torch.Tensor, ...]


class RNNLinear(nn.Linear):
    """The ``nn.Linear`` DP recurrent layers are built from (registered grad sampler: the one of
    ``nn.Linear``). It is always called batch first, ``(B, T, in)`` or ``(B, in)``, whatever the
    ``batch_first`` of the surrounding ``GradSampleModule``."""

    grad_sample_batch_first = True


class _TieHidden(torch.autograd.Function):
    """``value`` in the forward pass; in the backward pass the gradient ``g`` flows to ``value``
    unchanged and ``g @ weight`` flows to ``h`` (so ``value`` acts as ``F.linear(h, weight) + b``
    for back-propagation through time, without computing it again)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: torch.Tensor, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad, grad @ weight, None


# ---------------------------------------------------------------------------------- cells
class DPRNNCellBase(nn.Module):
    """A recurrent cell whose input and hidden projections are :class:`RNNLinear` layers
    ``ih`` (``I -> num_chunks*H``) and ``hh`` (``H_in -> num_chunks*H``)."""

    has_cell_state = False

    def __init__(
        self, input_size: int, hidden_size: int, bias: bool, num_chunks: int, hh_in: int | None = None
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bias = bias
        self.ih = RNNLinear(input_size, num_chunks * hidden_size, bias=bias)
        self.hh = RNNLinear(hh_in or hidden_size, num_chunks * hidden_size, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Same initialisation as torch: every weight ``U(-1/sqrt(H), 1/sqrt(H))``."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def set_max_batch_length(self, max_batch_length: int) -> None:
        """Kept for Opacus compatibility: batches never shrink inside dptorch's DP layers."""
        self.ih.max_batch_len = max_batch_length
        self.hh.max_batch_len = max_batch_length

    def step(self, xi: torch.Tensor, hh: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """One step from the input projection ``xi`` ``(B, G)``, the hidden projection ``hh``
        ``(B, G)`` and the state; returns ``(output before projection (B, H), new state)``."""
        raise NotImplementedError

    def project(self, m: torch.Tensor, state: State) -> State:
        """Turns a step's output into the new state (identity unless the cell has a projection)."""
        return (m, *state[1:])

    def forward(self, input: torch.Tensor, hx=None, batch_size_t: int | None = None):
        """One time step on ``input`` ``(B, I)``; ``hx`` as for the matching ``nn.*Cell``."""
        if batch_size_t is not None:
            input = input[:batch_size_t]
        b = input.shape[0]
        if hx is None:
            z = input.new_zeros(b, self.hidden_size)
            hx = (z, z) if self.has_cell_state else z
        state = tuple(s[:b] for s in hx) if self.has_cell_state else (hx[:b],)
        m, new = self.step(self.ih(input), self.hh(state[0]), state)
        new = self.project(m, new)
        return new if self.has_cell_state else new[0]


class DPRNNCell(DPRNNCellBase):
    """Elman cell ``h' = act(W_ih x + b_ih + W_hh h + b_hh)``, ``act`` ``tanh`` or ``relu``."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool, nonlinearity: str = "tanh"):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity {nonlinearity!r}: use 'tanh' or 'relu'.")
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, bias, num_chunks=1)

    def step(self, xi, hh, state):
        act = torch.tanh if self.nonlinearity == "tanh" else torch.relu
        h = act(xi + hh)
        return h, (h,)


class DPGRUCell(DPRNNCellBase):
    """GRU cell, gates ``r, z, n`` in torch's order."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool):
        super().__init__(input_size, hidden_size, bias, num_chunks=3)

    def step(self, xi, hh, state):
        xr, xz, xn = xi.chunk(3, -1)
        hr, hz, hn = hh.chunk(3, -1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        h = n + z * (state[0] - n)
        return h, (h,)


class DPLSTMCell(DPRNNCellBase):
    """LSTM cell, gates ``i, f, g, o`` in torch's order; with ``proj_size > 0`` the hidden
    state is ``W_hr (o * tanh(c))`` (``hr``: an :class:`RNNLinear` without bias)."""

    has_cell_state = True

    def __init__(self, input_size: int, hidden_size: int, bias: bool, proj_size: int = 0):
        self.proj_size = proj_size
        super().__init__(input_size, hidden_size, bias, num_chunks=4, hh_in=proj_size or None)
        if proj_size > 0:
            self.hr = RNNLinear(hidden_size, proj_size, bias=False)
            self.reset_parameters()

    def step(self, xi, hh, state):
        i, f, g, o = (xi + hh).chunk(4, -1)
        c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
        m = torch.sigmoid(o) * torch.tanh(c)
        return m, (m, c)

    def project(self, m, state):
        if self.proj_size > 0:
            return (self.hr(m), state[1])
        return state


# ---------------------------------------------------------------------------------- layers
class DPRNNBase(RenameParamsMixin, nn.Module):
    """Multi-layer, optionally bidirectional recurrent network of ``DP*Cell`` cells.

    Submodules ``l{k}`` / ``l{k}_reverse`` hold the cells; their parameters are published under
    torch's names (``weight_ih_l0``, ``bias_hh_l1_reverse``, ``weight_hr_l0``...).
    """

    def __init__(
        self,
        mode: str | type[DPRNNCellBase],
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        cell_params: dict | None = None,
    ) -> None:
        super().__init__()
        cells = {"RNN_TANH": DPRNNCell, "RNN_RELU": DPRNNCell, "GRU": DPGRUCell, "LSTM": DPLSTMCell}
        cell_cls = cells[mode] if isinstance(mode, str) else mode
        cell_params = dict(cell_params or {})
        if mode == "RNN_RELU":
            cell_params.setdefault("nonlinearity", "relu")
        if not 0 <= dropout <= 1 or isinstance(dropout, bool):
            raise ValueError(f"dropout should be a number in [0, 1], got {dropout!r}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if proj_size < 0 or (proj_size and proj_size >= hidden_size):
            raise ValueError(
                f"proj_size must be in [0, hidden_size) = [0, {hidden_size}), got {proj_size}"
            )
        if proj_size and cell_cls is not DPLSTMCell:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        self.mode = mode
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = proj_size
        self.num_directions = 2 if bidirectional else 1
        self.cell_params = cell_params
        if cell_cls is DPLSTMCell:
            self.cell_params["proj_size"] = proj_size
        out_size = proj_size or hidden_size
        rename = {}
        for layer in range(num_layers):
            in_size = input_size if layer == 0 else out_size * self.num_directions
            for suffix in ("", "_reverse")[: self.num_directions]:
                name = f"l{layer}{suffix}"
                self.add_module(name, cell_cls(in_size, hidden_size, bias, **self.cell_params))
                rename[f"{name}.ih.weight"] = f"weight_ih_l{layer}{suffix}"
                rename[f"{name}.hh.weight"] = f"weight_hh_l{layer}{suffix}"
                if bias:
                    rename[f"{name}.ih.bias"] = f"bias_ih_l{layer}{suffix}"
                    rename[f"{name}.hh.bias"] = f"bias_hh_l{layer}{suffix}"
                if proj_size:
                    rename[f"{name}.hr.weight"] = f"weight_hr_l{layer}{suffix}"
        self.set_rename_map(rename)

    @property
    def cells(self) -> list[DPRNNCellBase]:
        """Cells in torch's order: layer 0 forward, layer 0 reverse, layer 1 forward..."""
        return [
            getattr(self, f"l{k}{s}")
            for k in range(self.num_layers)
            for s in ("", "_reverse")[: self.num_directions]
        ]

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size:
            s += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        return s

    # ------------------------------------------------------------------ forward
    def forward(self, input: torch.Tensor | PackedSequence, state_init=None, *, hx=None):
        """Same as torch's: ``input`` ``(T, B, I)`` (``(B, T, I)`` if ``batch_first``),
        ``(T, I)`` unbatched, or a ``PackedSequence``; ``state_init`` (or, by torch's name,
        ``hx=``) the initial state(s)
        ``(num_layers * num_directions, B, H_out)`` (LSTM: a tuple ``(h_0, c_0)``, ``c_0`` with
        ``hidden_size``), zeros if ``None``. Returns ``(output, h_n)`` (LSTM: ``(h_n, c_n)``),
        ``output`` of feature size ``num_directions * H_out`` and ``h_n`` in the original order.
        """
        is_lstm = self.l0.has_cell_state
        packed = isinstance(input, PackedSequence)
        mask = None
        unbatched = False
        if packed:
            x, lengths = pad_packed_sequence(input, batch_first=True)
            t_idx = torch.arange(x.shape[1], device=lengths.device)
            mask = (t_idx[None, :] < lengths[:, None]).to(x.device)
        else:
            if input.dim() not in (2, 3):
                raise ValueError(
                    f"{type(self).__name__}: expected a 2D (unbatched) or 3D (batched) input, "
                    f"got shape {tuple(input.shape)}"
                )
            unbatched = input.dim() == 2
            if unbatched:
                x = input.unsqueeze(0)
            else:
                x = input if self.batch_first else input.transpose(0, 1)
        if x.shape[-1] != self.input_size:
            raise RuntimeError(
                f"{type(self).__name__}: input.size(-1) must be equal to input_size. "
                f"Expected {self.input_size}, got {x.shape[-1]}"
            )
        if hx is not None:
            if state_init is not None:
                raise TypeError(f"{type(self).__name__}: pass state_init or hx, not both")
            state_init = hx
        h0, c0 = self._initial_states(x, state_init, is_lstm, unbatched)

        h_n, c_n = [], []
        layer_in = x
        cells = self.cells
        for layer in range(self.num_layers):
            outs = []
            for d in range(self.num_directions):
                k = layer * self.num_directions + d
                out, states = self._run_direction(
                    cells[k], layer_in, (h0[k], c0[k]) if is_lstm else (h0[k],), mask, bool(d)
                )
                outs.append(out)
                h_n.append(states[0])
                if is_lstm:
                    c_n.append(states[1])
            layer_in = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                layer_in = F.dropout(layer_in, self.dropout, training=True)
        h_n_t = torch.stack(h_n)
        hidden = (h_n_t, torch.stack(c_n)) if is_lstm else h_n_t

        if packed:
            output = _repack(layer_in, input)
        elif unbatched:
            output = layer_in.squeeze(0)
            hidden = tuple(h.squeeze(1) for h in hidden) if is_lstm else hidden.squeeze(1)
        else:
            output = layer_in if self.batch_first else layer_in.transpose(0, 1)
        return output, hidden

    def _initial_states(self, x: torch.Tensor, hx, is_lstm: bool, unbatched: bool):
        n = self.num_layers * self.num_directions
        b = x.shape[0]
        h_size = self.proj_size or self.hidden_size
        if hx is None:
            h0 = x.new_zeros(n, b, h_size)
            c0 = x.new_zeros(n, b, self.hidden_size) if is_lstm else None
            return h0, c0
        if is_lstm:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"{type(self).__name__}: hx must be a tuple (h_0, c_0) or None")
            h0, c0 = hx
        else:
            if not isinstance(hx, torch.Tensor):
                raise TypeError(f"{type(self).__name__}: hx must be a Tensor or None")
            h0, c0 = hx, None
        if unbatched:
            h0 = h0.unsqueeze(1)
            c0 = c0.unsqueeze(1) if c0 is not None else None
        _check_hidden(type(self).__name__, "h_0" if is_lstm else "hx", h0, (n, b, h_size))
        if c0 is not None:
            _check_hidden(type(self).__name__, "c_0", c0, (n, b, self.hidden_size))
        return h0, c0

    def _run_direction(
        self,
        cell: DPRNNCellBase,
        x: torch.Tensor,
        state0: State,
        mask: torch.Tensor | None,
        reverse: bool,
    ) -> tuple[torch.Tensor, State]:
        """Runs ``cell`` over ``x`` ``(B, T, I)``; returns ``(outputs (B, T, H_out), final
        state)``. ``mask`` ``(B, T)``: which steps of each sample are real (``None``: all)."""
        steps = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
        proj = getattr(cell, "hr", None)
        masks = None if mask is None else mask.unsqueeze(-1)

        def advance(state, new, t):
            if masks is None:
                return new
            m = masks[:, t]
            return tuple(torch.where(m, a, b) for a, b in zip(new, state))

        # 1. values, without autograd
        with torch.no_grad():
            xi = F.linear(x, cell.ih.weight, cell.ih.bias)
            state = state0
            hprev: list = [None] * x.shape[1]
            mprev: list = [None] * x.shape[1]
            outs: list = [None] * x.shape[1]
            for t in steps:
                hprev[t] = state[0]
                m, new = cell.step(xi[:, t], F.linear(state[0], cell.hh.weight, cell.hh.bias), state)
                mprev[t] = m
                if proj is not None:
                    new = (F.linear(m, proj.weight), new[1])
                state = advance(state, new, t)
                outs[t] = state[0]
        if not torch.is_grad_enabled():
            return torch.stack(outs, 1), state

        # 2. the same computation with autograd; each projection is one call on the sequence.
        # unbind (not x[:, t]): its backward stacks the T step gradients once, where T slices
        # would each scatter into a full (B, T, G) zero tensor (quadratic in T).
        xi_t = cell.ih(x).unbind(1)
        hh_t_all = cell.hh(torch.stack(hprev, 1)).unbind(1)
        hr_t_all = proj(torch.stack(mprev, 1)).unbind(1) if proj is not None else None
        state = state0
        for t in steps:
            hh_t = _TieHidden.apply(hh_t_all[t], state[0], cell.hh.weight)
            m, new = cell.step(xi_t[t], hh_t, state)
            if hr_t_all is not None:
                new = (_TieHidden.apply(hr_t_all[t], m, proj.weight), new[1])
            state = advance(state, new, t)
            outs[t] = state[0]
        return torch.stack(outs, 1), state


def _check_hidden(layer: str, name: str, h: torch.Tensor, expected: tuple) -> None:
    if tuple(h.shape) != expected:
        raise RuntimeError(f"{layer}: expected {name} of size {expected}, got {tuple(h.shape)}")


def _repack(padded: torch.Tensor, like: PackedSequence) -> PackedSequence:
    """Packs ``padded`` ``(B, T, F)`` (original sample order) with the metadata of ``like``."""
    batch_sizes = like.batch_sizes
    b = padded.shape[0]
    t_max = batch_sizes.numel()
    sorted_idx = like.sorted_indices
    if sorted_idx is None:
        sorted_idx = torch.arange(b)
    ranks = torch.arange(b)
    valid = ranks[None, :] < batch_sizes[:, None]  # (T, B): step t has the first bs_t samples
    tt, rr = torch.nonzero(valid[:t_max], as_tuple=True)
    rows = sorted_idx.to(rr.device)[rr]
    data = padded[rows.to(padded.device), tt.to(padded.device)]
    return PackedSequence(data, batch_sizes, like.sorted_indices, like.unsorted_indices)


class _DPRNNTorchSignature(DPRNNBase):
    """A :class:`DPRNNBase` with the cell class fixed by the subclass (``cell_class``) and the
    constructor arguments of the matching torch layer."""

    cell_class: type[DPRNNCellBase]

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0,
        bidirectional: bool = False,
        proj_size: int = 0,
        *,
        cell_params: dict | None = None,
    ) -> None:
        super().__init__(
            self.cell_class,
            input_size,
            hidden_size,
            num_layers=num_layers,
            bias=bias,
            batch_first=batch_first,
            dropout=dropout,
            bidirectional=bidirectional,
            proj_size=proj_size,
            cell_params=cell_params,
        )


class DPRNN(_DPRNNTorchSignature):
    """Drop-in replacement for ``nn.RNN`` with per-sample gradients (see :class:`DPRNNBase`)."""

    cell_class = DPRNNCell

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0,
        bidirectional: bool = False,
        proj_size: int = 0,
        nonlinearity: str = "tanh",
    ) -> None:
        super().__init__(
            input_size,
            hidden_size,
            num_layers,
            bias,
            batch_first,
            dropout,
            bidirectional,
            proj_size,
            cell_params={"nonlinearity": nonlinearity},
        )
        self.nonlinearity = nonlinearity


class DPGRU(_DPRNNTorchSignature):
    """Drop-in replacement for ``nn.GRU`` with per-sample gradients (see :class:`DPRNNBase`)."""

    cell_class = DPGRUCell


class DPLSTM(_DPRNNTorchSignature):
    """Drop-in replacement for ``nn.LSTM`` (``proj_size`` included) with per-sample gradients
    (see :class:`DPRNNBase`)."""

    cell_class = DPLSTMCell
