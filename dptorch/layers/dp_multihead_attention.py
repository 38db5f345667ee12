"""Multi-head attention with exact per-sample gradients: ``DPMultiheadAttention``.

A drop-in replacement for ``nn.MultiheadAttention`` (same arguments, forward and state dict)
built from separate ``nn.Linear`` projections (``qlinear``, ``klinear``, ``vlinear``,
``out_proj``) and :class:`SequenceBias` for ``add_bias_kv``, all of which have grad samplers.
Every projection is called batch first, ``(B, L, E)``, whatever ``batch_first`` is (for the
layer or for the ``GradSampleModule``), so per-sample gradients are right in every combination.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SequenceBias(nn.Module):
    """Appends a learned vector ``bias`` ``(E,)`` as one extra step at the end of a sequence.

    Input ``(L, B, E)`` (``(B, L, E)`` if ``batch_first``), output ``(L + 1, B, E)``
    (``(B, L + 1, E)``): ``nn.MultiheadAttention``'s ``bias_k`` / ``bias_v``.
    """

    def __init__(self, embed_dim: int, batch_first: bool = False):
        super().__init__()
        self.embed_dim = embed_dim
        self.batch_first = batch_first
        self.bias = nn.Parameter(torch.empty(embed_dim))
        self._reset_parameters()

    @property
    def grad_sample_batch_first(self) -> bool:
        """Its layout is fixed by ``batch_first``, not by the ``GradSampleModule``'s."""
        return self.batch_first

    def _reset_parameters(self) -> None:
        nn.init.normal_(self.bias, std=1.0 / math.sqrt(self.embed_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_first:
            return torch.cat([x, self.bias.to(x.dtype).expand(x.shape[0], 1, -1)], 1)
        return torch.cat([x, self.bias.to(x.dtype).expand(1, x.shape[1], -1)], 0)

    def extra_repr(self) -> str:
        return f"{self.embed_dim}, batch_first={self.batch_first}"


def _batch_first_linear(in_features: int, out_features: int, bias: bool, **factory) -> nn.Linear:
    lin = nn.Linear(in_features, out_features, bias=bias, **factory)
    lin.grad_sample_batch_first = True  # always called on (B, L, E)
    return lin


class DPMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with per-sample gradients; same constructor and forward.

    Shapes (``batch_first=False``; swap the first two dims for ``True``): ``query`` ``(L, B, E)``,
    ``key`` ``(S, B, kdim)``, ``value`` ``(S, B, vdim)`` (or unbatched ``(L, E)``...);
    ``key_padding_mask`` ``(B, S)`` (bool: ``True`` = ignore; float: added);
    ``attn_mask`` ``(L, S)`` or ``(B * num_heads, L, S)`` (same conventions). Returns
    ``(attn_output (L, B, E), attn_weights)`` with weights ``(B, L, S)`` averaged over heads or
    ``(B, num_heads, L, S)`` (after dropout, as torch), ``None`` if ``need_weights=False``.
    ``state_dict()`` / ``load_state_dict()`` use ``nn.MultiheadAttention``'s keys
    (``in_proj_weight`` or ``q/k/v_proj_weight``, ``in_proj_bias``, ``bias_k``, ``bias_v``,
    ``out_proj.*``).
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.batch_first = batch_first
        self.add_bias_kv = add_bias_kv
        self.add_zero_attn = add_zero_attn
        self.bias = bias
        self.qlinear = _batch_first_linear(embed_dim, embed_dim, bias, **factory)
        self.klinear = _batch_first_linear(self.kdim, embed_dim, bias, **factory)
        self.vlinear = _batch_first_linear(self.vdim, embed_dim, bias, **factory)
        self.out_proj = _batch_first_linear(embed_dim, embed_dim, bias, **factory)
        if add_bias_kv:
            self.seq_bias_k = SequenceBias(embed_dim, batch_first=True).to(**factory)
            self.seq_bias_v = SequenceBias(embed_dim, batch_first=True).to(**factory)
        else:
            self.seq_bias_k = self.seq_bias_v = None
        self.dropout = nn.Dropout(dropout)
        self._reset_parameters()
        self.register_state_dict_post_hook(_to_torch_state_dict)
        self.register_load_state_dict_pre_hook(_from_torch_state_dict)

    def _reset_parameters(self) -> None:
        for lin in (self.qlinear, self.klinear, self.vlinear):
            nn.init.xavier_uniform_(lin.weight)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "DPMultiheadAttention: is_causal=True is only a hint that attn_mask is the "
                "causal mask; pass attn_mask too, e.g. "
                "nn.Transformer.generate_square_subsequent_mask(L)."
            )
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, tgt_len, _ = query.shape
        h, d = self.num_heads, self.head_dim
        if key.shape[0] != b or value.shape[0] != b or key.shape[1] != value.shape[1]:
            raise RuntimeError(  # as nn.MultiheadAttention: a view would mix the batch up
                f"DPMultiheadAttention: key {tuple(key.shape)} and value {tuple(value.shape)} "
                f"must have the query's batch size ({b}) and one source length (shapes shown "
                "batch first). Expand a shared memory to the batch: memory.expand(B, -1, -1)."
            )

        q = self.qlinear(query)
        k = self.klinear(key)
        v = self.vlinear(value)
        if self.seq_bias_k is not None:
            k = self.seq_bias_k(k)
            v = self.seq_bias_v(v)
            attn_mask = _pad_last(attn_mask)
            key_padding_mask = _pad_last(key_padding_mask)
        q = q.view(b, tgt_len, h, d).transpose(1, 2) * (1.0 / math.sqrt(d))  # (B, h, L, d)
        k = k.view(b, -1, h, d).transpose(1, 2)  # (B, h, S, d)
        v = v.view(b, -1, h, d).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(b, h, 1, d)], 2)
            v = torch.cat([v, v.new_zeros(b, h, 1, d)], 2)
            attn_mask = _pad_last(attn_mask)
            key_padding_mask = _pad_last(key_padding_mask)
        src_len = k.shape[2]

        scores = q @ k.transpose(-2, -1)  # (B, h, L, S)
        if attn_mask is not None:
            mask = _additive(attn_mask, scores.dtype)
            if mask.dim() == 3:
                if mask.shape != (b * h, tgt_len, src_len):
                    raise RuntimeError(
                        f"DPMultiheadAttention: 3D attn_mask must be {(b * h, tgt_len, src_len)}, "
                        f"got {tuple(mask.shape)}"
                    )
                mask = mask.view(b, h, tgt_len, src_len)
            elif mask.shape != (tgt_len, src_len):
                raise RuntimeError(
                    f"DPMultiheadAttention: 2D attn_mask must be {(tgt_len, src_len)}, got "
                    f"{tuple(mask.shape)}"
                )
            scores = scores + mask
        if key_padding_mask is not None:
            if key_padding_mask.shape != (b, src_len):
                raise RuntimeError(
                    f"DPMultiheadAttention: key_padding_mask must be {(b, src_len)}, got "
                    f"{tuple(key_padding_mask.shape)}"
                )
            scores = scores + _additive(key_padding_mask, scores.dtype)[:, None, None, :]
        attn = self.dropout(torch.softmax(scores, dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(b, tgt_len, self.embed_dim)
        out = self.out_proj(out)

        if unbatched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        weights = attn.mean(1) if average_attn_weights else attn
        return out, (weights.squeeze(0) if unbatched else weights)

    # torch's attribute names, read-only views (e.g. for code that inspects nn.MultiheadAttention)
    @property
    def bias_k(self) -> torch.Tensor | None:
        return None if self.seq_bias_k is None else self.seq_bias_k.bias.view(1, 1, -1)

    @property
    def bias_v(self) -> torch.Tensor | None:
        return None if self.seq_bias_v is None else self.seq_bias_v.bias.view(1, 1, -1)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool masks (``True`` = not allowed) to ``-inf``/``0``; float masks unchanged."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, float("-inf")
        )
    return mask.to(dtype)


def _pad_last(mask: torch.Tensor | None) -> torch.Tensor | None:
    """One more key position, allowed (``False`` / ``0``)."""
    return None if mask is None else F.pad(mask, (0, 1))


_PROJ = (("q", "qlinear"), ("k", "klinear"), ("v", "vlinear"))


def _to_torch_state_dict(module: DPMultiheadAttention, state_dict, prefix: str, local_metadata):
    """Rewrites this module's entries of ``state_dict`` with ``nn.MultiheadAttention``'s keys
    and order."""
    mine = {k[len(prefix) :]: state_dict.pop(k) for k in list(state_dict) if k.startswith(prefix)}
    torch_sd: dict[str, torch.Tensor] = {}
    w = [mine.pop(f"{lin}.weight") for _, lin in _PROJ]
    if module._qkv_same_embed_dim:
        torch_sd["in_proj_weight"] = torch.cat(w)
    else:
        for (short, _), wi in zip(_PROJ, w):
            torch_sd[f"{short}_proj_weight"] = wi
    if module.bias:
        torch_sd["in_proj_bias"] = torch.cat([mine.pop(f"{lin}.bias") for _, lin in _PROJ])
    if module.add_bias_kv:
        torch_sd["bias_k"] = mine.pop("seq_bias_k.bias").view(1, 1, -1)
        torch_sd["bias_v"] = mine.pop("seq_bias_v.bias").view(1, 1, -1)
    torch_sd.update(mine)  # out_proj.weight, out_proj.bias
    for k, v in torch_sd.items():
        state_dict[prefix + k] = v


def _from_torch_state_dict(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """Splits ``nn.MultiheadAttention`` keys into this module's (internal keys pass through)."""
    e = module.embed_dim
    w = state_dict.pop(prefix + "in_proj_weight", None)
    if w is not None:
        for i, (_, lin) in enumerate(_PROJ):
            state_dict[f"{prefix}{lin}.weight"] = w[i * e : (i + 1) * e]
    for short, lin in _PROJ:
        wi = state_dict.pop(f"{prefix}{short}_proj_weight", None)
        if wi is not None:
            state_dict[f"{prefix}{lin}.weight"] = wi
    b = state_dict.pop(prefix + "in_proj_bias", None)
    if b is not None:
        for i, (_, lin) in enumerate(_PROJ):
            state_dict[f"{prefix}{lin}.bias"] = b[i * e : (i + 1) * e]
    for name in ("k", "v"):
        bias = state_dict.pop(f"{prefix}bias_{name}", None)
        if bias is not None:
            state_dict[f"{prefix}seq_bias_{name}.bias"] = bias.reshape(-1)
