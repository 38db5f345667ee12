"""Where the batch is: the batch axis of a tensor computed from the batch, followed op by op.

:class:`~dptorch.grad_sample.use_trace.UseTrace` records, for each tensor derived from the
model's batch, which dimension holds the samples. Ops that move dimensions (``transpose``,
``permute``, ``movedim``, ``view``/``reshape``, basic indexing, reductions over named dims,
``unsqueeze``/``squeeze``) move it exactly; any other op keeps it where the output still has the
batch's size (counted from the front or from the back, and ``None`` when that is ambiguous).
A ``(T, B, d)`` tensor thus stays known to be sequence-first even when ``T = B``.
"""

from __future__ import annotations

import torch

__all__ = ["kept_axis", "out_axis"]


def _norm_dim(d, n: int) -> int | None:
    return d % n if isinstance(d, int) and n > 0 else None


def kept_axis(ax: int | None, src: torch.Tensor, out: torch.Tensor, b: int | None) -> int | None:
    """The batch axis of ``out``, an op's result from ``src`` whose batch axis is ``ax``, when
    the op does not say how it moves axes: the same axis counted from the front (reductions,
    ``x[:, 0]``) or from the back (broadcasting, ``x[t]``), whichever has the batch's size;
    ``None`` when both or neither do."""
    if ax is None:
        return None
    if out.dim() == src.dim():
        return ax if ax < out.dim() and (b is None or out.shape[ax] == b) else None
    cands = {a for a in (ax, ax + out.dim() - src.dim())
             if 0 <= a < out.dim() and (b is None or out.shape[a] == b)}
    return cands.pop() if len(cands) == 1 else None


def _reshaped_axis(ax: int, src: torch.Tensor, out: torch.Tensor) -> int | None:
    """``view``/``reshape``/``flatten``: the batch axis survives where the output has a dimension
    of the batch's size after dimensions holding exactly the source's leading elements."""
    lead = 1
    for s in src.shape[:ax]:
        lead *= s
    acc = 1
    for a, s in enumerate(out.shape):
        if acc == lead and s == src.shape[ax]:
            return a
        acc *= s
        if acc > lead and lead > 0:
            return None
    return None


def _index_axis(ax: int, src: torch.Tensor, index) -> int | None:
    """``src[index]`` with basic indexing (ints, slices, ``None``, ``...``): where the batch
    axis goes; ``None`` when an int takes it away or the index is advanced (tensors, lists)."""
    idx = index if isinstance(index, tuple) else (index,)
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in idx):
        return None
    n_src = sum(1 for i in idx if isinstance(i, (int, slice)))
    expanded: list = []
    for i in idx:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (src.dim() - n_src))
        else:
            expanded.append(i)
    pos_src, pos_out = 0, 0
    for i in expanded:
        if i is None:
            pos_out += 1
            continue
        if pos_src == ax:
            return None if isinstance(i, int) else pos_out
        pos_src += 1
        if not isinstance(i, int):
            pos_out += 1
    return pos_out + (ax - pos_src)


#: ops whose second argument (or ``dim=``) names the dimensions they remove
_REDUCTIONS = frozenset((
    "sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "argmax", "argmin",
    "std", "var", "logsumexp", "all", "any", "count_nonzero", "median", "nanmedian", "mode",
    "unbind", "select",
))


#: ops that may move the batch axis while keeping the shape (a square transpose when T = B)
_MOVES = frozenset((
    "transpose", "transpose_", "swapaxes", "swapdims", "swapaxes_", "swapdims_", "t", "t_",
    "T", "H", "mT", "mH", "permute", "movedim", "moveaxis", "view", "reshape", "flatten",
    "unflatten", "view_as", "reshape_as", "ravel", "__getitem__", "einsum", "as_strided",
    "rot90", "permute_copy", "transpose_copy", "stack", "unbind",
))


def _einsum_axis(args: tuple, src: torch.Tensor, ax: int) -> int | None:
    """``torch.einsum(eq, *operands)``: the output position of ``src``'s subscript at ``ax``
    (``...`` dims broadcast from the right); ``None`` when it is summed over."""
    eq = args[0] if args and isinstance(args[0], str) else None
    ops = args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    if eq is None or "->" not in eq:
        return None
    lhs, rhs = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    i = next((k for k, o in enumerate(ops) if o is src), None)
    if i is None or len(terms) != len(ops):
        return None
    n_ell = [o.dim() - len(t) + 3 if "..." in t else 0 for t, o in zip(terms, ops)]
    width = max(n_ell, default=0)

    def symbols(term: str, e: int) -> list[str]:
        if "..." not in term:
            return list(term)
        pre, post = term.split("...")
        return [*pre, *(f"#{width - e + j}" for j in range(e)), *post]

    src_syms = symbols(terms[i], n_ell[i])
    if ax >= len(src_syms):
        return None
    out_syms = symbols(rhs, width)
    return out_syms.index(src_syms[ax]) if src_syms[ax] in out_syms else None


def out_axis(func, args: tuple, kwargs: dict, src: torch.Tensor, ax: int,
              out: torch.Tensor, b: int | None) -> int | None:
    """The batch axis of ``out = func(*args, **kwargs)``, where ``src`` (an input) has it in
    ``ax``: followed exactly through the ops that move axes, else :func:`kept_axis`."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # properties: Tensor.T, .mT, .H, .mH
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    if name not in _MOVES and out.shape == src.shape:  # elementwise and the like: most ops
        return ax
    n = src.dim()
    res: int | None | bool = False  # False: not an axis-moving op, use the generic rule
    if name == "einsum":
        res = _einsum_axis(args, src, ax)
    elif name in ("as_strided", "rot90", "permute_copy", "transpose_copy"):
        res = None  # rare; not followed
    elif name == "stack" and args and isinstance(args[0], (list, tuple)) and any(
        t is src for t in args[0]
    ):
        d = _norm_dim(kwargs.get("dim", args[1] if len(args) > 1 else 0), n + 1)
        res = None if d is None else ax + (1 if d <= ax else 0)
    elif src is not (args[0] if args else None):
        res = False
    elif name in ("transpose", "transpose_", "swapaxes", "swapdims", "swapaxes_", "swapdims_"):
        d = [kwargs.get(k) for k in ("dim0", "dim1")] if "dim0" in kwargs else list(args[1:3])
        d0, d1 = (_norm_dim(x, n) for x in d)
        res = d1 if ax == d0 else d0 if ax == d1 else ax
    elif name in ("t", "t_", "T", "H"):  # T, H reverse all dims (a 2-d transpose for t)
        res = n - 1 - ax if name in ("T", "H") or n == 2 else ax
    elif name in ("mT", "mH"):
        res = {n - 1: n - 2, n - 2: n - 1}.get(ax, ax)
    elif name == "permute":
        dims = kwargs.get("dims")
        if dims is None:
            dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        dims = [_norm_dim(d, n) for d in dims]
        res = dims.index(ax) if ax in dims else None
    elif name in ("movedim", "moveaxis"):
        s_, d_ = (args[1:3] if len(args) >= 3 else (kwargs.get("source"), kwargs.get("destination")))
        s_ = [_norm_dim(x, n) for x in (s_ if isinstance(s_, (list, tuple)) else (s_,))]
        d_ = [_norm_dim(x, n) for x in (d_ if isinstance(d_, (list, tuple)) else (d_,))]
        order: list = [None] * n
        for si, di in zip(s_, d_):
            order[di] = si
        rest = iter(i for i in range(n) if i not in s_)
        order = [o if o is not None else next(rest) for o in order]
        res = order.index(ax)
    elif name in ("unsqueeze", "unsqueeze_"):
        d = _norm_dim(args[1] if len(args) > 1 else kwargs.get("dim"), n + 1)
        res = ax + 1 if d is not None and d <= ax else ax
    elif name in ("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "ravel"):
        res = _reshaped_axis(ax, src, out)
    elif name == "__getitem__":
        res = _index_axis(ax, src, args[1] if len(args) > 1 else None)
    elif name in ("squeeze", "squeeze_"):
        dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
        dims = range(n) if dims is None else dims if isinstance(dims, (list, tuple)) else (dims,)
        gone = {_norm_dim(d, n) for d in dims} & {i for i in range(n) if src.shape[i] == 1}
        res = None if ax in gone else ax - sum(1 for d in gone if d < ax)
    elif name in _REDUCTIONS:
        dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if dims is None and name == "unbind":
            dims = 0
        if isinstance(dims, bool) or not isinstance(dims, (int, list, tuple)):
            res = False
        elif kwargs.get("keepdim", False) or (len(args) > 2 and args[2] is True):
            res = ax
        else:
            dims = [_norm_dim(d, n) for d in (dims if isinstance(dims, (list, tuple)) else (dims,))]
            res = None if ax in dims else ax - sum(1 for d in dims if d is not None and d < ax)
    elif name in ("embedding", "one_hot") and out.dim() > n:  # appends trailing dims
        res = ax
    elif name in ("expand", "expand_as", "broadcast_to", "repeat", "tile"):  # prepends dims
        res = ax + out.dim() - n
    if res is False:
        return kept_axis(ax, src, out, b)
    if res is not None and b is not None and (res >= out.dim() or out.shape[res] != b):
        return None
    return res
