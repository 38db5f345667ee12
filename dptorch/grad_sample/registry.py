"""Layer rules: everything a mode needs to know about one layer type, in one place.

A :class:`LayerRule` is plain data: the functions the modes call for a layer type. All take
``(layer, activations, backprops)`` where ``activations`` is the list of the layer's positional
forward inputs (batch dimension first) and ``backprops`` the gradient of the loss with respect to
the layer's output (batch first, already rescaled for ``loss_reduction``):

=========================  =======================================  ==========================
field                      returns                                  used by
=========================  =======================================  ==========================
``grad_sample``            ``{param: (B, *param.shape)}``           hooks (and ghost/bk when
                                                                    instantiation is cheaper)
``norm_sq``                ``{param: (B,)}`` squared norms          ghost, bk
``clipped_sum``            ``{param: Σ_b grad_b}``; called with      bk
                           ``c_b·backprops[b]`` it is the clipped
                           sum for one weight-gradient's cost
``input_grad_only``        ``forward(layer, *inputs)`` whose         bk (autograd must not also
                           autograd computes input gradients only    compute weight gradients)
``prefer_ghost``           whether the norm (Gram) path beats        ghost, bk cost model
                           instantiating the per-sample gradient
=========================  =======================================  ==========================

A field left ``None`` means the mode's generic path (``torch.func`` per-sample gradients,
norms of the instantiated gradient, a recomputed forward + one vector-Jacobian product for the
clipped sum, zeroing the weight gradient by a tensor hook, never ghost); a built-in rule names
each field it leaves to the generic path in ``generic`` with the reason, and a test checks that
every built-in rule is complete in that sense.

One file per layer type (``linear.py``, ``conv.py`` ...) defines its functions and registers
one rule with :func:`register_layer_rule`. ``GRAD_SAMPLERS`` / ``NORM_SAMPLERS`` and the Opacus
decorators (``register_grad_sampler``, ``register_norm_sampler``) are views onto the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch import nn

from ..utils.fsdp_utils import fsdp_original_class

GradSamplerFn = Callable[[nn.Module, Sequence[torch.Tensor], torch.Tensor], dict]
CostFn = Callable[[nn.Module, Sequence, torch.Tensor], bool]

#: the per-layer fields of a rule, in the order of the table above
RULE_FIELDS = ("grad_sample", "norm_sq", "clipped_sum", "input_grad_only", "prefer_ghost")


@dataclass
class LayerRule:
    """What every mode needs to know about one layer type (see the module docstring).

    ``generic`` maps each field left ``None`` on purpose to the reason the generic path is
    right for this layer (e.g. ``"norm_sq": "the (B, C) gradient is cheapest instantiated"``).
    """

    grad_sample: GradSamplerFn | None = None
    norm_sq: GradSamplerFn | None = None
    clipped_sum: GradSamplerFn | None = None
    input_grad_only: Callable[..., torch.Tensor] | None = None
    prefer_ghost: CostFn | None = None
    generic: dict[str, str] = field(default_factory=dict)
    #: optional, outside :data:`RULE_FIELDS`: ``{param: Factors}``, the call's per-sample
    #: gradient in factored form (:class:`~dptorch.grad_sample.norm_samplers.Factors`). Ghost/bk
    #: use it for a parameter used by several calls (tied embeddings): the squared norm of the
    #: summed gradient is each call's ``norm_sq`` plus the cross terms of the factors, and
    #: nothing ``(B, *param.shape)`` is built. Without it such a parameter is instantiated.
    factors: GradSamplerFn | None = None
    #: optional, outside :data:`RULE_FIELDS`: ``(layer) -> reason | None``, why autograd's batch
    #: gradient of this layer, given ``c_b``-scaled output gradients, is *not* ``Σ_b c_b grad_b``
    #: (``Embedding(scale_grad_by_freq=True)`` divides by counts over the whole batch). Ghost
    #: mode, whose second backward pass lets autograd form the clipped sum, refuses such a layer.
    batch_grad_not_a_sum: Callable[[nn.Module], str | None] | None = None
    #: optional, outside :data:`RULE_FIELDS`: ``(layer, activations, backprops, c) -> {param:
    #: Σ_b c_b ∇_p loss_b}``, the clipped sum given the clip factors ``c`` ``(B,)``, for a layer
    #: that can apply them more cheaply than to a copy of the output gradient (``Linear``
    #: scales whichever of its input and output gradient is smaller). Without it bk calls
    #: ``clipped_sum`` with ``c ⊙ G``.
    weighted_clipped_sum: Callable[..., dict] | None = None

    def missing(self) -> list[str]:
        """Fields that are neither set nor declared generic (empty for a complete rule)."""
        return [f for f in RULE_FIELDS if getattr(self, f) is None and f not in self.generic]

    def is_empty(self) -> bool:
        return all(getattr(self, f) is None for f in RULE_FIELDS)


#: layer type -> its rule. Lookup is by exact type (a subclass needs its own rule); a key may
#: also be a type's qualified name ``"package.module.Class"``, for a layer of an optional
#: dependency that dptorch must not import (Hugging Face's ``Conv1D``). The one exception is
#: the class ``fully_shard`` generates for a layer (``FSDPLinear``, which adds no ``forward``):
#: it has the rule of the class it wraps (:func:`~dptorch.utils.fsdp_utils.fsdp_original_class`).
LAYER_RULES: dict[type | str, LayerRule] = {}

Target = type | str


def _targets(target_class_or_classes: Target | Iterable[Target]) -> list[Target]:
    if isinstance(target_class_or_classes, (type, str)):
        return [target_class_or_classes]
    return list(target_class_or_classes)


def qualified_name(t: type) -> str:
    """``"package.module.Class"`` of a type, the name key of :data:`LAYER_RULES`."""
    return f"{t.__module__}.{t.__qualname__}"


def register_layer_rule(target_class_or_classes: Target | Iterable[Target], rule: LayerRule) -> LayerRule:
    """Registers ``rule`` for one or several layer types, or qualified type names (replacing
    what was there); returns it."""
    unknown = [k for k in rule.generic if k not in RULE_FIELDS]
    if unknown:
        raise ValueError(f"LayerRule.generic names unknown fields {unknown}; fields: {RULE_FIELDS}")
    for t in _targets(target_class_or_classes):
        LAYER_RULES[t] = rule
    return rule


def pairs_with(field: str, partner: Callable) -> Callable[[Callable], Callable]:
    """Marks an optional rule function (``weighted_clipped_sum``, ``factors``) as a faster or
    factored form of ``partner``, the rule's ``field``: :func:`derived` returns it only from a
    rule whose ``field`` is still ``partner`` (a rule built with ``replace(LINEAR_RULE,
    clipped_sum=mine)`` must not keep Linear's weighted sum, which would ignore ``mine``)."""

    def mark(fn: Callable) -> Callable:
        fn.pairs_with = (field, partner)
        return fn

    return mark


def derived(rule: LayerRule | None, name: str) -> Callable | None:
    """The rule's optional function ``name`` if it is consistent with the rule (see
    :func:`pairs_with`), else ``None`` (the mode then takes the path that needs only the
    required fields)."""
    fn = getattr(rule, name, None) if rule is not None else None
    partner = getattr(fn, "pairs_with", None)
    if fn is None or (partner is not None and getattr(rule, partner[0]) is not partner[1]):
        return None
    return fn


def rule_for_type(t: type) -> LayerRule | None:
    """The rule registered for the type ``t`` exactly (or its qualified name), or ``None``.

    A class generated by FSDP2's ``fully_shard`` for a layer (``FSDPLinear`` for ``nn.Linear``)
    has the rule of the layer's class, unless a rule is registered for it; any other subclass,
    including a user's subclass of a layer wrapped by ``fully_shard`` (``FSDPMyLinear``), still
    needs its own rule."""
    rule = LAYER_RULES.get(t)
    if rule is None:
        rule = LAYER_RULES.get(qualified_name(t))
    if rule is None:
        original = fsdp_original_class(t)
        if original is not None:
            return rule_for_type(original)
    return rule


def rule_for(layer: nn.Module) -> LayerRule | None:
    """The rule of ``type(layer)`` (exact type), or ``None``."""
    return rule_for_type(type(layer))


def prefer_ghost(layer: nn.Module, activations: Sequence, backprops: torch.Tensor) -> bool:
    """Whether the norm (ghost) path of ``layer``'s rule beats instantiating its per-sample
    gradient for this call (``False`` for a layer without a cost model)."""
    rule = rule_for(layer)
    return bool(rule and rule.prefer_ghost and rule.prefer_ghost(layer, activations, backprops))


def replaced_forward(layer: nn.Module) -> bool:
    """Whether ``layer``'s ``forward`` was replaced on the instance by someone other than dptorch
    (accelerate's ``add_hook_to_module``, an assignment ``layer.forward = ...``). A rule's
    formulas describe the class's ``forward``, which the replacement may change (rescale the
    output): the layer is then handled as one without a rule (``torch.func`` recomputes the
    replacement itself)."""
    fn = layer.__dict__.get("forward")
    if fn is None:
        return False
    while isinstance(fn, partial):
        fn = fn.func
    return not (getattr(fn, "__module__", None) or "").startswith("dptorch.")


def input_grad_only_forward(layer: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The rule's forward without weight gradients for ``layer``: that of its own type or of the
    nearest base class with a rule, if ``layer`` keeps that class's ``forward`` (a subclass of
    ``nn.Linear`` that does not override ``forward`` computes a Linear's gradients; nor does a
    layer whose ``forward`` was replaced on the instance, :func:`replaced_forward`)."""
    if replaced_forward(layer):
        return None
    for base in type(layer).__mro__:
        rule = rule_for_type(base)
        if rule is not None and rule.input_grad_only is not None:
            return rule.input_grad_only if type(layer).forward is base.forward else None
    return None


def _set_field(t: Target, name: str, fn) -> None:
    rule = LAYER_RULES.get(t) if isinstance(t, str) else rule_for_type(t)
    if rule is None:
        LAYER_RULES[t] = LayerRule(**{name: fn})
    else:  # a new rule object: a rule shared by several types changes for ``t`` only
        LAYER_RULES[t] = replace(rule, **{name: fn})


class RuleFieldView(MutableMapping):
    """``{layer type: rule.<name>}`` over :data:`LAYER_RULES`, for the types that set it: the
    Opacus tables (``GRAD_SAMPLERS[MyLayer] = fn``) read and write the rules."""

    def __init__(self, name: str):
        if name not in RULE_FIELDS:
            raise ValueError(f"unknown rule field {name!r}")
        self.name = name

    def __getitem__(self, t: type):
        fn = getattr(rule_for_type(t) if isinstance(t, type) else LAYER_RULES.get(t), self.name, None)
        if fn is None:
            raise KeyError(t)
        return fn

    def __setitem__(self, t: type, fn) -> None:
        _set_field(t, self.name, fn)

    def __delitem__(self, t: type) -> None:
        self[t]  # noqa: B018  (KeyError if absent)
        _set_field(t, self.name, None)
        if t in LAYER_RULES and LAYER_RULES[t].is_empty():
            del LAYER_RULES[t]

    def __iter__(self) -> Iterator[type]:
        return iter([t for t, r in LAYER_RULES.items() if getattr(r, self.name) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"RuleFieldView({self.name!r}, {dict(self)!r})"


#: Opacus tables, as views: per-sample gradient and squared per-sample norm functions
GRAD_SAMPLERS = RuleFieldView("grad_sample")
NORM_SAMPLERS = RuleFieldView("norm_sq")


def _field_decorator(name: str, target_class_or_classes, wrap=None):
    def decorator(f):
        for t in _targets(target_class_or_classes):
            _set_field(t, name, wrap(f) if wrap else f)
        return f

    return decorator


def register_grad_sampler(target_class_or_classes: type | Iterable[type]):
    """Decorator (Opacus API): ``f(layer, activations, backprops) -> {param: (B, *param.shape)}``
    becomes the ``grad_sample`` of the layer type's rule. Lookup is by exact type."""
    return _field_decorator("grad_sample", target_class_or_classes)


def register_norm_sampler(target_class_or_classes: type | Iterable[type]):
    """Decorator (Opacus API): ``f(layer, activations, backprops)`` returning per-sample gradient
    *norms* ``{param: (B,)}`` becomes the rule's ``norm_sq`` (stored squared)."""

    def squared(f):
        def norm_sq(layer, activations, backprops):
            return {p: n.pow(2) for p, n in f(layer, activations, backprops).items()}

        norm_sq.__wrapped__ = f
        return norm_sq

    return _field_decorator("norm_sq", target_class_or_classes, squared)


def register_norm_sq_sampler(target_class_or_classes: type | Iterable[type]):
    """Decorator: ``f(layer, activations, backprops)`` returning *squared* per-sample norms
    ``{param: (B,)}`` becomes the rule's ``norm_sq``."""
    return _field_decorator("norm_sq", target_class_or_classes)

