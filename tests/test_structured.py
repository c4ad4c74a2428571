"""Structured outputs (hylora/structured): request parsing, compilation and its cache, per-request
matchers and the batched token mask — with the demo tokenizer and random logits, so only the
grammar makes the outputs valid."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
import torch

from hylora.structured import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    StructuredOutputError,
    StructuredSpec,
    allocate_bitmask,
    apply_token_masks,
    parse_structured_outputs,
)
from hylora.structured.mask import _banned, banned_by_shifts
from tests.structured_helpers import VOCAB, allowed_ids, demo_tokenizer, eos_pair

RELIC_SCHEMA = {
    "type": "object",
    "properties": {
        "relic_type": {"type": "string", "enum": ["vessel", "disc", "figure", "coin"]},
        "period": {"type": "string", "maxLength": 12},
        "dimensions": {
            "type": "object",
            "properties": {"height_cm": {"type": "integer", "minimum": 0, "maximum": 500}},
            "required": ["height_cm"],
            "additionalProperties": False,
        },
        "findings": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {"label": {"type": "string", "maxLength": 6}, "intact": {"type": "boolean"}},
                "required": ["label", "intact"],
                "additionalProperties": False,
            },
        },
        "inscription": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
    },
    "required": ["relic_type", "period", "dimensions", "findings", "inscription"],
    "additionalProperties": False,
}
DATE_REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9] [A-Z][a-z]{2,8}"
CHOICES = ["bronze", "jade", 'a "quoted" word', "ünïcode"]
EBNF = 'root ::= "period: " period "; count: " num\nperiod ::= "Shang" | "Zhou" | "Han"\nnum ::= [1-9] [0-9]?'
LARK = 'start: "period: " period "; count: " NUM\nperiod: "Shang" | "Zhou" | "Han"\nNUM: /[1-9][0-9]?/'
LARK_INLINED = "?start: entry\n?entry: " + LARK.removeprefix("start: ")  # the `?start:` form of vLLM's docs
GRAMMAR_LANGUAGE = r"period: (Shang|Zhou|Han); count: [1-9][0-9]?"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return demo_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def eos_ids(tokenizer):
    return eos_pair(tokenizer)


@pytest.fixture(scope="module")
def compiler(tokenizer, eos_ids):
    compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, cache_size=32)
    yield compiler
    compiler.close()


def generate(matcher: GrammarMatcher, eos_ids, seed: int, steps: int = 400, bias=None) -> list[int]:
    """Greedy decoding of random logits under the mask, until EOS (not returned) or `steps`."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(steps):
        logits = torch.randn(1, VOCAB, generator=g) + (0 if bias is None else bias)
        assert apply_token_masks(logits, [matcher]) == [None]
        token = int(logits[0].argmax())
        matcher.accept(token)
        if token in eos_ids:
            return out
        out.append(token)
    raise AssertionError(f"no EOS within {steps} steps; output so far {out[:40]}")


def validate(schema: dict, value, where: str = "$") -> None:
    """The JSON Schema subset RELIC_SCHEMA uses (jsonschema is not a test dependency)."""
    if "anyOf" in schema:
        problems = []
        for option in schema["anyOf"]:
            try:
                return validate(option, value, where)
            except AssertionError as e:
                problems.append(str(e))
        raise AssertionError(f"{where}: matches no anyOf option: {problems}")
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), where
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), where
    elif kind is not None:
        assert isinstance(value, types[kind]), f"{where}: {value!r} is not {kind}"
    if "enum" in schema:
        assert value in schema["enum"], where
    if kind == "string":
        assert len(value) <= schema.get("maxLength", len(value)), where
    if kind == "object":
        assert set(schema.get("required", [])) <= set(value), f"{where}: missing {schema['required']}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), f"{where}: extra keys {set(value)}"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                validate(sub, value[key], f"{where}.{key}")
    if kind == "array":
        assert len(value) <= schema.get("maxItems", len(value)), where
        for i, item in enumerate(value):
            validate(schema["items"], item, f"{where}[{i}]")


# --- parsing request fields ----------------------------------------------------------------


@pytest.mark.parametrize(
    "body, kind, payload",
    [
        ({}, None, None),
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}},
            "json_schema",
            '{"type":"object"}',
        ),
        ({"structured_outputs": {"json": '{"type": "object"}'}}, "json_schema", '{"type":"object"}'),
        ({"structured_outputs": {"json_object": True}}, "json_object", ""),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", ("a", "b")),
        ({"structured_outputs": {"grammar": LARK}}, "grammar", LARK),
        ({"guided_json": {"type": "object"}}, "json_schema", '{"type":"object"}'),
        ({"guided_regex": "[0-9]+", "guided_decoding_backend": "xgrammar"}, "regex", "[0-9]+"),
        ({"guided_choice": ["yes", "no"]}, "choice", ("yes", "no")),
        ({"guided_grammar": EBNF}, "grammar", EBNF),
        ({"guided_json": None, "response_format": None, "structured_outputs": None}, None, None),
    ],
    ids=lambda v: None if isinstance(v, dict) else str(v)[:20],
)
def test_parse_request_fields(body, kind, payload):
    spec = parse_structured_outputs(body)
    if kind is None:
        assert spec is None
    else:
        assert (spec.kind, spec.payload) == (kind, payload)


def test_parse_options_and_key_order():
    schema = {"z": 1, "type": "object", "a": 2}
    spec = parse_structured_outputs(
        {"structured_outputs": {"json": schema, "disable_additional_properties": True, "whitespace_pattern": " ?"}}
    )
    assert spec.payload == '{"z":1,"type":"object","a":2}'  # key order kept: it is the generation order
    assert (spec.additional_properties, spec.whitespace_pattern) == (False, " ?")
    assert (
        parse_structured_outputs({"guided_json": schema, "guided_whitespace_pattern": "[ ]"}).whitespace_pattern
        == "[ ]"
    )


@pytest.mark.parametrize(
    "body, message",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "only one output constraint"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "only one output constraint"),
        ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "'yaml' is not supported"),
        ({"response_format": "json"}, "must be an object"),
        ({"structured_outputs": {"jsonn": {}}}, "unknown field(s) ['jsonn']"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag is not supported"),
        ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
        ({"guided_json": [1, 2]}, "must be a JSON schema object"),
        ({"guided_choice": []}, "non-empty list of strings"),
        ({"guided_choice": ["a", 3]}, "only non-empty strings"),
        ({"guided_regex": 5}, "guided_regex must be a non-empty string"),
        ({"guided_grammar": "  "}, "guided_grammar must be a non-empty string"),
        ({"guided_regex": "a" * 300_000}, "at most"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_parse_refuses_with_a_message(body, message):
    with pytest.raises(StructuredOutputError, match=re.escape(message)):
        parse_structured_outputs(body)


# --- generation under the mask -------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_object_output_parses(compiler, tokenizer, eos_ids, seed):
    # nudge random logits towards closing strings and objects so documents end in a few hundred steps
    bias = torch.zeros(VOCAB)
    for t in range(len(tokenizer)):
        if any(c in tokenizer.decode([t]) for c in '"}]'):
            bias[t] = 2.5
    matcher = compiler.compile_blocking(StructuredSpec("json_object")).matcher()
    text = tokenizer.decode(generate(matcher, eos_ids, seed, bias=bias))
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_schema_output_validates(compiler, tokenizer, eos_ids, seed):
    matcher = compiler.compile_blocking(StructuredSpec.json_schema(RELIC_SCHEMA)).matcher()
    text = tokenizer.decode(generate(matcher, eos_ids, seed))
    value = json.loads(text)
    validate(RELIC_SCHEMA, value)
    assert list(value) == list(RELIC_SCHEMA["properties"])  # fields in schema order
    assert text == json.dumps(value, ensure_ascii=False)  # json.dumps layout: no free whitespace


def test_disable_additional_properties(compiler, tokenizer, eos_ids):
    open_schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    spec = parse_structured_outputs(
        {"structured_outputs": {"json": open_schema, "disable_additional_properties": True}}
    )
    matcher = compiler.compile_blocking(spec).matcher()
    for t in tokenizer.encode('{"a": true', add_special_tokens=False):
        matcher.accept(t)
    assert allowed_ids(matcher) == set(tokenizer.encode("}", add_special_tokens=False))  # no ', "extra": ...'


def test_disable_additional_properties_keeps_a_root_ref_satisfiable(compiler, tokenizer, eos_ids):
    # `{"$ref": ..., "type": "object"}` (a tool's parameters as hylora types them): closing that node itself
    # would forbid the properties its $ref requires; the referenced object is closed instead
    schema = {"$defs": {"A": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}},
              "$ref": "#/$defs/A", "type": "object"}  # fmt: skip
    spec = parse_structured_outputs({"structured_outputs": {"json": schema, "disable_additional_properties": True}})
    matcher = compiler.compile_blocking(spec).matcher()
    for t in tokenizer.encode('{"a": true', add_special_tokens=False):
        matcher.accept(t)
    assert allowed_ids(matcher) == set(tokenizer.encode("}", add_special_tokens=False))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_output_fully_matches(compiler, tokenizer, eos_ids, seed):
    matcher = compiler.compile_blocking(StructuredSpec("regex", DATE_REGEX)).matcher()
    text = tokenizer.decode(generate(matcher, eos_ids, seed))
    assert re.fullmatch(DATE_REGEX, text), text


@pytest.mark.parametrize("seed", range(4))
def test_choice_output_is_one_of_the_choices(compiler, tokenizer, eos_ids, seed):
    matcher = compiler.compile_blocking(StructuredSpec.choice(CHOICES)).matcher()
    assert tokenizer.decode(generate(matcher, eos_ids, seed)) in CHOICES


@pytest.mark.parametrize("grammar", [EBNF, LARK, LARK_INLINED], ids=["ebnf", "lark", "lark-?start"])
def test_grammar_output_is_in_the_language(compiler, tokenizer, eos_ids, grammar):
    for seed in range(3):
        matcher = compiler.compile_blocking(StructuredSpec("grammar", grammar)).matcher()
        text = tokenizer.decode(generate(matcher, eos_ids, seed))
        assert re.fullmatch(GRAMMAR_LANGUAGE, text), text


def test_matchers_of_one_compiled_grammar_are_independent(compiler, tokenizer, eos_ids):
    compiled = compiler.compile_blocking(StructuredSpec.choice(["jade", "bronze"]))
    first, second = compiled.matcher(), compiled.matcher()
    for t in tokenizer.encode("jade", add_special_tokens=False):
        first.accept(t)
    assert first.is_terminated() and not second.is_terminated()
    assert tokenizer.decode(generate(second, eos_ids, seed=0)) in ("jade", "bronze")


# --- the batch mask ------------------------------------------------------------------------


def test_mixed_batch_is_masked_in_one_call(compiler, tokenizer, eos_ids):
    specs = [StructuredSpec.json_schema(RELIC_SCHEMA), None, StructuredSpec("regex", DATE_REGEX), None]
    specs.append(StructuredSpec.choice(CHOICES))
    matchers = [compiler.compile_blocking(s).matcher() if s else None for s in specs]
    outputs: list[list[int]] = [[] for _ in specs]
    done = [m is None for m in matchers]
    g = torch.Generator().manual_seed(7)
    for _ in range(300):
        logits = torch.randn(len(specs), VOCAB, generator=g)
        raw = logits.clone()
        assert apply_token_masks(logits, matchers) == [None] * len(specs)
        for i, m in enumerate(matchers):
            if m is None:
                assert torch.equal(logits[i], raw[i])  # unconstrained rows: untouched, bit for bit
                continue
            allowed = allowed_ids(m)
            kept = torch.isfinite(logits[i])
            assert set(kept.nonzero().flatten().tolist()) == allowed
            assert torch.equal(logits[i][kept], raw[i][kept])  # allowed logits keep their values
            if done[i]:
                continue
            token = int(logits[i].argmax())
            m.accept(token)
            done[i] = token in eos_ids
            if not done[i]:
                outputs[i].append(token)
        if all(done):
            break
    assert all(done)
    validate(RELIC_SCHEMA, json.loads(tokenizer.decode(outputs[0])))
    assert re.fullmatch(DATE_REGEX, tokenizer.decode(outputs[2]))
    assert tokenizer.decode(outputs[4]) in CHOICES


def test_unconstrained_batch_is_untouched():
    logits = torch.randn(3, VOCAB)
    raw = logits.clone()
    assert apply_token_masks(logits, [None, None, None]) == [None, None, None]
    assert torch.equal(logits, raw)


def test_bit_unpacking_paths_agree():
    words = torch.randint(-(2**31), 2**31 - 1, (3, 23), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    expected = torch.tensor([[not (int(w[t // 32]) >> (t % 32)) & 1 for t in range(VOCAB)] for w in words])
    assert torch.equal(_banned(words, VOCAB, torch.device("cpu")), expected)  # numpy (CPU logits)
    assert torch.equal(banned_by_shifts(words, VOCAB), expected)  # torch shifts (GPU logits)


def test_mask_at_the_tokenizer_and_model_vocab_boundary(compiler, tokenizer, eos_ids):
    size = len(tokenizer)
    assert size < VOCAB and VOCAB % 32
    matcher = compiler.compile_blocking(StructuredSpec("json_object")).matcher()
    for t in tokenizer.encode('{"note": "', add_special_tokens=False):
        matcher.accept(t)
    allowed = allowed_ids(matcher)  # inside a string: nearly every token may come next
    specials = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    assert len(allowed) > size // 2
    assert max(allowed) < size  # padding rows never
    assert not allowed & specials  # special tokens never (EOS neither: the document is open)
    logits = torch.zeros(1, VOCAB)
    apply_token_masks(logits, [matcher])
    assert torch.isneginf(logits[0, size:]).all() and torch.isfinite(logits[0, sorted(allowed)]).all()


def test_termination_allows_only_eos(compiler, tokenizer, eos_ids):
    matcher = compiler.compile_blocking(StructuredSpec.choice(["jade", "bronze"])).matcher()
    for t in tokenizer.encode("jade", add_special_tokens=False):
        matcher.accept(t)
    assert matcher.is_terminated()
    assert allowed_ids(matcher) == set(eos_ids)
    logits = torch.randn(1, VOCAB)
    apply_token_masks(logits, [matcher])
    assert int(logits[0].argmax()) in eos_ids
    with pytest.raises(GrammarError, match="rejected token"):
        matcher.accept(tokenizer.encode("x", add_special_tokens=False)[0])


def test_eos_allowed_when_accepting_but_not_terminated(compiler, tokenizer, eos_ids):
    matcher = compiler.compile_blocking(StructuredSpec("regex", "[a-z]+")).matcher()
    assert not allowed_ids(matcher) & set(eos_ids)  # nothing generated yet: EOS would end too early
    matcher.accept(tokenizer.encode("ab", add_special_tokens=False)[0])
    allowed = allowed_ids(matcher)
    assert set(eos_ids) <= allowed and len(allowed) > len(eos_ids)
    assert not matcher.is_terminated()
    matcher.accept(eos_ids[1])
    assert matcher.is_terminated()
    with pytest.raises(GrammarError, match="had ended"):
        matcher.accept(eos_ids[0])


def test_rejected_token_fails_that_request_alone(compiler, tokenizer):
    good = compiler.compile_blocking(StructuredSpec("regex", "[a-z]+")).matcher()
    bad = compiler.compile_blocking(StructuredSpec("regex", "[a-z]+")).matcher()
    digit = tokenizer.encode("7", add_special_tokens=False)[0]
    with pytest.raises(GrammarError, match=rf"the regex rejected token {digit} .* after 0 generated tokens"):
        bad.accept(digit)
    logits = torch.randn(3, VOCAB)
    raw = logits.clone()
    errors = apply_token_masks(logits, [good, bad, None])
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], GrammarError) and "error state" in str(errors[1])
    assert torch.equal(logits[1:], raw[1:])  # the broken row is left finite for the caller to fail
    assert torch.isneginf(logits[0, digit])


# --- compilation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredSpec.json_schema({"type": "frobnicate"}), "Invalid type"),
        (StructuredSpec.json_schema({"if": {"type": "string"}, "then": {"maxLength": 3}}), "Unimplemented keys"),
        (StructuredSpec.json_schema({"$ref": "#/$defs/missing"}), "does not exist"),
        (StructuredSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable"),
        (StructuredSpec.json_schema({"properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}), "look-around"),
        (StructuredSpec("regex", r"(\w)\1"), "backreferences are not supported"),
        (StructuredSpec("regex", "(a"), "unclosed group"),
        (StructuredSpec("grammar", 'root ::= "a" missing'), "Rule 'missing' not found"),
        (StructuredSpec("grammar", 'start: "a" missing'), "unknown name"),
    ],
    ids=["type", "if-then", "ref", "unsatisfiable", "pattern", "backref", "regex-syntax", "ebnf-rule", "lark-rule"],
)
def test_uncompilable_spec_is_a_client_error(compiler, spec, message):
    with pytest.raises(StructuredOutputError, match=re.escape(message)) as first:
        compiler.compile_blocking(spec)
    assert str(first.value).startswith((f"cannot compile the {spec.label}", f"invalid {spec.label}"))
    failed = compiler.submit(spec)
    with pytest.raises(StructuredOutputError) as again:  # the failure is cached too
        compiler.compile_blocking(spec)
    assert compiler.submit(spec) is failed and str(again.value) == str(first.value)


def test_compile_cache_hit_and_lru_bound(tokenizer, eos_ids):
    compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, cache_size=2)
    try:
        a, b, c = (StructuredSpec("regex", f"[a-z]{{{n}}}") for n in (1, 2, 3))
        first = compiler.compile_blocking(a)
        assert compiler.compile_blocking(StructuredSpec("regex", "[a-z]{1}")) is first  # equal spec: same object
        compiler.compile_blocking(b)
        compiler.compile_blocking(a)  # a is now the most recent
        compiler.compile_blocking(c)  # evicts b
        assert compiler.compile_blocking(a) is first
        assert len(compiler._cache) == 2 and b not in compiler._cache
    finally:
        compiler.close()


def test_compile_cache_bounded_by_spec_text(tokenizer, eos_ids):
    """Large specs are evicted by their text, not only by count: a few big choice lists must not
    pin the memory of `cache_size` compiled grammars."""
    compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, cache_size=100, cache_chars=2500)
    try:
        big = [StructuredSpec("choice", tuple(f"{n}-{i:04d}" for i in range(150))) for n in range(3)]  # ~1k chars each
        small = StructuredSpec("regex", "[a-z]{2}")
        kept = compiler.compile_blocking(small)
        for spec in big:
            compiler.compile_blocking(spec)
        assert big[0] not in compiler._cache and small not in compiler._cache  # oldest out first
        assert big[1] in compiler._cache and big[2] in compiler._cache
        assert compiler._cached_chars == sum(sum(map(len, s.payload)) for s in big[1:]) <= 2500
        huge = StructuredSpec("choice", tuple(f"h-{i:05d}" for i in range(400)))  # past the bound alone
        held = compiler.compile_blocking(huge)
        assert list(compiler._cache) == [huge] and compiler.compile_blocking(huge) is held
        assert compiler.compile_blocking(small) is not kept  # evicted with huge: compiled anew
        assert list(compiler._cache) == [small]
    finally:
        compiler.close()


def test_async_compile_and_timeout(tokenizer, eos_ids, monkeypatch):
    compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, timeout_s=0.2)
    try:
        spec = StructuredSpec("regex", "[0-9]+")
        compiled = asyncio.run(compiler.compile(spec))
        assert compiled.spec == spec and compiled is compiler.compile_blocking(spec)
        with pytest.raises(StructuredOutputError, match="JSON schema"):
            asyncio.run(compiler.compile(StructuredSpec.json_schema({"type": "nope"})))

        slow = compiler._compile
        monkeypatch.setattr(compiler, "_compile", lambda s: time.sleep(0.6) or slow(s))
        late = StructuredSpec("regex", "[a-f]+")
        with pytest.raises(StructuredOutputError, match=r"took longer than 0.2 s"):
            asyncio.run(compiler.compile(late))
        with pytest.raises(StructuredOutputError, match=r"took longer than 0.2 s"):
            compiler.compile_blocking(StructuredSpec("regex", "[g-k]+"))
        time.sleep(0.6)  # the shared compilation was not cancelled by the timeout: it finishes and is cached
        assert compiler.submit(late).result(timeout=5).spec == late
    finally:
        compiler.close()


def test_a_cached_compile_older_than_the_timeout_is_served(tokenizer, eos_ids):
    """A spec compiled more than timeout_s ago is a cache hit, for the server (async) and offline
    callers alike, its error too: not a 'took longer than' timeout for every later request."""
    compiler = GrammarCompiler(tokenizer, VOCAB, eos_ids, timeout_s=0.2)
    try:
        spec, bad = StructuredSpec("regex", "[0-9]+"), StructuredSpec.json_schema({"type": "nope"})
        compiled = asyncio.run(compiler.compile(spec))
        with pytest.raises(StructuredOutputError, match="JSON schema"):
            asyncio.run(compiler.compile(bad))
        time.sleep(0.3)  # both compiles started longer than timeout_s ago
        assert asyncio.run(compiler.compile(spec)) is compiled
        assert compiler.compile_blocking(spec) is compiled
        with pytest.raises(StructuredOutputError, match="JSON schema"):
            asyncio.run(compiler.compile(bad))
    finally:
        compiler.close()


def test_tokenizer_larger_than_the_model_is_a_client_error(tokenizer, eos_ids):
    compiler = GrammarCompiler(tokenizer, 256, [0])
    try:
        with pytest.raises(StructuredOutputError, match="unavailable for this model's tokenizer"):
            compiler.compile_blocking(StructuredSpec("json_object"))
    finally:
        compiler.close()


def test_draft_prefix_and_draft_masks_follow_the_grammar_and_leave_the_matcher_as_it_was(compiler, tokenizer, eos_ids):
    """Speculative decoding's view of a matcher: the drafts it can take, and the mask of each
    verified row (after the drafts before it) — the masks sequential decoding would compute."""
    pattern = "(Shang|Zhou|Han)!( (Shang|Zhou|Han)!)*"
    matcher = compiler.compile_blocking(StructuredSpec("regex", pattern)).matcher()
    good = tokenizer.encode("Zhou! Han!", add_special_tokens=False)
    assert matcher.draft_prefix([*good, eos_ids[0], *good]) == good  # stops at EOS
    bad = tokenizer.encode("Zhou!x", add_special_tokens=False)
    assert matcher.draft_prefix(bad) == tokenizer.encode("Zhou!", add_special_tokens=False)
    rows = allocate_bitmask(len(good) + 1, VOCAB)
    matcher.fill_draft_masks(rows, good)
    assert matcher.num_tokens == 0 and allowed_ids(matcher) == allowed_ids(
        compiler.compile_blocking(StructuredSpec("regex", pattern)).matcher()
    )  # rolled back
    sequential = compiler.compile_blocking(StructuredSpec("regex", pattern)).matcher()
    for j, token in enumerate(good):
        expected = allocate_bitmask(1, VOCAB)[0]
        sequential.fill_mask(expected)
        assert torch.equal(rows[j], expected), j
        sequential.accept(token)
    expected = allocate_bitmask(1, VOCAB)[0]
    sequential.fill_mask(expected)
    assert torch.equal(rows[len(good)], expected)

    # before `</think>` (here the ids 5, 6) the rows are free; drafts stop at the one ending it
    thinking = compiler.compile_blocking(StructuredSpec("regex", pattern)).matcher(starts_after=(5, 6))
    assert thinking.draft_prefix([9, 5, 6, *good]) == [9, 5, 6]
    rows = allocate_bitmask(4, VOCAB)
    thinking.fill_draft_masks(rows, [9, 5, 6])
    assert bool((rows[:3] == -1).all())
    start = allocate_bitmask(1, VOCAB)[0]
    compiler.compile_blocking(StructuredSpec("regex", pattern)).matcher().fill_mask(start)
    assert torch.equal(rows[3], start) and not thinking.active
