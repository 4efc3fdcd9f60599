"""Which candidates stay, and why the others do not: layer detection's step after
`candidates`.

`judge` drops the candidates that cannot be a Kronecker-factored layer (weights
shared between layouts, used outside the layer, sliced by a scan and read another
way, or declared by a `register_dense` whose result is unused) and gives a reason
for each of their parameters.
"""

import types
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ..analyses import axes
from .candidates import Candidate
from .graph import Graph


class Verdict(NamedTuple):
    dropped: frozenset[int]  # ids of dropped candidates
    reasons: Mapping[int, str]  # parameter index -> why it is in no layer

    def drop(self, cands, reasons: Mapping[int, str]) -> "Verdict":
        """Also drops `cands`; `reasons` replace earlier ones."""
        return Verdict(
            self.dropped | {id(c) for c in cands},
            types.MappingProxyType({**self.reasons, **reasons}),
        )


def _ties(cands: Sequence[Candidate]) -> tuple[Mapping[int, tuple], Verdict]:
    """Groups the applications of tied weights; drops the layers whose weights are
    shared between different layouts."""
    claims: dict[int, list[Candidate]] = {}
    for cand in cands:
        for index in cand.indices:
            claims.setdefault(index, []).append(cand)
    tied, verdict = {}, Verdict(frozenset(), types.MappingProxyType({}))
    for index, users in claims.items():
        if len(users) == 1:
            continue
        if _tie_compatible(users):
            tied.update({id(c): tuple(users) for c in users})
            continue
        verdict = verdict.drop(users, {index: _untied(users)})
    return tied, verdict


def _untied(users: Sequence[Candidate]) -> str:
    """Why the applications of one parameter do not make one tied layer."""
    kind, n = users[0].kind, len(users)
    same_kind = all(c.kind == kind for c in users)
    if same_kind and not kind.tieable:
        return (
            f"read by {n} separate {kind.name} applications, whose statistics do "
            "not pool (for an embedding, look every token up at once: "
            "`weight[tokens]`)"
        )
    biases = {None if c.bias is None else c.bias.index for c in users}
    layouts = {_tie_key(c)[:2] + _tie_key(c)[3:] for c in users}
    if same_kind and len(layouts) == 1 and len(biases) > 1:
        derivative = (
            "; one application has no bias, as a derivative of the model (a "
            "`jax.jvp` or Jacobian penalty in the loss) applies the weight "
            "again without it"
            if None in biases
            else ""
        )
        return (
            f"a weight tied between {n} {kind.name} layers that have biases of "
            "their own: a tied layer is one weight and one bias, so these are "
            f"not one layer (tie the biases too, or leave them out){derivative}"
        )
    return f"used by {n} layers of different kinds or layouts (shared or tied weights)"


def _tie_key(c: Candidate) -> tuple:
    """What the applications of one tied layer share: kind, weight, bias, layout."""
    return (
        c.kind,
        None if c.weight is None else c.weight.index,
        None if c.bias is None else c.bias.index,
        c.weight_perm,
        c.d_in,
        len(axes.feature_axes(c.out_labels)),
    )


def _tie_compatible(users: Sequence[Candidate]) -> bool:
    """Whether several applications of one weight can share a Kronecker block."""
    first = _tie_key(users[0])
    return users[0].kind.tieable and all(_tie_key(c) == first for c in users)


def _outside_uses(cands, tied, graph: Graph, verdict: Verdict) -> Verdict:
    """Drops the layers whose parameters are also read outside every use of the
    layer, on a path to a loss: their Kronecker statistics would miss that use."""
    for cand in cands:
        if id(cand) in verdict.dropped:
            continue
        own = _own_nodes(tied.get(id(cand), (cand,)))
        for view in cand.param_views:
            srcs = [graph.srcvars[view.index]] + [n.outs[0] for n in view.nodes]
            users = [u for s in srcs for u in graph.consumers.get(id(s), [])]
            outside = [u for u in users if id(u) not in own and graph.reaches_loss(u)]
            if outside:
                reason = (
                    f"also used outside its {cand.kind.name} layer "
                    f"(by `{outside[-1].name}`)"
                )
                verdict = verdict.drop([cand], {view.index: reason})
    return verdict


def _own_nodes(uses: Sequence[Candidate]) -> set[int]:
    own = set()
    for use in uses:
        for view in use.param_views:
            own.update(id(n) for n in view.nodes)
        own.update(id(n) for n in (use.core,) + use.chain)
        own.update(use.computes)
    return own


def _stack_uses(cands, graph: Graph, verdict: Verdict) -> Verdict:
    """Drops the layers of scan units whose stacked leaf is also read another way:
    their Kronecker statistics would miss that use."""
    cutters: dict[int, set[int]] = {}  # parent var -> its units' slicing equations
    for u in graph.program.units:
        cutters.setdefault(id(u.parent), set()).update(id(n) for n in u.nodes)
    for j, u in enumerate(graph.program.units):
        k = graph.num_leaves + j
        claimants = [c for c in cands if k in c.indices]
        allowed = cutters[id(u.parent)].union(*(c.computes for c in claimants))
        others = [
            n
            for n in graph.consumers.get(id(u.parent), [])
            if id(n) not in allowed and graph.reaches_loss(n)
        ]
        if others:
            reason = f"its stacked leaf is also used outside the scan (by `{others[0].name}`)"
            verdict = verdict.drop(claimants, {k: reason})
    return verdict


def _unused_declarations(cands, graph: Graph, verdict: Verdict) -> Verdict:
    """Drops the declared layers whose tagged output reaches no loss although their
    parameters do: `register_dense`'s result was dropped, and the declaration
    claims the parameters from the layer the tracer would have found."""
    for cand in cands:
        if not cand.declared or id(cand.outputs) in graph.reach:
            continue
        reaching = [i for i in cand.indices if id(graph.srcvars[i]) in graph.reach]
        reason = (
            "declared by `eqfisher.register_dense`, whose result does not reach a "
            "registered loss: use the value it returns in place of `y`"
        )
        verdict = verdict.drop([cand], dict.fromkeys(reaching, reason))
    return verdict


def _partner_reasons(cands, graph: Graph, verdict: Verdict) -> Verdict:
    """The other parameters of a dropped layer say why it was dropped."""
    reasons = dict(verdict.reasons)
    for cand in cands:
        if id(cand) not in verdict.dropped:
            continue
        for index in cand.indices:
            others = [i for i in cand.indices if i in reasons]
            if index not in reasons and others:
                reasons[index] = (
                    f"in a {cand.kind.name} layer with `{graph.paths[others[0]]}`, "
                    "which is unmatched"
                )
    return verdict.drop([], reasons)


def judge(cands: Sequence[Candidate], graph: Graph) -> Verdict:
    # Only applications whose outputs reach a loss tie: a use of the weight that
    # carries no curvature (a Jacobian in `aux`, a derivative under `stop_hessian`)
    # would otherwise untie the layer, which lost its Kronecker block silently.
    tied, verdict = _ties([c for c in cands if id(c.outputs) in graph.reach])
    verdict = _outside_uses(cands, tied, graph, verdict)
    verdict = _stack_uses(cands, graph, verdict)
    verdict = _unused_declarations(cands, graph, verdict)
    return _partner_reasons(cands, graph, verdict)
