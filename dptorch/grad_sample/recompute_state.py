"""The ``torch.func`` recompute of a layer must be the forward call that ran.

A layer without a grad sampler gets its per-sample gradients from ``torch.func``, which calls the
layer's forward a second time, in the backward pass (:mod:`dptorch.grad_sample.functorch`). That
is exact only if the second call computes what the first computed, which a *stateful* forward
breaks: ``torch.nn.utils.parametrizations.spectral_norm`` in training mode runs one more power
iteration on its ``_u`` / ``_v`` buffers, a schedule kept in a child module's buffer advances, a
Python counter is incremented. The recompute then differentiates another function than the
forward: the per-sample gradients are wrong (hooks, functorch, bk), and ghost clipping, which
takes its norms from them and its released gradient from the real graph, releases more than the
clipping bound.

A static rule ("a trainable layer without a grad sampler must have no buffers", Opacus's) cannot
tell a state the forward changes from a constant one, and would refuse exact cases
(``parametrizations.orthogonal`` keeps a constant ``base`` buffer). The check here is exact and
cheap instead: :func:`recompute_guard` records, before the recompute, the identity and version
counter of every buffer and tensor attribute, and the value of every number attribute, of the
layer and all its submodules (parametrizations included); any change made by the recompute means
the forward changes state, and the step is refused (``ValueError`` naming the layer and the
attribute) before anything is released. Attributes the recompute reassigned are put back (no
tensor of ``torch.func`` leaks into the model). A tensor attribute that carries a gradient (an
auxiliary loss or an attention map kept on the module by the forward) is a cache of the forward's
graph, not state: it is put back without a refusal (whether the loss uses it is checked by
:mod:`dptorch.grad_sample.escapes`). An in-place update inside the recompute, which ``torch.func``
refuses with a ``RuntimeError``, gives the same ``ValueError``.

The guard sees the layer's own attributes only. A state kept elsewhere (a counter in a dict or
in a plain Python object, a ``numpy`` scalar, a tensor a *parent* reassigns on the child after
the call, the last output cached on the layer and read by its next call) changes the recompute
just as well, and ghost clipping, whose norms come from the recompute and whose release comes
from the real graph, would then release more than the clipping bound. So the recompute is also
checked against the forward it must reproduce: when a hooked call of such a layer ends, a
per-sample *fingerprint* of its first output is kept (:func:`forward_fingerprint`: each sample's
output norm and its projections on four fixed pseudo-random directions, ``O(B)`` memory whatever
the output's size, no copy of the output kept alive); the ``torch.func`` recompute, which runs on
each sample's slice, returns the same fingerprint of its per-sample outputs, and any difference
beyond round-off (:func:`check_recompute`; tolerances by precision: 1e-7 in float64, 1e-4 in
float32, 1e-2 with TF32 or autocast, 5e-2 for 16-bit outputs) refuses the step before anything
is released, naming the layer. Any change of a sample's output norm beyond the tolerance is
found deterministically; a change that keeps every norm (a permutation, a rotation) is found
unless it is orthogonal to all four directions, which has probability zero. The recompute then
computes the forward's values; that it also computes the forward's *function* (its derivatives)
is what the stateless-forward contract asks, and the states that break it in practice (counters,
schedules, temperatures, caches) all show in the output. The fingerprint costs, per call of a
layer without a grad sampler, one pass over its output in the forward and ``B × 5`` numbers.

Book-keeping clipping (``grad_sample_mode="bk"``) recomputes a forward too: a layer whose rule
has per-sample norms but no clipped sum (``EmbeddingBag``, the normalisation layers, a user's
rule registered with a norm function only) gets its clipped sum from one vector-Jacobian product
with a *batched* recompute at the end of the backward pass, while its norms came from the
forward's activations. Both guards apply to it: :func:`recompute_guard` (``batched=True``) around
it, and :func:`check_batch_recompute`, which compares every sample's row of the recomputed
output with the fingerprint of the forward's (taken, in bk, only for the calls that may take
this path).

The same guard lets sparse embeddings (``nn.Embedding(sparse=True)``) be recomputed: their
``sparse`` flag is off during the recompute, which gives the same (dense) per-sample gradient.
"""

from __future__ import annotations

import contextlib
import numbers
import re
import threading

import torch
from torch import nn

__all__ = [
    "ForwardFingerprint", "check_batch_recompute", "check_recompute", "current_fingerprint",
    "forward_fingerprint", "recompute_fingerprint", "recompute_guard", "run_with_fingerprint",
]

#: attributes every ``nn.Module`` has (``training``, its parameter, buffer and hook dictionaries)
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_MISSING = object()


def _snapshot(layer: nn.Module) -> list[tuple]:
    """``(module, path, kind, key, value, version)`` for every buffer, tensor attribute and
    number attribute of ``layer`` and its submodules."""
    entries = []
    for path, m in layer.named_modules():
        for k, b in m._buffers.items():
            entries.append((m, path, "buffer", k, b, None if b is None else b._version))
        for k, v in m.__dict__.items():
            if k in _MODULE_INTERNALS:
                continue
            if isinstance(v, torch.Tensor):
                entries.append((m, path, "attribute", k, v, v._version))
            elif isinstance(v, numbers.Number):  # bool and numpy scalars included
                entries.append((m, path, "attribute", k, v, None))
    return entries


def _restore(entries: list[tuple]) -> list[str]:
    """Puts back what the recompute reassigned; returns the state it changed (``path.key``)."""
    changed = []
    for m, path, kind, k, old, version in entries:
        store = m._buffers if kind == "buffer" else m.__dict__
        cur = store.get(k, _MISSING)
        name = f"{path}.{k}" if path else k
        if isinstance(old, torch.Tensor):
            if cur is not old:
                store[k] = old
                if kind == "buffer" or not old.requires_grad:
                    changed.append(f"{name} ({kind} reassigned)")
            elif old._version != version:
                changed.append(f"{name} ({kind} updated in place)")
        elif cur is not old and (cur is _MISSING or cur != old):
            store[k] = old
            changed.append(f"{name} ({kind} changed)")
    return changed


def _message(label: str, changed: list[str], error: Exception | None = None,
             batched: bool = False) -> str:
    text = f"{error} {error.__cause__}" if error is not None else ""
    op = re.search(r"in-place operation \(([^)]*)\)", text)
    what = f" ({', '.join(changed[:4])})" if changed else (
        f" (an in-place update{f' ({op.group(1)})' if op else ''} of a buffer or attribute)"
    )
    if batched:
        why = (
            "Its layer rule has per-sample norms but no clipped sum, so grad_sample_mode='bk' "
            "forms its clipped sum by calling its forward again at the end of the backward "
            "pass, and that second call sees (and makes) another state than the forward did: "
            "the clipped sum would not be that of the gradients whose norms were clipped, and "
            "could exceed max_grad_norm per sample. Fix: keep such state out of trainable "
            "layers' forward (update it between steps), freeze the layer, give its rule a "
            "clipped_sum (dptorch.grad_sample.register_layer_rule), which works from the "
            "forward's own activations, or use grad_sample_mode='hooks'."
        )
    else:
        why = (
            "This layer has no grad sampler, so dptorch gets its per-sample gradients by calling "
            "its forward again with torch.func in the backward pass, and that second call sees "
            "(and makes) another state than the forward did: its per-sample gradients would not "
            "be those of the released gradient. Fix: keep such state out of trainable layers' "
            "forward (update it between steps), freeze the layer, or register a grad sampler for "
            "it (dptorch.grad_sample.register_grad_sampler), which works from the forward's own "
            "activations."
        )
    return (
        f"{label}: its forward changes the layer's state{what}. {why} "
        "(torch.nn.utils.parametrizations.spectral_norm in training mode runs one more power "
        "iteration: put the parametrization in eval mode during the step "
        "(layer.parametrizations.weight[0].eval() after model.train()), which keeps u and v "
        "fixed, and run the power iterations between steps.)"
    )


@contextlib.contextmanager
def recompute_guard(layer: nn.Module, label: str, *, batched: bool = False):
    """Runs a recompute of ``layer``'s forward (named ``label`` in messages): ``torch.func``'s
    per-sample one, or with ``batched`` bk's batched one of a clipped sum
    (:func:`~dptorch.grad_sample.norm_samplers.generic_clipped_sum`). Sparse embeddings are
    recomputed dense, and ``ValueError`` is raised if the recompute changed the layer's state
    (see the module docstring)."""
    sparse = [
        m for m in layer.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    ]
    for m in sparse:
        m.sparse = False
    error, entries, changed = None, None, []
    try:
        entries = _snapshot(layer)
        try:
            yield
        except (RuntimeError, ValueError) as e:  # torch.func's error, or a message wrapping it
            if not any("mutate a captured Tensor" in str(x) for x in (e, e.__cause__)):
                raise
            error = e
    finally:  # also when the recompute failed: nothing of torch.func stays in the model
        if entries is not None:
            changed = _restore(entries)
        for m in sparse:
            m.sparse = True
    if changed or error is not None:
        raise ValueError(_message(label, changed, error, batched)) from error


# ---------------------------------------------------------------------- the recompute's output
#: number of pseudo-random directions of a fingerprint
_K = 4
_projections: dict[tuple, torch.Tensor] = {}
_local = threading.local()


class ForwardFingerprint:
    """What a hooked call's first output was, per sample (see the module docstring):
    ``values`` ``(B, K + 1)``: its projections on ``K`` fixed directions and its norm;
    ``numel``: the elements per sample; ``tol``: the relative tolerance of its precision."""

    __slots__ = ("module_id", "numel", "projection", "tol", "values")

    def __init__(self, module_id: int, values: torch.Tensor, projection: torch.Tensor,
                 tol: float):
        self.module_id = module_id
        self.values = values
        #: the ``(numel, K)`` directions (shared with the cache: drawn outside ``vmap``)
        self.projection = projection
        self.numel = projection.shape[0]
        self.tol = tol


def _fdtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _projection(n: int, device: torch.device) -> torch.Tensor:
    """``(n, K)`` fixed pseudo-random directions (standard normal entries), from a generator of
    their own: the global random state (dropout, sampling) is not touched."""
    dtype = _fdtype(device)
    key = (n, device, dtype)
    r = _projections.get(key)
    if r is None:
        gen = torch.Generator().manual_seed(0x5EED + n)
        r = torch.randn(n, _K, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
        if len(_projections) >= 16:
            _projections.pop(next(iter(_projections)))
        _projections[key] = r
    return r


def _sample_fingerprint(o: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``(..., K + 1)``: the projections of the rows of ``o`` (``(..., n)``) on ``r`` and their
    norms."""
    o = o.to(r.dtype)
    return torch.cat([o @ r, torch.linalg.vector_norm(o, dim=-1, keepdim=True)], dim=-1)


def _tolerance(dtype: torch.dtype, device: torch.device, lossy: bool) -> float:
    """The relative round-off allowed between a forward output and its recompute."""
    if dtype in (torch.float16, torch.bfloat16):
        return 5e-2
    if lossy:  # autocast in the forward: its float32 output has 16-bit round-off
        return 1e-2
    if dtype == torch.float64:
        return 1e-7
    if torch.get_float32_matmul_precision() != "highest" or (device.type == "cuda" and (
        torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    )):
        return 1e-2  # TF32 (the default for cuDNN convolutions)
    return 1e-4


def forward_fingerprint(module: nn.Module, out: torch.Tensor, bdim: int) -> ForwardFingerprint:
    """The fingerprint of ``out`` (the first output of a hooked call of ``module``, batch in
    dimension ``bdim``), taken when the call ends."""
    with torch.no_grad(), torch.autocast(out.device.type, enabled=False):
        o = out.detach().movedim(bdim, 0) if out.dim() > bdim else out.detach().reshape(1, -1)
        o = o.flatten(1) if o.dim() > 1 else o.unsqueeze(1)
        projection = _projection(o.shape[1], o.device)
        values = _sample_fingerprint(o, projection)
    lossy = _autocast_on(out.device.type)
    return ForwardFingerprint(
        id(module), values, projection, _tolerance(out.dtype, out.device, lossy)
    )


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type) or torch.is_autocast_enabled("cpu")
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return torch.is_autocast_enabled()


def run_with_fingerprint(fingerprint: ForwardFingerprint, on_grad, grad):
    """Calls ``on_grad(grad)`` (the capture hook of a call) with ``fingerprint`` as the current
    call's (:func:`current_fingerprint`): the per-sample recompute made inside checks its
    output against it."""
    prev = getattr(_local, "fingerprint", None)
    _local.fingerprint = fingerprint
    try:
        return on_grad(grad)
    finally:
        _local.fingerprint = prev


def current_fingerprint(layer: nn.Module) -> ForwardFingerprint | None:
    """The fingerprint of the call of ``layer`` whose gradient is being processed, if any."""
    fp = getattr(_local, "fingerprint", None)
    return fp if fp is not None and fp.module_id == id(layer) else None


def recompute_fingerprint(fingerprint: ForwardFingerprint, out: torch.Tensor, bdim: int,
                          label: str) -> torch.Tensor:
    """Inside the per-sample recompute (one sample's output ``out``, batch dimension ``bdim``
    of size 1): its fingerprint, ``(K + 1,)``."""
    o = out.detach()
    o = o.movedim(bdim, 0) if o.dim() > bdim else o
    o = o.reshape(-1)
    if o.shape[0] != fingerprint.numel:
        raise ValueError(
            f"{label}: called again by torch.func for its per-sample gradients, the layer "
            f"returned {o.shape[0]} elements per sample where its forward returned "
            f"{fingerprint.numel}. " + _FIX
        )
    return _sample_fingerprint(o, fingerprint.projection)


def check_recompute(
    label: str, fingerprint: ForwardFingerprint, got: torch.Tensor, per_sample: tuple
) -> tuple:
    """``ValueError`` unless the recompute's per-sample fingerprints ``got`` (``(B, K + 1)``)
    equal the forward's up to round-off; returns ``per_sample`` (the recompute's per-sample
    gradients). This reads one boolean on the host (a synchronisation, on the torch.func path
    only). While a CUDA graph is captured, where it cannot, the gradients of the samples that
    differ are made NaN instead (never released as if they were clipped: a non-finite norm
    drops the sample, a NaN gradient poisons the step visibly)."""
    bad = _mismatch(fingerprint, got)
    if bad is None:
        raise ValueError(
            f"{label}: the per-sample recompute returned {got.shape[0]} samples where the "
            f"forward had {fingerprint.values.shape[0]}. " + _FIX
        )
    if _capturing(got.device):
        rows = bad.any(dim=1)
        return tuple(
            torch.where(rows.view(-1, *([1] * (g.dim() - 1))), torch.nan, g) for g in per_sample
        )
    if not bool(bad.any()):
        return per_sample
    raise ValueError(_changed_output_message(label, fingerprint, got, bad, _PER_SAMPLE))


#: what the recompute is, what a difference would do, and the fix, in the messages of
#: :func:`check_recompute`
_PER_SAMPLE = (
    "the per-sample recompute: called again by torch.func on the same inputs and parameters "
    "(to get its per-sample gradients)",
    "Its per-sample gradients would not be those of the released gradient "
    "(grad_sample_mode='ghost' would release more than max_grad_norm).",
    None,
)
#: ... and of :func:`check_batch_recompute`
_BATCHED = (
    "the recompute of its clipped sum: called again at the end of the backward pass on the "
    "same inputs and parameters (its layer rule has per-sample norms but no clipped sum, so "
    "grad_sample_mode='bk' forms its clipped sum from that call, its norms from the forward's "
    "activations)",
    "The clipped sum would not be that of the gradients whose norms were clipped, and could "
    "exceed max_grad_norm per sample.",
    "Fix: make the layer's forward a function of its inputs and parameters (update counters, "
    "schedules and caches between steps, pass per-call values as arguments), freeze the layer, "
    "give its rule a clipped_sum (dptorch.grad_sample.register_layer_rule), which works from "
    "the forward's own activations instead of calling the layer again, or use "
    "grad_sample_mode='hooks'.",
)


def _changed_output_message(label: str, fingerprint: ForwardFingerprint, got: torch.Tensor,
                            bad: torch.Tensor, what: tuple) -> str:
    """The refusal of a recompute whose per-sample fingerprints ``got`` (``(B, K + 1)``) differ
    from the forward's where ``bad`` (``(B, K + 1)`` booleans) says (one host read)."""
    want = fingerprint.values
    got = got.to(want.dtype).reshape(got.shape[0], -1)
    norm = torch.maximum(want[:, -1], got[:, -1]).unsqueeze(1)
    diff = (got - want).abs()
    b = int(bad.any(dim=1).nonzero()[0])
    rel = float((diff[b] / norm[b].clamp_min(torch.finfo(norm.dtype).tiny)).max())
    return (
        f"{label}: its forward depends on state that changed between the forward pass and "
        f"{what[0]}, it returned another output (sample {b}: relative difference {rel:.3g}, "
        "beyond round-off). The state may be a counter or schedule the forward advances (in a "
        "dict, a numpy scalar, a Python object), a tensor set on the layer after the call (by "
        "its parent), the previous call's output cached on the layer and read by the next "
        f"call, or an input modified in place after the call. {what[1]} " + (what[2] or _FIX)
    )


def check_batch_recompute(
    label: str, fingerprint: ForwardFingerprint, out: torch.Tensor, bdim: int, sums: dict
) -> dict:
    """Checks a *batched* recompute of a hooked call against the forward it must reproduce:
    ``out`` is the recomputed first output (``B`` samples in dimension ``bdim``), whose
    per-sample rows must have the fingerprint the forward's had (``fingerprint.values``,
    ``(B, K + 1)``) up to round-off; ``ValueError`` (naming the layer ``label``) otherwise, or
    if ``out`` has another number of samples or of elements per sample. Returns ``sums`` (the
    recompute's results, e.g. ``{param: clipped sum}``) unchanged; while a CUDA graph is
    captured, where the check cannot read the host, every tensor of ``sums`` is made NaN if any
    sample differs (never released as if it were clipped)."""
    o = out.detach()
    o = o.movedim(bdim, 0) if o.dim() > bdim else o.reshape(1, -1)
    rows = o.shape[0]
    o = o.reshape(rows, -1)
    if o.shape[1] != fingerprint.numel or rows != fingerprint.values.shape[0]:
        raise ValueError(
            f"{label}: called again at the end of the backward pass to form its clipped sum, "
            f"the layer returned {rows} samples of {o.shape[1]} elements where its forward "
            f"returned {fingerprint.values.shape[0]} of {fingerprint.numel}. " + _BATCHED[2]
        )
    with torch.no_grad(), torch.autocast(o.device.type, enabled=False):
        got = _sample_fingerprint(o, fingerprint.projection)
    bad = _mismatch(fingerprint, got)
    if _capturing(got.device):
        poisoned = bad.any()
        return {k: torch.where(poisoned, torch.nan, v) for k, v in sums.items()}
    if bool(bad.any()):
        raise ValueError(_changed_output_message(label, fingerprint, got, bad, _BATCHED))
    return sums


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _mismatch(fingerprint: ForwardFingerprint, got: torch.Tensor) -> torch.Tensor | None:
    """``(B, K + 1)`` booleans: where ``got`` differs from the forward's fingerprint beyond
    round-off (no host synchronisation); ``None`` if the shapes differ."""
    want = fingerprint.values
    got = got.to(want.dtype).reshape(got.shape[0], -1)
    if got.shape != want.shape:
        return None
    norm = torch.maximum(want[:, -1], got[:, -1]).unsqueeze(1)
    bound = fingerprint.tol * norm
    bound = torch.cat([bound.expand(-1, _K) * 8.0, bound], dim=1)  # projections: 8 sigma
    return ((got - want).abs() > bound) | (~torch.isfinite(got) & torch.isfinite(want))


_FIX = (
    "Fix: make the layer's forward a function of its inputs and parameters (update counters, "
    "schedules and caches between steps, pass per-call values as arguments), freeze the layer, "
    "or register a grad sampler for it (dptorch.grad_sample.register_grad_sampler), which "
    "works from the forward's own activations instead of calling the layer again."
)
