"""A transformers checkpoint folder as one object: its config, weights, tokenizer and generation defaults.

``Checkpoint(folder)`` finds ``config.json``, the safetensors weights (one file or an
index), ``tokenizer.json`` (read by the ``tokenizers`` library, as transformers' fast
tokenizers read it: the same ids, special tokens included) and ``generation_config.json``
(the ``eos_token_id`` / ``pad_token_id`` transformers' ``generate`` uses).  Every file
is checked as graphc checks it elsewhere (regular files only; a missing one is named).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import SerializationError
from .weights import read_json_object, require_regular_file

__all__ = ["Checkpoint", "Tokenizer"]


class Tokenizer:
    """A checkpoint's ``tokenizer.json``: text to ids (special tokens added as the tokenizer's post-processor says) and back."""

    def __init__(self, path: Path) -> None:
        require_regular_file(path, "tokenizer")
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise SerializationError("reading tokenizer.json needs the tokenizers library: pip install tokenizers") from None
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library's parse error, named
            raise SerializationError(f"{path}: not a tokenizers tokenizer.json ({type(e).__name__}: {str(e)[:200]})") from None
        self.path = path

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, with the special tokens the tokenizer adds (a BOS for Llama) unless ``add_special_tokens``
        is False (a chat template's text carries its own)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens left out (as ``tokenizer.decode(..., skip_special_tokens=True)``)."""
        return str(self._tok.decode(ids, skip_special_tokens=True))

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can give (added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder (as ``save_pretrained`` writes it)."""

    folder: Path

    def __post_init__(self) -> None:
        folder = Path(self.folder)
        if not folder.is_dir():
            raise SerializationError(f"{str(folder)!r} is not a checkpoint folder (a folder with config.json and *.safetensors)")
        object.__setattr__(self, "folder", folder)
        if not (folder / "config.json").exists():
            raise SerializationError(f"{folder}: no config.json; a checkpoint folder holds config.json and the model's *.safetensors")

    @property
    def config(self) -> Path:
        """``config.json``."""
        return self.folder / "config.json"

    def tokenizer(self) -> Tokenizer:
        """The folder's ``tokenizer.json``."""
        path = self.folder / "tokenizer.json"
        if not path.exists():
            raise SerializationError(f"{self.folder}: no tokenizer.json; pass token ids with --prompt-ids instead of text")
        return Tokenizer(path)

    def chat_template(self) -> str:
        """The chat template transformers applies: ``chat_template.jinja``, else ``tokenizer_config.json``'s
        ``chat_template`` (a string, or the one named ``default`` of a list)."""
        return self._chat_template(_json(self.folder / "tokenizer_config.json"))

    def _chat_template(self, tokenizer_config: dict[str, Any]) -> str:
        path = self.folder / "chat_template.jinja"
        if path.exists():
            require_regular_file(path, "chat template")
            return path.read_text()
        found = tokenizer_config.get("chat_template")
        if isinstance(found, list):
            found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(found, str) or not found:
            raise SerializationError(f"{self.folder}: no chat template (chat_template.jinja, or chat_template in tokenizer_config.json)")
        return found

    def chat_prompt(self, user: str, tokenizer: Tokenizer | None = None) -> list[int]:
        """The ids of one user message in the checkpoint's chat template, with the assistant's turn opened (as
        transformers' ``apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)``);
        ``tokenizer``: the folder's, when already loaded."""
        try:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise SerializationError("chat templates need the jinja2 library: pip install jinja2") from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        config = _json(self.folder / "tokenizer_config.json")
        special = {k: _token_text(v) for k, v in config.items() if k.endswith("_token")}
        try:
            text = env.from_string(self._chat_template(config)).render(
                messages=[{"role": "user", "content": user}], add_generation_prompt=True, **{k: v for k, v in special.items() if v}
            )
        except SerializationError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error, named
            raise SerializationError(f"{self.folder}: the chat template failed: {type(e).__name__}: {e}") from None
        return (tokenizer or self.tokenizer()).encode(text, add_special_tokens=False)

    def generation_defaults(self) -> dict[str, Any]:
        """``eos_token_id`` (a list) and ``pad_token_id`` as transformers' ``generate`` takes them: ``generation_config.json``
        first, then ``config.json``; ``pad_token_id`` falls back to the first eos (as transformers does), else 0."""
        fields: dict[str, Any] = {}
        for name in ("config.json", "generation_config.json"):  # the later file wins
            doc = _json(self.folder / name)
            fields.update({k: doc[k] for k in ("eos_token_id", "pad_token_id") if doc.get(k) is not None})
        eos = fields.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids):
            raise SerializationError(f"{self.folder}: eos_token_id must be a token id or a list of them, got {eos!r}")
        pad = fields.get("pad_token_id", eos_ids[0] if eos_ids else 0)
        if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
            raise SerializationError(f"{self.folder}: pad_token_id must be a token id, got {pad!r}")
        return {"eos_token_id": eos_ids, "pad_token_id": pad}


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise SerializationError(f"the chat template refused the conversation: {message}")


def _json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; empty when the folder has no such file."""
    return read_json_object(path, path.stem.replace("_", " ")) if path.exists() else {}
