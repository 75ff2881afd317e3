"""Where a command's graph comes from: a preset, custom head counts, a saved graph, an ONNX model, a transformers config
or a checkpoint folder, read once from the flags into a frozen :class:`GraphSource`.

A checkpoint folder given as the positional argument means ``--hf-config DIR/config.json --weights DIR``; the source
records that instead of rewriting the parsed flags.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields, replace
from functools import cached_property
from pathlib import Path

from ..attention import AttentionConfig, attention_layer_graph, kv_cache_graph, preset, preset_names, sdpa_graph
from ..attention.encoder import ENCODER_FAMILIES
from ..attention.hf import HF_FAMILIES, HFConfig, read_hf_config
from ..dims import dim_symbols
from ..graph import Graph
from ..serialize import load_graph
from .common import UsageError, at_least, parse_sizes

__all__ = ["GraphSource", "add_graph_args", "import_onnx"]


def add_graph_args(p: argparse.ArgumentParser, sizes: bool = True) -> None:
    """The flags that name a graph (and, with ``sizes``, the batch and sequence sizes to run it at)."""
    src = p.add_argument_group("graph")
    src.add_argument(
        "model",
        nargs="?",
        default=None,
        help="an ONNX model (.onnx) to import, or a checkpoint folder (config.json, *.safetensors), instead of a preset",
    )
    src.add_argument("--strict", action="store_true", help="with an ONNX model: refuse ops graphc does not model (default: carry them through)")
    src.add_argument(
        "--attention-semantics",
        default="onnx-1.23",
        choices=("onnx-1.23", "legacy"),
        help="with an ONNX model: how Attention nodes are read (legacy: onnx <= 1.21, masks before softcap, qk_matmul_output_mode 1/2 swapped)",
    )
    src.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=INT",
        help="with an ONNX model or --graph: size of a symbolic dim (default: batch dims --batch, others --seq)",
    )
    src.add_argument(
        "--static-dim",
        action="append",
        default=[],
        metavar="NAME=INT",
        help="with an ONNX model: import it with that input dim fixed (a Conv over a symbolic image size: --static-dim height=224)",
    )
    src.add_argument(
        "--fix-input",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="with an ONNX model: an input given at import; an If on it keeps its branch (optimum's merged decoders: use_cache_branch=1 or 0)",
    )
    src.add_argument("--preset", help=f"model preset: {', '.join(preset_names())}")
    src.add_argument("--graph", metavar="FILE", help="a graph saved as JSON (graphc.save_graph)")
    src.add_argument("--hf-config", metavar="FILE", help=f"a transformers config.json: a decoder stack of that model ({', '.join(HF_FAMILIES)})")
    src.add_argument("--weights", metavar="PATH", help="with --hf-config: a .safetensors file or a directory of them (memory-mapped; default random)")
    src.add_argument("--layers", type=int, default=None, help="layers of the stack (--hf-config: default all; info: default the preset's)")
    src.add_argument("--heads", type=int, help="custom config: query heads")
    src.add_argument("--kv-heads", type=int, help="custom config: KV heads (default: --heads)")
    src.add_argument("--head-dim", type=int, help="custom config: head dim (default: d_model / heads)")
    src.add_argument("--d-model", type=int, help="custom config: model width (default: heads * head_dim)")
    src.add_argument("--bias", action="store_true", help="custom config: projection biases")
    src.add_argument("--core", action="store_true", help="the attention core only (q, k, v inputs), not the full layer")
    src.add_argument("--decode", action="store_true", help="one decode step over a KV cache (see --past)")
    src.add_argument("--past", type=int, default=4096, help="KV-cache length for --decode (default 4096)")
    src.add_argument("--no-causal", action="store_true", help="build a non-causal graph")
    src.add_argument("--seed", type=int, default=None, help="seed for random weights and inputs (default 0)")
    if sizes:
        src.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
        src.add_argument("--seq", type=int, default=None, help="new tokens (default 512; 1 with --decode)")


_SECOND_SOURCES = (
    ("preset", "--preset"),
    ("graph", "--graph"),
    ("hf_config", "--hf-config"),
    ("heads", "--heads"),
    ("kv_heads", "--kv-heads"),
    ("head_dim", "--head-dim"),
    ("d_model", "--d-model"),
    ("bias", "--bias"),
    ("dim", "--dim"),
    ("static_dim", "--static-dim"),
    ("fix_input", "--fix-input"),
)
"""Flags that describe a graph of their own (or size an ONNX model's dims): refused beside a checkpoint folder."""


@dataclass(frozen=True)
class GraphSource:
    """The graph flags of one command line, read once (a checkpoint folder resolved into its config and weights)."""

    model: str | None = None  # an ONNX model to import
    checkpoint_folder: str | None = None
    strict: bool = False
    attention_semantics: str = "onnx-1.23"
    dim: tuple[str, ...] = ()
    static_dim: tuple[str, ...] = ()
    fix_input: tuple[str, ...] = ()
    preset: str | None = None
    graph: str | None = None
    hf_config: str | None = None
    weights: str | None = None
    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    d_model: int | None = None
    bias: bool = False
    core: bool = False
    decode: bool = False
    past: int = 4096
    no_causal: bool = False
    seed: int = 0
    seed_given: bool = False  # --seed asks for seeded random weights where a folder has none
    batch: int = 1
    seq: int | None = None
    dtype: str = "float32"

    @classmethod
    def from_args(cls, args: argparse.Namespace, reads_weights: bool = True) -> GraphSource:
        """The source the parsed flags name; ``reads_weights=False`` for a command that reads a folder's config alone."""
        listed = ("dim", "static_dim", "fix_input")
        names = {f.name for f in fields(cls)} - {"seed", "seed_given", "dtype", "checkpoint_folder", *listed}
        values = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
        values.update({n: tuple(getattr(args, n, ()) or ()) for n in listed})
        seed = getattr(args, "seed", None)
        src = cls(**values, seed=0 if seed is None else seed, seed_given=seed is not None)
        folder = src.model
        if folder is None or not os.path.isdir(folder):
            return src
        given = [flag for attr, flag in _SECOND_SOURCES if getattr(src, attr)]
        if given:
            raise UsageError(f"{folder} is a checkpoint folder, the graph's source; {', '.join(given)} describe(s) another: drop it")
        return src._with_folder(folder, reads_weights)

    def _with_folder(self, folder: str, reads_weights: bool) -> GraphSource:
        """``--hf-config DIR/config.json --weights DIR``: a folder whose weights graphc cannot read (``pytorch_model.bin``
        only, say) is refused unless ``--seed`` asks for seeded random weights; ``--weights`` given as well wins."""
        from ..checkpoint import Checkpoint

        ckpt = Checkpoint(Path(folder))
        weights = self.weights
        if reads_weights and not weights:
            if ckpt.has_weights():
                weights = str(ckpt.folder)
            elif not self.seed_given:
                raise UsageError(
                    f"{folder} holds no weights graphc reads (model.safetensors, or model.safetensors.index.json and its files; "
                    f"found {ckpt.weight_files_seen() or 'none'}); pass --seed N for seeded random weights"
                )
        return replace(self, model=None, checkpoint_folder=str(ckpt.folder), hf_config=str(ckpt.config), weights=weights)

    @cached_property
    def hf(self) -> HFConfig | None:
        """``--hf-config`` read once (``None`` without one): every builder the command calls is handed this."""
        return None if self.hf_config is None else read_hf_config(self.hf_config)

    @property
    def fixed_inputs(self) -> dict[str, object]:
        """``--fix-input`` as values by input name."""
        return _fixed_inputs(self.fix_input)

    def with_dtype(self, dtype: str) -> GraphSource:
        """The same source built in storage dtype ``dtype``."""
        return replace(self, dtype=dtype)

    @property
    def seq_len(self) -> int:
        """New tokens a run takes: ``--seq``, else 1 with ``--decode`` and 512 without."""
        return self.seq if self.seq is not None else 1 if self.decode else 512

    def config(self) -> AttentionConfig:
        """The attention config a preset, custom head counts or ``--hf-config`` describe."""
        if self.hf is not None:
            from ..attention.hf import attention_config_from_hf

            return attention_config_from_hf(self.hf)
        flags = (("--heads", self.heads), ("--kv-heads", self.kv_heads), ("--head-dim", self.head_dim), ("--d-model", self.d_model))
        custom = [f for f, v in flags if v is not None]
        if self.preset and custom:
            raise UsageError(f"give either --preset or a custom config ({', '.join(custom)}), not both")
        for flag, v in flags:
            at_least(flag, v, 1)
        if self.preset:
            cfg = preset(self.preset)
        elif self.heads is not None:
            cfg = self._custom_config(self.heads)
        elif custom:
            raise UsageError(f"{', '.join(custom)} describe a custom config, which needs --heads too")
        else:
            raise UsageError(
                "no graph given: name an ONNX model (MODEL.onnx), or use --preset NAME, --heads N [--kv-heads M --head-dim D], or --graph FILE"
            )
        return cfg.with_(causal=False) if self.no_causal else cfg

    def _custom_config(self, heads: int) -> AttentionConfig:
        if self.head_dim is None and self.d_model is None:
            raise UsageError("a custom config needs --head-dim or --d-model")
        head_dim = self.head_dim if self.head_dim is not None else (self.d_model or 0) // heads
        if head_dim < 1:
            raise UsageError(f"--d-model {self.d_model} is smaller than --heads {heads}; give --head-dim")
        d_model = self.d_model if self.d_model is not None else heads * head_dim
        return AttentionConfig(d_model, heads, self.kv_heads if self.kv_heads is not None else heads, head_dim=head_dim, bias=self.bias)

    def build(self) -> tuple[Graph, dict[str, int]]:
        """The graph the flags describe, and the sizes of its symbolic dims."""
        seq = self.seq_len
        for flag, v, least in (("--batch", self.batch, 1), ("--seq", seq, 1), ("--past", self.past, 0), ("--seed", self.seed, 0)):
            at_least(flag, v, least)
        if self.weights and not self.hf_config:
            raise UsageError("--weights needs --hf-config (the model config the weights belong to)")
        step = {"batch": self.batch, "seq": seq, "past_seq": self.past} if self.decode else {"batch": self.batch, "seq": seq}
        if self.hf_config and self.hf is not None and self.hf.get("model_type") in ENCODER_FAMILIES:
            graph = self._encoder()
            used = {s for n in graph.inputs for d in graph.types[n].shape for s in dim_symbols(d)}
            return graph, {k: v for k, v in step.items() if k in used}
        if self.hf_config:
            return self._hf_stack(), step
        if self.model is not None or self.graph:
            return self._imported(seq)
        cfg, dtype = self.config(), self.dtype
        if self.decode and self.core:
            return sdpa_graph(cfg, q_len="seq", kv_len="past_seq+seq", dtype=dtype), step
        if self.decode:
            return kv_cache_graph(cfg, seed=self.seed, dtype=dtype), step
        return sdpa_graph(cfg, dtype=dtype) if self.core else attention_layer_graph(cfg, seed=self.seed, dtype=dtype), step

    def imported(self) -> Graph:
        """The ONNX model or saved graph this source names."""
        if self.model is not None and self.graph:
            raise UsageError("give either an ONNX model or --graph, not both")
        if self.model is None:
            if self.static_dim or self.fix_input:
                raise UsageError("--static-dim and --fix-input apply to an ONNX model being imported")
            return load_graph(str(self.graph))
        static = parse_sizes(self.static_dim, "--static-dim")
        return import_onnx(self.model, self.strict, self.attention_semantics, static, self.fixed_inputs)

    def _imported(self, seq: int) -> tuple[Graph, dict[str, int]]:
        """An imported graph and the sizes of its symbolic dims: ``--dim`` where given, else guessed from the names (batch
        dims ``--batch``, past dims ``--past``, the others ``--seq``)."""
        g = self.imported()
        symbols = {s for n in g.inputs for d in g.types[n].shape for s in dim_symbols(d)}
        defaults = {"batch": self.batch, "seq": seq, "past_seq": self.past, "q_len": seq, "kv_len": seq}
        sizes = {s: defaults.get(s, self.batch if "batch" in s.lower() else self.past if "past" in s.lower() else seq) for s in symbols}
        given = parse_sizes(self.dim, "--dim")
        unknown = sorted(set(given) - symbols)
        if unknown:
            raise UsageError(
                f"--dim names {', '.join(unknown)}, which the graph's inputs do not use; its symbolic dims: {', '.join(sorted(symbols)) or 'none'}"
            )
        return g, {**sizes, **given}

    def _encoder(self) -> Graph:
        """The encoder of ``--hf-config`` (BERT, DistilBERT, ViT) with the checkpoint's weights."""
        from ..attention.encoder import encoder_from_hf
        from ..weights import load_weights

        given = [flag for flag, on in (("--decode", self.decode), ("--core", self.core), ("--layers", self.layers is not None)) if on]
        if given:
            raise UsageError(f"{', '.join(given)} describe a decoder; a {self.hf.get('model_type') if self.hf else ''} encoder is built whole")
        if not self.weights:
            raise UsageError("an encoder is built from its checkpoint's weights: give the checkpoint folder (or --weights DIR)")
        return encoder_from_hf(self.hf, load_weights(self.weights, dtype=self.dtype))

    def _hf_stack(self) -> Graph:
        """The decoder stack of ``--hf-config`` (first ``--layers`` layers) with ``--weights`` or seeded random weights."""
        from ..attention.decoder import decoder_stack_graph
        from ..attention.hf import decoder_configs_from_hf, decoder_weights_from_hf
        from ..weights import load_weights

        at_least("--layers", self.layers, 1)
        if self.core:
            raise UsageError("--core builds one attention core; with --hf-config the graph is the decoder stack")
        assert self.hf is not None
        cfgs = decoder_configs_from_hf(self.hf, self.layers)
        weights = None
        if self.weights:  # a copy only when the dtype differs
            weights = decoder_weights_from_hf(load_weights(self.weights, dtype=self.dtype), self.hf)
            weights = {k: v for k, v in weights.items() if k.startswith(("model.layers.", "model.norm."))}
        final = bool(weights and "model.norm.weight" in weights)
        return decoder_stack_graph(cfgs, weights=weights, kv_cache=self.decode, seed=self.seed, dtype=self.dtype, final_norm=final)


def _fixed_inputs(items: tuple[str, ...]) -> dict[str, object]:
    """``--fix-input NAME=VALUE`` items: ``1``/``0``/``true``/``false``, an int or a float."""
    fixed: dict[str, object] = {}
    for item in items:
        name, sep, text = item.partition("=")
        value: object
        lowered = text.strip().lower()
        if lowered in ("true", "false"):
            value = lowered == "true"
        else:
            try:
                value = int(lowered)
            except ValueError:
                try:
                    value = float(lowered)
                except ValueError:
                    value = None
        if not sep or not name.strip() or value is None:
            raise UsageError(f"--fix-input takes NAME=VALUE (a number or true/false, e.g. use_cache_branch=1), got {item!r}")
        fixed[name.strip()] = value
    return fixed


def import_onnx(
    path: str, strict: bool, semantics: str = "onnx-1.23", dims: dict[str, int] | None = None, fixed: dict[str, object] | None = None
) -> Graph:
    """An ONNX model imported (a positional argument that is neither a folder nor a .onnx file is refused by name)."""
    if not path.endswith(".onnx") and not os.path.exists(path):
        raise UsageError(f"unexpected argument {path!r}: the positional argument is an ONNX model file (.onnx)")
    from ..onnx_import import from_onnx

    return from_onnx(path, strict=strict, attention_semantics=semantics, dims=dims, fixed_inputs=fixed)
