"""Hostile and careless structured-output specs (issue 22): each is refused at compile time with a
StructuredOutputError (HTTP 400), promptly, and none can crash, freeze or starve the process.

Everything runs through GrammarCompiler, whose worker processes absorb the native crashes the
pre-compile bounds miss; a runaway compile is simulated by stopping a worker (SIGSTOP), which is
what a compile that never returns looks like from the server."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hylora.structured import (
    CompilerBusy,
    CompileTimeout,
    GrammarCompiler,
    StructuredOutputError,
    StructuredSpec,
    parse_structured_outputs,
)
from hylora.structured.grammar import is_lark
from hylora.structured.limits import json_text_depth, regex_shape
from hylora.structured.rules import check_grammar
from hylora.structured.spec import MAX_CHOICES
from tests.structured_helpers import VOCAB, allowed_ids, demo_tokenizer, eos_pair

FUZZ_EXAMPLES = int(os.environ.get("HYLORA_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI failures reproduce
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
FUZZ_WALL_S = 25.0  # per fuzz test: later examples are skipped past this


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return demo_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def eos_ids(tokenizer):
    return eos_pair(tokenizer)


@pytest.fixture(scope="module")
def compiler(tokenizer, eos_ids):
    compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, max_workers=2)
    yield compiler
    compiler.close()


def wait_for_workers(compiler: GrammarCompiler, count: int) -> None:
    compiler.compile_blocking(StructuredSpec("regex", "[a-z]{3}"))
    deadline = time.monotonic() + 30
    while sum(w.alive() for w in compiler._workers) < count:
        assert time.monotonic() < deadline, "grammar workers did not start"
        time.sleep(0.02)


# --- specs that used to crash the server, freeze it or fail at the first token --------------


def ref_chain(n: int, wrap: str | None = None) -> dict:
    def link(i: int) -> dict:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {"type": "object", "properties": {"x": ref}} if wrap == "object" else ref

    defs = {f"d{i}": link(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_refs(hops: int, depth: int) -> dict:
    """`hops` definitions in a chain, each nesting the next `depth` arrays deep: within the JSON
    depth bound, but llguidance's compile of the whole overflowed an 8 MiB stack (SIGSEGV)."""
    defs = {}
    for i in range(hops):
        schema: dict = {"$ref": f"#/$defs/d{i + 1}"}
        for _ in range(depth):
            schema = {"type": "array", "items": schema}
        defs[f"d{i}"] = schema
    defs[f"d{hops}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'


def nested_arrays(n: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


HOSTILE = {
    # native stack overflows (SIGSEGV of the whole server before)
    "ref-chain-3000": (StructuredSpec.json_schema(ref_chain(3000)), "more than 2048 definitions"),
    "ref-chain-2000": (StructuredSpec.json_schema(ref_chain(2000)), "levels deep with its $refs followed"),
    "ref-chain-objects": (StructuredSpec.json_schema(ref_chain(200, "object")), "levels deep with its $refs followed"),
    "refs-through-nesting": (StructuredSpec.json_schema(nested_refs(60, 90)), "levels deep with its $refs followed"),
    "lark-chain-3000": (StructuredSpec("grammar", lark_chain(3000)), "more than 2048 rules"),
    "lark-chain-1500": (StructuredSpec("grammar", lark_chain(1500)), "nests 3004 levels deep from `start`"),
    "lark-chain-listed-backwards": (
        StructuredSpec(
            "grammar",
            "start: " + " | ".join(f"r{i}" for i in reversed(range(400))) + "\n" + lark_chain(400).split("\n", 1)[1],
        ),
        "levels deep from",
    ),
    "gbnf-chain-2000": (StructuredSpec("grammar", gbnf_chain(2000)), "levels deep from"),
    "rules-wrapped-in-groups": (  # 198 rules, each the next inside 23 groups: SIGSEGV at 8 MiB
        StructuredSpec(
            "grammar",
            "start: r0\n"
            + "".join(f"r{i}: " + "(" * 23 + f'"a" r{i + 1}' + ")" * 23 + "\n" for i in range(198))
            + 'r198: "a"',
        ),
        "levels deep from",
    ),
    "json-nested-120": (StructuredSpec("json_schema", json.dumps(nested_arrays(120))), "nested 121 levels deep"),
    "lark-groups-30": (StructuredSpec("grammar", "start: " + "(" * 30 + '"a"' + ")" * 30), "nests groups"),
    "regex-groups-100": (StructuredSpec("regex", "(" * 100 + "a" + ")" * 100), "nests 100 groups"),
    # no finite document, or nothing at all: failed at the first token before
    "ref-loop": (
        StructuredSpec.json_schema(
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        ),
        "admits no finite document",
    ),
    "ref-to-root": (StructuredSpec.json_schema({"$ref": "#"}), "admits no finite document"),
    "unclosable-ref": (
        StructuredSpec.json_schema(
            {
                "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
                "$ref": "#/$defs/n",
            }
        ),
        "admits no finite document",
    ),
    "unclosable-array": (
        StructuredSpec.json_schema({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
        "admits no finite document",
    ),
    "regex-matches-nothing": (StructuredSpec("regex", r"[^\s\S]"), "matches no output at all"),
    "regex-empty-intersection": (StructuredSpec("regex", "[a&&b]"), "matches no output at all"),
    "regex-repeat-product": (StructuredSpec("regex", "(a{1000}){1000}"), "1,000,000 elements long"),
    "pattern-repeat-product": (
        StructuredSpec.json_schema({"type": "string", "pattern": "(a{1000}){1000}"}),
        "1,000,000 elements long",
    ),
    "lark-regex-repeat-product": (StructuredSpec("grammar", "start: X\nX: /(a{1000}){1000}/"), "1,000,000 elements"),
    "lark-empty-language": (StructuredSpec("grammar", 'start: a\na: a "x"'), "derives no finite text"),
    "lark-self-only": (StructuredSpec("grammar", "start: start"), "derives no finite text"),
    "lark-empty-regex": (StructuredSpec("grammar", r"start: /[^\s\S]/"), "matches no output at all"),
    "gbnf-empty-language": (StructuredSpec("grammar", 'root ::= x\nx ::= "(" x ")"'), "derives no finite text"),
    "lark-alternatives-2000": (
        StructuredSpec("grammar", "start: " + " | ".join(f'"x{i}"' for i in range(2000))),
        "more than 1024 alternatives",
    ),
    # within every static bound, caught by the probe's first tokens: a forced run of 10⁶ through
    # two rules ("Too many items ... ff_tokens"), 2,000 alternatives open after one token
    "lark-forced-run": (
        StructuredSpec("grammar", 'start: x{1000}\nx: y{1000}\ny: "a"'),
        "exceeds the matcher's limits after 1 generated tokens",
    ),
    "lark-row-overflow": (
        StructuredSpec(
            "grammar",
            "start: a | b\na: "
            + " | ".join(f'"x{i}"' for i in range(1000))
            + "\nb: "
            + " | ".join(f'"x{i}y"' for i in range(1000)),
        ),
        "Current row has",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_spec_is_refused_at_compile_time(compiler, name):
    spec, message = HOSTILE[name]
    start = time.perf_counter()
    with pytest.raises(StructuredOutputError, match=re.escape(message)):
        compiler.compile_blocking(spec)
    assert time.perf_counter() - start < 3.0
    with pytest.raises(StructuredOutputError, match=re.escape(message)):  # cached: no second compile
        compiler.compile_blocking(spec)


def test_request_fields_refused_before_json_recursion():
    deep = "[" * 950 + "]" * 950
    with pytest.raises(StructuredOutputError, match="nested 950 levels deep; at most 100"):
        parse_structured_outputs({"guided_json": deep})
    nested: dict = {}
    node = nested
    for _ in range(950):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(StructuredOutputError, match="nested more than 100 levels deep"):
        parse_structured_outputs({"guided_json": nested})
    with pytest.raises(StructuredOutputError, match="4096 entries; at most 1024"):
        parse_structured_outputs({"guided_choice": [f"c{i}" for i in range(4096)]})
    with pytest.raises(StructuredOutputError, match="at most 1024"):
        StructuredSpec.choice([f"c{i}" for i in range(MAX_CHOICES + 1)])


def test_the_most_choices_survive_their_first_token(compiler, tokenizer, eos_ids):
    # 2,000 choices sharing a first token compile and then overflow llguidance's Earley row
    matcher = compiler.compile_blocking(StructuredSpec.choice([f"c{i}" for i in range(MAX_CHOICES)])).matcher()
    for token in tokenizer.encode("c1", add_special_tokens=False):
        assert token in allowed_ids(matcher)
        matcher.accept(token)
    assert allowed_ids(matcher)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredSpec.json_schema(nested_arrays(99)),
        StructuredSpec.json_schema(ref_chain(60, "object")),
        StructuredSpec.json_schema(
            {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}
        ),
        StructuredSpec.json_schema(
            {
                "$defs": {f"m{i}": {"type": "object", "properties": {"v": {"type": "integer"}}} for i in range(300)},
                "type": "object",
                "properties": {f"p{i}": {"$ref": f"#/$defs/m{i}"} for i in range(300)},
            }
        ),
        StructuredSpec("grammar", lark_chain(150)),
        StructuredSpec(
            "grammar",
            'start: expr\nexpr: expr "+" term | term\nterm: term "*" factor | factor\nfactor: "(" expr ")" | NUMBER\n'
            "NUMBER: /[0-9]+/",
        ),
        StructuredSpec("grammar", 'root ::= item ("," item)*\nitem ::= [a-z]+ | "(" root ")"'),
        StructuredSpec("regex", "(a{100}){100}"),
        StructuredSpec("regex", r"(\d{1,3}\.){3}\d{1,3}"),
    ],
    ids=[
        "nested-99",
        "ref-chain-60",
        "recursive-tree",
        "300-definitions",
        "lark-chain-150",
        "lark-expr",
        "gbnf",
        "rep-10k",
        "ip",
    ],
)
def test_big_real_specs_still_compile(compiler, spec):
    assert allowed_ids(compiler.compile_blocking(spec).matcher())


def test_detection_and_bounds_are_linear():
    text = "\n" * 250_000 + 'root ::= "a"'
    start = time.perf_counter()
    assert not is_lark(text)  # the quadratic `^\s*` took minutes at this size
    check_grammar(text)
    assert json_text_depth('"' + '\\"' * 100_000) == 0  # an unterminated string: no retry per quote
    check_grammar('start: "' + '\\"' * 100_000)
    assert regex_shape("(" * 100_000)[0] == 100_000
    assert time.perf_counter() - start < 5.0  # quadratic: minutes


# --- containment -----------------------------------------------------------------------------


def test_native_crash_is_absorbed_by_the_worker(tokenizer, eos_ids, caplog):
    # a 128 KiB probe stack: a 60-hop chain of objects (~550 KB of native stack) overflows it
    compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, max_workers=1, probe_stack_bytes=128 << 10)
    try:
        wait_for_workers(compiler, 1)
        before = compiler._workers[0].pid
        spec = StructuredSpec.json_schema(ref_chain(60, "object"))
        with (
            caplog.at_level("WARNING", logger="hylora.structured.sandbox"),
            pytest.raises(StructuredOutputError, match="crashed its worker process"),
        ):
            compiler.compile_blocking(spec)
        assert "SIGSEGV" in caplog.text
        assert compiler.compile_blocking(StructuredSpec("regex", "[0-9]+"))  # a fresh worker
        assert compiler._workers[0].pid != before and compiler._workers[0].alive()
        after = compiler._workers[0].pid
        with pytest.raises(StructuredOutputError, match="crashed its worker process"):
            compiler.compile_blocking(spec)  # cached: the worker is not crashed again
        assert compiler._workers[0].pid == after
    finally:
        compiler.close()


@pytest.mark.xfail(
    strict=False,
    reason="in 2 of 4 full CI runs (never alone; not reproduced in 12 lone runs and 3 module runs beside CPU "
    "hogs) the victim's probe went unanswered on a worker the test had resumed with SIGCONT; the test now waits "
    "for both workers' set-up and says each worker's pid, starts, probes and process state when it fails",
)
def test_runaway_compile_is_killed_and_does_not_delay_others(tokenizer, eos_ids):
    # the probe gets half of the 16 s: a 2-core CI machine busy elsewhere starved the victim's probe
    # past 0.75 s and, once, past 3 s; what is checked is only that the victim is answered before the
    # hostile compile is killed, so the budget can be generous
    compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, max_workers=2, timeout_s=16.0)
    stopped: list[int] = []
    try:
        wait_for_workers(compiler, 2)
        workers = list(compiler._workers)
        deadline = time.monotonic() + 30
        while any(w.starts < 1 for w in workers):  # set up, not only started (alive() is true before)
            assert time.monotonic() < deadline, "grammar workers were not set up"
            time.sleep(0.02)
        before = [(w.pid, w.starts, w._probes) for w in workers]

        def states() -> str:
            """What each worker was and is, for a failure's message."""
            return "; ".join(
                f"worker {w.name}: pid {w.pid} (was {pid}), starts {w.starts} (was {starts}), probes {w._probes} "
                f"(was {probes}), process state {process_state(w.pid)}"
                for w, (pid, starts, probes) in zip(workers, before, strict=True)
            )

        for w in workers:
            os.kill(w.pid, signal.SIGSTOP)
            stopped.append(w.pid)
        hostile = compiler.submit(StructuredSpec("regex", "[a-z]+ hostile"))
        deadline = time.monotonic() + 5
        while [w._probes for w in workers] == [probes for *_, probes in before]:
            assert time.monotonic() < deadline, states()
            time.sleep(0.01)
        changed = [w for w, (*_, probes) in zip(workers, before, strict=True) if w._probes != probes]
        assert len(changed) == 1 and [(w.pid, w.starts) for w in workers] == [b[:2] for b in before], states()
        stuck = changed[0]
        free = next(w for w in workers if w is not stuck)
        stuck_pid = stuck.pid
        os.kill(free.pid, signal.SIGCONT)

        try:
            assert compiler.compile_blocking(StructuredSpec("regex", "[0-9]{1,4} victim"))
        except CompileTimeout:
            pytest.fail(f"the victim was not answered; {states()}")
        assert not hostile.done()  # the victim did not wait for the hostile compile to be killed

        with pytest.raises(CompileTimeout, match="took longer than 8 s"):  # the probe gets half
            hostile.result(timeout=20)
        assert compiler.submit(StructuredSpec("regex", "[a-z]+ hostile")) is hostile  # cached for a while
        with pytest.raises(ProcessLookupError):  # the stopped process was killed and reaped
            os.kill(stuck_pid, 0)
        assert compiler.compile_blocking(StructuredSpec("regex", "[a-f]+ after"))
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        compiler.close()


def process_state(pid: int | None) -> str:
    """The kernel's one-letter state of `pid` (R running, S sleeping, T stopped, Z zombie), Linux only."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"


def test_queue_wait_is_not_compile_time_and_overload_is_busy(tokenizer, eos_ids, monkeypatch):
    compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, max_workers=1, timeout_s=1.0, queue_timeout_s=0.3)
    try:
        wait_for_workers(compiler, 1)
        hostile = StructuredSpec("regex", "[a-z]+ hostile")
        real = compiler._compile
        monkeypatch.setattr(compiler, "_compile", lambda s: (time.sleep(1.6) if s == hostile else None) or real(s))
        held = compiler.submit(hostile)  # holds the only compile thread for 1.6 s
        while not compiler._cache[hostile].started.done():
            time.sleep(0.01)
        waiting = StructuredSpec("regex", "[0-9]+ waiting")
        start = time.perf_counter()
        with pytest.raises(CompilerBusy, match="within 0.3 s"):  # a 503: no thread took it in time
            compiler.compile_blocking(waiting)
        assert not held.done()  # answered at its queue timeout, not when the thread came free
        compiler.queue_timeout_s = 10.0
        compiled = compiler.compile_blocking(waiting)  # queued ~1.3 s, longer than its 1 s compile timeout
        assert compiled.spec == waiting and time.perf_counter() - start > 1.0
        assert held.result(timeout=5).spec == hostile
    finally:
        compiler.close()


def test_without_worker_processes_the_bounds_still_hold(tokenizer, eos_ids, monkeypatch, caplog):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with caplog.at_level("WARNING", logger="hylora.structured.compiler"):
        compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, max_workers=1)
        try:
            assert allowed_ids(compiler.compile_blocking(StructuredSpec("regex", "[a-z]+")).matcher())
            for name in (
                "ref-chain-2000",
                "lark-chain-1500",
                "unclosable-ref",
                "regex-matches-nothing",
                "lark-forced-run",
            ):
                spec, message = HOSTILE[name]
                with pytest.raises(StructuredOutputError, match=re.escape(message)):
                    compiler.compile_blocking(spec)
        finally:
            compiler.close()
    assert "compiling structured-output specs in the server process" in caplog.text


def test_small_specs_are_compiled_first(tokenizer, eos_ids):
    compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, max_workers=1, timeout_s=5.0)
    try:
        wait_for_workers(compiler, 1)
        worker = compiler._workers[0]
        probes = worker._probes
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            blocker = compiler.submit(StructuredSpec("regex", "[a-z]+ blocker"))
            while worker._probes == probes:
                time.sleep(0.01)
            big = compiler.submit(StructuredSpec("grammar", lark_chain(150)))
            small = compiler.submit(StructuredSpec("regex", "[0-9]"))
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        blocker.result(timeout=15)
        assert small.result(timeout=15).compile_s >= 0 and big.result(timeout=15)
        jobs = {id(job.future): job for job in compiler._cache.values()}
        assert jobs[id(small)].finished <= jobs[id(big)].finished
    finally:
        compiler.close()


# --- fuzz --------------------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "d"])
REGEX_ATOMS = st.sampled_from(["a", "b", "[a-c]", ".", r"\d", "[^a]", r"\w", "x"])


@st.composite
def regexes(draw, max_leaves: int = 10) -> str:
    def extend(children):
        return st.one_of(
            st.builds(lambda xs: "".join(xs), st.lists(children, min_size=1, max_size=3)),
            st.builds(lambda xs: "|".join(xs), st.lists(children, min_size=2, max_size=3)),
            st.builds(
                lambda x, q: f"({x}){q}",
                children,
                st.one_of(
                    st.sampled_from(["", "*", "+", "?"]),
                    st.builds(lambda m, n: f"{{{m},{m + n}}}", st.integers(0, 400), st.integers(0, 900)),
                    st.builds(lambda m: f"{{{m}}}", st.integers(0, 1200)),
                ),
            ),
        )

    regex = draw(st.recursive(REGEX_ATOMS, extend, max_leaves=max_leaves))
    hostile = draw(st.integers(0, 7))
    if hostile == 0:  # very deep
        depth = draw(st.integers(20, 300))
        regex = "(" * depth + regex + ")" * depth
    elif hostile == 1:  # nested counted repetitions
        for _ in range(draw(st.integers(1, 3))):
            regex = f"({regex}){{{draw(st.integers(2, 1500))}}}"
    return regex


@st.composite
def json_schemas(draw) -> dict:
    leaves = st.one_of(
        st.just({"type": "integer"}),
        st.just({"type": "string", "maxLength": 4}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.just({"enum": ["x", 1, None]}),
        st.builds(lambda p: {"type": "string", "pattern": p}, regexes(max_leaves=4)),
        st.builds(lambda n: {"$ref": f"#/$defs/{n}"}, NAMES),
        st.just({"$ref": "#"}),
        st.just(True),
    )

    def extend(children):
        return st.one_of(
            st.builds(
                lambda props, required: {"type": "object", "properties": props, "required": list(props)[:required]},
                st.dictionaries(NAMES, children, max_size=3),
                st.integers(0, 3),
            ),
            st.builds(
                lambda items, low: {"type": "array", "items": items, "minItems": low}, children, st.integers(0, 2)
            ),
            st.builds(lambda xs: {"anyOf": xs}, st.lists(children, min_size=1, max_size=3)),
            st.builds(lambda xs: {"allOf": xs}, st.lists(children, min_size=1, max_size=2)),
        )

    body = st.recursive(leaves, extend, max_leaves=12)
    kind = draw(st.integers(0, 5))
    if kind == 1:  # $ref chains through nesting
        return nested_refs(draw(st.integers(1, 80)), draw(st.integers(0, 40)))
    if kind == 0:  # a deep chain of one shape
        depth = draw(st.integers(10, 400))
        shape = draw(st.sampled_from(["array", "object", "anyOf", "ref"]))
        if shape == "ref":
            return ref_chain(depth, draw(st.sampled_from([None, "object"])))
        schema: dict = {"type": "integer"}
        for _ in range(depth):
            schema = {
                "array": {"type": "array", "items": schema},
                "object": {"type": "object", "properties": {"a": schema}, "required": ["a"]},
                "anyOf": {"anyOf": [schema, {"type": "null"}]},
            }[shape]
        return schema
    root = draw(body)
    root = root if isinstance(root, dict) else {}
    return {**root, "$defs": draw(st.dictionaries(NAMES, body, max_size=4))}


@st.composite
def grammar_trees(draw) -> tuple[list[list[list[tuple]]], bool]:
    """Rules r0 (the start) .. rN: each a list of alternatives, each a list of elements."""
    count = draw(st.integers(1, 6))
    element = st.one_of(
        st.builds(lambda s: ("str", s), st.text("abc ", min_size=1, max_size=3)),
        st.builds(lambda r: ("rx", r), regexes(max_leaves=3)),
        st.builds(lambda i: ("ref", i), st.integers(0, count - 1)),
    )
    element = st.builds(
        lambda e, q: (*e, q), element, st.sampled_from(["", "", "?", "*", "+", "{2}", "{1,3}", "{0,40}"])
    )
    group = st.builds(
        lambda alts, q: ("group", alts, q),
        st.lists(st.lists(element, min_size=1, max_size=3), min_size=1, max_size=3),
        st.sampled_from(["", "?", "*", "+", "{3}"]),
    )
    rule = st.lists(st.lists(st.one_of(element, group), min_size=1, max_size=4), min_size=1, max_size=3)
    return draw(st.lists(rule, min_size=count, max_size=count)), draw(st.booleans())


def render(tree: tuple[list, bool]) -> str:
    rules, lark = tree
    name = (lambda i: "start" if i == 0 else f"r{i}") if lark else (lambda i: "root" if i == 0 else f"r{i}")

    def element(e: tuple) -> str:
        if e[0] == "group":
            return "(" + " | ".join(" ".join(element(x) for x in alt) for alt in e[1]) + ")" + e[2]
        kind, value, q = e
        if kind == "str":
            text = '"' + value + '"'
        elif kind == "rx":
            text = "/" + value.replace("/", "\\/") + "/" if lark else "[a-c]"
        else:
            text = name(value)
        return text + q

    sep = ": " if lark else " ::= "
    return "".join(
        name(i) + sep + " | ".join(" ".join(element(e) for e in alt) for alt in alts) + "\n"
        for i, alts in enumerate(rules)
    )


def check_compiles_or_refuses(compiler: GrammarCompiler, spec: StructuredSpec) -> None:
    try:
        compiled = compiler.compile_blocking(spec)
    except StructuredOutputError:
        return
    assert allowed_ids(compiled.matcher()), f"compiled, but no first token: {spec}"


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def spent(self) -> bool:
        return time.monotonic() > self.deadline


@pytest.fixture(scope="module")
def fuzz_compiler(tokenizer, eos_ids):
    compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, max_workers=2, cache_size=1024)
    yield compiler
    compiler.close()


@pytest.fixture
def budget():
    return Budget(FUZZ_WALL_S)


@FUZZ
@given(schema=json_schemas(), closed=st.booleans())
def test_fuzz_json_schemas(fuzz_compiler, budget, schema, closed):
    if budget.spent():
        return
    try:
        spec = StructuredSpec.json_schema(schema, additional_properties=not closed)
    except StructuredOutputError:
        return
    check_compiles_or_refuses(fuzz_compiler, spec)


@FUZZ
@given(tree=grammar_trees(), deep=st.integers(0, 7), size=st.integers(30, 2500))
def test_fuzz_grammars(fuzz_compiler, budget, tree, deep, size):
    if budget.spent():
        return
    text = render(tree)
    if deep == 0:  # a long chain of rules, Lark or GBNF
        text = lark_chain(size) if tree[1] else gbnf_chain(size)
    elif deep == 2:  # the chain's rules listed from its far end: shallow depth-first, long path
        chain = lark_chain(size // 4) if tree[1] else gbnf_chain(size // 4)
        head, sep = ("start: ", "\n") if tree[1] else ("root ::= ", "\n")
        text = head + " | ".join(f"r{i}" for i in reversed(range(size // 4))) + sep + chain.split(sep, 1)[1]
    elif deep == 1:  # deeply nested groups
        open_, close = ("(" * (size // 50), ")" * (size // 50))
        text = (
            text.replace(": ", ": " + open_, 1).replace("\n", close + "\n", 1)
            if tree[1]
            else text.replace("::= ", "::= " + open_, 1).replace("\n", close + "\n", 1)
        )
    check_compiles_or_refuses(fuzz_compiler, StructuredSpec("grammar", text))


@FUZZ
@given(regex=regexes())
def test_fuzz_regexes(fuzz_compiler, budget, regex):
    if budget.spent():
        return
    check_compiles_or_refuses(fuzz_compiler, StructuredSpec("regex", regex))


def test_fuzz_left_the_workers_serving(fuzz_compiler):
    assert allowed_ids(fuzz_compiler.compile_blocking(StructuredSpec("regex", "[a-c]{2} done")).matcher())
    assert all(w.alive() for w in fuzz_compiler._workers)
