"""What doctor checks: a deployment that scores prompts. In-process it is hylora's engine; against
a server it is `endpoint.Endpoint`. Both answer the same two questions."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hylora.doctor.prompts import Probe, video_messages
from hylora.doctor.scores import Generation, Scores
from hylora.engine.chat_input import multimodal_prompt
from hylora.engine.engine import LLMEngine, RequestError, RequestOutput
from hylora.engine.multimodal import MultimodalPrompt
from hylora.engine.request import SamplingParams

# the top-1 and the runner-up: two served results whose top-1s differ are a near-tie when the one
# compared with ranks the judged one's top-1 close to its own (compare.diff_served)
SERVED_TOP_K = 2
_MISSING = object()


@dataclass
class LoadStats:
    """N concurrent streams for a bounded time: nothing may be lost, nothing may fail."""

    streams: int
    seconds: float
    started: int = 0
    completed: int = 0  # ended normally with the tokens asked for (or a stop)
    server_errors: int = 0  # 5xx (or an engine error in-process)
    other_errors: int = 0  # 4xx, refused
    lost: int = 0  # ended without a finish (connection dropped, no [DONE], missing tokens)
    tokens: int = 0
    examples: list[str] = field(default_factory=list)  # the first few problems

    def problem(self, text: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(text)


@dataclass(frozen=True)
class Features:
    """The fast paths a deployment serves with (fastpaths.py checks each). None: not known, the
    check finds out from the answers (a server's cached-token counts, its /metrics)."""

    prefix_caching: bool | None = None
    speculative: bool | None = None
    quantization: str | None = None  # e.g. "fp8": the deployment serves quantised weights
    # with quantised weights: whether it quantises the activations too (None: not known, judged as if it
    # does); False (weight-only or split-activation FP8) is held to the unquantised tolerance
    quantized_activations: bool | None = None
    # split-activation FP8 (`--fp8-activations split`): its activations hold a bf16 rounding's precision,
    # so a deployment of a finer dtype is held to bf16's tolerance at least
    split_activations: bool = False
    source: str = ""  # where this came from

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items()}


class Deployment(Protocol):
    description: str
    limits: list[str]  # what cannot be checked on this deployment

    def score(self, probes: list[Probe], concurrent: bool = False) -> list[Scores]:
        """Each probe's prompt scored: sent one after another, or all at once (one batch)."""
        ...

    def load(self, streams: int, seconds: float, max_tokens: int) -> LoadStats: ...

    # optional (decode.py, fastpaths.py; a deployment without them has neither decode nor the fast
    # paths checked): features() -> Features; generate(probes, max_tokens, prompt_logprobs=False[,
    # together=False]) -> list[Generation] (together: all requests in flight at once);
    # speculation_counter() -> float | None (draft tokens proposed so far)


class EngineDeployment:
    """hylora in this process: requests go straight to the engine; several at once share its steps."""

    def __init__(self, engine: LLMEngine, sequence: list[int], request_timeout: float = 3600.0):
        self.engine, self.sequence = engine, sequence
        self.request_timeout = request_timeout
        self._ids = itertools.count()
        dtype = str(engine.model.dtype).removeprefix("torch.")
        self.description = f"hylora in-process ({engine.model_dir.name}, {engine.model.device.type}, {dtype})"
        self.limits: list[str] = []

    def score(self, probes: list[Probe], concurrent: bool = False) -> list[Scores]:
        if not concurrent:
            return [self._run([p])[0] for p in probes]
        return self._run(probes)

    def _run(self, probes: list[Probe]) -> list[Scores]:
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=SERVED_TOP_K, prompt_logprobs=SERVED_TOP_K)
        results: list[Scores | None] = [None] * len(probes)
        order = {}
        for i, probe in enumerate(probes):
            rid = f"doctor-{next(self._ids)}"
            try:
                if probe.video is not None:
                    ids, mm = self._video_prompt(probe.video)
                    self.engine.add_request(
                        rid, ids, SamplingParams(max_tokens=1, temperature=0.0), probe.target, mm=mm
                    )
                else:
                    self.engine.add_request(rid, probe.ids(self.sequence), params, probe.target)
            except (RequestError, LookupError, ValueError) as e:  # refused: unknown adapter, too long, bad media
                results[i] = Scores.failed(f"refused: {e}")
                continue
            order[rid] = i
            if probe.fault:
                self.engine.inject_fault(rid, probe.fault)
        for out in self._until_done(set(order)):
            i = order[out.request_id]
            video_ok = probes[i].video is not None and not out.error
            results[i] = Scores() if video_ok else Scores.from_output(out)
        return results  # type: ignore[return-value]

    # --- fast paths (fastpaths.py) ----------------------------------------------------------
    def features(self) -> Features:
        """What the engine was configured with (attributes it may not have yet read as off):
        prefix caching when it built a prefix cache, speculation when it drafts tokens."""
        config = self.engine.config
        speculative = getattr(config, "speculative_config", None) or getattr(config, "num_speculative_tokens", 0)
        cache = getattr(self.engine, "prefix_cache", _MISSING)  # None when configured on but not built
        prefix = cache is not None if cache is not _MISSING else bool(getattr(config, "enable_prefix_caching", False))
        quantization = getattr(self.engine, "quantization", None) or getattr(config, "quantization", None)
        kernels = getattr(config, "kernels", None)
        activations = getattr(kernels, "fp8_activations", "dynamic") if quantization else None
        return Features(
            prefix_caching=prefix,
            speculative=bool(speculative),
            quantization=quantization,
            quantized_activations=None if activations is None else activations == "dynamic",
            split_activations=activations == "split",
            source="the engine's configuration",
        )

    def speculation_counter(self) -> float | None:
        """Draft tokens the engine proposed so far (`stats().spec_draft_tokens`), None if it has no count."""
        value = getattr(self.engine.stats(), "spec_draft_tokens", None)
        return None if value is None else float(value)

    def generate(
        self, probes: list[Probe], max_tokens: int, prompt_logprobs: bool = False, together: bool = False
    ) -> list[Generation]:
        """Greedy continuations of `max_tokens` tokens (top-1 logprobs), one request at a time, or
        with `together` all added before the engine steps (its decode steps then batch them)."""
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=SERVED_TOP_K,
            prompt_logprobs=SERVED_TOP_K if prompt_logprobs else None,
        )  # fmt: skip
        if together:
            return self._generate_together(probes, params)
        out = []
        for probe in probes:
            rid = f"doctor-{next(self._ids)}"
            try:
                self.engine.add_request(rid, probe.ids(self.sequence), params, probe.target)
            except (RequestError, LookupError, ValueError) as e:
                out.append(Generation.failed(f"refused: {e}"))
                continue
            hits = self._prefix_hits()
            gen = Generation.from_output(self._until_done({rid})[0])
            if gen.cached_tokens is None and hits is not None:  # one request at a time: the counter's growth
                gen.cached_tokens = self._prefix_hits() - hits  # type: ignore[operator]
            out.append(gen)
        return out

    def _generate_together(self, probes: list[Probe], params: SamplingParams) -> list[Generation]:
        results: list[Generation | None] = [None] * len(probes)
        order: dict[str, int] = {}
        for i, probe in enumerate(probes):
            rid = f"doctor-{next(self._ids)}"
            try:
                self.engine.add_request(rid, probe.ids(self.sequence), params, probe.target)
            except (RequestError, LookupError, ValueError) as e:
                results[i] = Generation.failed(f"refused: {e}")
                continue
            order[rid] = i
        for out in self._until_done(set(order)):
            results[order[out.request_id]] = Generation.from_output(out)
        return results  # type: ignore[return-value]

    def _prefix_hits(self) -> int | None:
        """Prompt tokens served from the prefix cache so far (`stats().prefix_cache_hits`), if counted."""
        return getattr(self.engine.stats(), "prefix_cache_hits", None)

    def _video_prompt(self, path: Path) -> tuple[list[int], MultimodalPrompt]:
        settings = self.engine.media_settings()
        if settings is None:
            raise ValueError("this model has no vision tower: no video can be sent")
        return asyncio.run(multimodal_prompt(settings, self.engine.tokenizer, video_messages(path)))

    def _until_done(self, ids: set[str]) -> list[RequestOutput]:
        """Step until every request in `ids` finished; past the timeout the rest are aborted."""
        finished = []
        deadline = time.monotonic() + self.request_timeout
        while ids:
            if time.monotonic() > deadline:
                for rid in ids:
                    self.engine.abort(rid, error=f"did not finish within {self.request_timeout:g} s")
            for out in self.engine.step():
                if out.finished and out.request_id in ids:
                    ids.discard(out.request_id)
                    finished.append(out)
        return finished

    def load(self, streams: int, seconds: float, max_tokens: int) -> LoadStats:
        stats = LoadStats(streams, seconds)
        targets = [None, *self.engine.adapters.names()]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        running: set[str] = set()
        deadline = time.monotonic() + seconds
        while running or time.monotonic() < deadline:
            while time.monotonic() < deadline and len(running) < streams:
                n = next(self._ids)
                rid = f"doctor-load-{n}"
                stats.started += 1
                try:
                    self.engine.add_request(rid, self.sequence[n % 64 : n % 64 + 16], params, targets[n % len(targets)])
                except (RequestError, LookupError, ValueError) as e:
                    stats.other_errors += 1
                    stats.problem(f"{rid}: refused: {e}")
                    continue
                running.add(rid)
            for out in self.engine.step():
                if not out.finished or out.request_id not in running:
                    continue
                running.discard(out.request_id)
                stats.tokens += len(out.token_ids)
                if out.error:
                    stats.server_errors += 1
                    stats.problem(f"{out.request_id}: {out.error}")
                elif len(out.token_ids) != max_tokens:
                    stats.lost += 1
                    stats.problem(f"{out.request_id}: {len(out.token_ids)} of {max_tokens} tokens")
                else:
                    stats.completed += 1
        return stats
