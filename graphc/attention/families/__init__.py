"""transformers model families, one module each, found by ``model_type`` (:func:`get_family`).

Each module defines its :class:`Family` (config mapping, weight-name table, quirks) and
registers one instance; importing this package registers the built-in ones.  A family of
your own is one module: subclass :class:`Family`, override what differs from Llama, and
call :func:`register_family` (``tests/test_extending_family.py`` adds one).
"""

# each module registers its family; in this order they are listed
from . import llama, mistral, qwen2, qwen3, gemma2, falcon, phi3, gpt_neox, gpt2  # noqa: F401
from .base import Family, family_names, get_family, register_family, unregister_family

__all__ = ["Family", "register_family", "unregister_family", "family_names", "get_family"]
