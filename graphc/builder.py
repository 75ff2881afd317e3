"""Builder methods of :class:`~graphc.graph.Graph`: one method per op, returning values.

Any einsum graph can be written by hand with them, not only attention::

    g = Graph("ffn")
    x = g.input("x", ["batch", "seq", 64])
    w1 = g.constant("w1", np.ones((64, 256), np.float32))
    h = g.relu(g.einsum("bsd,df->bsf", x, w1))
    g.output(h)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .dims import Dim
from .errors import GraphError
from .ops import Binary, CausalMask, Cast, Compare, Concat, Einsum, Op, Repeat, Reshape, Scale, Softmax, Transpose, Unary, Where
from .values import Value, ValueLike
from .visibility import Visibility

__all__ = ["GraphBuilder"]


class GraphBuilder:
    """Mixin giving a graph one builder method per op. Each takes an optional ``name``."""

    def add_input(self, name: str, shape: Sequence[Dim], dtype: str = "float32") -> Value:  # pragma: no cover - Graph defines it
        raise NotImplementedError

    def add_initializer(self, name: str, array: np.ndarray) -> Value:  # pragma: no cover - Graph defines it
        raise NotImplementedError

    def add_node(self, op: Op, inputs: Sequence[ValueLike], name: str | None = None) -> Value:  # pragma: no cover - Graph defines it
        raise NotImplementedError

    def add_multi_node(self, op: Op, inputs: Sequence[ValueLike], names: Sequence[str] | None = None) -> tuple[Value, ...]:  # pragma: no cover
        raise NotImplementedError

    def input(self, name: str, shape: Sequence[Dim], dtype: str = "float32") -> Value:
        """Declare a graph input; dims are ints or symbols (``"batch"``, ``"seq"``) bound at run time."""
        return self.add_input(name, shape, dtype)

    def constant(self, name: str, array: np.ndarray) -> Value:
        """Declare an initializer (weights, biases) holding ``array``."""
        return self.add_initializer(name, array)

    def einsum(self, spec: str, *operands: ValueLike, name: str | None = None) -> Value:
        """Contract ``operands`` with an explicit einsum spec such as ``"bhqd,bhkd->bhqk"``."""
        return self.add_node(Einsum(spec), operands, name)

    def reshape(self, x: ValueLike, shape: Sequence[Dim], name: str | None = None) -> Value:
        """Reshape ``x`` to ``shape`` (same element count; dims may be symbolic expressions)."""
        return self.add_node(Reshape(tuple(shape)), [x], name)

    def transpose(self, x: ValueLike, perm: Sequence[int], name: str | None = None) -> Value:
        """Permute the axes of ``x``: output axis i is input axis ``perm[i]``."""
        return self.add_node(Transpose(tuple(perm)), [x], name)

    def repeat(self, x: ValueLike, repeats: int, axis: int, name: str | None = None) -> Value:
        """Repeat-interleave ``x`` along ``axis`` (``torch.repeat_interleave``): the KV-head repeat."""
        return self.add_node(Repeat(axis, repeats), [x], name)

    def softmax(self, x: ValueLike, axis: int = -1, name: str | None = None) -> Value:
        """Softmax along ``axis``; fully masked rows give zeros."""
        return self.add_node(Softmax(axis), [x], name)

    def concat(self, values: Sequence[ValueLike], axis: int, name: str | None = None) -> Value:
        """Concatenate ``values`` along ``axis``."""
        return self.add_node(Concat(axis), values, name)

    def cast(self, x: ValueLike, dtype: str, name: str | None = None) -> Value:
        """Convert ``x`` to ``dtype``."""
        return self.add_node(Cast(dtype), [x], name)

    def unary(self, fn: str, x: ValueLike, name: str | None = None) -> Value:
        """Apply the elementwise function ``fn`` (``"exp"``, ``"tanh"`` ...)."""
        return self.add_node(Unary(fn), [x], name)

    def exp(self, x: ValueLike, name: str | None = None) -> Value:
        """Elementwise ``exp``."""
        return self.unary("exp", x, name)

    def neg(self, x: ValueLike, name: str | None = None) -> Value:
        """Elementwise negation."""
        return self.unary("neg", x, name)

    def tanh(self, x: ValueLike, name: str | None = None) -> Value:
        """Elementwise ``tanh``."""
        return self.unary("tanh", x, name)

    def sqrt(self, x: ValueLike, name: str | None = None) -> Value:
        """Elementwise square root."""
        return self.unary("sqrt", x, name)

    def reciprocal(self, x: ValueLike, name: str | None = None) -> Value:
        """Elementwise ``1 / x``."""
        return self.unary("reciprocal", x, name)

    def relu(self, x: ValueLike, name: str | None = None) -> Value:
        """Elementwise ``max(x, 0)``."""
        return self.unary("relu", x, name)

    def sigmoid(self, x: ValueLike, name: str | None = None) -> Value:
        """Elementwise logistic sigmoid."""
        return self.unary("sigmoid", x, name)

    def binary(self, fn: str, a: ValueLike, b: ValueLike, name: str | None = None) -> Value:
        """Apply the broadcasting binary function ``fn`` (``"add"``, ``"mul"`` ...)."""
        return self.add_node(Binary(fn), [a, b], name)

    def add(self, a: ValueLike, b: ValueLike, name: str | None = None) -> Value:
        """Broadcasting ``a + b``."""
        return self.binary("add", a, b, name)

    def sub(self, a: ValueLike, b: ValueLike, name: str | None = None) -> Value:
        """Broadcasting ``a - b``."""
        return self.binary("sub", a, b, name)

    def mul(self, a: ValueLike, b: ValueLike, name: str | None = None) -> Value:
        """Broadcasting ``a * b``."""
        return self.binary("mul", a, b, name)

    def div(self, a: ValueLike, b: ValueLike, name: str | None = None) -> Value:
        """Broadcasting ``a / b``."""
        return self.binary("div", a, b, name)

    def maximum(self, a: ValueLike, b: ValueLike, name: str | None = None) -> Value:
        """Broadcasting elementwise maximum."""
        return self.binary("max", a, b, name)

    def compare(self, fn: str, a: ValueLike, b: ValueLike, name: str | None = None) -> Value:
        """Broadcasting comparison ``fn`` (``"less"``, ``"less_equal"``, ``"greater"``, ``"greater_equal"``, ``"equal"``): a bool value."""
        return self.add_node(Compare(fn), [a, b], name)

    def where(self, cond: ValueLike, x: ValueLike, y: ValueLike, name: str | None = None) -> Value:
        """``cond ? x : y`` with broadcasting; ``cond`` is a bool tensor."""
        return self.add_node(Where(), [cond, x, y], name)

    def scale(self, x: ValueLike, factor: float, name: str | None = None) -> Value:
        """Multiply ``x`` by the constant ``factor``."""
        return self.add_node(Scale(factor), [x], name)

    def attention(
        self,
        q: ValueLike,
        k: ValueLike,
        v: ValueLike,
        scale: float,
        visibility: Visibility | None = None,
        mask: ValueLike | None = None,
        past_key: ValueLike | None = None,
        past_value: ValueLike | None = None,
        names: Sequence[str] | None = None,
    ) -> Value | tuple[Value, Value, Value]:
        """One :class:`~graphc.attention_op.Attention` node; with ``past_key``/``past_value`` returns ``(out, present_key, present_value)``.

        ``visibility``: which keys each query sees (:class:`~graphc.visibility.Visibility`; default: every key, and a
        bool ``mask`` when one is given).  A ``mask`` goes with a visibility whose ``mask`` kind is ``"bool"`` or
        ``"additive"``.

        Builders emit attention decomposed; this is for graphs that want the op itself
        (imports, tests, hand-written graphs).
        """
        from .attention_op import Attention  # the op module builds on Graph

        if (past_key is None) != (past_value is None):
            raise GraphError("attention: past_key and past_value come together (a KV cache has both), got only one")
        if visibility is None:
            visibility = Visibility(mask="bool" if mask is not None else "none")
        if visibility.has_mask != (mask is not None):
            given = "a mask" if mask is not None else "no mask"
            raise GraphError(f"attention: the visibility ({visibility.describe()}) and {given} given disagree on whether a mask is an input")
        op = Attention(scale, visibility, past_key is not None)
        inputs = [q, k, v] + ([mask] if mask is not None else [])
        if past_key is None or past_value is None:
            return self.add_multi_node(op, inputs, names)[0]
        out, present_key, present_value = self.add_multi_node(op, [*inputs, past_key, past_value], names)
        return out, present_key, present_value

    def causal_mask(self, x: ValueLike, offset: Dim = 0, name: str | None = None) -> Value:
        """Mask scores ``x[..., i, j]`` with ``-inf`` where ``j > i + offset`` (offset = KV-cache past length)."""
        return self.add_node(CausalMask(offset), [x], name)
