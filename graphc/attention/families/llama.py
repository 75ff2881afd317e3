"""Llama (``model_type: llama``): graphc's reference family; every :class:`Family` default is Llama's."""

from __future__ import annotations

from .base import Family, register_family

__all__ = ["LLAMA"]

LLAMA = register_family(Family("llama"))
