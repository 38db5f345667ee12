"""Matrix products of dptorch's own work on the CPU's fastest single-precision GEMM.

torch's CPU ``mm`` runs on the BLAS torch was built with (MKL in the x86 wheels), while its fused
kernels (``nn.LSTM``, compiled code) run on oneDNN's GEMM. On some CPUs the two are far apart:
on the AMD EPYC of the README's benchmarks, MKL's float32 GEMM reaches 0.4 of oneDNN's
(``(2048, 128) @ (128, 512)``: 2.6 ms against 1.1 ms, one thread), so a DP-LSTM whose recurrence
dptorch runs step by step paid 2.5× for the matrix products that ``nn.LSTM`` gets from oneDNN.

:func:`mm`, :func:`mm_tn`, :func:`bmm_nt` and :func:`linear` compute the same products (float32 accumulation, IEEE float32
inputs, no reduced precision) through oneDNN where that is possible: CPU float32 tensors,
outside autograd recording, ``torch.func`` transforms, ``torch.compile`` tracing and autocast,
with float32 matmul precision ``"highest"`` (a lower precision setting is left to torch), and
``torch.backends.mkldnn.enabled``. Everywhere else, and where the oneDNN operator is missing or
failed its check at first use, they are torch's ``mm`` / ``bmm`` / ``F.linear``. Products under
about a million multiply-adds stay with torch (oneDNN's call costs about 10 µs), and operands
are passed to oneDNN only in layouts its optimised kernels read (a right operand with a leading
dimension wider than its rows sends it to a reference kernel a thousand times slower; such an
operand is copied first).

They are used for the computations that only a DP step does: the clipped sums of bk (Linear,
GPT-2's Conv1D), the Gram matrices of ghost norms, per-sample convolution weight gradients, and
the DP-LSTM's decomposed recurrence and projections in bk, which stand in for the oneDNN kernel
that ``nn.LSTM`` (and DPLSTM outside DP training) runs. Every other layer's forward and input
gradient keeps torch's products, as in the non-private step it is compared with.

``DPTORCH_CPU_GEMM=torch`` in the environment turns the oneDNN path off (the benchmarks report
both).
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "MIN_MACS", "bmm_nt", "linear", "mm", "mm_tn", "onednn_applies", "onednn_gemm_enabled",
]

_state: dict[str, bool] = {}


def _op_works() -> bool:
    """The oneDNN linear operator exists and reproduces ``torch.mm`` (checked once)."""
    if "ok" not in _state:
        ok = False
        try:
            if torch.backends.mkldnn.is_available() and hasattr(torch.ops, "mkldnn"):
                lp = torch.ops.mkldnn._linear_pointwise
                gen = torch.Generator().manual_seed(0)
                a = torch.randn(7, 33, generator=gen)
                w = torch.randn(5, 33, generator=gen)
                o = torch.randn(7, 5, generator=gen)
                want = a @ w.t()
                ok = bool(
                    torch.allclose(lp(a, w, None, "none", [], ""), want, rtol=1e-5, atol=1e-5)
                    and torch.allclose(lp.binary(a, o, w, None, "add"), want + o,
                                       rtol=1e-5, atol=1e-5)
                )
        except Exception:  # noqa: BLE001 - any failure: torch's own product
            ok = False
        _state["ok"] = ok
    return _state["ok"]


def onednn_gemm_enabled() -> bool:
    """Whether :func:`mm` may use oneDNN in this process (environment and operator)."""
    if os.environ.get("DPTORCH_CPU_GEMM", "").lower() == "torch":
        return False
    return _op_works()


def _precision_is_ieee() -> bool:
    if torch.get_float32_matmul_precision() != "highest":
        return False
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    precision = getattr(matmul, "fp32_precision", "none")
    return precision in ("none", "ieee")


#: tensor types taken as they are (a subclass may redefine its operations)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def onednn_applies(*tensors: torch.Tensor) -> bool:
    """Whether products of ``tensors`` go to oneDNN here (CPU float32, no autograd recording,
    no transform, tracing or autocast, IEEE precision, enabled); a loop of many small products
    decides once."""
    return _eligible(*tensors)


def _eligible(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        if type(t) not in _PLAIN or t.dtype != torch.float32 or t.device.type != "cpu":
            return False
        if t.numel() == 0:
            return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if torch._C._functorch.maybe_current_level() is not None or torch.is_autocast_enabled("cpu"):
        return False
    if torch.autograd.forward_ad._current_level >= 0:  # oneDNN's op would drop the tangents
        return False
    if torch.compiler.is_compiling():
        return False
    return torch.backends.mkldnn.enabled and _precision_is_ieee() and onednn_gemm_enabled()


#: below this many multiply-adds oneDNN's call overhead (about 10 µs) outweighs its speed
MIN_MACS = 1 << 20


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-d) contiguous or the transpose of a contiguous matrix (copied otherwise): other
    layouts send oneDNN's linear to a reference kernel, up to a thousand times slower."""
    if t.is_contiguous() or t.t().is_contiguous():
        return t
    return t.contiguous()


def _lhs(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-d) with unit stride in one dimension (rows with a leading dimension, as a slice
    of a larger matrix, are read in place)."""
    return t if t.stride(-1) == 1 or t.stride(0) == 1 else t.contiguous()


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a`` ``(m, k)`` and ``b`` ``(k, n)``: ``(m, n)``."""
    if (
        a.dim() == 2 and b.dim() == 2 and a.shape[0] * a.shape[1] * b.shape[1] >= MIN_MACS
        and _eligible(a, b)
    ):
        # oneDNN's linear is ``x wᵀ``: w = bᵀ
        return torch.ops.mkldnn._linear_pointwise(_lhs(a), _dense(b.t()), None, "none", [], "")
    return a.mm(b)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x wᵀ + b`` for ``x`` ``(m, k)``, ``w`` ``(n, k)``, ``b`` ``(n,)`` or ``None``:
    ``(m, n)`` (``F.linear``)."""
    if (
        x.dim() == 2 and w.dim() == 2 and x.shape[0] * x.shape[1] * w.shape[0] >= MIN_MACS
        and _eligible(x, w, *(() if b is None else (b,)))
    ):
        return torch.ops.mkldnn._linear_pointwise(
            _lhs(x), _dense(w), None if b is None else b.contiguous(), "none", [], ""
        )
    return torch.nn.functional.linear(x, w, b)


def mm_tn(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``gᵀ a`` for ``g`` ``(N, o)`` and ``a`` ``(N, i)`` (a weight gradient ``Σ_n g_n a_nᵀ``):
    ``(o, i)``, contiguous."""
    if (
        g.dim() == 2 and a.dim() == 2 and g.shape[0] * g.shape[1] * a.shape[1] >= MIN_MACS
        and _eligible(g, a)
    ):
        lp = torch.ops.mkldnn._linear_pointwise
        # oneDNN copies a transposed left operand to rows: transpose the one with fewer features
        if g.shape[1] <= a.shape[1]:
            return lp(_lhs(g.t()), _dense(a.t()), None, "none", [], "")
        return lp(_lhs(a.t()), _dense(g.t()), None, "none", [], "").t().contiguous()
    return g.t().mm(a)


def bmm_nt(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x_b y_bᵀ`` per sample for ``x`` ``(B, T1, d)`` and ``y`` ``(B, T2, d)``:
    ``(B, T1, T2)`` (Gram matrices)."""
    if (
        x.dim() == 3 and y.dim() == 3 and x.shape[1] * y.shape[1] * x.shape[2] >= 4 * MIN_MACS
        and x.shape[2] >= 64 and _eligible(x, y)
    ):
        # one call per sample: only where each product outweighs the loop (measured: many
        # small Grams, or feature sizes under 64, are faster in torch's batched product)
        lp = torch.ops.mkldnn._linear_pointwise
        return torch.stack([lp(_lhs(xb), _dense(yb), None, "none", [], "")
                            for xb, yb in zip(x, y)])
    return torch.bmm(x, y.transpose(1, 2))
