"""amp_exp: what fp16, bf16 or fp8 buys over fp32 for a model, on this hardware, and whether it is
safe. ``amp_exp.record`` records a plain training loop in amp_exp's results format; the trainer
callbacks live in ``amp_exp.integrations`` (docs/integrations.md).

Importing amp_exp imports nothing else: ``record`` (and torch with it) loads when first used, and
neither transformers nor lightning is ever imported by it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["record"]


def __getattr__(name: str) -> Any:
    if name == "record":
        from amp_exp.integrations.record import record

        return record
    raise AttributeError(f"module 'amp_exp' has no attribute {name!r}")
