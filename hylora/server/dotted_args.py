"""vLLM's dotted spelling of its JSON launch flags (`--limit-mm-per-prompt.video 0`), as hylora's parser
reads them: one JSON object per flag. No heavy imports: the CLI runs it before parsing."""

from __future__ import annotations

import json
import re

from hylora.json_merge import merge_json

# flags that take a JSON object, and so vLLM's dotted form: `--limit-mm-per-prompt.video 0`
JSON_FLAGS = (
    "--limit-mm-per-prompt", "--mm-processor-kwargs", "--media-io-kwargs", "--speculative-config",
    "--default-chat-template-kwargs", "--override-generation-config", "--compilation-config",
    "--structured-outputs-config", "--hf-overrides",
)  # fmt: skip
_DOTTED = re.compile(r"^(--[a-z][a-z0-9-]*)\.([\w.-]+?)(\+)?(?:=(.*))?$", re.DOTALL)


def expand_dotted_args(argv: list[str]) -> list[str]:
    """vLLM's dotted spelling of a JSON flag as the flag with one JSON object: `--speculative-config.method
    mtp --speculative-config.num_speculative_tokens 2` → `--speculative-config '{"method": "mtp", ...}'`.
    A value is read as JSON where it parses (2, false, {...}), else as a string; `key+` appends to a list; the
    dotted keys go over a JSON object the same flag gives whole. Anything else is left as it is."""
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
        try:
            value = json.loads(inline)
        except json.JSONDecodeError:
            value = inline
        if flag not in objects:
            objects[flag], slots[flag] = {}, len(out) + 1
            out += [flag, ""]
        node = objects[flag]
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"{token}: {key!r} is already set to a value, not an object")
        if append:
            node.setdefault(leaf, []).append(value)
        else:
            node[leaf] = value
    for flag, obj in objects.items():
        out[slots[flag]] = json.dumps(obj)
    return out


def _json_object(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} expects a JSON object")
    return value
