"""Rule 2 of the use trace after the forward pass: tensors that leave a hooked call, computed from
its parameters, other than through its first output.

Per-sample gradients follow a hooked call's *first output* only: a grad sampler turns that
output's gradient into per-sample gradients, and ``torch.func`` recomputes the call keeping its
first output. A tensor the call computed from its parameters that leaves it another way (a second
output the model returns, an auxiliary loss kept on the module such as a mixture-of-experts
router's ``self.aux_loss``) is seen by no hook: ghost clipping's second backward pass would
release its gradient unclipped, and the other modes would silently drop it.

The trace (:class:`~dptorch.grad_sample.use_trace.UseTrace`) already refuses such a tensor when
an operation *of the forward pass* uses it. What it cannot see is a use *after* the forward pass,
by the training loop or the criterion. Refusing every such tensor at the end of the forward pass
would be wrong: a tensor may leave the forward pass without the loss ever using it (attention
maps returned with ``output_attentions=True``, ``past_key_values``, a cache kept for logging).
The exact criterion is whether the loss's gradient flows through the tensor, which only the
backward pass knows. So, at the end of a traced forward pass (:func:`escaped_tensors`: the
tensors the trace tagged as computed in a call from its parameters, other than the call's first
output), two checks are armed, each refusing only a gradient through such a tensor:

* **guards** (every mode): every such tensor found in the model's output (tuples, lists, dicts,
  ``ModelOutput``) or in a module's attributes and buffers is replaced there by a copy whose
  backward raises ``ValueError`` (:class:`EscapeGuard`). The forward pass's own operations keep
  the original, so the guard's backward runs exactly when the loss is differentiated through
  what the model handed out, never for the forward's own uses of the tensor (a copy, not a
  view: the caller may modify it in place);
* **ghost** (whose second backward pass would release the gradient unclipped) also marks the
  tensors' autograd nodes (:func:`mark_escapes`): before the DP loss's first backward pass,
  :meth:`GradSampleModule.check_param_uses` refuses a guard in the loss's graph, or a node made
  after the forward pass (a higher sequence number) with an edge into a marked tensor, wherever
  the tensor was kept (a global, a closure, an input container). Nothing is back-propagated
  then. The forward pass's own uses, custom autograd Functions included, are older nodes.

Both give the same ``ValueError``, naming the layer. A hook on the escaped tensor itself would
not do: it also fires for the forward's own uses of the tensor (an attention map that the layer's
output is computed from and that ``output_attentions=True`` returns).

Cost: nothing for a model whose hooked calls only return their first output (every Hugging Face
layer: the keys and values of ``past_key_values`` come from the projections' first outputs);
otherwise one scan of the modules' attributes per traced pass, one copy per escaped tensor found
there, and for ghost a look at the edges of the nodes made after the pass. Modes that trace only
the first forward pass (hooks, functorch, bk) check that pass, and for them a tensor kept
elsewhere than the output or a module (a global) is not found: its gradient is dropped, not
released. Ghost, which would release it, traces and checks every pass, whatever the route.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "EscapeGuard", "escaped_tensors", "escaped_use", "guard_escapes", "is_escape_guard",
    "mark_escapes",
]

#: attributes every ``nn.Module`` has (its parameter, buffer, module and hook dictionaries)
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)


class EscapeGuard(torch.autograd.Function):
    """A copy of an escaped tensor whose backward raises ``ValueError(message)``; the message is
    kept on the backward node (``node.dptorch_escape``)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, message: str) -> torch.Tensor:
        ctx.dptorch_escape = message
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError(ctx.dptorch_escape)


def is_escape_guard(node) -> bool:
    """Whether the autograd node ``node`` is the backward of an :class:`EscapeGuard`."""
    return type(node) is EscapeGuard._backward_cls


def _replace(obj, swap, depth: int):
    """``obj`` with the tensors that ``swap`` maps to another tensor replaced, in lists and
    dicts in place, in tuples by a new tuple of the same type; ``obj`` itself when nothing is
    replaced."""
    if isinstance(obj, torch.Tensor):
        return swap(obj)
    if depth <= 0:
        return obj
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            new = _replace(v, swap, depth - 1)
            if new is not v:
                obj[i] = new
        return obj
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            new = _replace(v, swap, depth - 1)
            if new is not v:
                obj[k] = new  # a Hugging Face ModelOutput updates its attribute as well
        return obj
    if isinstance(obj, tuple):
        items = [_replace(v, swap, depth - 1) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*items)
        try:
            return type(obj)(items)
        except TypeError:
            return tuple(items)
    return obj


def escaped_tensors(trace) -> dict[int, tuple[torch.Tensor, frozenset[int]]]:
    """``{id: (tensor, calls)}``: the tensors that ``trace`` (a finished
    :class:`~dptorch.grad_sample.use_trace.UseTrace`) tagged as computed inside hooked calls
    (``calls``) from their parameters, with a gradient, and that get it from those parameters
    other than through the calls' first outputs. A tensor a call derived from its first output
    only (a layer returning ``(y, y.softmax(-1))``, Mixtral's router scores computed from its
    logits) is not one: every gradient through it reaches the parameters through the first
    output, whose capture hook sees it (:meth:`UseTrace.leaking` walks the autograd graph from
    the tensor, stopping at the first output, within the nodes made during the call)."""
    out = {}
    for tid, (t, cids) in list(trace.tags.items()):
        ended = cids & trace.ended
        if ended and t.grad_fn is not None:
            ended = trace.leaking(t, ended)
            if ended:
                out[tid] = (t, ended)
    return out


def guard_escapes(trace, out, model: nn.Module, escaped: dict | None = None):
    """Replaces, in ``out`` (the model's output) and in the attributes and buffers of
    ``model``'s modules, every tensor that ``trace`` found computed inside a hooked call from
    its parameters and not through its first output (:func:`escaped_tensors`, or ``escaped``),
    by an :class:`EscapeGuard`. Returns the output (the same object unless it is such a tensor
    or a tuple holding one)."""
    if escaped is None:
        escaped = escaped_tensors(trace)
    if not escaped:
        return out
    guards: dict[int, torch.Tensor] = {}

    def swap(t: torch.Tensor) -> torch.Tensor:
        entry = escaped.get(id(t))
        if entry is None:
            return t
        g = guards.get(id(t))
        if g is None:
            g = guards[id(t)] = EscapeGuard.apply(t, _message(trace, entry[1]))
        return g

    out = _replace(out, swap, 4)
    for m in model.modules():
        for k, v in list(m.__dict__.items()):
            if k not in _MODULE_INTERNALS and isinstance(v, (torch.Tensor, list, tuple, dict)):
                new = _replace(v, swap, 3)
                if new is not v:
                    m.__dict__[k] = new
        for k, b in list(m._buffers.items()):
            if b is not None and id(b) in escaped:
                m._buffers[k] = swap(b)
    return out


#: key of :func:`mark_escapes` in an autograd node's ``metadata``
_KEY = "dptorch_escapes"


def mark_escapes(trace, escaped: dict, owner: object, end: int) -> None:
    """Ghost, at the end of a traced forward pass (whose autograd nodes are numbered below
    ``end``): marks the autograd node of every escaped tensor (``escaped``, from
    :func:`escaped_tensors`) with its output number and message. A node created after the pass
    with an edge into such an output (:func:`escaped_use`) uses the tensor outside the forward
    pass, wherever it was kept (a global, a closure, an input container): exact, whatever the
    route the tensor took, and nothing holds the graph alive (the mark is on the node)."""
    messages: dict[frozenset[int], str] = {}
    for t, cids in escaped.values():
        message = messages.get(cids)
        if message is None:
            message = messages[cids] = _message(trace, cids)
        t.grad_fn.metadata.setdefault(_KEY, {})[t.output_nr] = (id(owner), end, message)


def escaped_use(node, owner: object) -> str | None:
    """The message of an escaped tensor (:func:`mark_escapes` by ``owner``) that ``node`` takes
    as an input, ``node`` being created after that tensor's forward pass; else ``None``."""
    seq = None
    for nxt, idx in node.next_functions:
        if nxt is None:
            continue
        marks = nxt.metadata.get(_KEY)
        if marks is None or idx not in marks:
            continue
        who, end, message = marks[idx]
        if seq is None:
            seq = node._sequence_nr()
        if who == id(owner) and seq >= end:
            return message
    return None


def _message(trace, cids) -> str:
    calls = [trace.calls[c] for c in sorted(cids)]
    names = ", ".join(dict.fromkeys(f"{c.name} ({type(c.module).__name__})" for c in calls))
    return (
        f"The loss is differentiated through a tensor that {names} computed from its parameters "
        "and that left the layer's call other than through its first output (a second output "
        "returned by the model, or a tensor kept on a module, such as an auxiliary loss stored "
        "in forward): per-sample gradients follow only a layer's first output, so that "
        "contribution would not be clipped per sample (grad_sample_mode='ghost' would release "
        "it unclipped, the other modes would drop it). Fix: compute the extra term outside the "
        "layer from its first output (e.g. a router returns its logits and the caller computes "
        "the load-balancing loss), make it part of the first output, register a grad sampler "
        "for the layer that covers it, or detach it."
    )
