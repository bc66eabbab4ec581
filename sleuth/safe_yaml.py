"""YAML from users' files, with the size of what it expands to bounded.

`yaml.safe_load` shares the node an alias points to, so a "billion laughs" document (ten aliases of ten
aliases of ... ) loads quickly and then hangs whatever walks it (a message that prints a value, a
validator, json.dumps). Here the document is composed into nodes first, its expanded size (every alias
counted as a full copy) is measured over the node graph in time linear in the distinct nodes, and only a
document under the bound is constructed. Recursive aliases and nesting too deep to compose are refused too.
"""

from __future__ import annotations

from pathlib import Path

# A run config or sleuth's config is tens of nodes; a playbook a few thousand. Far above any real file,
# far below what could hang a reader.
MAX_EXPANDED_NODES = 100_000
MAX_FILE_BYTES = 10 * 1024 * 1024
# As for JSON (sleuth.artifacts.MAX_JSON_DEPTH): no recursive reader downstream meets the recursion limit.
MAX_DEPTH = 64


class YamlLimitError(ValueError):
    """The document is refused before it is built; the message is one line."""


def load_yaml(text: str, *, max_nodes: int = MAX_EXPANDED_NODES) -> object:
    """Like yaml.safe_load (raises yaml.YAMLError on bad syntax), but refuses documents that expand past
    `max_nodes` nodes, hold a recursive alias, or nest too deeply."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise YamlLimitError("YAML nested too deeply to read") from None
        if node is None:
            return None
        _check_expanded_size(node, max_nodes)
        try:
            return loader.construct_document(node)
        except RecursionError:
            raise YamlLimitError("YAML nested too deeply to read") from None
        except yaml.YAMLError:
            raise
        except (ValueError, OverflowError) as exc:  # an integer of 5000 digits, a timestamp out of range
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise YamlLimitError(f"YAML holds a value that cannot be read: {first}") from None
    finally:
        loader.dispose()


def read_text_file(path: Path, *, what: str, max_bytes: int = MAX_FILE_BYTES, within: Path | None = None) -> str:
    """A user's text file, size-capped and strictly UTF-8, read under sleuth.artifacts' discipline (a regular
    file: a FIFO is refused, not waited on; inside `within` when given). YamlLimitError / UnicodeDecodeError /
    OSError carry one-line reasons for the caller to wrap."""
    from sleuth.artifacts import ArtifactError, read_bytes, shown

    try:
        data = read_bytes(path, max_bytes=max_bytes, within=within)
    except ArtifactError as exc:
        raise YamlLimitError(f"{what} {shown(path)} {exc.reason}") from None
    return data.decode("utf-8")


def describe_decode_error(exc: UnicodeDecodeError) -> str:
    return f"is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"


def _children(node: object) -> list[object]:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expanded_size(root: object, max_nodes: int) -> None:
    """Post-order walk of the node graph: a node's expanded size is 1 + its children's, each shared node
    measured once. A node met again while it is still open is an alias to an ancestor: a cycle.
    Depth is measured the same way (1 + the deepest child)."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            children = _children(node)
            total = 1 + sum(sizes[id(child)] for child in children)
            if total > max_nodes:
                raise YamlLimitError(f"YAML expands to more than {max_nodes} nodes through its aliases "
                                     "(an alias bomb?); refused")
            depth = 1 + max((depths[id(child)] for child in children), default=0)
            if depth > MAX_DEPTH:
                raise YamlLimitError(f"YAML nested too deeply to read (more than {MAX_DEPTH} levels)")
            sizes[key], depths[key] = total, depth
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise YamlLimitError("YAML holds a recursive alias (a node that contains itself); refused")
        open_nodes.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in open_nodes:
                raise YamlLimitError("YAML holds a recursive alias (a node that contains itself); refused")
            if id(child) not in sizes:
                stack.append((child, False))
