"""Canonical ONNX graphs: the same computation always serializes to the same bytes.

ONNX Runtime's offline optimizer numbers the nodes it inserts (e.g. NCHWc `ReorderOutput_token_89`) from hash-map
iteration, so two compiles of one model differ in node order and names while computing the same thing. This pass
orders nodes topologically with a structural tie-break and renames inserted nodes and intermediate tensors by
position. Graph inputs, outputs and initializers keep their names.
"""

from __future__ import annotations

import heapq

import onnx


def canonicalize(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = model.graph
    keep = {v.name for v in graph.input} | {v.name for v in graph.output} | {i.name for i in graph.initializer}
    nodes = list(graph.node)
    producers = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    deps = [{producers[t] for t in n.input if t in producers} for n in nodes]
    users: dict[int, list[int]] = {i: [] for i in range(len(nodes))}
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    rename: dict[str, str] = {}

    def key(i: int) -> tuple:
        n = nodes[i]
        attrs = b"".join(a.SerializeToString() for a in n.attribute)
        return (n.domain, n.op_type, tuple(rename.get(t, t) for t in n.input), attrs)

    pending = [len(ds) for ds in deps]
    ready = [(key(i), i) for i in range(len(nodes)) if pending[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for j, out in enumerate(nodes[i].output):
            if out and out not in keep:
                rename[out] = f"t{len(order) - 1}_{j}"
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, (key(u), u))
    if len(order) != len(nodes):
        raise ValueError("graph has a cycle; cannot canonicalize")
    new_nodes = []
    for pos, i in enumerate(order):
        n = onnx.NodeProto()
        n.CopyFrom(nodes[i])
        n.name = f"{n.op_type}_{pos}"
        n.input[:] = [rename.get(t, t) for t in n.input]
        n.output[:] = [rename.get(t, t) for t in n.output]
        new_nodes.append(n)
    graph.ClearField("node")
    graph.node.extend(new_nodes)
    for vi in graph.value_info:
        vi.name = rename.get(vi.name, vi.name)
    values = sorted(graph.value_info, key=lambda v: v.name)
    graph.ClearField("value_info")
    graph.value_info.extend(values)
    return model
