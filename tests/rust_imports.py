"""The module graph of a Rust crate, read off its source: every `use` tree (grouped `{..}` at any depth, `self`,
`super` chains, `crate`), every path written inline (`crate::a::f()`, `super::b::C`), names the crate root
re-exports (`use crate::Report` is an import of the module lib.rs re-exports it from), and the code of unit-test
modules kept apart (`#[cfg(test)] mod tests { .. }` inline, or a file declared under `#[cfg(test)]`), so that a
check can hold test code to its own rule instead of not reading it. Used by tests/test_layers.py; no Rust toolchain
needed.

A module is a tuple of path segments from the crate root: `("backups", "retain")`; lib.rs is `("lib",)`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

Module = tuple[str, ...]

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


@dataclasses.dataclass
class Graph:
    """Edges from each file module to the modules it imports: from its code, and from its unit-test code."""

    modules: set[Module]
    code: dict[Module, set[Module]]
    tests: dict[Module, set[Module]]


def file_module(src: pathlib.Path, path: pathlib.Path) -> Module:
    parts = path.relative_to(src).with_suffix("").parts
    return parts[:-1] if parts[-1] == "mod" else parts


_RAW_STRING = re.compile(r'r(#*)"')
_CHAR_LITERAL = re.compile(r"'(\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'])'")


def strip_comments(text: str) -> str:
    """The text without `//` and `/* */` comments and with string and char literals emptied (a `"//"` or a brace
    inside a string must not count), line structure kept."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "r" and (m := _RAW_STRING.match(text, i)) and not (i and re.match(r"\w", text[i - 1])):
            hashes = m[1]
            end = text.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and (m := _CHAR_LITERAL.match(text, i)):
            # A char literal ('{', '\''), not a lifetime ('a).
            out.append("' '")
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _matching_brace(text: str, open_at: int) -> int:
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


_TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + _IDENT + r")\s*([{;])")


def split_tests(code: str) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(code outside unit-test modules, [(name, body) of inline test modules], [names of test modules declared
    as files: `#[cfg(test)] mod tests;`])."""
    kept, inline, files = [], [], []
    at = 0
    for m in _TEST_MOD.finditer(code):
        if m.start() < at:
            continue
        kept.append(code[at:m.start()])
        if m[2] == ";":
            files.append(m[1])
            at = m.end()
        else:
            close = _matching_brace(code, m.end() - 1)
            inline.append((m[1], code[m.end():close]))
            at = close + 1
    kept.append(code[at:])
    return "".join(kept), inline, files


def expand_use_tree(tree: str) -> list[list[str]]:
    """`a::{b, c::{d, self}, e as f}` -> [[a, b], [a, c, d], [a, c], [a, e]] (glob `*` ends a path)."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+" + _IDENT, "", tree))  # `x as y` imports x

    def parse(s: str, prefix: list[str]) -> list[list[str]]:
        out: list[list[str]] = []
        for item in _split_top(s):
            if not item:
                continue
            brace = item.find("{")
            if brace >= 0:
                head = [p for p in item[:brace].split("::") if p]
                out += parse(item[brace + 1:item.rindex("}")], prefix + head)
                continue
            parts = [p for p in item.split("::") if p and p != "*"]
            if parts == ["self"]:
                out.append(list(prefix))
            else:
                out.append(prefix + parts)
        return out

    return parse(tree, [])


def _split_top(s: str) -> list[str]:
    items, depth, cur = [], 0, []
    for ch in s:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return items


_USE = re.compile(r"\buse\s+([^;]+);")
_INLINE_PATH = re.compile(r"(?<![A-Za-z0-9_:])((?:crate|super|self)(?:::(?:super|" + _IDENT + r"))+)")


def paths_in(code: str) -> list[list[str]]:
    """Every path `code` names through `use` or inline, as segment lists (leading `crate`/`super`/`self` kept)."""
    paths: list[list[str]] = []
    for m in _USE.finditer(code):
        tree = m[1].strip()
        if tree.startswith("::"):
            tree = tree[2:]
        paths += expand_use_tree(tree)
    without_uses = _USE.sub(";", code)
    paths += [hit[1].split("::") for hit in _INLINE_PATH.finditer(without_uses)]
    return paths


def resolve(path: list[str], here: Module, modules: set[Module], root_names: dict[str, Module]) -> Module | None:
    """The module a path from module `here` lands in (its longest prefix that is a module), or None (another
    crate, a name of `here` itself)."""
    if not path:
        return None
    first = path[0]
    if first == "crate":
        base: Module = ()
        rest = path[1:]
        if rest and (rest[0],) not in modules and rest[0] in root_names:
            return root_names[rest[0]]
    elif first in ("super", "self"):
        base = here
        rest = path
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                base = base[:-1]
            rest = rest[1:]
    else:
        # 2018 paths: a child module of `here`, else another crate (std, pyo3, ...).
        if here + (first,) not in modules:
            return None
        base, rest = here, path
    target = base + tuple(rest)
    while target and target not in modules:
        target = target[:-1]
    if not target and first == "crate":
        return None
    return target or None


def crate_root_names(src: pathlib.Path, modules: set[Module]) -> dict[str, Module]:
    """Names lib.rs re-exports (`pub use engine::{Report, Stats}` -> Report: engine)."""
    lib = src / "lib.rs"
    names: dict[str, Module] = {}
    if not lib.is_file():
        return names
    code, _, _ = split_tests(strip_comments(lib.read_text()))
    for m in re.finditer(r"\bpub\s+use\s+([^;]+);", code):
        for path in expand_use_tree(m[1].strip()):
            if not path:
                continue
            target = resolve(["crate"] + path, ("lib",), modules, {})
            if target:
                names[path[-1]] = target
    return names


def read_graph(src: pathlib.Path) -> Graph:
    files = {file_module(src, p): p for p in src.rglob("*.rs")}
    modules = set(files)
    root_names = crate_root_names(src, modules)
    code_edges: dict[Module, set[Module]] = {m: set() for m in modules}
    test_edges: dict[Module, set[Module]] = {m: set() for m in modules}
    test_files: set[Module] = set()
    parsed = {}
    for m, path in files.items():
        parsed[m] = split_tests(strip_comments(path.read_text()))
        # A module's own `#[cfg(test)] mod x;` makes file x all test code. For lib.rs, children are top modules.
        parent = () if m == ("lib",) else m
        test_files.update(parent + (name,) for name in parsed[m][2])
    for m, (code, inline, _) in parsed.items():
        # lib.rs paths are relative to the crate root.
        here = () if m == ("lib",) else m
        into = test_edges if m in test_files or any(m[:k] in test_files for k in range(1, len(m))) else code_edges
        for path in paths_in(code):
            target = resolve(path, here, modules, root_names)
            if target and target != m and target != here:
                into[m].add(target)
        for name, body in inline:
            for path in paths_in(body):
                target = resolve(path, here + (name,), modules, root_names)
                if target and target != m:
                    test_edges[m].add(target)
    return Graph(modules, code_edges, test_edges)
