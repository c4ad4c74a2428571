"""Structured outputs: grammar-constrained decoding through llguidance.

    spec = parse_structured_outputs(body)          # None, a StructuredSpec, or StructuredOutputError (400)
    compiled = await compiler.compile(spec)        # off the engine thread, cached; errors / timeout → 400
    matcher = compiled.matcher()                   # one per request (per choice when n > 1)
    errors = apply_token_masks(logits, matchers)   # each step, whole batch, before penalties / temperature
    matcher.accept(token)                          # after sampling; GrammarError fails that request alone
    matcher.is_terminated()                        # document complete: finish with "stop"

Why llguidance rather than xgrammar (both are vLLM backends). Measured on this shared 2-core x86
CPU (load ~3, so ±50%), llguidance 1.9.1 vs xgrammar 0.2.9, with a synthetic byte-level vocabulary
of 248,077 tokens in 248,320 model rows (Qwen3.5's sizes).

- install: llguidance is one 3.1 MB abi3 wheel with no dependencies (7.6 MB installed; wheels for
  Linux x86_64/aarch64, macOS arm64, Windows). xgrammar needs apache-tvm-ffi (13 MB), torch,
  transformers and, on Linux x86_64, triton (691 MB installed).
- compile a 7-field relic schema (enums, nested object, array of objects, anyOf with null):
  llguidance 2.5–2.9 ms, xgrammar 223–508 ms; regex 1–2 ms vs 131–518 ms; EBNF 1–3 ms vs
  19–56 ms; any JSON object 1 ms vs 177–224 ms. A request's matcher from a compiled grammar: 5 µs.
- token mask per step along one 212-token path through a relic document (same tokens for both):
  llguidance mean 111–121 µs, p50 45 µs, p90 ~200 µs, max ~3 ms; xgrammar mean 258–633 µs,
  p50 7 µs, p90 1.5–2 ms, max 2.7–7.6 ms. Free-form JSON (json_object): 138–186 µs vs 2.4–3.2 ms
  mean. Demo tokenizer (693 tokens): every kind compiles in < 2 ms, masks take ~10–60 µs.
- tokenizer set-up, once per engine, in the compiler's thread: llguidance 2.4–3.5 s and 214 MiB
  for the 248k vocabulary (xgrammar 1.9–2.1 s).
- formats: both do JSON schema, regex, choice and grammars; llguidance takes Lark and converts
  GBNF/EBNF (vLLM's `guided_grammar` spelling), reports unsupported schema keywords as errors
  (→ 400) instead of ignoring them, and bounds per-step work (LLParserLimits).

llguidance is therefore a core dependency (`llguidance>=1.9.1,<2`). Regex syntax is Rust's
`regex` crate (no look-around or back-references: those are a 400); as in Python's `re`,
`\\d`/`\\w` are Unicode-aware — write `[0-9]` for ASCII digits.

llguidance compiles natively and recursively: a deep enough spec overflows the stack and kills
the process, others compile and fail at the first token. Such specs are refused before or while
compiling, never in the engine: limits.py and rules.py (pre-compile bounds), probe.py (a test
compile and drive of the first tokens), worker.py / sandbox.py (the probe, in a worker process
with a small stack), compiler.py (the queue, the cache, the server-side compile).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hylora.structured.compiler import CompiledGrammar, GrammarCompiler
    from hylora.structured.errors import CompilerBusy, CompileTimeout, StructuredOutputError
    from hylora.structured.mask import allocate_bitmask, apply_bitmask, apply_token_masks, fill_bitmask
    from hylora.structured.matcher import GrammarError, GrammarMatcher
    from hylora.structured.spec import StructuredSpec, parse_structured_outputs

# Imported on first use: the grammar worker process (structured/worker.py) imports the light
# modules of this package and must not pay for torch / transformers.
_HOMES = {
    "CompiledGrammar": "compiler",
    "GrammarCompiler": "compiler",
    "CompileTimeout": "errors",
    "CompilerBusy": "errors",
    "StructuredOutputError": "errors",
    "allocate_bitmask": "mask",
    "apply_bitmask": "mask",
    "apply_token_masks": "mask",
    "fill_bitmask": "mask",
    "GrammarError": "matcher",
    "GrammarMatcher": "matcher",
    "StructuredSpec": "spec",
    "parse_structured_outputs": "spec",
}

__all__ = [
    "CompiledGrammar",
    "CompileTimeout",
    "CompilerBusy",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "StructuredOutputError",
    "StructuredSpec",
    "allocate_bitmask",
    "apply_bitmask",
    "apply_token_masks",
    "fill_bitmask",
    "parse_structured_outputs",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
