"""The reference doctor compares a deployment with: hylora's own engine on the base weights, with
each adapter merged into them in place (merged.py) — never dynamic LoRA. One request per target, on
the longest prompt of the sweep, scores every shorter prefix too."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from hylora.adapters.files import read_adapter
from hylora.doctor.merged import Restore, merged
from hylora.doctor.scores import ReferenceScores
from hylora.engine.engine import LLMEngine
from hylora.engine.request import SamplingParams

log = logging.getLogger(__name__)
REFERENCE_TOP_K = 20  # to place a served top-1 that (nearly) ties with the reference's, and the gap when it does not


class Reference:
    """Reference logprobs per target (None = the base model) for the first `length` tokens of
    `sequence`, computed once. Uses `engine` exclusively while it runs (weights are folded in place)."""

    def __init__(
        self,
        engine: LLMEngine,
        adapters: dict[str, Path],
        sequence: list[int],
        length: int,
        restore: Restore = "auto",
    ):
        if length > len(sequence):
            raise ValueError(f"the reference covers {length} tokens but the sequence has {len(sequence)}")
        self.engine, self.adapters = engine, adapters
        self.sequence, self.prompt = sequence, sequence[:length]
        self.restore = restore
        self.notes: dict[str, str] = {}  # target label → how it was computed
        # FP8 weights dequantised (the fp8 check's reference)
        self.dequantised = engine.dequantised_fp8
        self._scores: dict[str | None, ReferenceScores] = {}

    @property
    def dtype(self) -> str:
        return str(self.engine.model.dtype).removeprefix("torch.")

    @property
    def description(self) -> str:
        where = f"{self.engine.model_dir.name}, {self.engine.model.device.type}, {self.dtype}"
        if self.dequantised:
            where += ", FP8 weights dequantised"
        return f"hylora, adapters merged into the weights ({where})"

    def scores(self, target: str | None) -> ReferenceScores:
        if target not in self._scores:
            self._scores[target] = self._compute(target)
        return self._scores[target]

    def _compute(self, target: str | None) -> ReferenceScores:
        started = time.monotonic()
        if target is None:
            result = self._run()
            how = "base weights"
        else:
            adapter = read_adapter(self.adapters[target], self.engine.model.config, target)
            with merged(self.engine.model, adapter, self.restore, self.engine.model_dir) as strategy:
                result = self._run()
            how = f"{target} merged in place (restored by {strategy})"
        self.notes[target or "base"] = f"{how}, {len(self.prompt)} tokens, {time.monotonic() - started:.1f} s"
        log.info("reference for %s: %s", target or "the base model", self.notes[target or "base"])
        return result

    def _run(self) -> ReferenceScores:
        if self.engine.has_unfinished():
            raise RuntimeError("the reference needs the engine to itself (requests are in flight)")
        params = SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=REFERENCE_TOP_K, prompt_logprobs=REFERENCE_TOP_K
        )
        rid = f"doctor-reference-{time.monotonic_ns()}"
        self.engine.add_request(rid, self.prompt, params, None)
        while True:
            for out in self.engine.step():
                if out.finished and out.request_id == rid:
                    return ReferenceScores.from_output(out)
