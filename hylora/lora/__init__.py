"""LoRA adapters: PEFT files → validated tensors → device slots → applied per token in each linear."""
