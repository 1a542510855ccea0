"""Reading a manifest's YAML safely: floats like ``1e-4`` as numbers (YAML 1.2 style), duplicate
keys refused, recursive aliases and alias bombs refused, every failure one ``ManifestError``."""

from __future__ import annotations

import re
from typing import Any

import yaml

from aotc.errors import ManifestError

__all__ = ["load_yaml"]

_MAX_ALIAS_EXPANSION = 100_000  # nodes a document may expand to through aliases (YAML bombs)


def _check_aliases(root: yaml.Node) -> None:
    """Refuse a node graph that aliases make cyclic, or expand (billion laughs) to more than
    ``_MAX_ALIAS_EXPANSION`` nodes; iterative, linear in the distinct nodes."""
    size: dict[int, int] = {}  # id(node) -> nodes once expanded
    ancestors: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    distinct = 0

    def children(n: yaml.Node) -> list[yaml.Node]:
        if isinstance(n, yaml.MappingNode):
            return [c for pair in n.value for c in pair]
        return list(n.value) if isinstance(n, yaml.SequenceNode) else []

    while stack:
        node, done = stack.pop()
        if done:
            ancestors.discard(id(node))
            size[id(node)] = 1 + sum(size[id(c)] for c in children(node))
            if size[id(node)] > max(_MAX_ALIAS_EXPANSION, distinct):
                raise yaml.composer.ComposerError(
                    None, None, f"aliases expand to more than {_MAX_ALIAS_EXPANSION} values "
                    "(a YAML bomb?); write the values out", node.start_mark)
            continue
        if id(node) in size:
            continue
        ancestors.add(id(node))
        distinct += 1
        stack.append((node, True))
        for c in children(node):
            if id(c) in ancestors:
                raise yaml.composer.ComposerError(
                    None, None, "recursive alias (an alias inside its own anchor)", c.start_mark)
            stack.append((c, False))


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float, refuses duplicate keys, recursive aliases and
    alias bombs."""

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _check_aliases(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str, file: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(e.problem or e.context or "syntax error").split())
        raise ManifestError(file, where, f"invalid YAML: {problem}") from None
    except yaml.YAMLError as e:
        raise ManifestError(file, "", f"invalid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ManifestError(file, "", "invalid YAML: nested too deeply; flatten the document") from None
    except ValueError as e:  # an impossible date (2024-13-45), an int of over 4300 digits
        why = " ".join(str(e).split("; use sys.set_int_max_str_digits")[0].split())
        raise ManifestError(file, "", f"invalid YAML: cannot read a value ({why}); "
                                      "quote it if it is meant as a string") from None


