"""Pre-compile bounds for grammars: the rule structure of a Lark or GBNF text, read in one pass.

The text is scanned once, without recursion (linear-time token regexes, an explicit stack for
groups), into rules: each rule's references, group nesting, alternatives, counted repetitions and
a small AND/OR tree of what it needs to derive a finite text. `check_grammar` then refuses:

- more than MAX_RULES = 2048 rules (real grammars have tens to a few hundred);
- an expansion nested deeper than MAX_RULE_DEPTH = 400 from the start rule, a rule reference
  counting RULE_WEIGHT = 2 and each group around it 1 (limits.deepest_path: the longest chain
  once cycles are folded, or a depth-first walk, whichever is deeper). llguidance's compile
  recurses per rule and per group, ~3.2 KB and ~1.9 KB of native stack: 2,400 chained rules
  overflowed an 8 MiB thread, and so did 198 rules that each wrap the next in 23 groups (a shape
  that counting rules alone lets through); 400 keeps the worst measured shape under ~800 KB;
- groups ( ) / [ ] nested deeper than MAX_GROUP_NESTING = 24 (llguidance's Lark parser stops at
  28; the GBNF converter, Python, recurses per level);
- more than MAX_ALTERNATIVES = 1024 alternatives in one group (Earley rows hold 2000 items);
- a rule body, or a /regex/ literal, over the regex bounds (structured/limits.py: nesting, size
  with counted repetitions `{m,n}` / `~ m..n` unrolled); inline `%json { ... }` schemas get the
  JSON schema bounds;
- a start rule that derives no finite text (every alternative needs the rule itself again, as in
  `start: a` + `a: a "x"`): llguidance compiles it and fails at the first mask or token.

Unknown syntax never causes a refusal: what the scanner does not understand counts as a finite,
reference-free atom, and the finite-text check is skipped when the text uses templates.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from hylora.structured.errors import StructuredOutputError
from hylora.structured.grammar import is_lark
from hylora.structured.limits import (
    MAX_JSON_DEPTH,
    MAX_REGEX_SIZE,
    check_json_schema,
    check_regex,
    deepest_path,
    json_text_depth,
)

MAX_RULES = 2048
MAX_RULE_DEPTH = 400
RULE_WEIGHT = 2
MAX_GROUP_NESTING = 24
MAX_ALTERNATIVES = 1024

# Every pattern is linear: possessive loops, and strings / regexes that run to the line's end
# rather than fail when unterminated (a failed attempt would be retried at every later quote).
_COMMON = r"""
      (?P<nl> \n )
    | (?P<ws> [ \t\r\f\v]++ )
    | (?P<comment> (?://|\#)[^\n]*+ )
    | (?P<string> "(?:[^"\\\n]++|\\.)*+"?i? )
    | (?P<regex> /(?:[^/\\\n]++|\\.)*+(?:/[imslux]*+)? )
    | (?P<directive> %[A-Za-z_]++ )
    | (?P<special> <[^<>\n]*+> )
    | (?P<ident> [A-Za-z0-9_][A-Za-z0-9_\-]*+ )
    | (?P<gref> @[A-Za-z0-9_\-]++ )
    | (?P<repeat> \{[ \t]*+(?P<low>\d*+)[ \t]*+(?:(?P<comma>,)[ \t]*+(?P<high>\d*+)[ \t]*+)?\} )
    | (?P<tilde> ~[ \t]*+(?P<tlow>\d++)(?:[ \t]*+\.\.[ \t]*+(?P<thigh>\d++))? )
    | (?P<arrow> -> )
"""
_LARK_TOKEN = re.compile(_COMMON + r"| (?P<op> . )", re.X)
_GBNF_TOKEN = re.compile(_COMMON + r"| (?P<cls> \[(?:[^\]\\\n]++|\\.)*+\]? ) | (?P<op> . )", re.X)
_LARK_HEAD = re.compile(
    r"[ \t]*+[?!]?(?P<name>[A-Za-z_][A-Za-z0-9_\-]*+)(?:\.-?\d++)?(?:\[[^\]\n]*+\])?(?P<template>\{[^}\n]*+\})?"
    r"[ \t]*+:(?!:)"
)
_GBNF_HEAD = re.compile(r"[ \t]*+(?P<name>[A-Za-z0-9_\-]++)[ \t]*+::=")
_JSON_PART = re.compile(r'"(?:[^"\\]++|\\.)*+"?|[{}\[\]]|[^"{}\[\]]++', re.S)
_JSON_DIRECTIVES = ("%json", "%regex", "%llguidance")


@dataclass
class _Rule:
    name: str
    refs: list[tuple[str, int]] = field(default_factory=list)  # (rule name, groups around the reference)
    body: tuple = ("atom",)  # the AND/OR tree: ("alt" | "seq", [...]) / ("ref", name) / ("atom",)


@dataclass
class GrammarShape:
    rules: dict[str, _Rule]
    start: str
    definitions: int = 0  # rule heads, redefinitions included
    max_nesting: int = 0
    opaque: bool = False  # templates or unbalanced groups: the finite-text check would be unsound


def check_grammar(text: str) -> None:
    """Raise StructuredOutputError when a Lark / GBNF grammar is over a bound (see the module doc)."""
    shape = read_grammar(text)  # refuses too many rules, groups, alternatives, repetitions on the way
    if shape.start not in shape.rules:
        return  # llguidance names the missing start rule
    depth = _rule_depth(shape)
    if depth > MAX_RULE_DEPTH:
        raise StructuredOutputError(
            f"the grammar nests {depth} levels deep from `{shape.start}` through its rules (a rule reference "
            f"counts {RULE_WEIGHT}, each group around it 1, a cycle once); at most {MAX_RULE_DEPTH} are accepted"
        )
    if not shape.opaque:
        culprit = _infinite(shape)
        if culprit is not None:
            raise StructuredOutputError(
                f"the grammar derives no finite text: every alternative of `{culprit}` needs `{culprit}` again "
                "(directly or through other rules), so no output could ever end"
            )


def read_grammar(text: str) -> GrammarShape:
    """The rules of a Lark grammar, or of a GBNF / EBNF one (`name ::= ...`): one pass, no recursion."""
    lark = is_lark(text)
    token_re, head_re = (_LARK_TOKEN, _LARK_HEAD) if lark else (_GBNF_TOKEN, _GBNF_HEAD)
    shape = GrammarShape({}, "start" if lark else "root")
    rule: _Rule | None = None
    frames: list[dict] = []
    pos, end, line_start = 0, len(text), True
    while pos < end:
        if line_start:
            line_start = False
            head = head_re.match(text, pos)
            if head is not None:
                if rule is not None:
                    _close(rule, frames, shape)
                rule, frames = _Rule(head.group("name")), [_frame(None)]
                shape.rules.setdefault(rule.name, rule)  # a redefinition: llguidance reports it
                shape.definitions += 1
                if shape.definitions > MAX_RULES:
                    raise StructuredOutputError(
                        f"the grammar has more than {MAX_RULES} rules; at most {MAX_RULES} are accepted"
                    )
                if head.groupdict().get("template"):
                    shape.opaque = True
                pos = head.end()
                continue
        m = token_re.match(text, pos)
        if m is None:  # cannot happen: "op" takes any character but a newline, "nl" takes that
            break
        kind, pos = m.lastgroup or "op", m.end()
        if kind == "nl":
            line_start = True
        elif kind == "directive" and m.group() in _JSON_DIRECTIVES:
            after = _skip_json(text, pos, m.group() == "%json")
            if after is not None:
                pos = after
                if rule is not None:
                    _atom(frames[-1], ("atom",))
        elif kind == "directive" and rule is None or kind == "directive" and m.group() in ("%ignore", "%import"):
            newline = text.find("\n", pos)
            pos = end if newline < 0 else newline  # %ignore / %import / ...: a line of its own
        elif rule is not None and kind not in ("ws", "comment"):
            _body_token(rule, frames, shape, kind, m, lark)
    if rule is not None:
        _close(rule, frames, shape)
    return shape


def _frame(closer: str | None) -> dict:
    # alts: finished alternatives; seq: the current one; size: elements inside with counted
    # repetitions unrolled; last: the size of the last element (what a repetition multiplies)
    return {"alts": [], "seq": [], "closer": closer, "size": 0, "last": 0, "alias": False}


def _body_token(rule: _Rule, frames: list[dict], shape: GrammarShape, kind: str, m: re.Match, lark: bool) -> None:
    text, top = m.group(), frames[-1]
    if kind == "ident":
        if top["alias"]:  # `-> alias` names a tree node, not a rule
            top["alias"] = False
            return
        rule.refs.append((text, len(frames) - 1))
        _atom(top, ("ref", text))
    elif kind == "arrow":
        top["alias"] = True
    elif kind == "regex":
        body = text[1:]
        body = body[: body.rfind("/")] if "/" in body else body
        check_regex(body, f"a /regex/ of grammar rule `{rule.name}`")
        _atom(top, ("atom",))
    elif kind == "repeat":
        low, comma, high = m.group("low"), m.group("comma"), m.group("high")
        count = int(high) if comma and high else int(low or 0)
        _repeat(top, int(low or 0), count)
    elif kind == "tilde":
        low, high = int(m.group("tlow")), m.group("thigh")
        _repeat(top, low, int(high) if high else low)
    elif kind == "op" and text in "([":
        if text == "(" or lark:
            frames.append(_frame(")" if text == "(" else "]"))
            shape.max_nesting = max(shape.max_nesting, len(frames) - 1)
            if shape.max_nesting > MAX_GROUP_NESTING:
                raise StructuredOutputError(
                    f"the grammar nests groups more than {MAX_GROUP_NESTING} deep; "
                    f"at most {MAX_GROUP_NESTING} are accepted"
                )
    elif kind == "op" and text in ")]":
        _close_group(frames, shape, text)
    elif kind == "op" and text == "|":
        top["alts"].append(top["seq"])
        top["seq"], top["last"] = [], 0
        if len(top["alts"]) >= MAX_ALTERNATIVES:
            raise StructuredOutputError(
                f"a group of grammar rule `{rule.name}` has more than {MAX_ALTERNATIVES} alternatives; "
                f"at most {MAX_ALTERNATIVES} are accepted"
            )
    elif kind == "op" and text in "?*+":
        _repeat(top, 1 if text == "+" else 0, 1)
    elif kind == "op" and text in "{}":
        shape.opaque = True  # template arguments `name{a, b}`
    elif kind == "op" and (lark or text != "."):
        pass  # `&`, `~` (lexeme operators), `,` `=` `:` ...: no element
    else:
        _atom(top, ("atom",))  # strings, GBNF classes and `.`, <special>, @grammar, numbers


def _atom(frame: dict, node: tuple) -> None:
    frame["seq"].append(node)
    frame["size"] += 1
    frame["last"] = 1


def _repeat(frame: dict, low: int, count: int) -> None:
    if not frame["seq"]:
        return
    if low == 0:
        frame["seq"][-1] = ("atom",)  # optional: always derivable
    if frame["last"] and count > 1:
        grown = min(frame["last"] * count, 10**18)
        frame["size"] += grown - frame["last"]
        frame["last"] = grown
        if frame["size"] > MAX_REGEX_SIZE:
            raise StructuredOutputError(
                f"a rule of the grammar is {frame['size']:,} elements long with its counted repetitions "
                f"({{m,n}}, ~n) unrolled; at most {MAX_REGEX_SIZE:,} are accepted"
            )


def _close_group(frames: list[dict], shape: GrammarShape, closer: str) -> None:
    if len(frames) < 2 or frames[-1]["closer"] != closer:
        shape.opaque = True  # unbalanced: llguidance reports it
        return
    done = frames.pop()
    node = _finish(done)
    parent = frames[-1]
    parent["seq"].append(("atom",) if closer == "]" else node)  # Lark [ ... ] is optional
    parent["last"] = done["size"]
    parent["size"] += done["size"]


def _finish(frame: dict) -> tuple:
    alts = [*frame["alts"], frame["seq"]]
    return ("alt", [("seq", seq) for seq in alts])


def _close(rule: _Rule, frames: list[dict], shape: GrammarShape) -> None:
    while len(frames) > 1:  # unclosed groups: llguidance reports them
        shape.opaque = True
        _close_group(frames, shape, frames[-1]["closer"])
    rule.body = _finish(frames[0])


def _skip_json(text: str, pos: int, is_schema: bool) -> int | None:
    """The end of the JSON object after a `%json` / `%regex` / `%llguidance` directive (a %json
    schema gets the JSON schema bounds), or None when no object follows."""
    start = pos
    while start < len(text) and text[start] in " \t\r\n":
        start += 1
    if not text.startswith("{", start):
        return None
    depth, i = 0, start
    for part in _JSON_PART.finditer(text, start):
        token, i = part.group(), part.end()
        if token in ("{", "["):
            depth += 1
        elif token in ("}", "]"):
            depth -= 1
            if depth == 0:
                break
    if is_schema:
        chunk = text[start:i]
        depth = json_text_depth(chunk)
        if depth > MAX_JSON_DEPTH:
            raise StructuredOutputError(
                f"a %json schema in the grammar is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted"
            )
        try:
            schema = json.loads(chunk)
        except ValueError:
            return i  # llguidance reports the bad JSON
        check_json_schema(schema)
    return i


def _rule_depth(shape: GrammarShape) -> int:
    """How deep the start rule's expansion nests (limits.deepest_path), a reference to a rule
    counting RULE_WEIGHT and each group around it 1 (measured: ~3.2 KB of llguidance's native
    stack per rule, ~1.9 KB per group level)."""
    number = {name: i for i, name in enumerate(shape.rules)}
    edges = [
        [(number[r], RULE_WEIGHT + groups) for r, groups in rule.refs if r in number] for rule in shape.rules.values()
    ]
    return deepest_path(edges, number[shape.start]) + RULE_WEIGHT


def _infinite(shape: GrammarShape) -> str | None:
    """A rule on the start rule's way that derives no finite text (the start rule itself if none
    other), or None when the start rule derives one. The least fixpoint of "derives a finite
    text" over the rules' AND/OR trees, propagated with counters (linear)."""
    kinds: list[str] = []  # per node: "alt" (any child), "seq" (all children), "ref" (its rule)
    children: list[list[int]] = []
    refs_to: list[tuple[int, str]] = []
    rule_node: dict[str, int] = {}
    for name, rule in shape.rules.items():
        stack: list[tuple[tuple, int]] = [(rule.body, -1)]
        while stack:
            node, parent = stack.pop()
            index = len(kinds)
            kind = node[0] if node[0] in ("alt", "seq", "ref") else "seq"  # an atom: an empty AND
            kinds.append(kind)
            children.append([])
            if kind in ("alt", "seq") and node[0] != "atom":
                stack.extend((child, index) for child in node[1])
            elif kind == "ref":
                refs_to.append((index, node[1]))
            if parent < 0:
                rule_node[name] = index
            else:
                children[parent].append(index)
    users: list[list[int]] = [[] for _ in kinds]
    waiting = [0] * len(kinds)
    for i, kind in enumerate(kinds):
        for c in children[i]:
            users[c].append(i)
        waiting[i] = 1 if kind == "alt" else len(children[i])
    for index, name in refs_to:
        target = rule_node.get(name)
        if target is not None:
            users[target].append(index)
            waiting[index] = 1  # else an imported or unknown name: llguidance decides
    derives = [False] * len(kinds)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    while ready:
        i = ready.pop()
        if derives[i]:
            continue
        derives[i] = True
        for user in users[i]:
            if not derives[user]:
                waiting[user] = 0 if kinds[user] in ("alt", "ref") else waiting[user] - 1
                if waiting[user] == 0:
                    ready.append(user)
    if derives[rule_node[shape.start]]:
        return None
    for name, _ in shape.rules[shape.start].refs:
        if name in rule_node and not derives[rule_node[name]]:
            return name
    return shape.start
