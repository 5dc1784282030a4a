"""The routing an estimate assumes for a mixture-of-experts model whose experts run eagerly.

transformers' eager experts (runner/builders/experts.py) loop over the experts the router hit, each
taking the tokens sent to it (`nonzero`, `where`): shapes that fake tensors, which have no values,
cannot know. How many tokens each expert takes, and how many experts a layer hits, move a step's
peak, and both change from step to step as the router learns.

The estimate assumes a **balanced** routing: every expert takes an equal share of the tokens' top-k
choices (give or take one), which is what a mixture-of-experts' load-balancing loss trains the
router towards and what a freshly initialised router is close to. It is the expected peak, not a
bound: no simple routing bounds eager experts' peak (in backward, each expert hit adds a gradient
the size of all the experts' weights while the tokens of the experts not yet reached are still
held): on a tiny Mixtral of 4 experts, the most skewed of 20 random routings drawn to be uneven
measured 5.6 % above it, while its own router's steps stayed within 1.2 % (3 seeds, 8 experts).
So training measures every step of such a model against the cap (runner/memory/measure.py), and the
estimate says what it assumed. tests/runner/predict/test_routing.py compares it with real steps
over several seeds. transformers' default kernel, grouped_mm, which ckrun picks wherever torch's
grouped kernel runs, has the batch's shapes whatever the routing: nothing is assumed for it.

How: the experts' `top_k_index` is replaced by the balanced routing as a real tensor, and inside the
experts' forward the ops on the routing (its masks, `nonzero`, the loop's indices) run for real, while
every op on the activations stays fake: the eager loop itself runs, as in training, with the tokens
per expert the assumption gives. The same wrapping on a real model routes it the same way, which
is how the tests hold a real step to the estimate byte for byte.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..builders.experts import EAGER, experts_modules, implementation
from ..memory.blocks import Undo, undo_all, wrap_forward

EAGER_NOTE = ("mixture of experts: {count} experts modules run eagerly, so a step's bytes follow the routing; "
              "estimated for a balanced routing (each of the {experts} experts takes an equal share of {tokens} "
              "tokens x top-{k}, what the load-balancing loss trains towards); a skewed routing needs a few % more, "
              "so training measures every step against the cap. transformers' grouped_mm does not depend on "
              "routing (model.config.experts_implementation)")
GROUPED_NOTE = "mixture of experts: {count} experts modules run transformers' {kernel}; its bytes do not depend on the routing"


class BalancedRouting:
    """While it lasts, `model`'s eager experts route every forward by `balanced_routing`; `notes()` says
    what the estimate assumed, with the sizes of the last forward."""

    def __init__(self, model: nn.Module):
        self.modules = experts_modules(model)
        self.eager = [m for m in self.modules if implementation(m) == EAGER]
        self.sizes: dict[str, int] = {}
        self.remove: Undo = undo_all([wrap_forward(m, self._routed, m.num_experts) for m in self.eager])

    def notes(self) -> list[str]:
        if not self.modules:
            return []
        if not self.eager:
            return [GROUPED_NOTE.format(count=len(self.modules), kernel=implementation(self.modules[0]))]
        return [EAGER_NOTE.format(count=len(self.eager), **self.sizes)] if self.sizes else []

    def _routed(self, forward, num_experts: int):
        @functools.wraps(forward)
        def run(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            tokens, k = top_k_index.shape
            self.sizes = {"tokens": tokens, "k": k, "experts": num_experts}
            with unset_fake_temporarily():
                routing = balanced_routing(tokens, k, num_experts).to(top_k_index.dtype)
            with _RealRouting():
                return forward(hidden_states, routing, top_k_weights, *args, **kwargs)
        return run


def balanced_routing(tokens: int, k: int, experts: int) -> torch.Tensor:
    """[tokens, k] expert ids, each token's k distinct: the choices dealt out in turn, so every expert
    takes tokens * k / experts of them (give or take one)."""
    return (torch.arange(tokens).unsqueeze(1) * k + torch.arange(k)) % experts


class _RealRouting(TorchDispatchMode):
    """Ops on the routing run for real: those with real tensor arguments and no fake one, and integer
    factories with no tensor argument (`one_hot`'s zeros); every other op stays fake."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        real = not any(isinstance(t, FakeTensor) for t in tensors)
        if real and (tensors or _integral(kwargs.get("dtype"))):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _integral(dtype) -> bool:
    return isinstance(dtype, torch.dtype) and not dtype.is_floating_point and not dtype.is_complex
