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

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..utils import gemm
from .param_rename import RenameParamsMixin

State = tuple[torch.Tensor, ...]


def _first_order(backward):
    """Refuses a ``create_graph`` backward (outside ``torch.func``, whose transforms replay
    the general recurrence): the recurrence's recorded states are values, so second
    derivatives through them would be silently missing."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled() and torch._C._functorch.maybe_current_level() is None:
            raise RuntimeError(
                "DPLSTM/DPGRU/DPRNN: a backward pass with create_graph=True (a gradient penalty, "
                "a double backward) through the layer's own recurrence, whose recorded states "
                "carry no second derivatives. Outside DP training on a CPU the layer runs torch's "
                "kernel, which supports it; otherwise use torch's nn.LSTM/GRU/RNN for that term."
            )
        return backward(ctx, *grads)

    return wrapper


class RNNLinear(nn.Linear):
    """The ``nn.Linear`` DP recurrent layers are built from (registered grad sampler: the one of
    ``nn.Linear``). It is always called batch first, ``(B, T, in)`` or ``(B, in)``, whatever the
    ``batch_first`` of the surrounding ``GradSampleModule``.

    Inside :meth:`returning`, the call on the given input returns the given value of
    ``input Wᵀ + b`` (already computed by the recurrence) instead of computing it again;
    autograd, and every hook on the call, treat it exactly as ``F.linear(input, weight, bias)``.
    """

    grad_sample_batch_first = True
    _given: tuple[torch.Tensor, torch.Tensor] | None = None

    @contextmanager
    def returning(self, output: torch.Tensor, *, for_input: torch.Tensor) -> Iterator[None]:
        """The call of the layer on ``for_input`` (that tensor object) returns ``output``, its
        value ``for_input Wᵀ + b``, once; any other call computes as usual."""
        self._given = (for_input, output)
        try:
            yield
        finally:
            self._given = None

    def take_given(self, input: torch.Tensor) -> torch.Tensor | None:
        """The value set by :meth:`returning` if ``input`` is its input (once), else ``None``."""
        if self._given is None or self._given[0] is not input:
            return None
        given, self._given = self._given[1], None
        return given

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        given = self.take_given(input)
        if given is None:
            return super().forward(input)
        return _GivenLinear.apply(given, input, self.weight, self.bias)


class _GivenLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose value ``given`` is already known: the forward pass
    returns it; the backward pass is ``F.linear``'s (``G W``, ``Gᵀ x``, ``Σ G``)."""

    @staticmethod
    def forward(ctx, given, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return given.view_as(given)

    @staticmethod
    @_first_order
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = g.matmul(weight.to(g.dtype)) if ctx.needs_input_grad[1] else None
        gw = gb = None
        if ctx.needs_input_grad[2]:
            gw = g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]).to(g.dtype))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            gb = g.reshape(-1, g.shape[-1]).sum(0)
        return None, gx, gw, gb


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
    @_first_order
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

    Outside DP training (nothing hooks the cells' projections) the layer runs torch's own fused
    kernel on the same parameters, as fast as ``nn.LSTM``; ``use_native_kernel = False`` keeps
    the decomposed recurrence everywhere (the one a ``GradSampleModule`` sees).
    """

    use_native_kernel: bool = True

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
        if parametrize.is_parametrized(self):
            names = ", ".join(self.parametrizations.keys())
            raise ValueError(
                f"{type(self).__name__}: {names} is parametrized under torch's name, but the "
                "layer computes with its cells' weights (l0.ih.weight, l0.hh.weight...), so the "
                "parametrization would be ignored. Parametrize the cell's weight instead, e.g. "
                "weight_norm(layer.l0.hh, 'weight') for weight_hh_l0."
            )
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
        native = self._native_kernel(x)
        if native is not None:
            return self._forward_native(native, input, x, h0, c0, unbatched)

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

    # ------------------------------------------------------------------ torch's kernel
    def _native_kernel(self, x: torch.Tensor):
        """torch's fused function for this layer (``torch.lstm``, ``torch.gru``,
        ``torch.rnn_tanh``, ``torch.rnn_relu``) when nothing observes the layer's
        :class:`RNNLinear` calls, so the result and every gradient are the same function of the
        same parameters computed faster (oneDNN); ``None`` when the calls must run: a hook on a
        projection (a ``GradSampleModule``'s, or anyone's), a global module hook, a replaced
        ``forward`` (bk), a tensor-subclass parameter (ExpandedWeights), a ``torch.func``
        transform, a custom cell class, a non-CPU device (not measured there), or
        ``use_native_kernel = False``."""
        cell_type = type(self.l0)
        kernel = _NATIVE_KERNELS.get(cell_type)
        if kernel is None or not self.use_native_kernel or x.device.type != "cpu":
            return None
        if cell_type is DPRNNCell:
            kernel = torch.rnn_tanh if self.l0.nonlinearity == "tanh" else torch.rnn_relu
        if torch._C._functorch.maybe_current_level() is not None or _global_module_hooks():
            return None
        for cell in self.cells:
            if type(cell) is not cell_type:
                return None
            for lin in cell.children():
                if type(lin) is not RNNLinear or "forward" in lin.__dict__ or _has_hooks(lin):
                    return None
                if any(type(p) is not nn.Parameter for p in lin.parameters(recurse=False)):
                    return None
        return kernel

    def _forward_native(self, kernel, input, x, h0, c0, unbatched: bool):
        """:meth:`forward` by torch's ``kernel`` on the same parameters, in torch's order."""
        flat = []
        for cell in self.cells:
            flat += [cell.ih.weight, cell.hh.weight]
            if self.bias:
                flat += [cell.ih.bias, cell.hh.bias]
            if self.proj_size:
                flat.append(cell.hr.weight)
        is_lstm = c0 is not None
        args = (flat, self.bias, self.num_layers, self.dropout, self.training, self.bidirectional)
        if isinstance(input, PackedSequence):
            order, back = input.sorted_indices, input.unsorted_indices
            hx = [h0, c0] if is_lstm else h0
            if order is not None:
                hx = [h.index_select(1, order) for h in hx] if is_lstm else hx.index_select(1, order)
            out, *hidden = kernel(input.data, input.batch_sizes, hx, *args)
            if back is not None:
                hidden = [h.index_select(1, back) for h in hidden]
            output = PackedSequence(out, input.batch_sizes, order, back)
        else:
            out, *hidden = kernel(x, [h0, c0] if is_lstm else h0, *args, True)
            if unbatched:
                output, hidden = out.squeeze(0), [h.squeeze(1) for h in hidden]
            else:
                output = out if self.batch_first else out.transpose(0, 1)
        return output, (tuple(hidden) if is_lstm else hidden[0])

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

        if (
            torch.is_grad_enabled()
            and type(cell) is DPLSTMCell
            and proj is None
            and torch._C._functorch.maybe_current_level() is None  # not under vmap / grad
        ):
            return _run_lstm(cell, x, state0, masks, reverse)
        # 1. values, without autograd
        with torch.no_grad():
            xi = F.linear(x, cell.ih.weight, cell.ih.bias)
            state = state0
            hprev: list = [None] * x.shape[1]
            mprev: list = [None] * x.shape[1]
            outs: list = [None] * x.shape[1]
            for t in steps:
                hprev[t] = state[0].detach()  # a value: h0 itself may require grad
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
            hh_t = _TieHidden.apply(hh_t_all[t], state[0], cell.hh.weight.detach())
            m, new = cell.step(xi_t[t], hh_t, state)
            if hr_t_all is not None:
                new = (_TieHidden.apply(hr_t_all[t], m, proj.weight.detach()), new[1])
            state = advance(state, new, t)
            outs[t] = state[0]
        return torch.stack(outs, 1), state


# ------------------------------------------------------------------ LSTM: one pass, manual BPTT
@dataclass
class _LSTMValues:
    """One LSTM direction's forward values, for ``T`` steps of ``B`` samples.

    ``out`` ``(B, T, H)``: the state after each step; ``hprev`` ``(B, T, H)``: the state each
    step reads (``h_{t-1}``; both contiguous, as the layer calls and outputs want them);
    ``pre`` ``(B, T, 4H)``: the gate pre-activations, then ``W_hh h_{t-1} + b_hh``; ``gates``
    ``(B, T, 4, H)``: the activated gates ``i, f, g, o``, then (first backward) the factors of the
    backward loop. Time-major, for the backward loop: ``cs`` ``(T + 1, B, H)`` (every cell state
    in time order, ``c0`` first for the forward direction and last for the reverse one),
    ``tanh(c)`` ``(T, B, H)`` and the step mask ``(T, B, 1)``. Also the final state and ``w_hh``
    (detached). Buffers are reused in place: every fresh allocation of this size costs page
    faults on a CPU.
    """

    out: torch.Tensor | None
    hprev: torch.Tensor
    pre: torch.Tensor
    cs: torch.Tensor
    gates: torch.Tensor
    tanh_c: torch.Tensor
    w_hh: torch.Tensor
    mask: torch.Tensor | None
    reverse: bool
    h_n: torch.Tensor | None = None
    c_n: torch.Tensor | None = None

    @property
    def c_prev(self) -> torch.Tensor:
        """``(T, B, H)``: the cell state step ``t`` reads."""
        return self.cs[1:] if self.reverse else self.cs[:-1]


def _tanh(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``tanh(x) = 2 sigmoid(2x) - 1`` into ``out``: torch's CPU ``sigmoid`` is vectorised and
    several times faster than its ``tanh`` (absolute error a few ulp of 1)."""
    torch.sigmoid(x * 2, out=out)
    return out.mul_(2).sub_(1)


@torch.no_grad()
def _lstm_values(
    cell: DPLSTMCell, xi: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, mask, reverse: bool
) -> _LSTMValues:
    """Runs the recurrence of ``cell`` on the input projections ``xi`` ``(B, T, 4H)`` from
    ``(h0, c0)`` ``(B, H)``, without autograd; ``mask`` ``(B, T, 1)`` or ``None``. On return
    ``pre`` holds ``W_hh h_{t-1} + b_hh`` (up to rounding)."""
    b, t_len, g4 = xi.shape
    h_size = g4 // 4
    bias = cell.hh.bias
    new = xi.new_empty
    v = _LSTMValues(
        out=new(b, t_len, h_size),
        hprev=new(b, t_len, h_size),
        pre=xi.clone() if bias is None else xi + bias.detach().to(xi.dtype),
        cs=new(t_len + 1, b, h_size),
        gates=new(b, t_len, 4, h_size),
        tanh_c=new(t_len, b, h_size),
        w_hh=cell.hh.weight.detach(),
        mask=None if mask is None else mask.transpose(0, 1),
        reverse=reverse,
    )
    w_t = v.w_hh.t().to(xi.dtype)  # under autocast the recurrence runs in xi's precision
    fast = gemm.onednn_applies(xi, w_t) and b * h_size * g4 >= gemm.MIN_MACS
    if fast:  # (the operator exists only where oneDNN does)
        w_hh, lp = w_t.t(), torch.ops.mkldnn._linear_pointwise
    v.cs[t_len if reverse else 0] = c0
    h = h0.to(xi.dtype)
    for t in range(t_len - 1, -1, -1) if reverse else range(t_len):
        read, write = (t + 1, t) if reverse else (t, t + 1)
        v.hprev[:, t] = h
        c = v.cs[read]
        pre = v.pre[:, t]
        if fast:  # xi_t + b_hh + W_hh h_{t-1}
            pre.copy_(lp.binary(h, pre, w_hh, None, "add"))
        else:
            pre.addmm_(h, w_t)
        a = v.gates[:, t]
        torch.sigmoid(pre.view(b, 4, h_size), out=a)
        i, f, g, o = a.unbind(1)
        _tanh(pre[:, 2 * h_size : 3 * h_size], out=g)
        if v.mask is None:
            c_new = torch.addcmul(f * c, i, g, out=v.cs[write])
            h = torch.mul(o, _tanh(c_new, out=v.tanh_c[t]), out=v.out[:, t])
        else:
            c_new = torch.addcmul(f * c, i, g)
            h_new = o * _tanh(c_new, out=v.tanh_c[t])
            torch.where(v.mask[t], c_new, c, out=v.cs[write])
            h = torch.where(v.mask[t], h_new, h, out=v.out[:, t])
    v.pre.sub_(xi)
    v.h_n, v.c_n = h.clone(), v.cs[0 if reverse else t_len].clone()
    return v


class _LSTMRecurrence(torch.autograd.Function):
    """The recurrence of one LSTM direction whose values :func:`_lstm_values` computed.

    Inputs: the two terms of the gate pre-activations, ``xi = W_ih x + b_ih`` and ``hh = W_hh
    h_{t-1} + b_hh`` (each ``(B, T, 4H)``, the outputs of the layers' ``RNNLinear`` calls), and
    ``h0, c0`` ``(B, H)``. Outputs the computed values: outputs ``(B, T, H)``, ``h_n``, ``c_n``.
    Backward (back-propagation through time, one loop over ``T`` without autograd): the
    pre-activation gradient ``dG`` ``(B, T, 4H)`` goes to ``xi`` and to ``hh``, whose layer
    calls turn it into the (per-sample) gradients of ``W_ih`` and ``W_hh``; ``dG_t W_hh`` goes
    to ``h_{t-1}``.
    """

    @staticmethod
    def forward(ctx, xi, hh, h0, c0, values: _LSTMValues):
        out, h_n, c_n = values.out, values.h_n, values.c_n
        # the node keeps ``values`` for its backward but not its own outputs: a node that holds
        # them is a reference cycle the garbage collector cannot see (every step's graph leaks)
        values.out = values.h_n = values.c_n = None
        ctx.values = values
        ctx.coefficients_ready = False
        return out, h_n, c_n

    @staticmethod
    def _coefficients(v: _LSTMValues) -> None:
        """Turns the saved values, in place, into the factors of the backward loop (once):
        ``gates`` ``[i, f, g, o]`` -> ``[g·i(1-i), c_prev·f(1-f), i(1-g²), tanh(c)·o(1-o)]``,
        ``c_prev`` -> ``f``, ``tanh(c)`` -> ``o(1-tanh²(c))``."""
        i, f, g, o = v.gates.transpose(0, 1).unbind(2)
        c_prev, tanh_c = v.c_prev, v.tanh_c
        tmp = torch.mul(g, i)
        torch.addcmul(i, tmp, g, value=-1, out=g)
        torch.addcmul(tmp, tmp, i, value=-1, out=i)
        torch.mul(c_prev, f, out=tmp)
        c_prev.copy_(f)
        torch.addcmul(tmp, tmp, f, value=-1, out=f)
        torch.mul(tanh_c, o, out=tmp)
        torch.addcmul(o, tmp, tanh_c, value=-1, out=tanh_c)
        torch.addcmul(tmp, tmp, o, value=-1, out=o)

    @staticmethod
    @_first_order
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_hn, d_cn):
        v: _LSTMValues = ctx.values
        if not ctx.coefficients_ready:  # a second backward (ghost clipping) reuses them
            _LSTMRecurrence._coefficients(v)
            ctx.coefficients_ready = True
        b, t_len, _, h_size = v.gates.shape
        coef, f, dc_dh = v.gates, v.c_prev, v.tanh_c
        # dG_t = [dc·ci, dc·cf, dc·cg, dh·co] with dc = dc_next + dh·∂c/∂h; dc_prev = dc·f
        d_gates = torch.empty_like(v.gates)
        steps = list(range(t_len) if v.reverse else range(t_len - 1, -1, -1))
        dh = v.gates.new_zeros(b, h_size) if d_hn is None else d_hn
        if d_out is not None:
            dh = dh + d_out[:, steps[0]]
        dc = v.gates.new_zeros(b, h_size) if d_cn is None else d_cn
        w_hh = v.w_hh.to(coef.dtype)
        fast = (
            gemm.onednn_applies(w_hh, d_gates) and b * h_size * 4 * h_size >= gemm.MIN_MACS
            and (d_out is None or gemm.onednn_applies(d_out))
        )
        if fast:  # dG_t W_hh + d_out as oneDNN's ``x wᵀ + other``, w = W_hhᵀ
            w_t, lp = w_hh.t().contiguous(), torch.ops.mkldnn._linear_pointwise
        for k, t in enumerate(steps):
            dh_cell, dc_cell = dh, dc
            if v.mask is not None:
                dh_cell, dc_cell = dh * v.mask[t], dc * v.mask[t]
            dc_tot = torch.addcmul(dc_cell, dh_cell, dc_dh[t])
            dg = d_gates[:, t]
            torch.mul(dc_tot.unsqueeze(1), coef[:, t, :3], out=dg[:, :3])
            torch.mul(dh_cell, coef[:, t, 3], out=dg[:, 3])
            dc_next = dc_tot * f[t]
            if d_out is not None and k + 1 < t_len:
                if fast:
                    dh_next = lp.binary(dg.flatten(1), d_out[:, steps[k + 1]], w_t, None, "add")
                else:
                    dh_next = torch.addmm(d_out[:, steps[k + 1]], dg.flatten(1), w_hh)
            elif fast:
                dh_next = lp(dg.flatten(1), w_t, None, "none", [], "")
            else:
                dh_next = dg.flatten(1).mm(w_hh)
            if v.mask is not None:
                keep = ~v.mask[t]
                dh_next = dh_next + dh * keep
                dc_next = dc_next + dc * keep
            dh, dc = dh_next, dc_next
        d_pre = d_gates.view(b, t_len, 4 * h_size)
        return d_pre, d_pre, dh, dc, None


def _run_lstm(
    cell: DPLSTMCell, x: torch.Tensor, state0: State, mask: torch.Tensor | None, reverse: bool
) -> tuple[torch.Tensor, State]:
    """One LSTM direction over ``x`` ``(B, T, I)`` with autograd: ``ih`` and ``hh`` are each one
    call on the whole sequence (``hh`` returning the values the recurrence computed), the
    recurrence one :class:`_LSTMRecurrence`. Returns ``(outputs (B, T, H), (h_n, c_n))``."""
    xi = cell.ih(x)
    v = _lstm_values(cell, xi.detach(), state0[0], state0[1], mask, reverse)
    with cell.hh.returning(v.pre, for_input=v.hprev):
        hh = cell.hh(v.hprev)
    out, h_n, c_n = _LSTMRecurrence.apply(xi, hh, state0[0], state0[1], v)
    return out, (h_n, c_n)


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def _has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, name, None) for name in _HOOK_DICTS)


def _global_module_hooks() -> bool:
    from torch.nn.modules import module as m

    return any(
        getattr(m, name, None)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    )


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


_NATIVE_KERNELS = {DPLSTMCell: torch.lstm, DPGRUCell: torch.gru, DPRNNCell: torch.rnn_tanh}
