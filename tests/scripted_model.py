"""A demo checkpoint rewired so that its greedy output is known: the tests of the reasoning and
tool-call parsers run end to end through the server on a model that writes a fixed text.

Every attention, GDN and MLP layer's output projection is zeroed, so the residual stream at a token
is that token's embedding; the final norm is the identity scale; the embedding of the i-th token of
the script is the unit vector e_i and the lm_head row of the (i+1)-th holds 30·e_i, every other
lm_head row zero. After token script[i] the logits single out script[i+1]: greedy decoding from a
prompt that ends with script[0] writes the rest of the script. The tokens a script conditions on
must be distinct (each has one successor).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

ZEROED = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")


def write_scripted_model(demo: Path, out: Path, script: list[str], extra_tokens: tuple[str, ...] = ()) -> Path:
    """Copy `demo` to `out` (without its adapters) so that the model writes `script` (one token
    each; `extra_tokens` are added to the tokenizer first, as plain added tokens)."""
    shutil.copytree(demo, out, ignore=shutil.ignore_patterns("adapters", "media"))
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    if extra_tokens:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
        tokenizer.save(str(out / "tokenizer.json"))
    ids = []
    for piece in script:
        encoded = tokenizer.encode(piece, add_special_tokens=False).ids
        if len(encoded) != 1:
            raise ValueError(f"script piece {piece!r} is {len(encoded)} tokens; use one token per piece")
        ids.append(encoded[0])
    if len(set(ids[:-1])) != len(ids) - 1:
        raise ValueError("every token the script continues from must be distinct")
    weights = load_file(out / "model.safetensors")
    embed, head = weights["model.language_model.embed_tokens.weight"], weights["lm_head.weight"]
    if max(ids) >= head.shape[0] or len(ids) > embed.shape[1]:
        raise ValueError("the script needs more vocabulary rows or hidden dimensions than the demo has")
    for name in weights:
        if name.endswith(ZEROED):
            weights[name] = torch.zeros_like(weights[name])
    weights["model.language_model.norm.weight"] = torch.zeros_like(weights["model.language_model.norm.weight"])
    head.zero_()
    for i, (token, following) in enumerate(zip(ids, ids[1:], strict=False)):
        embed[token] = 0.0
        embed[token, i] = 1.0
        head[following, i] = 30.0
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "DEMO_COMPLETE").unlink(missing_ok=True)
    return out
