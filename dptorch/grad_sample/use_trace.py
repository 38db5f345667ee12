"""The use trace: checks, over one forward pass, that every gradient contribution is hooked.

Per-sample gradients are computed per *call* of a hooked module, from that call's inputs and
its output's gradient. They are exact only if

1. every use of a trainable parameter that carries a gradient happens inside a call of a
   module that samples it (not ``F.linear(h, self.out.weight)`` in a parent's forward);
2. what such a call computes from its parameters leaves the call only through its first
   output (not a second output, nor a tensor cached on the module), whose gradient the hook
   sees;
3. the call's inputs come from the batch, so that its rows are the samples. A call on inputs
   that do not (Hugging Face's ``position_ids`` of shape ``[1, T]``, T5's ``[T, T]`` bucket
   index) has a gradient shared by all samples: with a batch dimension of size 1 its output is
   expanded to the batch by the module (exact), otherwise it is refused;
4. an expanded output keeps its batch axis, row ``b`` for sample ``b``, until it meets batch
   data: an op that merges, moves, indexes or reduces that axis first (``reshape(-1, d)``,
   ``[index]``, ``sum(0)``) would credit every sample's gradient to the first rows, and is
   refused;
5. a call's batch input has the batch in the layer's batch dimension: the trace follows the
   batch axis through ops that move it (``x.transpose(0, 1)``, ``permute``, ``view``), so that a
   ``(T, B, d)`` input of a batch-first layer is refused even when ``T = B``, where counting
   rows cannot tell positions from samples (XLNet, FSMT, Longformer).

:class:`UseTrace` is a ``TorchFunctionMode`` run around one forward pass (the first after
wrapping, and after the trainable parameters change). It tags every tensor computed inside a
hooked call from a parameter the call samples, and every tensor derived from the model's batch
inputs; the checks are then set operations on these tags. Cost: one Python call per torch
function of that one forward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .batch_axis import kept_axis, out_axis
from .param_edges import next_sequence_nr

__all__ = ["UseTrace", "mark_batched", "tensors_in"]

_ACTIVE: list[UseTrace] = []


def mark_batched(t: torch.Tensor) -> torch.Tensor:
    """Declares that ``t`` has one row per sample of the current batch (e.g. an index a model
    adapter expanded to the batch). Returns ``t``; a no-op when no trace runs."""
    for tr in _ACTIVE:
        tr.batched[id(t)] = t
        tr.axis[id(t)] = tr.bdim if t.dim() > tr.bdim else None
    return t


def tensors_in(obj, depth: int = 3) -> Iterator[torch.Tensor]:
    """The tensors in ``obj`` and in its lists, tuples and dict values (``depth`` levels)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v, depth - 1)
    elif depth > 0 and isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v, depth - 1)


@dataclass
class _Call:
    module: nn.Module
    name: str
    sampled: frozenset[int]
    batched: bool
    inputs: tuple = ()
    bdim: int = 0
    #: sequence numbers: autograd nodes created during the call are numbered in [start, end)
    start: int = 0
    end: int | None = None
    #: the edges ``(node, output_nr)`` whose gradient the capture hook of the call sees whole:
    #: its first output's, and (hook on a view's base covering the same elements) the base's
    exits: frozenset = frozenset()
    #: memo of :meth:`UseTrace.leaks`: node -> whether a parameter is reachable from it
    memo: dict | None = None


#: ops whose result's rows depend on their position: they do not keep copies' rows equal (a
#: causal mask ``torch.ones(T, T).tril()`` when ``T = B``)
_ROW_DEPENDENT = frozenset(
    f"{n}{suffix}" for suffix in ("", "_") for n in (
        "tril", "triu", "diag", "diagonal", "diag_embed", "diagflat", "rot90", "unfold",
        "fill_diagonal", "masked_scatter", "take", "index_put",
    )
)
#: ops along a dimension (``dim`` / ``dims``, second positional argument): they break copies'
#: equal rows only along the batch dimension (``cumsum`` over the sequence keeps them)
_ALONG_DIM = frozenset(
    f"{n}{suffix}" for suffix in ("", "_") for n in (
        "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "flip", "sort", "argsort",
        "gather", "scatter", "scatter_add", "scatter_reduce", "index_select", "index_add",
        "index_copy", "index_fill", "take_along_dim",
    )
)


def _breaks_rows(func, args: tuple, kwargs: dict, bdim: int) -> bool:
    """Whether ``func(*args, **kwargs)`` may make equal rows (along ``bdim``) unequal: a
    position-dependent op, an op along ``bdim``, or one that moves ``bdim`` (``transpose``,
    ``permute``, ``movedim``, ``t``, ``flip``, ``roll``)."""
    name = getattr(func, "__name__", "")
    if name in _ROW_DEPENDENT:
        return True
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if src is None:
        return False
    nd = max(src.dim(), 1)

    def norm(d) -> int:
        return d % nd if isinstance(d, int) else d

    if name in _ALONG_DIM or name in ("roll", "roll_"):
        dims = kwargs.get("dims", kwargs.get("dim"))
        if dims is None and name in ("roll", "roll_"):
            dims = args[2] if len(args) > 2 else None
            if dims is None:  # a flattened roll moves every element
                return True
        elif dims is None:
            dims = args[1] if len(args) > 1 else -1
        dims = dims if isinstance(dims, (list, tuple)) else (dims,)
        return any(norm(d) == bdim for d in dims if isinstance(d, int))
    if name in ("transpose", "transpose_", "swapaxes", "swapdims", "swapaxes_", "swapdims_"):
        d = [kwargs.get(k) for k in ("dim0", "dim1")] if "dim0" in kwargs else list(args[1:3])
        return any(isinstance(x, int) and norm(x) == bdim for x in d)
    if name in ("t", "t_"):
        return bdim <= 1
    if name == "permute":
        dims = kwargs.get("dims")
        if dims is None:
            one = len(args) == 2 and isinstance(args[1], (list, tuple))
            dims = args[1] if one else args[1:]
        return len(dims) > bdim and norm(dims[bdim]) != bdim
    if name in ("movedim", "moveaxis"):
        moved = [*args[1:3], kwargs.get("source"), kwargs.get("destination")]
        flat = [d for m in moved for d in (m if isinstance(m, (list, tuple)) else (m,))]
        return any(isinstance(d, int) and norm(d) == bdim for d in flat)
    return False


_CONSTANT_FACTORIES = frozenset(
    ("zeros", "ones", "full", "empty", "new_zeros", "new_ones", "new_full", "new_empty")
)


def _fills_alike(args: tuple, dst: torch.Tensor, src: torch.Tensor, ax: int) -> bool:
    """Whether writing ``src`` into ``dst`` (``dst.copy_(src)``, ``dst[index] = src``) puts
    ``src``'s dimension ``ax`` on ``dst``'s: same shape, or a write through slices only (T5's
    ``shifted[..., 1:] = ids[..., :-1]``) of the same rank and batch size."""
    if dst.shape == src.shape:
        return True
    if dst.dim() != src.dim() or dst.shape[ax] != src.shape[ax] or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return all(i is Ellipsis or isinstance(i, slice) for i in index)


class UseTrace(TorchFunctionMode):
    """Records the problems of one forward pass (see the module docstring).

    Args:
        params: ``{id(p): (name, p)}`` of every trainable parameter.
        module_names: ``{id(module): path}`` for messages.
        batch_inputs: the tensors of the model's batch (the wrapped module's inputs).
        batch_size: ``B``, or ``None`` when unknown.
        bdim: the batch dimension of the model's tensors (1 with ``batch_first=False``).
        check_uses: check rules 1 and 2 (off where per-sample gradients do not come from
            module calls, e.g. ExpandedWeights, which differentiates every use of a parameter).
    """

    def __init__(
        self,
        params: dict[int, tuple[str, nn.Parameter]],
        module_names: dict[int, str],
        batch_inputs: list[torch.Tensor],
        batch_size: int | None,
        bdim: int = 0,
        check_uses: bool = True,
    ):
        super().__init__()
        self.bdim = bdim
        self.check_uses = check_uses
        self.params = params
        self.module_names = module_names
        self.batch_size = batch_size
        self.batched: dict[int, torch.Tensor] = {id(t): t for t in batch_inputs}
        self._declared = {id(t) for t in batch_inputs}  # axis by batch_first, not by the trace
        #: the batch axis of batched tensors where the trace can follow it (``None``: unknown)
        self.axis: dict[int, int | None] = {
            id(t): bdim if t.dim() > bdim else None for t in batch_inputs
        }
        self.expanded: dict[int, torch.Tensor] = {}
        self.copies: dict[int, torch.Tensor] = {}
        self.tags: dict[int, tuple[torch.Tensor, frozenset[int]]] = {}
        self.stack: list[int] = []
        self.calls: dict[int, _Call] = {}
        self.ended: set[int] = set()
        self.problems: list[str] = []
        self._paused = 0
        self._next = 0
        self._last_exit: str | None = None
        self._moved = False
        self.expanded_layers: dict[str, None] = {}  # names, in order

    # ------------------------------------------------------------------ module calls
    def from_batch(self, t: torch.Tensor) -> bool:
        """Whether ``t`` was derived from the model's batch inputs in this pass."""
        tid = id(t)
        return tid in self.batched or tid in self.expanded or tid in self.copies

    def mark_expanded(self, t: torch.Tensor) -> None:
        """``t`` is the output of the call that just ended, expanded from a batch dimension of
        size 1 (rule 4)."""
        self.expanded[id(t)] = t
        if self._last_exit is not None:
            self.expanded_layers.setdefault(self._last_exit, None)

    def enter(
        self, module: nn.Module, sampled: set[int], inputs, bdim: int | None = None
    ) -> None:
        """A hooked call begins (forward pre-hook); ``bdim``: the layer's batch dimension
        (default: the model's)."""
        batched = any(
            id(t) in self.batched or id(t) in self.expanded or id(t) in self.copies
            for t in tensors_in(inputs)
        )
        self._next += 1
        want = self.bdim if bdim is None else bdim
        call = _Call(
            module, self.module_names.get(id(module), type(module).__name__), frozenset(sampled),
            batched, tuple(tensors_in(inputs)), want, next_sequence_nr() if sampled else 0,
        )
        self.calls[self._next] = call
        self.stack.append(self._next)
        first = call.inputs[0] if call.inputs else None
        # a layer that fixes its own layout (dptorch's DPMultiheadAttention projections, RNN
        # cells: ``grad_sample_batch_first``) is fed by its owner's forward, which the trace
        # need not follow
        own = getattr(module, "grad_sample_batch_first", None) is not None
        if sampled and not own and first is not None and id(first) in self.batched:
            ax = self.axis.get(id(first), want)
            b = self.batch_size
            # which dimensions could hold the samples: not a trailing feature dimension
            # (a Linear's (B, d) input with d = B is not ambiguous), except for indices
            dims = first.shape if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or (
                first.dim() < 2) else first.shape[:-1]
            lost = ax is None and b is not None and sum(s == b for s in dims) > 1
            if lost and not self._moved:
                self._moved = True
                self.problems.append(
                    f"{call.name} ({type(module).__name__}) receives an input of shape "
                    f"{tuple(first.shape)} with several dimensions of the batch's size {b}, and "
                    "the ops that made it (e.g. torch.stack of slices, advanced indexing, "
                    "as_strided, a partial write) do not tell which one holds the samples: its "
                    "per-sample gradients could be taken along positions. Fix: build the input "
                    "with ops that keep the batch dimension visible (transpose, permute, view, "
                    "torch.stack(..., dim=...) of per-sample rows), or freeze this layer."
                )
            if ax is not None and ax != want and not self._moved:  # the first layer is enough
                self._moved = True
                self.problems.append(
                    f"{call.name} ({type(module).__name__}) receives an input of shape "
                    f"{tuple(first.shape)} whose batch is in dimension {ax}, not in dimension "
                    f"{want} where its per-sample gradients are taken (the model moved the "
                    "batch axis, e.g. x.transpose(0, 1)): its rows are not the samples, and "
                    "when that dimension's size equals the batch size nothing else tells them "
                    "apart. Fix: keep the batch first in the layers that have trainable "
                    "parameters (or, if every such layer takes (T, B, ...) inputs, wrap the "
                    "model with batch_first=False), or freeze this layer."
                )

    def check_layout(self, module: nn.Module, inputs, bdim: int) -> None:
        """A layer with a layout of its own (a DP layer's ``batch_first``) is called: its first
        input must have the batch where that layout says (such a layer's forward mixes the
        samples otherwise, e.g. a recurrence run along the batch)."""
        first = next(tensors_in(inputs), None)
        if first is None or id(first) not in self.batched or self._moved:
            return
        if id(first) in self._declared:  # the model's own input: its layout is the layer's
            return
        ax = self.axis.get(id(first))
        if ax is not None and ax != bdim:
            self._moved = True
            name = self.module_names.get(id(module), type(module).__name__)
            self.problems.append(
                f"{name} ({type(module).__name__}, batch_first={bdim == 0}) receives an input of "
                f"shape {tuple(first.shape)} whose batch is in dimension {ax}: its forward would "
                "treat positions as samples and mix the samples. Fix: pass the input in the "
                "layer's layout, or build the layer with the other batch_first."
            )

    def layout_output(self, output, bdim: int) -> None:
        """Such a layer's first output has the batch where its layout says."""
        t = next(tensors_in(output), None)
        b = self.batch_size
        if t is not None and id(t) in self.batched and t.dim() > bdim and (
            b is None or t.shape[bdim] == b
        ):
            self.axis[id(t)] = bdim

    def exit(self, module: nn.Module, output, expanded: bool = False) -> None:
        """A hooked call ends (forward hook): its first output is the sanctioned exit;
        ``expanded``: the module expanded a batch dimension of size 1 to the batch."""
        while self.stack:
            cid = self.stack.pop()
            self.ended.add(cid)
            if self.calls[cid].module is module:
                break
        else:
            return
        call = self.calls[cid]
        self._last_exit = call.name
        first = next(tensors_in(output), None)
        if call.sampled:
            call.end = next_sequence_nr()
            call.exits = _exit_edges(_hooked_first(output), call.start, expanded)
        if call.batched:  # ops inside the call that the trace cannot see (custom Functions)
            # inputs that reach the batch only through copies or expanded tensors: expanded
            truly = any(id(t) in self.batched for t in call.inputs)
            marks = self.batched if truly else self.expanded
            for t in tensors_in(output):
                if id(t) not in self.batched and id(t) not in self.expanded:
                    marks[id(t)] = t
        # a sampled layer maps the rows of its batch dimension to the same rows of its output,
        # however it computes them (bk's Linear runs on a flattened (B·T, d) view)
        src = next((t for t in call.inputs if id(t) in self.batched), None)
        if call.sampled and src is not None:
            b, d = self.batch_size, call.bdim
            for t in tensors_in(output):
                if id(t) in self.batched:
                    fits = t.dim() > d and (b is None or t.shape[d] == b)
                    self.axis[id(t)] = d if fits else kept_axis(
                        self.axis.get(id(src)), src, t, b
                    )
        if first is not None:
            tag = self.tags.get(id(first))
            if tag is not None:
                rest = tag[1] - {cid}
                if rest:
                    self.tags[id(first)] = (first, rest)
                else:
                    del self.tags[id(first)]
        if (
            call.sampled
            and not call.batched
            and first is not None
            and first.requires_grad
            and self.batch_size is not None
            and self.batch_size > 1
            and not expanded
        ):
            self.problems.append(
                f"{call.name} ({type(module).__name__}) was called on inputs that do not come "
                "from the batch (e.g. an index built from the sequence length), and its output "
                f"of shape {tuple(first.shape)} has no batch dimension of size 1 to expand: its "
                "parameters' gradient is shared by every sample and cannot be split per sample "
                "at this layer. Fix: compute the layer per sample (expand its input to the "
                "batch), or freeze it."
            )

    @contextlib.contextmanager
    def paused(self):
        """Torch calls made by dptorch itself (hooks) are not traced."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # ------------------------------------------------------------------ every torch call
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        inputs = list(tensors_in((args, kwargs)))
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if not any(id(t) in self.expanded for t in inputs):
                raise
            name = getattr(func, "__name__", str(func))
            raise ValueError(
                f"{name} {self._where()} failed on a tensor that dptorch expanded to the batch "
                f"from the output of {', '.join(self.expanded_layers) or 'a layer'}, which had a "
                "batch dimension of size 1 (the layer was called on an input that does not come "
                "from the batch, e.g. position ids of shape [1, T]); the model expects that "
                "output to keep its size-1 batch dimension (it repeats it, or writes into it in "
                f"place): {type(e).__name__}: {e}. Fix: feed that layer an input expanded to the "
                "batch, or freeze it."
            ) from e
        outs = [t for t in tensors_in(out) if isinstance(t, torch.Tensor)]
        if any(id(t) in self.expanded for t in inputs):
            self._check_expanded(func, inputs, outs)
        if any(id(t) in self.batched for t in inputs):
            batched = [t for t in inputs if id(t) in self.batched]  # args[0] first, if it is
            # the input whose batch axis is known leads (a mask made by x.new_ones has none)
            src = next((t for t in batched if self.axis.get(id(t)) is not None), batched[0])
            ax = self.axis.get(id(src))
            if getattr(func, "__name__", "") in _CONSTANT_FACTORIES:  # x.new_zeros(...)
                ax = None  # batched by convention (DPLSTM's h0), but no data: no axis
            elif ax is not None and any(  # ``a + b.transpose(0, 1)``: which axis is it?
                t is not src and t.shape == src.shape and self.axis.get(id(t), ax) not in (ax, None)
                for t in batched
            ):
                ax = None
            for t in outs:
                self.batched[id(t)] = t
                self.axis[id(t)] = (
                    None if ax is None else out_axis(func, args, kwargs, src, ax, t, self.batch_size)
                )
            dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if dst is not None and dst is not src and (
                id(dst) not in self.batched or self.axis.get(id(dst)) is None
            ):
                # batch data written into a tensor made elsewhere (``out[:] = x``, ``out.copy_(x)``)
                self.batched[id(dst)] = dst
                self.copies.pop(id(dst), None)
                self.axis[id(dst)] = ax if ax is not None and _fills_alike(args, dst, src, ax) else None
        elif self._copies(func, inputs, outs):
            for t in outs:
                self.copies[id(t)] = t
        # what _copies tagged, or an in-place op's own tensor, unless rows may now differ
        if self.copies and _breaks_rows(func, args, kwargs, self.bdim):
            for t in outs:
                self.copies.pop(id(t), None)
        if not self.check_uses or not any(t.requires_grad for t in outs):
            return out
        carried: set[int] = set()
        for t in inputs:
            tid = id(t)
            if tid in self.params and self.params[tid][1].requires_grad:
                cid = self._covering_call(tid)
                if cid is None:
                    self._uncovered(tid, func)
                else:
                    carried.add(cid)
            tag = self.tags.get(tid)
            if tag is not None:
                ended = tag[1] & self.ended
                escaped = self.leaking(t, ended) if ended else ended
                if escaped:
                    self._escaped(escaped)
                carried |= tag[1] - ended
        if carried:
            for t in outs:
                prev = self.tags.get(id(t))
                self.tags[id(t)] = (t, frozenset(carried) | (prev[1] if prev else frozenset()))
        return out

    def _check_expanded(self, func, inputs: list, outs: list) -> None:
        """Rule 4: every output of an op on an expanded tensor keeps the batch axis; until the
        op also takes batch data, its outputs are expanded tensors too."""
        b, d = self.batch_size, self.bdim
        ranks = {t.dim() for t in inputs if id(t) in self.expanded}
        for o in outs:
            # with several inputs, broadcasting aligns the trailing axes: the expanded tensor's
            # batch axis stays the output's only if their ranks agree
            misaligned = len(inputs) > 1 and any(r != o.dim() for r in ranks)
            if b is not None and (o.dim() <= d or o.shape[d] != b or misaligned):
                name = getattr(func, "__name__", str(func))
                self.problems.append(
                    f"{name} {self._where()} turns a tensor of shape (..., batch {b}, ...) that "
                    "dptorch expanded from a batch dimension of size 1 (a layer called on an "
                    "input that does not come from the batch, e.g. position ids of shape "
                    f"[1, T]) into shape {tuple(o.shape)}, which no longer has one row per "
                    "sample: per-sample gradients would be credited to the wrong samples. Fix: "
                    "keep the batch axis first until the tensor is combined with batch data, or "
                    "feed the layer an input expanded to the batch."
                )
                return
        if not any(id(t) in self.batched for t in inputs if id(t) not in self.expanded):
            for o in outs:
                self.expanded[id(o)] = o

    def _copies(self, func, inputs: list, outs: list) -> bool:
        """Whether ``func`` made ``B`` identical rows out of data that is the same for every
        sample: a constant created with ``B`` rows (``torch.zeros(input_shape)``), an
        ``expand``/``repeat`` to ``B`` rows (Hugging Face's ``token_type_ids`` buffer), or an
        op on such copies, with other inputs of lower rank only, that keeps the ``B`` rows. A hooked call may take them (its
        output is then *expanded*, rule 4). An index built from the sequence length (T5's
        ``[T, T]``, ``torch.eye(T)``) is not copies, even when ``T == B``."""
        b = self.batch_size
        if b is None or not outs:
            return False
        o = outs[0]
        if o.dim() <= self.bdim or o.shape[self.bdim] != b:
            return False
        name = getattr(func, "__name__", "")
        if name in _CONSTANT_FACTORIES:
            return not inputs or name.startswith("new_")
        if name in ("expand", "expand_as", "broadcast_to", "repeat") and inputs:
            src = inputs[0]
            lead = src.dim() - o.dim() + self.bdim
            return lead < 0 or src.shape[lead] == 1 or id(src) in self.copies
        # an op on copies keeps identical rows if its other inputs have a lower rank than the
        # output (broadcast alike to every row: scalars, a [T] table), not a row-wise one
        if not any(id(t) in self.copies for t in inputs):
            return False
        return all(t.dim() < o.dim() for t in inputs if id(t) not in self.copies)

    def _covering_call(self, pid: int) -> int | None:
        for cid in reversed(self.stack):
            if pid in self.calls[cid].sampled:
                return cid
        return None

    def _where(self) -> str:
        return f"inside {self.calls[self.stack[-1]].name}'s forward" if self.stack else (
            "in the model's top-level forward"
        )

    def _uncovered(self, pid: int, func) -> None:
        name = self.params[pid][0]
        fname = getattr(func, "__name__", str(func))
        self.problems.append(
            f"parameter {name} is used by {fname} {self._where()}, outside a call of the "
            "module that owns it: no per-sample-gradient hook sees that use, so its gradient "
            "would not be clipped per sample. Fix: call the owning module instead of using its "
            "parameter directly (e.g. self.out(h), not F.linear(h, self.out.weight)), register "
            "a grad sampler for the module that uses it, or freeze the parameter."
        )

    def leaking(self, t: torch.Tensor, cids: frozenset[int]) -> frozenset[int]:
        """The ended calls among ``cids`` (calls that tagged ``t``) from whose parameters ``t``
        gets a gradient other than through the call's first output. A tensor the call derived
        from its first output (a layer returning ``(y, y.softmax(-1))``, a router's scores
        computed from its logits) sends every gradient through that output, whose capture hook
        sees it: exact, and the call is dropped from ``t``'s tag. Found by walking ``t``'s
        autograd graph (see :meth:`_leaks`)."""
        out = frozenset(c for c in cids if self._leaks(t, self.calls[c]))
        if out != cids:
            tid = id(t)
            tag = self.tags.get(tid)
            if tag is not None:
                rest = tag[1] - (cids - out)
                if rest:
                    self.tags[tid] = (t, rest)
                else:
                    del self.tags[tid]
        return out

    @staticmethod
    def _leaks(t: torch.Tensor, call: _Call) -> bool:
        """Whether a sampled parameter of ``call`` is reachable in the autograd graph from
        ``t`` without crossing one of the call's exit edges (its first output, the hooked
        base): the walk visits the nodes created from the call's start on (older nodes are
        the inputs' graphs, whose parameter uses belong to other calls), and counts an edge
        into a parameter's ``AccumulateGrad`` from a node created during the call. Memoised
        per call (each node is visited once per call, whatever the number of tensors)."""
        node = t.grad_fn
        if node is None:
            return False
        if (node, t.output_nr) in call.exits:
            return False
        if call.end is None:  # not a finished call: nothing to tell
            return True
        memo = call.memo
        if memo is None:
            memo = call.memo = {}
        start, end, exits, sampled = call.start, call.end, call.exits, call.sampled
        stack = [(node, False)]
        while stack:
            n, done = stack.pop()
            if n in memo and not done:
                continue
            seq = n._sequence_nr()
            if not done:
                if seq < start:
                    memo[n] = False
                    continue
                stack.append((n, True))
                for nxt, idx in n.next_functions:
                    if nxt is None or (nxt, idx) in exits or nxt in memo:
                        continue
                    if getattr(nxt, "variable", None) is None:
                        stack.append((nxt, False))
                continue
            hit = False
            for nxt, idx in n.next_functions:
                if nxt is None or (nxt, idx) in exits:
                    continue
                var = getattr(nxt, "variable", None)
                if var is not None:
                    if seq < end and id(var) in sampled:
                        hit = True
                        break
                elif memo.get(nxt, False):
                    hit = True
                    break
            memo[n] = hit
        return memo[node]

    def _escaped(self, cids: set[int]) -> None:
        for cid in cids:
            call = self.calls[cid]
            msg = (
                f"{call.name} ({type(call.module).__name__}) computed a tensor from its "
                "parameters that is used after the call other than through its first output "
                "(a second output, or a tensor kept on the module): only the first output's "
                "gradient is seen, so that contribution would not be clipped per sample. Fix: "
                "return one tensor (or make the others detached), or register a grad sampler "
                "for the module."
            )
            if msg not in self.problems:
                self.problems.append(msg)

    # ------------------------------------------------------------------ activation
    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def check(self) -> None:
        """Raises ``ValueError`` listing every problem found."""
        if self.problems:
            lines = "\n".join(f"  - {p}" for p in dict.fromkeys(self.problems))
            raise ValueError(
                "This model cannot get exact per-sample gradients as written; training it "
                f"would release unclipped or wrong gradients:\n{lines}"
            )


def _hooked_first(output) -> torch.Tensor | None:
    """The output tensor whose gradient the capture hook takes: a tensor output, or the first
    tensor of a tuple or list output (as ``GradSampleModule`` hooks it)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((v for v in output if isinstance(v, torch.Tensor)), None)
    return None


def _exit_edges(first: torch.Tensor | None, start: int, expanded: bool) -> frozenset:
    """The autograd edges ``(node, output_nr)`` whose whole gradient the capture hook of a
    call (nodes numbered from ``start``) sees: its first output's, and, where that output is a
    view without overlap covering the whole of a contiguous base the call created (the hook is
    then on the base), the base's. None when the call's output was expanded to the batch (the
    hook is on the expanded tensor, which the call's own tensors do not go through)."""
    if first is None or first.grad_fn is None or expanded:
        return frozenset()
    edges = {(first.grad_fn, first.output_nr)}
    base = first._base if first._is_view() else None
    if (
        base is not None
        and base.grad_fn is not None
        and base.grad_fn._sequence_nr() >= start
        and base.is_contiguous()
        and base.numel() == first.numel()
        and non_overlapping(first)
    ):
        edges.add((base.grad_fn, base.output_nr))
    return frozenset(edges)


def non_overlapping(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory (strides sorted, each step past the last)."""
    span = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride < span:
            return False
        span = stride * size
    return True


def check_structure(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    batch_size: int | None,
    bdim: int = 0,
    check_uses: bool = True,
) -> None:
    """Runs ``model(*args, **kwargs)`` once under a :class:`UseTrace` (hooks on every module
    that samples a trainable parameter) and raises ``ValueError`` on any problem. A call on a
    batch-independent input counts as a problem even with a batch dimension of size 1 (for
    modes that cannot expand it, such as ExpandedWeights). The output is discarded."""
    from .unit_params import sampled_parameters

    sampled = sampled_parameters(model)
    names = {id(m): name or "<root>" for name, m in model.named_modules()}
    params = {id(p): (n, p) for n, p in model.named_parameters() if p.requires_grad}
    trace = UseTrace(
        params, names, list(tensors_in((args, kwargs))), batch_size, bdim, check_uses
    )
    handles = []
    for m in model.modules():
        ids = {id(p) for _, p in sampled.get(id(m), ())}
        if not ids:
            continue

        def enter(mod, a, kw, ids=ids):
            with trace.paused():
                trace.enter(mod, ids, (a, kw))

        def leave(mod, a, kw, out):
            with trace.paused():
                trace.exit(mod, out, expanded=False)

        handles.append(m.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(m.register_forward_hook(leave, with_kwargs=True))
    try:  # fork_rng: the extra forward pass draws no random numbers of the training (dropout)
        with torch.random.fork_rng(), trace, torch.enable_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    trace.check()
