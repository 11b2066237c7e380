"""LoRA adapters served on top of the base model (docs/lora.md): vLLM's LoRARequest, PEFT adapters
read and checked (peft.py), the linears that add each adapter's rows unmerged (layers.py) and the
adapters kept loaded (manager.py)."""
