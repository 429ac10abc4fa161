"""A shape family's compiles: its share of the variant budget, and its one symbolic graph.

Note [Shape families] (tracer.lifecycle) says what a family is; Note [Family graphs]
(scheduler.symbolic) how one graph serves its members. This module decides, for a member
about to go warm, which compile it gets; tracer.lifecycle carries the decision out (it owns
requests, installs and the path states) and nothing here calls back into it.
"""

from __future__ import annotations

import dataclasses

from adaptive_eager.scheduler import symbolic

__all__ = ["Family", "Decision", "decide", "STATIC", "SYMBOLIC", "JOIN", "OVER"]

# what a member about to go warm gets
STATIC = "static"  # a fused compile of its own sizes
SYMBOLIC = "symbolic"  # the family's symbolic graph, compiled from this member
JOIN = "join"  # the family's symbolic graph, compiled already or compiling
OVER = "over"  # nothing: the budget is spent; it replays exactly


@dataclasses.dataclass
class Family:
    """The compiles of one family, on the thread that owns the trie."""

    compiled: int = 0  # fused compiles requested, the symbolic one included
    # (specs, ext metas, live metas) of each member given a fused graph of its own, in order
    members: list = dataclasses.field(default_factory=list)
    template: tuple | None = None  # of the symbolic graph, once requested
    variant: tuple | None = None  # the symbolic graph's variant (live, lifted, floats)
    key: object = None  # and its GraphKey
    guards: object = None  # symbolic.SizeGuards, once delivered
    waiting: list = dataclasses.field(default_factory=list)  # (path, variant, size) joined
    # before the graph arrived
    failed: str = ""  # why the family has no symbolic graph after all


@dataclasses.dataclass(frozen=True)
class Decision:
    kind: str
    size: int = 0  # the member's symbolic size (SYMBOLIC, JOIN)
    template: tuple | None = None  # SYMBOLIC
    why: str = ""  # OVER, or why a JOIN or SYMBOLIC was not possible (counted)


def members_program(path, live: tuple) -> tuple:
    """What two members of a family are compared by: ops, externals, live outputs."""
    return path.specs, path.ext_metas, {i: path.val_meta[i] for i in live}


def decide(fam: Family, path, live: tuple, variant: tuple, budget: int) -> Decision:
    """Which compile ``path`` (a member of ``fam`` about to go warm, ``variant`` its first
    launch's) gets. Records the compile it decides in ``fam``."""
    program = members_program(path, live)
    why = ""
    if fam.template is not None and not fam.failed:
        try:
            size = symbolic.match(fam.template, program)
        except symbolic.NotFamily as e:
            why = f"not the family's program at another size ({e})"
        else:
            if variant != fam.variant:
                why = "its floats or live outputs differ from the family graph's"
            elif fam.guards is not None and not fam.guards.admit(size):
                why = f"the family graph does not admit size {size}"
            else:
                return Decision(JOIN, size)
    if fam.compiled >= budget:
        return Decision(OVER, why=why or "shape variants of one path over the variant budget")
    fam.compiled += 1
    # Inductor compiles symbolic sizes; TorchNeuron's backend takes a graph of fixed sizes
    if (fam.compiled == budget and fam.members and fam.template is None
            and path.backend == "inductor"):
        made = _template(fam.members, program, path.plan)
        if type(made) is str:
            return Decision(STATIC, why=f"no symbolic graph for the family ({made})")
        fam.template, fam.variant = made[0], variant
        return Decision(SYMBOLIC, made[1], made[0])
    fam.members.append(program)
    return Decision(STATIC, why=why)


def _template(members, program, the_plan):
    """(template, size) of ``program`` against the latest member it makes one with (a first
    member of size 1 makes none: every size is a multiple of 1), or why there is none."""
    why = ""
    for other in reversed(members):
        try:
            template, size = symbolic.template(other, program)
        except symbolic.NotFamily as e:
            why = str(e)
            continue
        ext, live = template[1], template[2]
        inputs = [ext[k] for k in the_plan.ext_inputs] + list(live.values())
        if symbolic.whole_dimension(inputs, len(the_plan.ext_inputs),
                                    bool(the_plan.lifted)) is None:
            return "the size is no whole dimension of an input"
        return template, size
    return why
