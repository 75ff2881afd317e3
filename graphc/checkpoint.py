"""A transformers checkpoint folder as one object: its config, weights, tokenizer and generation defaults.

``Checkpoint(folder)`` finds ``config.json``, the safetensors weights (one file or an
index), ``tokenizer.json`` (read by the ``tokenizers`` library, as transformers' fast
tokenizers read it: the same ids, special tokens included) and ``generation_config.json``
(the ``eos_token_id`` / ``pad_token_id`` transformers' ``generate`` uses).  Every file
is checked as graphc checks it elsewhere (regular files only; a missing one is named).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat import MAX_PROMPT_CHARS, SPECIAL_TOKEN_NAMES, render_chat
from .errors import SerializationError
from .folders import confined, confined_if_present
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
        is False (a chat template's text carries its own).  Text longer than :data:`~graphc.chat.MAX_PROMPT_CHARS`
        characters, or that is not valid Unicode, is refused before the tokenizer sees it."""
        if not isinstance(text, str):
            raise SerializationError(f"{self.path}: a tokenizer encodes text (a str), got {type(text).__name__}")
        if len(text) > MAX_PROMPT_CHARS:
            raise SerializationError(f"a prompt of {len(text):,} characters is past the {MAX_PROMPT_CHARS:,} graphc encodes; refused")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise SerializationError(f"the prompt is not valid Unicode text (character {e.start}: {text[e.start]!r}); give UTF-8 text") from None
        try:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        except Exception as e:  # noqa: BLE001 - the library's refusal (a WordLevel vocabulary without an unk token ...), named
            raise SerializationError(f"{self.path}: the tokenizer cannot encode the prompt: {str(e)[:200]}") from None

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens left out (as ``tokenizer.decode(..., skip_special_tokens=True)``)."""
        vocab = self.vocab_size
        bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab]
        if bad:
            raise SerializationError(f"{self.path}: token id {bad[0]!r} is not in the tokenizer's vocabulary (ids 0..{vocab - 1})")
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

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
        if not os.path.lexists(folder / "config.json"):
            raise SerializationError(f"{folder}: no config.json; a checkpoint folder holds config.json and the model's *.safetensors")

    @property
    def config(self) -> Path:
        """``config.json`` (a link that leaves the folder is refused)."""
        return confined(self.folder, "config.json", str(self.folder / "config.json"), "checkpoint folder")

    def tokenizer(self) -> Tokenizer:
        """The folder's ``tokenizer.json``."""
        path = self.file("tokenizer.json")
        if path is None:
            raise SerializationError(f"{self.folder}: no tokenizer.json; pass token ids with --prompt-ids instead of text")
        return Tokenizer(path)

    def has_weights(self) -> bool:
        """Whether the folder holds safetensors weights: ``*.safetensors`` beside ``config.json``, or an index."""
        return any(self.folder.glob("*.safetensors")) or os.path.lexists(self.folder / "model.safetensors.index.json")

    def weight_files_seen(self) -> str:
        """The weight files of other formats the folder holds (``pytorch_model.bin`` ...), for an error message."""
        seen = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack") for p in self.folder.glob(pattern))
        return ", ".join(seen[:4]) + (" ..." if len(seen) > 4 else "")

    def file(self, name: str) -> Path | None:
        """The folder's file ``name``, or None when the folder has none; a link that leaves the folder is refused."""
        return confined_if_present(self.folder, name)

    def chat_template(self) -> str:
        """The chat template transformers applies: ``chat_template.jinja``, else ``tokenizer_config.json``'s
        ``chat_template`` (a string, or the one named ``default`` of a list)."""
        return self._chat_template(self._json("tokenizer_config.json"))

    def _chat_template(self, tokenizer_config: dict[str, Any]) -> str:
        path = self.file("chat_template.jinja")
        if path is not None:
            require_regular_file(path, "chat template")
            try:
                return path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise SerializationError(f"{path}: a chat template is UTF-8 text ({e.reason} at byte {e.start})") from None
        found = tokenizer_config.get("chat_template")
        if isinstance(found, list):
            found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(found, str) or not found:
            raise SerializationError(f"{self.folder}: no chat template (chat_template.jinja, or chat_template in tokenizer_config.json)")
        return found

    def special_tokens(self) -> dict[str, str]:
        """The named special tokens (``bos_token`` ... ``mask_token``) as transformers' tokenizer loads them:
        ``tokenizer_config.json``'s, overridden by ``special_tokens_map.json``'s unless the config lists its
        ``added_tokens_decoder`` (then transformers reads no map)."""
        config = self._json("tokenizer_config.json")
        docs = [config] if "added_tokens_decoder" in config else [config, self._json("special_tokens_map.json")]
        found: dict[str, str] = {}
        for doc in docs:  # the later file wins
            found |= {key: text for key in SPECIAL_TOKEN_NAMES if (text := _token_text(doc.get(key))) is not None}
        return found

    def chat_prompt(self, user: str, tokenizer: Tokenizer | None = None) -> list[int]:
        """The ids of one user message in the checkpoint's chat template, with the assistant's turn opened (as
        transformers' ``apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)``);
        ``tokenizer``: the folder's, when already loaded."""
        template = self._chat_template(self._json("tokenizer_config.json"))
        text = render_chat(template, [{"role": "user", "content": user}], self.special_tokens(), where=f"{self.folder}: the chat template")
        return (tokenizer or self.tokenizer()).encode(text, add_special_tokens=False)

    def _json(self, name: str) -> dict[str, Any]:
        """The JSON object in the folder's file ``name``; empty when the folder has none."""
        path = self.file(name)
        return read_json_object(path, name.removesuffix(".json").replace("_", " ")) if path is not None else {}

    def generation_defaults(self) -> dict[str, Any]:
        """``eos_token_id`` (a list) and ``pad_token_id`` as transformers' ``generate`` takes them: ``generation_config.json``
        first, then ``config.json``; ``pad_token_id`` falls back to the first eos (as transformers does), else 0."""
        fields: dict[str, Any] = {}
        for name in ("config.json", "generation_config.json"):  # the later file wins
            doc = self._json(name)
            fields.update({k: doc[k] for k in ("eos_token_id", "pad_token_id") if doc.get(k) is not None})
        eos = fields.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
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
