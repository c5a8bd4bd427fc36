"""Rule tables: one table per rule kind, filled by the primitive declarations.

Tables are owned here (not by transforms) so that primitives can register rules
without importing transforms. Each primitive's registrations sit together in its
family module under ``fshard/primitives/``. ``describe(prim)`` lists what a
primitive has; ``unsupported(prim, kind, reason)`` records a deliberate gap.

Rule signatures (x: operands, t: tangents, ct: cotangents, d: batch dims):

- ``abstract_eval(*avals, **params) -> list[ArrayType]``
- ``impl(*tensors, **params) -> list[Tensor]``            (eager MindSpore)
- ``lowering(ctx, *exprs, **params) -> str``              (source of one expression)
- ``batching(args, dims, **params) -> (outs, out_dims)``
- ``jvp(primals, tangents, **params) -> (primals_out, tangents_out)``
- ``transpose(cts_out, *args, **params) -> cts_in``        (linear primitives)
- ``sharding(*avals, **params) -> FactorSpec``             (see fshard/core/factors.py)
"""

from __future__ import annotations

from typing import Callable, Generic, Protocol, TypeVar

from fshard.errors import MissingRuleError


class Primitive(Protocol):
    """What the rule tables need of a primitive: its name (``fshard.core.tracing``'s
    ``Primitive``, which sits above; rules only files primitives and looks them up)."""

    name: str

R = TypeVar("R", bound=Callable)

_registry: dict[str, Primitive] = {}


def register_primitive(prim: Primitive, family: str, module: str | None = None) -> Primitive:
    """Record a declared primitive (``def_primitive`` calls this), its family and the
    module that declares it (named in the errors of a missing rule)."""
    assert prim.name not in _registry, f"primitive {prim.name} declared twice"
    _registry[prim.name] = prim
    _families[prim.name] = family
    if module is not None:
        _modules[prim.name] = module
    return prim


_families: dict[str, str] = {}
_modules: dict[str, str] = {}

#: Primitives whose eager implementation takes ``fs.ShardedArray`` operands (this
#: process's block of a global array); every other eager operation refuses them.
takes_process_local: set = set()


def all_primitives() -> list[Primitive]:
    """Every declared primitive, in declaration order (``import fshard`` declares
    them all)."""
    return list(_registry.values())


def family_of(prim: Primitive) -> str:
    return _families.get(prim.name, "?")


class RuleTable(Generic[R]):
    """A table mapping primitives to one kind of rule."""

    def __init__(self, kind: str, what: str):
        self.kind = kind
        self.what = what  # used in the MissingRuleError message
        self._rules: dict[Primitive, R] = {}
        self._unsupported: dict[Primitive, str] = {}

    def set(self, prim: Primitive, rule: R) -> None:
        """Register ``prim``'s rule of this kind: the one way to register a rule."""
        assert prim not in self._rules, f"{self.kind} rule for {prim} registered twice"
        self._rules[prim] = rule

    def get(self, prim: Primitive) -> R | None:
        return self._rules.get(prim)

    def __contains__(self, prim: Primitive) -> bool:
        return prim in self._rules

    def lookup(self, prim: Primitive, *, transform: str) -> R:
        rule = self._rules.get(prim)
        if rule is None:
            reason = self._unsupported.get(prim)
            why = f" ({reason})" if reason else ""
            module = _modules.get(prim.name)
            where = (module.replace(".", "/").replace("fshard/transforms/", "transforms/")
                     + ".py" if module else "the module that declares it")
            raise MissingRuleError(
                f"{transform} needs the {self.what} of primitive '{prim}', which has "
                f"none{why}.\nFix: register one with fshard.rules.{self.kind}.set({prim}, "
                f"rule) in {where}, after its def_primitive (see "
                f"docs/adding_a_primitive.md), or avoid this primitive under {transform}.")
        return rule


abstract_eval: RuleTable = RuleTable("abstract_eval", "type rule")
impl: RuleTable = RuleTable("impl", "eager implementation")
lowering: RuleTable = RuleTable("lowering", "lowering rule")
batching: RuleTable = RuleTable("batching", "batching rule")
jvp: RuleTable = RuleTable("jvp", "JVP rule")
transpose: RuleTable = RuleTable("transpose", "transpose rule")
sharding: RuleTable = RuleTable("sharding", "sharding rule")

# Reverse mode splits a linearized Program into its known and linear parts by a taint
# from the tangents (transforms/ad.py ``partial_eval``). A primitive carrying a body
# that must split differently (``remat_call``: what to save and what to recompute)
# registers ``partial_eval(eq, unknown_mask) -> (known_eqs, unknown_eqs)``. Only such
# primitives have one, so the table is not among the kinds every primitive lists.
partial_eval: RuleTable = RuleTable("partial_eval", "partial-evaluation rule")

TABLES = {t.kind: t for t in (abstract_eval, impl, lowering, batching, jvp, transpose, sharding)}


def unsupported(prim: Primitive, kind: str, reason: str) -> None:
    """Record that ``prim`` deliberately has no ``kind`` rule, and why."""
    TABLES[kind]._unsupported[prim] = reason


def rule_status(prim: Primitive) -> dict[str, str]:
    """kind -> 'yes' | 'unsupported: <reason>' | 'missing'."""
    out = {}
    for kind, table in TABLES.items():
        if prim in table._rules:
            out[kind] = "yes"
        elif prim in table._unsupported:
            out[kind] = f"unsupported: {table._unsupported[prim]}"
        else:
            out[kind] = "missing"
    return out


def describe(prim: Primitive | str) -> str:
    """Which rules a primitive has.

    >>> import fshard as fs
    >>> print(fs.rules.describe("exp"))  # doctest: +ELLIPSIS
    exp (elementwise)
      abstract_eval: yes
    ...
    """
    if isinstance(prim, str):
        all_primitives()
        prim = _registry[prim]
    lines = [f"{prim.name} ({family_of(prim)})"]
    lines += [f"  {k}: {v}" for k, v in rule_status(prim).items()]
    return "\n".join(lines)
