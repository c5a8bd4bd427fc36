"""Pytrees: a thin layer over optree, always in the ``fshard`` namespace.

Register your own containers with ``fs.tree.register_node(cls, flatten, unflatten)``
(optree's ``register_pytree_node`` with ``namespace="fshard"``). ``None`` is an empty
subtree, as in JAX.
"""

from __future__ import annotations

import optree

NAMESPACE = "fshard"


def flatten(tree, is_leaf=None):
    """``(leaves, treedef)``."""
    return optree.tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=False, namespace=NAMESPACE)


def unflatten(treedef, leaves):
    return optree.tree_unflatten(treedef, leaves)


def leaves(tree):
    return optree.tree_leaves(tree, none_is_leaf=False, namespace=NAMESPACE)


def structure(tree):
    return optree.tree_structure(tree, none_is_leaf=False, namespace=NAMESPACE)


def map(fn, tree, *rest, is_leaf=None):  # noqa: A001  (mirrors jax.tree.map)
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, none_is_leaf=False,
                           namespace=NAMESPACE)


def flatten_with_path(tree):
    """``(paths, leaves, treedef)`` where each path is a tuple of keys."""
    return optree.tree_flatten_with_path(tree, none_is_leaf=False, namespace=NAMESPACE)


def keystr(path) -> str:
    """``('w', 0)`` -> ``"['w'][0]"``: the key path as users index it."""
    return "".join(f"[{k!r}]" for k in path)


def broadcast_prefix(prefix_tree, full_tree, is_leaf=None):
    """Expand ``prefix_tree`` (e.g. ``in_axes``) to one entry per leaf of ``full_tree``.

    Raises ValueError (from optree, naming the key path) when the prefix does not match.
    """
    entries, spec = optree.tree_flatten(prefix_tree, is_leaf=is_leaf, none_is_leaf=True,
                                        namespace=NAMESPACE)
    out = []
    # An entry covering a subtree without leaves (an empty optimizer state) covers
    # nothing (optree's broadcast_prefix would still emit it once).
    for entry, sub in zip(entries, spec.flatten_up_to(full_tree)):
        out += [entry] * len(optree.tree_leaves(sub, none_is_leaf=False, namespace=NAMESPACE))
    return out


def register_node(cls, flatten_fn, unflatten_fn):
    """Register a container type: ``flatten_fn(x) -> (children, aux)``,
    ``unflatten_fn(aux, children) -> x``."""
    return optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)
