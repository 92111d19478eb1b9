"""The autograd nodes a loss's backward will run, by name: to check which mechanism a forward put in the graph."""
from __future__ import annotations

import torch


def graph_nodes(loss: torch.Tensor) -> set[str]:
    """The class names of every node reachable from ``loss.grad_fn``."""
    seen, names, todo = set(), set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [next_node for next_node, _ in node.next_functions]
    return names
