"""hylora: serve a Qwen3.5/3.6 hybrid (Gated DeltaNet + gated attention) model with many LoRA adapters."""

__version__ = "0.1.0"
