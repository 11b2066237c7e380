"""LoRARequest: which adapter a request runs with, named and shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name (what the server's `model` selects), a positive integer id (vLLM's; kept for
    callers written for it) and the PEFT directory it is read from."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be >= 1, got {self.lora_int_id}")
