"""Mistral (``model_type: mistral``): Llama's layout with a sliding window on every layer (``sliding_window``)."""

from __future__ import annotations

from .base import Family, register_family

__all__ = ["MISTRAL"]

MISTRAL = register_family(Family("mistral"))
