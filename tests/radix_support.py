"""Radix-tree helpers shared by the radix, host-tier and agent-cost tests."""

from akv_jax.serving.radix import RadixTree


def insert(tree: RadixTree, keys: list) -> list:
    """Insert like the engine: match, then one node per token run / op, pages allocated.
    Token nodes carry absolute *token* indices (ops not counted), so that drop ranges name
    the tokens they drop; a repos node gets one page."""
    path = tree.match(keys)
    i = sum(len(n.key) for n in path)
    tok = sum(1 for k in keys[:i] if isinstance(k, int))
    parent = path[-1] if path else tree.root
    while i < len(keys):
        if isinstance(keys[i], int):
            j = i
            while j < len(keys) and isinstance(keys[j], int):
                j += 1
            node = tree.add_child(parent, tuple(keys[i:j]), "tokens", tok)
            node.pages = tree.alloc(-(-(j - i) // tree.page_size))
            tok += j - i
            i = j
        else:
            node = tree.add_child(parent, (keys[i],), keys[i][0])
            if keys[i][0] == "repos":
                node.held_tokens = tuple(range(tok))  # what it holds does not matter here
                node.pages = tree.alloc(1)
            i += 1
        path.append(node)
        parent = node
    return path
