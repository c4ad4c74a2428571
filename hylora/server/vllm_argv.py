"""vLLM's spellings of a launch line that argparse alone would not read, turned into hylora's before parsing
(as vLLM's FlexibleArgumentParser does): `--max_model_len` for `--max-model-len`; the short `-sc`, `-cc`,
`-ac`; the dotted form of a JSON flag (`--limit-mm-per-prompt.video 0`); and the sizes `32k`, `1M`, `auto`
that `--max-model-len` and `--max-num-batched-tokens` take. No heavy imports: the CLI runs it first."""

from __future__ import annotations

import argparse
import json
import re

from hylora.json_merge import merge_json

# flags that take a JSON object, and so vLLM's dotted form: `--limit-mm-per-prompt.video 0`
JSON_FLAGS = (
    "--limit-mm-per-prompt", "--mm-processor-kwargs", "--media-io-kwargs", "--speculative-config",
    "--default-chat-template-kwargs", "--override-generation-config", "--compilation-config",
    "--structured-outputs-config", "--hf-overrides", "--attention-config",
)  # fmt: skip
SHORT_FLAGS = {"-sc": "--speculative-config", "-cc": "--compilation-config", "-ac": "--attention-config"}
_DOTTED = re.compile(r"^(--[a-z][a-z0-9-]*)\.([\w.-]+?)(\+)?(?:=(.*))?$", re.DOTALL)
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
AUTO = -1  # --max-model-len auto: the model's own context, shortened to what the memory holds


def vllm_argv(argv: list[str]) -> list[str]:
    """The launch line with vLLM's spellings turned into hylora's: flag names with underscores
    (`--gpu_memory_utilization=0.8`) and the short JSON flags (`-sc`, `-cc`, `-ac`) in their long form,
    then the dotted JSON flags as one object each (`expand_dotted_args`)."""
    out = []
    for token in argv:
        if token.startswith("--"):
            name, sep, value = token.partition("=")
            head, dot, rest = name.partition(".")
            token = head.replace("_", "-") + dot + rest + sep + value
        else:
            for short, long in SHORT_FLAGS.items():
                if token == short or token.startswith((short + ".", short + "=")):
                    token = long + token[len(short) :]
                    break
        out.append(token)
    return expand_dotted_args(out)


def expand_dotted_args(argv: list[str]) -> list[str]:
    """vLLM's dotted spelling of a JSON flag as the flag with one JSON object: `--speculative-config.method
    mtp --speculative-config.num_speculative_tokens 2` → `--speculative-config '{"method": "mtp", ...}'`.
    A value is read as JSON where it parses (2, false, {...}), else as a size (`32k`), else as a string;
    `key+ a,b` appends "a" and "b" to a list; the dotted keys go over a JSON object the same flag gives whole.
    Anything else is left as it is."""
    out: list[str] = []
    objects: dict[str, dict] = {}
    slots: dict[str, int] = {}  # where each flag's JSON goes in `out`
    i = 0
    while i < len(argv):
        token = argv[i]
        match = _DOTTED.match(token) if token.startswith("--") else None
        if match is None or match.group(1) not in JSON_FLAGS:
            if token in JSON_FLAGS and i + 1 < len(argv) and argv[i + 1].lstrip().startswith("{"):
                whole = _json_object(token, argv[i + 1])
                if token not in objects:
                    objects[token], slots[token] = {}, len(out) + 1
                    out += [token, ""]
                objects[token] = merge_json(whole, objects[token])
                i += 2
                continue
            out.append(token)
            i += 1
            continue
        flag, path, append, inline = match.groups()
        if inline is None:
            if i + 1 >= len(argv):
                raise ValueError(f"{token} needs a value")
            inline, i = argv[i + 1], i + 2
        else:
            i += 1
        if flag not in objects:
            objects[flag], slots[flag] = {}, len(out) + 1
            out += [flag, ""]
        node = objects[flag]
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"{token}: {key!r} is already set to a value, not an object")
        if append:  # vLLM's rule: the value split at commas, each item a string
            items = node.setdefault(leaf, [])
            if not isinstance(items, list):
                raise ValueError(f"{token}: {leaf!r} is already set to a value, not a list")
            items += inline.split(",")
        else:
            node[leaf] = _value(inline)
    for flag, obj in objects.items():
        out[slots[flag]] = json.dumps(obj)
    return out


def _value(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return human_readable_int(text)
    except (ValueError, argparse.ArgumentTypeError):
        return text


def human_readable_int(value: str) -> int:
    """A count as vLLM's flags take it: `4096`, `32k` (x 1000), `32K` (x 1024), `25.6k`; k m g t decimal,
    K M G T binary (whole numbers only)."""
    text = value.strip()
    match = _SIZE.fullmatch(text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a count (e.g. 4096, 32k, 32K)") from None
    number, suffix = match.groups()
    if suffix in DECIMAL:
        return int(float(number) * DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{value!r}: no decimals with the binary suffix {suffix}; {number}{suffix.lower()} is decimal"
        )
    return int(number) * BINARY[suffix]


def max_model_len_arg(value: str) -> int:
    """--max-model-len: a count as `human_readable_int` reads it, or `auto` / -1 (AUTO): the model's context."""
    if value.strip().lower() in ("auto", "-1"):
        return AUTO
    return human_readable_int(value)


def _json_object(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} expects a JSON object")
    return value
