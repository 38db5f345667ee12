"""``batch_axis.out_axis`` follows the batch dimension through ops that move dimensions: with a
batch size that no other dimension can take (7 among sizes 1, 2, 3, 5), the batch axis of every
result is the one dimension of size 7, or ``None`` when the op merged or removed it."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dptorch.grad_sample.batch_axis import out_axis

B = 7


def _truth(t: torch.Tensor) -> int | None:
    dims = [i for i, s in enumerate(t.shape) if s == B]
    return dims[0] if len(dims) == 1 else None


@st.composite
def _op(draw, n: int):
    """(function, args after the tensor, kwargs) for a tensor of rank ``n``."""
    kind = draw(st.sampled_from([
        "transpose", "permute", "movedim", "unsqueeze", "squeeze", "flatten", "getitem", "sum",
        "mT", "t", "tanh", "add_bias", "select", "amax_keep",
    ]))
    d = st.integers(-n, n - 1)
    if kind == "transpose":
        return torch.Tensor.transpose, (draw(d), draw(d)), {}
    if kind == "permute":
        return torch.Tensor.permute, tuple(draw(st.permutations(range(n)))), {}
    if kind == "movedim":
        return torch.movedim, (draw(d), draw(d)), {}
    if kind == "unsqueeze":
        return torch.Tensor.unsqueeze, (draw(st.integers(-n - 1, n)),), {}
    if kind == "squeeze":
        return torch.Tensor.squeeze, (draw(d),), {}
    if kind == "flatten":
        a = draw(st.integers(0, n - 1))
        return torch.flatten, (a, draw(st.integers(a, n - 1))), {}
    if kind == "getitem":
        idx = tuple(draw(st.sampled_from([slice(None), 0, None, slice(0, 1), Ellipsis]))
                    for _ in range(draw(st.integers(1, n))))
        if sum(i is Ellipsis for i in idx) > 1:
            idx = tuple(i for i in idx if i is not Ellipsis)
        return torch.Tensor.__getitem__, (idx,), {}
    if kind == "sum":
        return torch.sum, (draw(d),), {}
    if kind == "select":
        return torch.select, (draw(d), 0), {}
    if kind == "amax_keep":
        return torch.amax, (draw(d),), {"keepdim": True}
    if kind == "mT":
        return (lambda t: t.mT), (), {}
    if kind == "t":
        return torch.Tensor.t, (), {}
    if kind == "add_bias":
        return torch.add, (torch.ones(1),), {}
    return torch.tanh, (), {}


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_out_axis_follows_the_batch_dimension(data):
    n = data.draw(st.integers(1, 4))
    shape = data.draw(st.lists(st.sampled_from([1, 2, 3, 5]), min_size=n - 1, max_size=n - 1))
    ax = data.draw(st.integers(0, n - 1))
    shape.insert(ax, B)
    x = torch.zeros(shape)
    for _ in range(data.draw(st.integers(1, 4))):
        if x.dim() == 0 or ax is None:
            break
        func, args, kwargs = data.draw(_op(x.dim()))
        try:
            out = func(x, *args, **kwargs)
        except (RuntimeError, IndexError, ValueError):
            continue  # not a valid op for this shape
        if func is torch.Tensor.t and x.dim() > 2 or not isinstance(out, torch.Tensor):
            continue
        name_func = func if getattr(func, "__name__", "") != "<lambda>" else torch.Tensor.mT.__get__
        got = out_axis(name_func, (x, *args), kwargs, x, ax, out, B)
        want = _truth(out)
        assert got == want, (func, args, kwargs, tuple(x.shape), ax, tuple(out.shape))
        x, ax = out, got


def test_sequence_first_is_known_when_its_length_equals_the_batch():
    """The case that counting rows cannot see: ``(B, T) → (T, B)`` with ``T = B``."""
    x = torch.zeros(4, 4, 8)
    y = x.transpose(0, 1)
    assert out_axis(torch.Tensor.transpose, (x, 0, 1), {}, x, 0, y, 4) == 1
    v = y.view(4, 4, 2, 4)  # heads split: the batch stays in dim 1, then moves to 2
    assert out_axis(torch.Tensor.view, (y, 4, 4, 2, 4), {}, y, 1, v, 4) == 1
    assert out_axis(torch.Tensor.permute, (v, 0, 2, 1, 3), {}, v, 1, v.permute(0, 2, 1, 3), 4) == 2
    assert out_axis(torch.Tensor.__getitem__, (y, (slice(None), slice(None), 0)), {}, y, 1, y[:, :, 0], 4) == 1


def test_einsum_is_followed_by_its_subscripts():
    x = torch.zeros(4, 4, 8)
    y = torch.einsum("btd->tbd", x)
    assert out_axis(torch.einsum, ("btd->tbd", x), {}, x, 0, y, 4) == 1
    w = torch.zeros(8, 3)
    z = torch.einsum("btd,de->bte", x, w)
    assert out_axis(torch.einsum, ("btd,de->bte", x, w), {}, x, 0, z, 4) == 0
    s = torch.einsum("btd->td", x)
    assert out_axis(torch.einsum, ("btd->td", x), {}, x, 0, s, 4) is None


def test_einsum_with_an_ellipsis():
    """LongT5's ``einsum("...nd,...ng->...gd")``: the batch stays in front."""
    h, blocks = torch.zeros(3, 5, 16), torch.zeros(3, 5, 3)
    out = torch.einsum("...nd,...ng->...gd", h, blocks)
    assert out_axis(torch.einsum, ("...nd,...ng->...gd", h, blocks), {}, h, 0, out, 3) == 0
    x = torch.zeros(4, 4, 8)
    y = torch.einsum("b...d->...bd", x)
    assert out_axis(torch.einsum, ("b...d->...bd", x), {}, x, 0, y, 4) == 1
