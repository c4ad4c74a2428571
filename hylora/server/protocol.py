"""OpenAI-compatible request bodies. Unknown fields are accepted (clients send extras) and logged;
known fields with values hylora cannot honour are refused with a message."""

from __future__ import annotations

import json
import logging
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from hylora.engine.request import INT64_MAX, INT64_MIN, SamplingParams

log = logging.getLogger(__name__)


MAX_BATCHED_PROMPTS = 256  # prompts in one completions request
MAX_CHOICES = 1024  # engine requests one HTTP request may start (prompts × n)
# Lists no real client comes near, bounded before their items are validated: a body under the size
# limit holds 500 000 messages or 2.7M token ids, seconds of validation on the server.
MAX_MESSAGES = 10_000
MAX_CONTENT_PARTS = 10_000  # per message
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # a large vocabulary's worth (Qwen's has 248k ids)
MAX_TOOLS = 4096  # function definitions in one request
MAX_DETOKENIZE_IDS = 1 << 20  # four times the longest context of a Qwen3.5 / 3.6 model


class Unsupported(ValueError):
    """A known request field with a value hylora does not implement (or out of range): `param` names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _at_most(most: int, what: str, fix: str) -> BeforeValidator:
    """A bound on a list (or object) field's length, checked before its items are validated."""

    def check(value: Any) -> Any:
        if isinstance(value, (list, dict)) and len(value) > most:
            raise PydanticCustomError("too_long", f"at most {most} {what}, got {len(value)}: {fix}")
        return value

    return BeforeValidator(check)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _valid_unicode(self) -> _Body:
        """JSON may carry lone surrogates (\\ud800): text that cannot become UTF-8 is refused here,
        not discovered halfway through tokenising or answering."""
        stack: list[tuple[str, Any]] = [(name, value) for name, value in self.__dict__.items()]
        stack += list((self.model_extra or {}).items())
        if _utf8_clean(stack):
            return self
        while stack:  # find the offending field, to name it
            where, value = stack.pop()
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(
                        f"{where} contains invalid Unicode (a lone surrogate); send valid UTF-8 text"
                    ) from None
            elif isinstance(value, dict):  # (nested request bodies checked themselves)
                stack += [(f"{where}.{k}", v) for k, v in value.items()] + [(where, k) for k in value]
            elif isinstance(value, (list, tuple)):
                stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        return self

    def check_unknown_fields(self, route: str) -> None:
        """Refuse a vLLM field hylora does not implement that would change the output; log the rest."""
        extra = self.model_extra or {}
        for name, instead in UNIMPLEMENTED_FIELDS.items():
            if name in extra and not _asks_nothing(name, extra[name]):
                raise Unsupported(f"{name} is not supported by hylora: {instead}", param=name)
        if extra:
            log.warning("%s: ignoring unknown fields %s", route, sorted(extra)[:20])


# vLLM request fields that change what is generated and that hylora does not implement: sent with an
# effect (a non-empty list, true), each is refused rather than ignored, so that nobody is served an
# output other than the one they asked for. Unknown fields stay ignored with a warning, as vLLM does.
UNIMPLEMENTED_FIELDS = {
    "logits_processors": "hylora runs no custom logits processors",
    "truncate_prompt_tokens": "shorten the prompt yourself",
    "echo": "on chat, prepend the prompt yourself (/v1/completions takes echo)",
    "use_beam_search": "hylora has no beam search; sample n choices instead",
    "thinking_token_budget": "hylora does not cut the reasoning short; bound the whole answer with max_tokens, "
    'or turn thinking off with chat_template_kwargs {"enable_thinking": false}',
    "repetition_detection": "hylora does not end repetitive output early; bound it with max_tokens, or set "
    "repetition_penalty / frequency_penalty",
}
# values that ask for nothing (vLLM's defaults); thinking_token_budget 0 does ask for something
_INERT: dict[str, tuple[Any, ...]] = {"thinking_token_budget": (None,)}


def _asks_nothing(name: str, value: Any) -> bool:
    inert = _INERT.get(name, (None, False, [], {}, 0))
    return any(value is v or (type(value) is type(v) and value == v) for v in inert)


class SamplingRequest(_Body):
    model: str | None = None
    task: str | None = None  # hylora: route by task instead of model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Annotated[
        str | list[str] | None, _at_most(SamplingParams.MAX_STOP_STRINGS, "stop strings", "send fewer stop strings")
    ] = None
    stop_token_ids: Annotated[
        list[int] | None, _at_most(SamplingParams.MAX_STOP_TOKEN_IDS, "stop_token_ids", "send fewer stop tokens")
    ] = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logit_bias: Annotated[
        dict[str, float] | None, _at_most(SamplingParams.MAX_LOGIT_BIAS, "logit_bias entries", "bias fewer tokens")
    ] = None
    allowed_token_ids: Annotated[  # vLLM: only these tokens may be generated
        list[int] | None, _at_most(MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids", "send each token id once")
    ] = None
    # vLLM: words never generated; each at most as long as a stop string (vLLM sets no bound: 128 words
    # of 60 000 characters made 15M token ids that were checked and copied per choice)
    bad_words: list[Annotated[str, Field(max_length=SamplingParams.MAX_STOP_CHARS)]] | None = Field(
        default=None, max_length=128
    )
    best_of: int | None = None
    prompt_logprobs: int | None = None  # vLLM: logprobs of every prompt token (+ top-k), non-streaming
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs name each token "token_id:N", not its text
    return_token_ids: bool = False  # vLLM: the prompt's and the generated tokens' ids beside the text
    # vLLM: prefix-cache entries are shared only between requests with the same salt (tenants who must not
    # learn from each other's cache hits); a long random string
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured outputs (parsed by hylora.structured.parse_structured_outputs)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted; hylora has one grammar engine (llguidance)
    user: str | None = None  # OpenAI's end-user id: accepted, not used

    def check_supported(self, max_logprobs: int = 20) -> None:
        if self.best_of not in (None, self.n):
            raise Unsupported("best_of is not supported (use n)", "best_of")
        if self.prompt_logprobs is not None and self.stream:
            raise Unsupported("prompt_logprobs is not supported with stream=true", "prompt_logprobs")
        if not 1 <= self.n <= 16:
            raise Unsupported("n must be between 1 and 16", "n")
        if self.seed is not None and self.seed != -1 and not INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1):
            raise Unsupported(
                f"seed must be a 64-bit integer in [-2^63, 2^63 - n] (n = {self.n}), got {self.seed}", "seed"
            )
        _check_count("prompt_logprobs", self.prompt_logprobs, max_logprobs)

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        seed_offset: int = 0,
        defaults: dict[str, Any] | None = None,
        bad_words_ids: list[list[int]] | None = None,
    ) -> SamplingParams:
        """`defaults`: the sampling values that apply when the request sets none (the model's
        generation_config.json, unless the server was started with --generation-config vllm);
        `bad_words_ids`: `bad_words` tokenised (tokenizer.bad_words_token_ids)."""
        d = SAMPLING_DEFAULTS | (defaults or {})

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return d[name] if value is None else value

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"),
            seed=None if self.seed in (None, -1) else self.seed + seed_offset,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_token_bias(self.logit_bias),
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids else None,
            bad_words_ids=[list(s) for s in bad_words_ids or []],
        )


SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        # ASCII digits only: int() also reads " 5 ", "5_0" and other scripts' digits, and two spellings of one id
        # would bias it once, silently
        if _TOKEN_ID.fullmatch(key) is None:
            raise Unsupported(f"logit_bias keys must be token ids written in decimal digits, got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


_TOKEN_ID = re.compile(r"-?[0-9]+")  # a negative id gets the vocabulary-range message


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Annotated[
        str | list[dict[str, Any]] | None, _at_most(MAX_CONTENT_PARTS, "content parts", "join the text parts")
    ] = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None
    # an earlier assistant turn's reasoning: `reasoning` as vLLM >= 0.20 reads it, `reasoning_content` as
    # hylora and older vLLM return it (clients send back what they got); the template decides where it shows
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _one_reasoning(self) -> ChatMessage:
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError(
                "an assistant message has reasoning and reasoning_content with different texts; send one of them "
                "(reasoning, vLLM's name, or reasoning_content, as the answer gave it)"
            )
        return self

    def earlier_reasoning(self) -> str | None:
        """The reasoning an assistant turn carries for the chat template (None on other roles)."""
        if self.role != "assistant":
            return None
        return self.reasoning if self.reasoning is not None else self.reasoning_content

    def text_chars(self) -> int:
        """Characters of the message's text (its text parts and an assistant turn's reasoning; media parts
        count 0), without raising."""
        reasoning = len(self.earlier_reasoning() or "")
        if isinstance(self.content, str):
            return len(self.content) + reasoning
        return sum(len(str(p.get("text", ""))) for p in self.content or [] if isinstance(p, dict)) + reasoning

    def for_template(self, content: Any) -> dict[str, Any]:
        """The message as the chat template takes it, with `content` (text, or normalised parts):
        tool calls with their arguments as objects (OpenAI sends JSON strings; Qwen's templates
        iterate them), the tool call id of a tool result, an assistant turn's reasoning under both names
        (Qwen3.5 / 3.6's templates read `reasoning_content`: the turns after the last user query show it in
        their think block, every turn with `preserve_thinking`; vLLM passes both)."""
        out: dict[str, Any] = {"role": self.role, "content": content}
        reasoning = self.earlier_reasoning()
        if reasoning is not None:
            out["reasoning_content"] = out["reasoning"] = reasoning
        if self.tool_calls:
            out["tool_calls"] = [_call_for_template(call, i) for i, call in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        """The content of a text-only message (image / video parts take the multimodal path)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            kind = part.get("type")
            if kind != "text":
                raise Unsupported(f"message content of type {kind!r} is not supported (text, image_url, video_url)")
            if not isinstance(part.get("text"), str):
                got = f"{part.get('text')!r:.80}"
                raise Unsupported(f"a text content part needs a string 'text', got {got}", "messages")
            parts.append(part["text"])
        return "".join(parts)


_MESSAGES_BOUND = _at_most(MAX_MESSAGES, "messages", "shorten the conversation")


CONTINUE_NEEDS_NO_GENERATION_PROMPT = (
    "continue_final_message needs add_generation_prompt: false (the reply continues the last message "
    "instead of starting a new one)"
)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1), _MESSAGES_BOUND]
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM: per-request preprocessing (fps, num_frames, ...)
    media_io_kwargs: dict[str, dict[str, Any]] | None = None  # vLLM: {"video": {"num_frames": 16}}
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[  # checked by hylora.server.parsers.parse_tool_request
        list[Any] | None, _at_most(MAX_TOOLS, "tools", "send the tools this request may call")
    ] = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM: false leaves the reasoning out of the answer (it is still generated)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: the reply continues the last (assistant) message

    def check_supported(self, max_logprobs: int = 20) -> None:
        super().check_supported(max_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise Unsupported("top_logprobs needs logprobs=true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise Unsupported(CONTINUE_NEEDS_NO_GENERATION_PROMPT, "continue_final_message")
        _check_count("top_logprobs", self.top_logprobs, max_logprobs)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def check_supported(self, max_logprobs: int = 20) -> None:
        super().check_supported(max_logprobs)
        if self.suffix:
            raise Unsupported("suffix is not supported", "suffix")
        _check_count("logprobs", self.logprobs, max_logprobs)
        prompts = self.prompt_list()
        if not prompts or len(prompts) > MAX_BATCHED_PROMPTS:
            raise Unsupported(f"prompt must hold 1 to {MAX_BATCHED_PROMPTS} prompts, got {len(prompts)}", "prompt")
        if len(prompts) * self.n > MAX_CHOICES:
            raise Unsupported(f"prompts × n must be at most {MAX_CHOICES}", "n")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise Unsupported("max_tokens must be at least 0", "max_tokens")

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts: a string, a list of token ids, or a list of either (one choice set each)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)  # type: ignore[arg-type]
        return [self.prompt]  # type: ignore[list-item]


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage] | None, _MESSAGES_BOUND] = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Any] | None, _at_most(MAX_TOOLS, "tools", "send the tools the prompt lists")] = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Annotated[list[int], _at_most(MAX_DETOKENIZE_IDS, "tokens", "detokenize in parts")]


class LoadLoRARequest(_Body):
    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    lora_path: str


class UnloadLoRARequest(_Body):
    lora_name: str


def _utf8_clean(value: Any) -> bool:
    """Whether every string in `value` encodes as UTF-8 (False also when unsure); nested request bodies
    (messages) are skipped: they check themselves.

    Dicts and short lists are walked here and each string checked on its own: an ASCII one (`isascii`,
    microseconds for megabytes) needs nothing more. A long list goes to json.dumps, which walks it in C
    (1M token ids: 150 ms against 340 in Python). Dumping a whole body instead took 13–24 ms per 5.2 MB
    video frame list with the GIL held, which the engine thread waited out (docs/SERVING.md)."""
    stack, seen = [value], set()
    try:
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                if not item.isascii():
                    item.encode("utf-8")
                continue
            if not isinstance(item, (dict, list, tuple)) or id(item) in seen:
                continue
            seen.add(id(item))  # a structure built in Python may hold itself
            if isinstance(item, dict):
                stack.extend(k for k in item if isinstance(k, str))
                stack.extend(item.values())
            elif len(item) > _WALKED_ITEMS:
                json.dumps(item, ensure_ascii=False, skipkeys=True, default=lambda _: None).encode("utf-8")
            else:
                stack.extend(item)
    except (UnicodeEncodeError, ValueError, RecursionError):
        return False
    return True


_WALKED_ITEMS = 64  # a list longer than this is checked by json.dumps (in C)


def _check_count(name: str, value: int | None, most: int) -> None:
    if value is not None and not 0 <= value <= most:
        raise Unsupported(f"{name} must be between 0 and {most} (--max-logprobs), got {value}", name)


def _call_for_template(call: Any, index: int) -> dict[str, Any]:
    where = f"messages[].tool_calls[{index}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise Unsupported(f'{where} must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}')
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise Unsupported(f"{where}.function.arguments is not valid JSON: {e}", "messages") from None
        except RecursionError:
            raise Unsupported(f"{where}.function.arguments is nested too deeply", "messages") from None
    if not isinstance(arguments, dict):
        raise Unsupported(f"{where}.function.arguments must be a JSON object", "messages")
    return {**call, "function": {**function, "arguments": arguments}}
