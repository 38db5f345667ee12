"""Which autograd nodes feed a parameter's gradient directly: the check that ghost clipping's
second backward pass takes no gradient from a use of a parameter outside the traced forward."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["NodeSet", "param_consumers"]


def param_consumers(roots: Iterable[torch.Tensor], param_ids: set[int]) -> set:
    """The autograd nodes reachable from the ``grad_fn`` of ``roots`` that have an edge into the
    ``AccumulateGrad`` node of a parameter whose ``id`` is in ``param_ids``: the operations
    through which that parameter receives a gradient."""
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set = set()
    out: set = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
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


class NodeSet(set):
    """A set of autograd nodes kept on a module: copies and pickles of the module get an empty
    one (nodes cannot be copied, and belong to the original's graph)."""

    def __deepcopy__(self, memo) -> NodeSet:
        return NodeSet()

    def __reduce__(self):
        return (NodeSet, ())
