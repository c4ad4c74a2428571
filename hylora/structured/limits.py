"""Pre-compile bounds: cheap checks of a spec's shape, made before anything is compiled.

llguidance compiles in native code, recursively: a spec that is deep enough overflows the
compiling thread's stack (SIGSEGV: the whole process dies), and some small specs compile but
fail at the first token. The checks here refuse the shapes that do, with a StructuredOutputError
(HTTP 400) that names the bound and the value found. They are iterative (no Python recursion on
client data) and linear in the spec's size (at most 256 K characters). What they miss is caught
by the probe (structured/probe.py) in a worker process with a small stack (structured/sandbox.py).

The bounds, measured with llguidance 1.9.1; each is far above real schemas and grammars and at or
below what llguidance itself survives:

- MAX_JSON_DEPTH = 100 nested objects/arrays in a schema document. llguidance refuses 124 and
  more (serde_json's recursion limit of 128 on the grammar that wraps the schema); Python's json
  recurses once per level (a 950-deep string raised RecursionError: a 500 before).
- MAX_SCHEMA_DEPTH = 256: the deepest path through the schema with its `$ref`s followed, a level
  of nesting counting 1 and a `$ref` REF_WEIGHT = 2 (`deepest_path`: the longest path once
  recursion is folded, or a depth-first walk expanding each definition once, whichever is deeper).
  llguidance uses ~1–2 KB of native stack per level and 3.4 KB per bare `$ref` hop (9.4 KB when
  each definition wraps the next in an object): 2,500 hops overflowed an 8 MiB thread, 600 a 2 MiB
  one; 60 definitions each nesting the next 90 arrays deep (150 KB, within the JSON depth bound)
  overflowed 8 MiB too. 256 keeps the worst measured shape under 1 MiB; real schemas (nested
  models through `$defs`) stay well under 100.
- MAX_REFS = 4096 `$ref`s and MAX_DEFINITIONS = 2048 entries of `$defs` / `definitions`.
- no finite document: a schema whose root needs itself (a required property, an item of a
  non-empty array, an allOf member or every anyOf branch that refers back, a bare `$ref` loop)
  is refused; llguidance compiles it and then fails at the first mask or token (forced tokens
  without end: "Too many items ... ff_tokens").
- MAX_REGEX_NESTING = 64 nested groups (the regex parser refuses 251);
  MAX_REGEX_SIZE = 20,000 elements with counted repetitions unrolled (`x{m,n}` counts n times x,
  `*` `+` `?` once; alternatives add up). `(a{1000}){1000}` (10⁶) compiles, spends 0.5 s and
  250 MB on the first mask and fails at the first token ("too many expressions constructed").
  Below that, every mask costs ~0.08 ms per 1,000 elements still to come (200k vocabulary):
  `a{100000}` 7.7 ms at every step of the request, which the whole batch waits for; 20,000 keeps
  it near 1.5 ms (`[a-z]{1,100000}`: 1 ms). Checked for the regex kind, `whitespace_pattern`,
  JSON schema `pattern`s and `patternProperties`, Lark `/regex/` literals and each grammar rule.
- grammars (structured/rules.py): MAX_RULES, MAX_RULE_DEPTH, MAX_GROUP_NESTING, MAX_ALTERNATIVES.
- choice lists: MAX_CHOICES (structured/spec.py).
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterable
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from hylora.structured.errors import StructuredOutputError

if TYPE_CHECKING:
    from hylora.structured.spec import StructuredSpec

MAX_JSON_DEPTH = 100
MAX_SCHEMA_DEPTH = 256
REF_WEIGHT = 2
MAX_REFS = 4096
MAX_DEFINITIONS = 2048
MAX_REGEX_NESTING = 64
MAX_REGEX_SIZE = 20_000


def check_spec(spec: StructuredSpec) -> None:
    """Raise StructuredOutputError when `spec` is over a bound; cost linear in its size."""
    from hylora.structured.rules import check_grammar
    from hylora.structured.spec import MAX_CHOICES

    if spec.whitespace_pattern is not None:
        check_regex(spec.whitespace_pattern, "whitespace_pattern")
    if spec.kind == "json_schema":
        text = str(spec.payload)
        depth = json_text_depth(text)
        if depth > MAX_JSON_DEPTH:
            raise StructuredOutputError(
                f"the JSON schema is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted"
            )
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
        check_json_schema(schema)
    elif spec.kind == "regex":
        check_regex(str(spec.payload), "regex")
    elif spec.kind == "choice":
        if len(spec.payload) > MAX_CHOICES:
            raise StructuredOutputError(f"the choice list has {len(spec.payload)} entries; at most {MAX_CHOICES}")
    elif spec.kind == "grammar":
        check_grammar(str(spec.payload))


# --- JSON nesting ----------------------------------------------------------------------------

# a string, or what is left of an unterminated one: possessive, so it never fails and never backtracks
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]++")
_BRACKET_DELTA = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_text_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON text (strings skipped), at C speed."""
    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text))
    return max(0, max(accumulate(map(_BRACKET_DELTA.__getitem__, brackets)), default=0))


def object_depth(value: Any, limit: int) -> int:
    """The nesting of dicts and lists in `value`, or limit + 1 as soon as it is deeper."""
    deepest = 0
    seen: dict[int, int] = {}  # a container shared by several parents is walked again only when met deeper
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Iterable[Any] = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > limit:
            return limit + 1
        if seen.get(id(node), 0) >= depth:
            continue
        seen[id(node)] = depth
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return deepest


# --- JSON schemas ----------------------------------------------------------------------------

_LITERALS = {"enum", "const", "default", "examples"}  # data, not schemas
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_DEFINITION_MAPS = {"$defs", "definitions"}
_SCALAR_TYPES = {"string", "number", "integer", "boolean", "null"}


class _Schema:
    """One schema object of a document, for the ref walk and the finite-document check."""

    __slots__ = ("value", "parent", "key", "children", "ref", "clauses")

    def __init__(self, value: dict, parent: _Schema | None, key: str):
        self.value = value
        self.parent = parent
        self.key = key  # the JSON pointer step(s) from the parent
        self.children: list[_Schema] = []  # subschemas, definitions ($defs) excluded: reached through $refs only
        self.ref: Any = None  # the $ref target: a _Schema, True/False (boolean schemas), None (not local)
        self.clauses: list[list[Any]] = []  # each: schemas one of which must have a finite instance

    def pointer(self) -> str:
        steps: list[str] = []
        node: _Schema | None = self
        while node is not None and node.parent is not None:
            steps.append(node.key)
            node = node.parent
        return "#" + "".join(f"/{s}" for s in reversed(steps))


def check_json_schema(schema: Any) -> None:
    """Bounds on `$ref`s and definitions, the regexes inside, and that the root has a finite instance."""
    if not isinstance(schema, dict):
        return
    root = _Schema(schema, None, "")
    nodes = [root]
    refs = definitions = 0
    pending = [root]
    while pending:  # every schema object of the document
        node = pending.pop()
        for key, value in node.value.items():
            if key in _LITERALS:
                continue
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                if key in _DEFINITION_MAPS:
                    definitions += len(value)
                    if definitions > MAX_DEFINITIONS:
                        raise StructuredOutputError(
                            f"the JSON schema has more than {MAX_DEFINITIONS} definitions ($defs / definitions); "
                            f"at most {MAX_DEFINITIONS} are accepted"
                        )
                if key == "patternProperties":
                    for pattern in value:
                        check_regex(pattern, "a patternProperties key of the JSON schema")
                items = [(f"{_step(key)}/{_step(k)}", v) for k, v in value.items()]
            elif isinstance(value, dict):
                items = [(_step(key), value)]
            elif isinstance(value, list):
                items = [(f"{_step(key)}/{i}", v) for i, v in enumerate(value)]
            else:
                if key == "$ref" and isinstance(value, str):
                    refs += 1
                    if refs > MAX_REFS:
                        raise StructuredOutputError(
                            f"the JSON schema has more than {MAX_REFS} $refs; at most {MAX_REFS} are accepted"
                        )
                elif key == "pattern" and isinstance(value, str):
                    check_regex(value, "a pattern of the JSON schema")
                continue
            for child_key, child in items:
                if isinstance(child, dict):
                    sub = _Schema(child, node, child_key)
                    if key not in _DEFINITION_MAPS:
                        node.children.append(sub)
                    nodes.append(sub)
                    pending.append(sub)
    by_id = {id(n.value): n for n in nodes}
    for node in nodes:
        ref = node.value.get("$ref")
        if isinstance(ref, str):
            node.ref = _resolve(schema, ref, by_id)
    _check_schema_depth(root, nodes)
    _check_finite(root, nodes, by_id)


def _step(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _resolve(root: dict, ref: str, by_id: dict[int, _Schema]) -> Any:
    """The schema a local `$ref` ("#", "#/json/pointer") names: a _Schema, a boolean schema, or None."""
    if not ref.startswith("#"):
        return None
    target: Any = root
    for step in urllib.parse.unquote(ref[1:]).split("/")[1:]:
        step = step.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and step in target:
            target = target[step]
        elif isinstance(target, list) and step.isdigit() and int(step) < len(target):
            target = target[int(step)]
        else:
            return None  # llguidance reports the missing target
    if isinstance(target, bool):
        return target
    return by_id.get(id(target)) if isinstance(target, dict) else None


def _check_schema_depth(root: _Schema, nodes: list[_Schema]) -> None:
    """The deepest path through the schema with its `$ref`s followed, a nesting level counting 1
    and a `$ref` REF_WEIGHT (a `$ref` costs llguidance about twice the stack of a level)."""
    number = {id(n): i for i, n in enumerate(nodes)}
    edges: list[list[tuple[int, int]]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        edges[i] = [(number[id(c)], 1) for c in node.children]
        if isinstance(node.ref, _Schema):
            edges[i].append((number[id(node.ref)], REF_WEIGHT))
    depth = deepest_path(edges, number[id(root)])
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(
            f"the JSON schema is {depth} levels deep with its $refs followed (each $ref counts {REF_WEIGHT}); "
            f"at most {MAX_SCHEMA_DEPTH} are accepted"
        )


def deepest_path(edges: list[list[tuple[int, int]]], root: int) -> int:
    """How deep a recursive compile from `root` can go over a graph of (node, weight) edges: the
    larger of the longest path once each cycle is folded into one node (strongly connected
    components, Tarjan), and the deepest path of a depth-first walk that expands each node once
    (inside cycles). Iterative, linear."""
    n = len(edges)
    # depth-first walk, each node expanded once
    expanded = [False] * n
    walk_deepest = 0
    stack = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if expanded[node]:
            continue
        expanded[node] = True
        walk_deepest = max(walk_deepest, depth)
        stack.extend((child, depth + weight) for child, weight in reversed(edges[node]) if not expanded[child])
    # strongly connected components (emitted sinks first), then the longest path over them
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    component = [-1] * n
    longest: list[int] = []
    counter = 0
    scc_stack: list[int] = []
    work = [(root, 0)]
    index[root] = low[root] = counter = 0
    counter = 1
    scc_stack.append(root)
    on_stack[root] = True
    while work:
        v, i = work[-1]
        if i < len(edges[v]):
            work[-1] = (v, i + 1)
            w = edges[v][i][0]
            if index[w] < 0:
                index[w] = low[w] = counter
                counter += 1
                scc_stack.append(w)
                on_stack[w] = True
                work.append((w, 0))
            elif on_stack[w]:
                low[v] = min(low[v], index[w])
            continue
        work.pop()
        if work:
            u = work[-1][0]
            low[u] = min(low[u], low[v])
        if low[v] == index[v]:
            c = len(longest)
            members = []
            while True:
                x = scc_stack.pop()
                on_stack[x] = False
                component[x] = c
                members.append(x)
                if x == v:
                    break
            best = 0
            for x in members:
                for y, weight in edges[x]:
                    if component[y] != c:
                        best = max(best, weight + longest[component[y]])
            longest.append(best)
    return max(walk_deepest, longest[component[root]])


def _check_finite(root: _Schema, nodes: list[_Schema], by_id: dict[int, _Schema]) -> None:
    """Refuse a root that admits no finite document: the least fixpoint of "has a finite
    instance" over the schemas, through the keywords that force a subschema into every instance.
    Anything not understood counts as finite (never a false refusal)."""
    for node in nodes:
        _clauses(node, by_id)
    # counter-based propagation (Horn satisfiability): a node is finite once each of its clauses has a finite member
    waiting = {id(n): len(n.clauses) for n in nodes}
    users: dict[int, list[tuple[_Schema, int]]] = {}
    finite: set[int] = set()
    ready = [n for n in nodes if not n.clauses]
    for node in nodes:
        for i, clause in enumerate(node.clauses):
            for member in clause:
                users.setdefault(id(member), []).append((node, i))
    satisfied: set[tuple[int, int]] = set()
    while ready:
        node = ready.pop()
        if id(node) in finite:
            continue
        finite.add(id(node))
        for user, i in users.get(id(node), ()):
            if (id(user), i) in satisfied:
                continue
            satisfied.add((id(user), i))
            waiting[id(user)] -= 1
            if waiting[id(user)] == 0:
                ready.append(user)
    if id(root) not in finite:
        raise StructuredOutputError(
            "the JSON schema admits no finite document: every instance of "
            f"{_culprit(root, finite).pointer()} must contain another one (a required property, an item of a "
            "non-empty array or an allOf member that refers back to it, or a $ref loop)"
        )


def _culprit(root: _Schema, finite: set[int]) -> _Schema:
    """A $ref target on the root's infinite part, for the message (the root if none)."""
    stack, seen = [root], {id(root)}
    while stack:
        node = stack.pop()
        if isinstance(node.ref, _Schema) and id(node.ref) not in finite:
            return node.ref
        for clause in node.clauses:
            for member in clause:
                if isinstance(member, _Schema) and id(member) not in seen and id(member) not in finite:
                    seen.add(id(member))
                    stack.append(member)
    return root


def _clauses(node: _Schema, by_id: dict[int, _Schema]) -> None:
    value = node.value

    def schema(v: Any) -> Any:  # a clause member: a _Schema, or None when not analysable (counts as finite)
        if v is True or v == {}:
            return None
        if v is False:
            return _NEVER
        return by_id.get(id(v)) if isinstance(v, dict) else None

    def need(*options: Any) -> None:
        members = [schema(o) for o in options]
        if any(m is None for m in members):
            return  # one option is finite or unknown: no constraint
        node.clauses.append([m for m in members if m is not _NEVER])

    if node.ref is False:
        node.clauses.append([])
    elif isinstance(node.ref, _Schema):
        node.clauses.append([node.ref])
    for key in ("allOf",):
        if isinstance(value.get(key), list):
            for member in value[key]:
                need(member)
    for key in ("anyOf", "oneOf"):
        if isinstance(value.get(key), list) and value[key]:
            need(*value[key])
    types = value.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if not types or any(t in _SCALAR_TYPES or not isinstance(t, str) for t in types):
        return  # a scalar instance (or an unknown type) is finite
    if types == ["object"]:
        properties = value.get("properties") if isinstance(value.get("properties"), dict) else {}
        extra = value.get("additionalProperties", True)
        for name in value.get("required", []) if isinstance(value.get("required"), list) else []:
            if not isinstance(name, str):
                continue
            need(properties.get(name, extra))
    elif types == ["array"]:
        low = value.get("minItems", 0)
        low = low if isinstance(low, int) and not isinstance(low, bool) else 0
        prefix = value.get("prefixItems") if isinstance(value.get("prefixItems"), list) else []
        items = value.get("items", True)
        if isinstance(items, list):  # draft-04 tuple form
            prefix, items = items, value.get("additionalItems", True)
        for i in range(min(low, len(prefix))):
            need(prefix[i])
        if low > len(prefix):
            need(items)


class _Never:
    """The `false` schema: no instance at all."""


_NEVER = _Never()


# --- regexes ---------------------------------------------------------------------------------

_REGEX_TOKEN = re.compile(
    r"""(?P<flags> \(\?[A-Za-z-]*\) )                                   # (?i): sets flags, no group
    | (?P<open> \((?:\?(?:P?<[A-Za-z_][A-Za-z_0-9]*>|[A-Za-z-]*:))? )  # ( (?: (?i: (?P<name> (?<name>
    | (?P<close> \) )
    | (?P<repeat> \{(\d+)(,(\d*))?\} )                               # {m} {m,} {m,n}
    | (?P<atom> \\[pPxu]\{[^}]*\}? | \\. | [^\\\[(){] | \{ | \\\Z )   # \p{Greek} \x{10FFFF} \n a * + ? |
    """,
    re.S | re.X,
)
_CLASS_TOKEN = re.compile(r"\\.?|\[:\^?[a-z]+:\]|\[|\]|[^\\\[\]]++", re.S)


def check_regex(pattern: str, what: str) -> None:
    """Bound a regex's group nesting and its size with counted repetitions unrolled."""
    depth, size = regex_shape(pattern)
    if depth > MAX_REGEX_NESTING:
        raise StructuredOutputError(f"{what} nests {depth} groups deep; at most {MAX_REGEX_NESTING} are accepted")
    if size > MAX_REGEX_SIZE:
        raise StructuredOutputError(
            f"{what} is {size:,} elements long with its counted repetitions ({{m,n}}) unrolled; "
            f"at most {MAX_REGEX_SIZE:,} are accepted"
        )


def regex_shape(pattern: str) -> tuple[int, int]:
    """(deepest group nesting, size with counted repetitions unrolled: an atom counts 1, a group
    the sum of its elements over all alternatives, `x{m,n}` n times x; `*` `+` `?` count once).
    One pass over the pattern, no recursion."""
    frames = [0]  # per open group: the size of its elements so far
    last = 0  # the size of the last element (what a repetition multiplies); 0: nothing to repeat
    deepest = 0
    pos, end = 0, len(pattern)
    while pos < end:
        if pattern[pos] == "[":
            pos = _skip_class(pattern, pos)
            frames[-1] += 1
            last = 1
            continue
        m = _REGEX_TOKEN.match(pattern, pos)
        if m is None:  # cannot happen: "atom" takes any single character
            break
        pos = m.end()
        kind = m.lastgroup
        if kind == "open":
            frames.append(0)
            deepest = max(deepest, len(frames) - 1)
            last = 0
        elif kind == "close":
            last = frames.pop() if len(frames) > 1 else 0
            frames[-1] += last
        elif kind == "repeat":
            low, comma, high = int(m.group(5)), m.group(6), m.group(7)
            count = int(high) if comma and high else low
            if last:
                grown = min(last * count, 10**18)
                frames[-1] += grown - last
                last = grown
        elif kind == "atom" and m.group() not in ("*", "+", "?", "|"):
            frames[-1] += 1
            last = 1
        elif kind == "atom" and m.group() == "|":
            last = 0
    return deepest, sum(frames)


def _skip_class(pattern: str, pos: int) -> int:
    """The end of the character class that opens at `pos` (classes nest in Rust's syntax; a `]`
    right after `[` or `[^` is a literal)."""
    depth, i, end = 0, pos, len(pattern)
    while i < end:
        m = _CLASS_TOKEN.match(pattern, i)
        if m is None:
            return end
        token, i = m.group(), m.end()
        if token == "[":
            depth += 1
            if pattern.startswith("^", i):
                i += 1
            if pattern.startswith("]", i):
                i += 1
        elif token == "]":
            depth -= 1
            if depth == 0:
                return i
    return end
