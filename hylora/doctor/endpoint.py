"""An OpenAI-compatible server as a deployment doctor can check: plain `/v1/completions` with
token-id prompts, prompt logprobs from vLLM's `prompt_logprobs` field where the server has it,
else from `echo` + `logprobs` (OpenAI's legacy format). Every request counts against a budget of
requests and time; each has its own timeout.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx

from hylora.doctor.deployment import SERVED_TOP_K, Features, LoadStats
from hylora.doctor.prompts import Probe, video_messages
from hylora.doctor.scores import TOKEN_ID, Generation, Scores, Token, finite_or_nan

PROMPT_LOGPROBS = "prompt_logprobs"  # vLLM's extension: ids and logprobs of every prompt position
ECHO = "echo"  # OpenAI legacy: echo=true + logprobs gives the prompt tokens' logprobs as text-keyed dicts
SPEC_DRAFT_METRICS = ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens")


class BudgetExhausted(RuntimeError):
    pass


@dataclass
class Budget:
    """At most `max_requests` requests and `seconds` of wall time for everything sent to the server."""

    max_requests: int
    seconds: float
    sent: int = 0
    started: float = 0.0

    def __post_init__(self) -> None:
        self.started = time.monotonic()

    def take(self) -> None:
        if self.sent >= self.max_requests:
            raise BudgetExhausted(f"request budget exhausted ({self.max_requests} requests, --max-requests)")
        if time.monotonic() - self.started > self.seconds:
            raise BudgetExhausted(f"time budget exhausted ({self.seconds:g} s, --time-limit)")
        self.sent += 1

    @property
    def remaining_s(self) -> float:
        return self.seconds - (time.monotonic() - self.started)


class Endpoint:
    def __init__(
        self,
        url: str,
        sequence: list[int],
        adapters: list[str],
        api_key: str | None = None,
        base_name: str | None = None,
        request_timeout: float = 300.0,
        budget: Budget | None = None,
        quantization: str | None = None,
    ):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.quantization = quantization  # what the server serves, when told (--endpoint-quantization)
        self.sequence, self.adapters = sequence, adapters
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_name = base_name
        self.timeout = request_timeout
        self.budget = budget or Budget(max_requests=2000, seconds=3600.0)
        self.mode: str | None = None
        self.token_ids = False  # the server renders tokens as `token_id:N` (vLLM's return_tokens_as_token_ids)
        self.limits: list[str] = []
        self.models: list[str] = []  # the names /v1/models lists
        self.description = f"endpoint {self.url}"

    # --- discovery -------------------------------------------------------------------------
    def connect(self) -> None:
        """Find the base model's name and the adapters in /v1/models, then how the server returns
        prompt logprobs. Raises ConnectionError when the server cannot be used at all."""
        try:
            r = httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=min(self.timeout, 30.0))
        except httpx.HTTPError as e:
            raise ConnectionError(f"{self.url}/v1/models: {e!r}") from None
        if r.status_code != 200:
            raise ConnectionError(f"{self.url}/v1/models: HTTP {r.status_code}: {_error_text(_json_or_text(r))}")
        try:
            listed = r.json()["data"]
        except (ValueError, KeyError, TypeError):
            raise ConnectionError(f"{self.url}/v1/models: not an OpenAI model list: {r.text[:300]}") from None
        models = [m for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)]
        names = self.models = [m["id"] for m in models]
        missing = [a for a in self.adapters if a not in names]
        if missing:
            self.limits.append(f"the server lists no model named {', '.join(missing)} (its models: {', '.join(names)})")
        if self.base_name is None:
            bases = [m["id"] for m in models if m["id"] not in self.adapters and not m.get("parent")]
            if len(bases) != 1:
                raise ConnectionError(f"cannot tell the base model among {names}; name it with --served-model-name")
            self.base_name = bases[0]
        self.description = f"endpoint {self.url} (base model {self.base_name!r})"
        self._detect()

    def _detect(self) -> None:
        prompt = self.sequence[:4]
        body = self._body(None, prompt) | {PROMPT_LOGPROBS: SERVED_TOP_K, "return_tokens_as_token_ids": True}
        first, data = asyncio.run(self._once(body))
        choice = _first_choice(data) if first == 200 else None
        if choice is not None and isinstance(choice.get(PROMPT_LOGPROBS), list):
            self.mode = PROMPT_LOGPROBS
            self.token_ids = _renders_ids(choice)
            return
        body = self._body(None, prompt) | {"echo": True, "return_tokens_as_token_ids": True}
        status, data = asyncio.run(self._once(body))
        if first >= 400 and status >= 400:  # refused both ways: the server's own words, not "no logprobs"
            raise ConnectionError(self._refusal(status, data))
        choice = _first_choice(data) if status == 200 else None
        logprobs = (choice or {}).get("logprobs") or {}
        if isinstance(logprobs.get("token_logprobs"), list) and len(logprobs["token_logprobs"]) == len(prompt) + 1:
            self.mode = ECHO
            self.token_ids = _renders_ids(choice)
            self.limits.append(
                "the server has no `prompt_logprobs` field: prompt logprobs come from echo + logprobs"
                + ("" if self.token_ids else ", tokens as text (top-1 compared by text)")
            )
            return
        self.limits.append(
            "the server returns no prompt logprobs (neither vLLM's prompt_logprobs nor echo + logprobs): "
            f"nothing can be compared (last answer: HTTP {status}: {_error_text(data)})"
        )

    def _refusal(self, status: int, data: Any) -> str:
        text = f"a request for the base model {self.base_name!r} got HTTP {status}: {_error_text(data)}"
        if status == 404 and self.base_name not in self.models:  # (a listed name's 404 is not about the name)
            text += f"; check --served-model-name (the server's /v1/models lists {', '.join(self.models) or 'nothing'})"
        return text

    # --- scoring ---------------------------------------------------------------------------
    def score(self, probes: list[Probe], concurrent: bool = False) -> list[Scores]:
        return asyncio.run(self._score(probes, concurrent))

    async def _score(self, probes: list[Probe], concurrent: bool) -> list[Scores]:
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            if concurrent:
                return list(await asyncio.gather(*(self._score_one(client, p) for p in probes)))
            return [await self._score_one(client, p) for p in probes]

    async def _score_one(self, client: httpx.AsyncClient, probe: Probe) -> Scores:
        if self.mode is None:
            return Scores.failed("the server returns no prompt logprobs")
        if probe.fault:
            return Scores.failed("faults cannot be injected into an endpoint")
        if probe.video is not None:
            return await self._video(client, probe)
        prompt = probe.ids(self.sequence)
        body = self._body(probe.target, prompt)
        body |= {PROMPT_LOGPROBS: SERVED_TOP_K} if self.mode == PROMPT_LOGPROBS else {"echo": True}
        if self.token_ids:
            body["return_tokens_as_token_ids"] = True
        try:
            status, data = await self._post(client, body)
        except BudgetExhausted as e:
            return Scores.failed(str(e))
        if status != 200:
            return Scores.failed(f"HTTP {status}: {_error_text(data)}")
        try:
            return self._parse(prompt, _first_choice(data) or {})
        except (KeyError, TypeError, ValueError, IndexError) as e:
            return Scores.failed(f"cannot read the logprobs in the answer ({e!r}): {json.dumps(data)[:300]}")

    async def _video(self, client: httpx.AsyncClient, probe: Probe) -> Scores:
        """A chat request with the video: served (an empty Scores) or failed."""
        body = {
            "model": probe.target or self.base_name,
            "messages": video_messages(probe.video),  # type: ignore[arg-type]
            "max_tokens": 1,
            "temperature": 0.0,
        }
        try:
            status, data = await self._post(client, body, "/v1/chat/completions")
        except BudgetExhausted as e:
            return Scores.failed(str(e))
        return Scores() if status == 200 else Scores.failed(f"HTTP {status}: {_error_text(data)}")

    def _parse(self, prompt: list[int], choice: dict[str, Any]) -> Scores:
        n = len(prompt)
        generated = choice.get("logprobs") or {}
        if self.mode == PROMPT_LOGPROBS:
            entries = choice[PROMPT_LOGPROBS]
            if len(entries) != n:
                raise ValueError(f"{len(entries)} prompt_logprobs entries for a {n}-token prompt")
            logprobs, top1, top1_logprobs, tops = [], [], [], []
            for p in range(1, n):
                entry = entries[p] or {}
                tops.append(_ranked_logprobs(entry))
                actual = entry.get(str(prompt[p])) or {}
                logprobs.append(finite_or_nan(actual.get("logprob")))
                best = _best_ranked(entry)
                top1.append(best)
                top1_logprobs.append(finite_or_nan((entry.get(str(best)) or {}).get("logprob")) if best is not None
                                     else math.nan)  # fmt: skip
            if not generated.get("tokens"):
                raise ValueError("no generated token")
            # the generated token is the last entry (some servers list the prompt's tokens before it)
            tokens: list[Token] = [*prompt[1:], _token(generated["tokens"][-1])]
            logprobs.append(finite_or_nan(generated["token_logprobs"][-1]))
            last_top = (generated.get("top_logprobs") or [None])[-1]
            top1.append(_best_keyed(last_top))
            top1_logprobs.append(_best_keyed_value(last_top))
            tops.append(_keyed_logprobs(last_top))
            return Scores(tokens, logprobs, top1, top1_logprobs=top1_logprobs, tops=tops)
        token_logprobs, top_logprobs = generated["token_logprobs"], generated.get("top_logprobs") or []
        if len(token_logprobs) != n + 1:
            raise ValueError(f"{len(token_logprobs)} echoed logprobs for a {n}-token prompt and 1 generated token")
        tops = list(top_logprobs) + [None] * (n + 1 - len(top_logprobs))
        return Scores(
            tokens=[*prompt[1:], _token(generated["tokens"][n])],
            logprobs=[finite_or_nan(x) for x in token_logprobs[1:]],
            top1=[_best_keyed(t) for t in tops[1:]],
            top1_logprobs=[_best_keyed_value(t) for t in tops[1:]],
            tops=[_keyed_logprobs(t) for t in tops[1:]],
        )

    def _body(self, model: str | None, prompt: list[int]) -> dict[str, Any]:
        return {
            "model": model or self.base_name,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": SERVED_TOP_K,
        }

    async def _once(self, body: dict[str, Any]) -> tuple[int, Any]:
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            try:
                return await self._post(client, body)
            except BudgetExhausted as e:
                return 0, {"error": str(e)}

    async def _post(
        self, client: httpx.AsyncClient, body: dict[str, Any], route: str = "/v1/completions"
    ) -> tuple[int, Any]:
        self.budget.take()
        try:
            r = await client.post(f"{self.url}{route}", json=body)
        except httpx.TimeoutException:
            return 0, {"error": f"no answer within {self.timeout:g} s (--request-timeout)"}
        except httpx.HTTPError as e:
            return 0, {"error": f"request failed: {e!r}"}
        return r.status_code, _json_or_text(r)

    # --- fast paths (fastpaths.py) ----------------------------------------------------------
    def features(self) -> Features:
        """A server does not say which fast paths it runs: prefix caching shows in the cached
        prompt tokens it reports (usage.prompt_tokens_details.cached_tokens), speculative decoding
        in its /metrics (vLLM's spec_decode counters), FP8 only when told (--endpoint-quantization:
        "fp8", or "fp8-weight-only" for a server with unquantised activations)."""
        if self.quantization == "fp8-weight-only":
            return Features(quantization="fp8", quantized_activations=False, source="what the server reports")
        return Features(quantization=self.quantization, source="what the server reports")

    def speculation_counter(self) -> float | None:
        """vLLM's cumulative draft tokens (`vllm:spec_decode_num_draft_tokens_total`, all label
        sets), or None when the server has no such metric."""
        try:
            r = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=min(self.timeout, 30.0))
        except httpx.HTTPError:
            return None
        return draft_tokens(r.text) if r.status_code == 200 else None

    def generate(
        self, probes: list[Probe], max_tokens: int, prompt_logprobs: bool = False, together: bool = False
    ) -> list[Generation]:
        """Greedy continuations, one request after another, or with `together` all in flight at once;
        `prompt_logprobs` also asks for the prompt's logprobs (servers then skip their prefix cache
        for the request, vLLM's rule)."""
        return asyncio.run(self._generate(probes, max_tokens, prompt_logprobs, together))

    async def _generate(
        self, probes: list[Probe], max_tokens: int, prompt_logprobs: bool, together: bool
    ) -> list[Generation]:
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            if together:
                calls = (self._generate_one(client, p, max_tokens, prompt_logprobs) for p in probes)
                return list(await asyncio.gather(*calls))
            return [await self._generate_one(client, p, max_tokens, prompt_logprobs) for p in probes]

    async def _generate_one(
        self, client: httpx.AsyncClient, probe: Probe, max_tokens: int, prompt_logprobs: bool
    ) -> Generation:
        if self.mode is None:
            return Generation.failed("the server returns no logprobs")
        prompt = probe.ids(self.sequence)
        body = self._body(probe.target, prompt) | {"max_tokens": max_tokens, "ignore_eos": True}
        if self.token_ids:
            body["return_tokens_as_token_ids"] = True
        if prompt_logprobs:
            body |= {PROMPT_LOGPROBS: SERVED_TOP_K} if self.mode == PROMPT_LOGPROBS else {"echo": True}
        try:
            status, data = await self._post(client, body)
        except BudgetExhausted as e:
            return Generation.failed(str(e))
        if status != 200:
            return Generation.failed(f"HTTP {status}: {_error_text(data)}")
        try:
            choice = _first_choice(data) or {}
            logprobs = choice.get("logprobs") or {}
            # the generated tokens are the last entries (echo, and some servers with prompt logprobs, list
            # the prompt's tokens first)
            skip = max(0, len(logprobs["tokens"]) - max_tokens)
            tokens = [_token(t) for t in logprobs["tokens"][skip:]]
            values = [finite_or_nan(x) for x in logprobs["token_logprobs"][skip:]]
            tops = list(logprobs.get("top_logprobs") or [])[skip:]
            tops += [None] * (len(tokens) - len(tops))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            return Generation.failed(f"cannot read the logprobs in the answer ({e!r}): {json.dumps(data)[:300]}")
        details = ((data.get("usage") or {}).get("prompt_tokens_details") or {}) if isinstance(data, dict) else {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return Generation(tokens, values, [_best_keyed(t) for t in tops],
                          cached_tokens=cached if isinstance(cached, int) else None)  # fmt: skip

    # --- load ------------------------------------------------------------------------------
    def load(self, streams: int, seconds: float, max_tokens: int) -> LoadStats:
        return asyncio.run(self._load(streams, seconds, max_tokens))

    async def _load(self, streams: int, seconds: float, max_tokens: int) -> LoadStats:
        stats = LoadStats(streams, seconds)
        targets = [self.base_name, *self.adapters]
        deadline = time.monotonic() + seconds
        counter = iter(range(1 << 62))

        async def worker(client: httpx.AsyncClient) -> None:
            while time.monotonic() < deadline:
                n = next(counter)
                body = {
                    "model": targets[n % len(targets)],
                    "prompt": self.sequence[n % 64 : n % 64 + 16],
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                try:
                    self.budget.take()
                except BudgetExhausted as e:
                    stats.problem(str(e))
                    return
                stats.started += 1
                await self._stream(client, body, max_tokens, stats)

        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            await asyncio.gather(*(worker(client) for _ in range(streams)))
        return stats

    async def _stream(self, client: httpx.AsyncClient, body: dict[str, Any], max_tokens: int, stats: LoadStats) -> None:
        finish, done, usage, error = None, False, None, None
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")[:200]
                    if r.status_code >= 500:
                        stats.server_errors += 1
                    else:
                        stats.other_errors += 1
                    stats.problem(f"HTTP {r.status_code}: {text}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        error = _error_text(event)
                    for choice in event.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
                    usage = event.get("usage") or usage
        except (httpx.HTTPError, ValueError) as e:
            stats.lost += 1
            stats.problem(f"stream broke: {e!r}")
            return
        if error is not None or finish == "error":
            stats.server_errors += 1
            stats.problem(f"stream ended with an error: {error or finish}")
        elif not done or finish is None:
            stats.lost += 1
            stats.problem(f"stream ended without {'[DONE]' if not done else 'a finish_reason'}")
        elif finish == "length" and usage and usage.get("completion_tokens") not in (None, max_tokens):
            stats.lost += 1
            stats.problem(f"finish 'length' after {usage.get('completion_tokens')} of {max_tokens} tokens")
        else:
            stats.completed += 1
            stats.tokens += (usage or {}).get("completion_tokens") or 0


def draft_tokens(metrics: str) -> float | None:
    """The draft-token counter in a Prometheus text page, summed over its label sets (None: absent)."""
    total, seen = 0.0, False
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SPEC_DRAFT_METRICS:
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return total if seen else None


def _first_choice(data: Any) -> dict[str, Any] | None:
    choices = data.get("choices") if isinstance(data, dict) else None
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None


def _renders_ids(choice: dict[str, Any] | None) -> bool:
    tokens = ((choice or {}).get("logprobs") or {}).get("tokens") or []
    return bool(tokens) and all(isinstance(t, str) and TOKEN_ID.fullmatch(t) for t in tokens)


def _token(value: Any) -> Token:
    if isinstance(value, str):
        m = TOKEN_ID.fullmatch(value)
        return int(m.group(1)) if m else value
    return int(value)


def _best_keyed(top: Any) -> Token | None:
    """The most likely token of a {token: logprob} dict (OpenAI legacy top_logprobs)."""
    if not isinstance(top, dict) or not top:
        return None
    key = max(top, key=lambda k: _sortable(top[k]))
    return _token(key)


def _best_keyed_value(top: Any) -> float:
    """The largest logprob of a {token: logprob} dict (nan when there is none)."""
    if not isinstance(top, dict) or not top:
        return math.nan
    best = max(_sortable(v) for v in top.values())
    return best if math.isfinite(best) else math.nan


def _keyed_logprobs(top: Any) -> dict[Token, float]:
    """{token: logprob} from an OpenAI legacy top_logprobs dict (empty when there is none)."""
    return {_token(k): finite_or_nan(v) for k, v in top.items()} if isinstance(top, dict) else {}


def _ranked_logprobs(entry: dict[str, Any]) -> dict[Token, float]:
    """{token id: logprob} from a vLLM prompt_logprobs entry (its top-k and the prompt's token)."""
    return {int(k): finite_or_nan(v.get("logprob")) for k, v in entry.items() if isinstance(v, dict)}


def _best_ranked(entry: dict[str, Any]) -> Token | None:
    """The rank-1 token of a vLLM prompt_logprobs entry {"<id>": {"logprob", "rank", ...}}."""
    if not entry:
        return None
    ranked = [k for k, v in entry.items() if isinstance(v, dict) and v.get("rank") == 1]
    key = ranked[0] if ranked else max(entry, key=lambda k: _sortable((entry[k] or {}).get("logprob")))
    return int(key)


def _sortable(value: Any) -> float:
    v = finite_or_nan(value)
    return -math.inf if math.isnan(v) else v


def _json_or_text(r: httpx.Response) -> Any:
    try:
        return json.loads(r.text)  # (json.loads reads NaN / Infinity literals)
    except ValueError:
        return {"error": r.text[:300]}


def _error_text(data: Any) -> str:
    """The server's own message in an error body: OpenAI's {"error": {"message"}}, vLLM's
    {"message"} or FastAPI's {"detail"}."""
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        if err is not None:
            return str(err)[:300]
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])[:300]
    return json.dumps(data)[:300]
