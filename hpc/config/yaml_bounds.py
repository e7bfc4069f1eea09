"""YAML read within bounds: a config's size in bytes, and its node count once aliases expand.

A 4 KB "billion laughs" (anchors of lists of aliases of anchors ...) is legal YAML: PyYAML builds
it as shared references in no time, but every copy the config system then makes (OmegaConf's
merge, the checks, the printout) walks it expanded, and `validate` ran for minutes in hundreds
of MB without a word. The composed node graph keeps aliases as shared nodes, so the expanded
count is found in linear time, before anything is built from it.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_BYTES = 1 << 20  # 1 MiB: the shipped configs are a few KB; a 50 MB file is a mistake
MAX_NODES = 100_000  # scalars, lists and mappings, aliases counted at every place they stand


def expanded_size(node: yaml.Node, memo: dict[int, int] | None = None) -> int:
    """Nodes in the document with every alias expanded (memoised by node: aliases share nodes)."""
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = MAX_NODES + 1  # a node inside itself (a recursive alias) is past any bound
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(expanded_size(k, memo) + expanded_size(v, memo) for k, v in node.value)
    else:
        size = 1
    memo[id(node)] = size
    return size


def load_bounded(text: str, loader: type[yaml.SafeLoader], where: str) -> Any:
    """`yaml.load(text, loader)`, refusing in one line a text past MAX_BYTES or MAX_NODES.
    YAML errors propagate as they would from yaml.load."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise ValueError(f"{where} is {len(text.encode('utf-8', 'surrogatepass')):,} bytes, over the "
                         f"{MAX_BYTES:,} a config may have; is it the right file?")
    reader = loader(text)
    try:
        node = reader.get_single_node()
        if node is None:
            return None
        if expanded_size(node) > MAX_NODES:
            raise ValueError(f"{where} expands to over {MAX_NODES:,} values once its YAML aliases (*name) are "
                             "followed; write the values out, or drop the aliases")
        return reader.construct_document(node)
    finally:
        reader.dispose()
