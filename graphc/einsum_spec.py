"""Parsing, validation and shape inference of einsum specifications.

graphc accepts the explicit form only: ``"bhqd,bhkd->bhqk"``.  Exactly one
``->``, letters only, no ellipsis, no label repeated inside one operand
(diagonals), output labels unique and present in some input, one size per label.
An empty term is a rank-0 operand (``"->"``: one scalar; ``",->"``: two).
Every error names the operand, the label and the sizes involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .dims import Dim, Shape, format_shape, normalize_dim
from .errors import EinsumSpecError

__all__ = ["einsum_flops", "EinsumSpec", "parse_einsum", "infer_einsum_shape", "label_sizes", "fresh_labels"]

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class EinsumSpec:
    """A parsed einsum: one label string per operand and the output labels."""

    inputs: tuple[str, ...]
    output: str

    def __str__(self) -> str:
        return ",".join(self.inputs) + "->" + self.output

    @property
    def labels(self) -> str:
        """Every label that occurs, in order of first occurrence."""
        seen: dict[str, None] = {}
        for term in (*self.inputs, self.output):
            for c in term:
                seen.setdefault(c)
        return "".join(seen)


def parse_einsum(spec: str) -> EinsumSpec:
    """Parse and validate ``spec``; raise :class:`EinsumSpecError` naming what is wrong."""
    if not isinstance(spec, str):
        raise EinsumSpecError(f"einsum spec must be a string, got {type(spec).__name__}")
    text = spec.replace(" ", "")
    if text.count("->") != 1:
        raise EinsumSpecError(f"einsum spec {spec!r} must contain exactly one '->' (implicit output is not accepted), found {text.count('->')}")
    lhs, out = text.split("->")
    inputs = tuple(lhs.split(","))
    for i, term in enumerate(inputs):
        for c in term:
            if c not in LETTERS:
                raise EinsumSpecError(f"einsum spec {spec!r}: operand {i} ({term!r}) has {c!r}; labels must be letters a-z, A-Z (no ellipsis)")
        for c in set(term):
            if term.count(c) > 1:
                raise EinsumSpecError(f"einsum spec {spec!r}: label {c!r} repeats in operand {i} ({term!r}); diagonals and traces are not supported")
    for c in out:
        if c not in LETTERS:
            raise EinsumSpecError(f"einsum spec {spec!r}: output {out!r} has {c!r}; labels must be letters a-z, A-Z")
        if out.count(c) > 1:
            raise EinsumSpecError(f"einsum spec {spec!r}: output label {c!r} appears more than once in {out!r}")
        if not any(c in term for term in inputs):
            raise EinsumSpecError(f"einsum spec {spec!r}: output label {c!r} does not appear in any input")
    return EinsumSpec(inputs, out)


def label_sizes(spec: EinsumSpec, shapes: Sequence[Shape]) -> dict[str, Dim]:
    """Map each label of ``spec`` to its size, checking ranks and consistency against ``shapes``."""
    if len(shapes) != len(spec.inputs):
        raise EinsumSpecError(f"einsum spec {str(spec)!r} has {len(spec.inputs)} operands but {len(shapes)} were given")
    sizes: dict[str, Dim] = {}
    where: dict[str, int] = {}
    for i, (term, shape) in enumerate(zip(spec.inputs, shapes)):
        if len(term) != len(shape):
            raise EinsumSpecError(
                f"einsum spec {str(spec)!r}: operand {i} ({term!r}) has {len(term)} labels but rank {len(shape)} (shape {format_shape(shape)})"
            )
        for c, d in zip(term, shape):
            d = normalize_dim(d)
            if c in sizes and sizes[c] != d:
                raise EinsumSpecError(f"einsum spec {str(spec)!r}: label {c!r} has size {sizes[c]!r} in operand {where[c]} but {d!r} in operand {i}")
            sizes.setdefault(c, d)
            where.setdefault(c, i)
    return sizes


def infer_einsum_shape(spec: EinsumSpec, shapes: Sequence[Shape]) -> Shape:
    """Return the output shape of ``spec`` applied to operands of ``shapes``."""
    sizes = label_sizes(spec, shapes)
    return tuple(sizes[c] for c in spec.output)


def fresh_labels(used: str, count: int) -> str:
    """Return ``count`` letters not in ``used`` (for rewrites that introduce labels)."""
    free = [c for c in LETTERS if c not in used]
    if len(free) < count:
        raise EinsumSpecError(f"no {count} free einsum labels left (used: {used!r})")
    return "".join(free[:count])


def einsum_flops(spec: EinsumSpec, sizes: dict[str, int]) -> int:
    """FLOPs of evaluating ``spec`` in one go: 2 per multiply-add when a label is summed."""
    total = 1
    for c in spec.labels:
        total *= sizes[c]
    summed = any(c not in spec.output for c in spec.labels)
    return total * max(len(spec.inputs) - 1, 1) * (2 if summed else 1)
