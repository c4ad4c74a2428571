"""The serving engine: scheduler, runner, sampler, offline and async front ends."""

from hylora.engine.config import EngineConfig
from hylora.engine.engine import LLMEngine, RequestError, RequestOutput
from hylora.engine.llm import LLM
from hylora.engine.request import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestError", "RequestOutput", "SamplingParams"]
