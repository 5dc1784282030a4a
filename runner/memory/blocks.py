"""The model's repeated blocks: what a memory plan's block indices count.

Checkpointing and offload act on "blocks": the transformer layers, the ResNet bottlenecks, the
children of a user's `nn.Sequential`. They are found generically: the blocks are the children of
an `nn.ModuleList` / `nn.Sequential` that share one class, and when several classes qualify the
one holding the most parameters wins. Every container of the winning class contributes, in module
order, so T5's `encoder.block` and `decoder.block`, or ResNet's `layer1`..`layer4`, make one list.
Two refinements (issue 32: GoogLeNet's blocks came out as 36 inner branches, so full checkpointing
saved 1%, and Pegasus's encoder layers were never blocks):
- a stack of another class beside the winner's (BART's and Pegasus's encoder layers beside their
  decoder layers) joins it when it holds at least a quarter of the winner's parameters and neither
  holds the other's members;
- units that hold the winner's members but sit in no container (GoogLeNet's nine Inception modules,
  plain attributes holding its branches) replace them when there are three or more of one class
  and they hold nearly all (90%) of the winner's parameters: the outer unit is the one worth
  recomputing. Two such units (T5's encoder and decoder stacks) are not blocks.
`memory.blocks: "path.to.container"` overrides the guess.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import nn

from ..builders.model import count_parameters
from ..plan.policy_base import check_indices, short_list  # noqa: F401 - short_list: importable from here as before
from ..problems import suggest

log = logging.getLogger(__name__)

CONTAINERS = (nn.ModuleList, nn.Sequential)

Undo = Callable[[], None]  # puts back what a plan changed on the model


class Block(NamedTuple):
    index: int  # position in the plan's numbering, 0-based
    name: str  # qualified name in the model, e.g. "bert.encoder.layer.3"
    module: nn.Module


@dataclass
class BlockList:
    container_name: str  # "bert.encoder.layer"; several joined by ", " (T5, ResNet)
    blocks: list[Block]
    containers: list[str] = field(default_factory=list)  # one entry per block: the container it sits in
    root: nn.Module | None = field(default=None, repr=False)  # the model the blocks were found in

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self):
        return iter(self.blocks)

    def __getitem__(self, index: int) -> Block:
        return self.blocks[index]

    def check_indices(self, key: str, indices: list[int]) -> None:
        """A ValueError naming the recipe key when an index is past the last block."""
        check_indices(key, indices, len(self))


def find_blocks(model: nn.Module, explicit: str | None = None) -> BlockList:
    """The repeated blocks of `model`, or of the container at dotted path `explicit`."""
    if explicit is not None:
        return _explicit_blocks(model, explicit)
    groups = _candidate_groups(model, in_containers=True)
    if not groups:
        siblings = _sibling_sequence(model)
        if siblings:
            return _block_list(model, siblings)
        raise ValueError(
            f"memory.blocks: found no repeated blocks in {type(model).__name__} (no nn.ModuleList or nn.Sequential holding 2 or "
            'more modules of one class); name the container with memory.blocks: "path.to.container"'
        )
    # the most parameters wins; on a tie the class found first (the outermost) wins
    best_class, best = max(groups.items(), key=lambda item: item[1]["params"])
    members = _outer_units(model, best)
    if members is None:
        members, beside = list(best["members"]), _beside(groups, best_class, best)
        if beside:  # in module order: the encoder's layers before the decoder's
            members = sorted(members + beside, key=_module_order(model))
    log.debug("blocks: %d x %s, the repeated class holding the most parameters (%s); other candidates: %s",
              len(members), ", ".join(sorted({type(m).__name__ for _, m in members})), f"{best['params']:,}",
              ", ".join(cls.__name__ for cls in groups if cls is not best_class) or "none")
    return _block_list(model, members)


def _block_list(model: nn.Module, members: list[tuple[str, nn.Module]]) -> BlockList:
    names = [name for name, _ in members]
    containers = [name.rpartition(".")[0] for name in names]
    blocks = [Block(i, name, module) for i, (name, module) in enumerate(members)]
    return BlockList(", ".join(dict.fromkeys(containers)), blocks, containers, model)


def _sibling_sequence(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """Where no container repeats a class (Inception v3: Mixed_5b..7c are eleven modules of five classes,
    plain attributes of the model): the composite children (modules of modules) of the one module whose
    composite children hold the most parameters, three or more holding at least half of the model's,
    in module order: the stages along the forward path, each worth recomputing whole."""
    total = count_parameters(model)
    best, best_params = None, 0
    for name, module in model.named_modules():
        units = [(_join(name, child_name), child) for child_name, child in module.named_children()
                 if next(child.children(), None) is not None and count_parameters(child) > 0]
        params = sum(count_parameters(child) for _, child in units)
        if len(units) >= 3 and params * 2 >= total > 0 and params > best_params:
            best, best_params = units, params
    if best is not None:
        log.debug("blocks: no container repeats a class; the %d composite children of %s (%s parameters)", len(best),
                  best[0][0].rpartition(".")[0] or "the model", f"{best_params:,}")
    return best


def _candidate_groups(model: nn.Module, in_containers: bool) -> dict[type, dict]:
    """Per child class: the same-class children of every container (`in_containers`), or of every other
    module (three or more, containers themselves left out), in module order, and their parameters."""
    groups: dict[type, dict] = {}
    taken: set[int] = set()  # a module counts once, even if two containers hold it
    for name, module in model.named_modules():
        if isinstance(module, CONTAINERS) != in_containers:
            continue
        by_class = defaultdict(list)
        for child_name, child in module.named_children():
            if in_containers or not isinstance(child, CONTAINERS):
                by_class[type(child)].append((_join(name, child_name), child))
        for cls, members in by_class.items():
            held = {n for n, _ in groups.get(cls, {"members": []})["members"]}
            members = [(n, m) for n, m in members if id(m) not in taken and not _inside(n, held)]
            if len(members) < (2 if in_containers else 3):
                continue
            taken.update(id(m) for _, m in members)
            group = groups.setdefault(cls, {"members": [], "params": 0})
            group["members"] += members
            group["params"] += sum(count_parameters(m) for _, m in members)
    return groups


def _inside(name: str, held: set[str]) -> bool:
    """Whether `name` lies inside one of `held`: a group's members never nest (Sequentials of Sequentials
    made '1' and '1.0' one class's blocks, checkpointed twice over). Modules come outer first, so a
    member found later can lie inside one found earlier, never hold it; the outer one is kept."""
    parts = name.split(".")
    return any(".".join(parts[:end]) in held for end in range(1, len(parts)))


def _beside(groups: dict[type, dict], best_class: type, best: dict) -> list[tuple[str, nn.Module]]:
    """Stacks of other classes beside the winner's (an encoder's layers beside a decoder's): a quarter of its
    parameters or more, none of them holding or held by the winner's members."""
    chosen = list(best["members"])
    for cls, group in sorted(groups.items(), key=lambda item: -item[1]["params"]):
        if cls is best_class or group["params"] * 4 < best["params"]:
            continue
        if not any(_nested(a, b) for a, _ in group["members"] for b, _ in chosen):
            chosen += group["members"]
    return chosen[len(best["members"]):]


def _outer_units(model: nn.Module, best: dict) -> list[tuple[str, nn.Module]] | None:
    """Units outside containers that hold nearly all of the winner's parameters (GoogLeNet's Inceptions), or None."""
    for group in _candidate_groups(model, in_containers=False).values():
        inside = [(n, m) for n, m in best["members"] if any(n.startswith(f"{outer}.") for outer, _ in group["members"])]
        if sum(count_parameters(m) for _, m in inside) >= 0.9 * best["params"] > 0:
            return list(group["members"])
    return None


def _nested(outer: str, inner: str) -> bool:
    """Whether `inner` names `outer` or a module inside it (or the other way round)."""
    return inner == outer or inner.startswith(f"{outer}.") or outer.startswith(f"{inner}.") or not outer or not inner


def _module_order(model: nn.Module):
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    return lambda member: order[member[0]]


def _explicit_blocks(model: nn.Module, path: str) -> BlockList:
    try:
        container = model.get_submodule(path)
    except AttributeError:
        known = [name for name, m in model.named_modules() if isinstance(m, CONTAINERS) and name]
        raise ValueError(f"memory.blocks: {type(model).__name__} has no module {path!r}{suggest(path, known)}") from None
    if not isinstance(container, CONTAINERS):
        raise ValueError(f"memory.blocks: {path!r} is a {type(container).__name__}, not an nn.ModuleList or nn.Sequential")
    children = list(container.named_children())
    if not children:
        raise ValueError(f"memory.blocks: {path!r} is empty")
    blocks = [Block(i, _join(path, name), child) for i, (name, child) in enumerate(children)]
    return BlockList(path, blocks, [path] * len(blocks), model)


def wrap_forward(module: nn.Module, make: Callable, *make_args) -> Undo:
    """Set `module.forward = make(forward, *make_args)` on the instance; wrappers stack (offload over
    checkpoint), and the returned undo puts back exactly the forward it replaced."""
    had_own = "forward" in module.__dict__
    inner = module.forward
    module.forward = make(inner, *make_args)

    def undo() -> None:
        if had_own:
            module.forward = inner
        else:
            del module.forward
    return undo


def undo_all(undos: list[Undo]) -> Undo:
    def undo() -> None:
        for step in reversed(undos):
            step()
    return undo


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
