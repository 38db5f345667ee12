"""Which autograd nodes feed a parameter's gradient directly: the check that ghost clipping's
second backward pass takes no gradient from a use of a parameter outside the traced forward."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["is_sanctioned", "next_sequence_nr", "param_consumers", "sanction"]


def param_consumers(
    roots: Iterable[torch.Tensor], param_ids: set[int], floor: int | None = None,
    flagged: Callable[[object], bool] | None = None, found: list | None = None,
) -> set:
    """The autograd nodes reachable from the ``grad_fn`` of ``roots`` that have an edge into the
    ``AccumulateGrad`` node of a parameter whose ``id`` is in ``param_ids``: the operations
    through which that parameter receives a gradient. With ``floor``, only nodes created at or
    after that sequence number (:func:`next_sequence_nr`) are visited. With ``flagged``, the
    visited nodes for which it returns true are appended to ``found`` (same walk)."""
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set = set()
    out: set = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if floor is not None and node._sequence_nr() < floor:
            continue
        if flagged is not None and flagged(node):
            found.append(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                if id(var) in param_ids:
                    out.add(node)
            elif nxt not in seen:
                stack.append(nxt)
    return out


def next_sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread will have at least:
    nodes created before this call have smaller numbers."""
    with torch.enable_grad():
        return torch.empty((), requires_grad=True).view(()).grad_fn._sequence_nr()


#: key of :func:`sanction` in a node's ``metadata``
_KEY = "dptorch_sanctioned"


def sanction(nodes: Iterable, owner: object, generation: int) -> None:
    """Marks ``nodes`` as sanctioned by ``owner`` in ``generation`` (kept in the node's own
    ``metadata``: nothing holds the graph alive)."""
    for node in nodes:
        node.metadata[_KEY] = (id(owner), generation)


def is_sanctioned(node, owner: object, generation: int) -> bool:
    return node.metadata.get(_KEY) == (id(owner), generation)
