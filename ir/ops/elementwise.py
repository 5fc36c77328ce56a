"""Elementwise ops: broadcasting binary math and comparisons, unary math, where, cast."""

import torch
import torch.nn.functional as F

from ..dtypes import to_torch
from ..registry import REQUIRED, OpDef, register
from ..tensor_type import TensorType
from .shape_rules import broadcast_shapes, result_dtype

ELEMENTWISE = frozenset({"elementwise"})
COMMUTATIVE = frozenset({"elementwise", "commutative"})


def _binary(name, fn, boolean=False, doc="", traits=ELEMENTWISE):
    def infer(a, b):
        shape = broadcast_shapes(a.shape, b.shape)
        return TensorType("bool" if boolean else result_dtype((a.dtype, a.rank), (b.dtype, b.rank)), shape)

    register(OpDef(name, ("a", "b"), infer, fn, doc=doc, traits=traits))


def _unary(name, fn, float_only=False, boolean=False, **attrs):
    def infer(x, **_):
        return x.with_dtype("bool") if boolean else x

    register(OpDef(name, ("x",), infer, fn, attrs=attrs, traits=ELEMENTWISE))


_binary("add", torch.add, traits=COMMUTATIVE)
_binary("sub", torch.sub)
_binary("mul", torch.mul, traits=COMMUTATIVE)
_binary("div", torch.div, doc="true division")
_binary("pow", torch.pow)
_binary("maximum", torch.maximum, traits=COMMUTATIVE)
_binary("minimum", torch.minimum, traits=COMMUTATIVE)
_binary("eq", torch.eq, boolean=True, traits=COMMUTATIVE)
_binary("ne", torch.ne, boolean=True, traits=COMMUTATIVE)
_binary("lt", torch.lt, boolean=True)
_binary("le", torch.le, boolean=True)
_binary("gt", torch.gt, boolean=True)
_binary("ge", torch.ge, boolean=True)
_binary("logical_and", torch.logical_and, boolean=True, traits=COMMUTATIVE)
_binary("logical_or", torch.logical_or, boolean=True, traits=COMMUTATIVE)

_unary("neg", torch.neg)
_unary("exp", torch.exp)
_unary("log", torch.log)
_unary("sqrt", torch.sqrt)
_unary("rsqrt", torch.rsqrt)
_unary("reciprocal", torch.reciprocal)
_unary("abs", torch.abs)
_unary("tanh", torch.tanh)
_unary("sin", torch.sin)
_unary("cos", torch.cos)
_unary("erf", torch.erf)
_unary("sigmoid", torch.sigmoid)
_unary("relu", torch.relu)
_unary("silu", F.silu)
_unary("logical_not", torch.logical_not, boolean=True)
_unary("gelu", lambda x, approximate: F.gelu(x, approximate=approximate), approximate="none")


def _where_infer(cond, a, b):
    return TensorType(
        result_dtype((a.dtype, a.rank), (b.dtype, b.rank)), broadcast_shapes(cond.shape, a.shape, b.shape)
    )


register(OpDef("where", ("cond", "a", "b"), _where_infer, torch.where, traits=ELEMENTWISE))
register(
    OpDef(
        "cast",
        ("x",),
        lambda x, dtype: x.with_dtype(dtype),
        lambda x, dtype: x.to(to_torch(dtype)),
        attrs={"dtype": REQUIRED},
        traits=ELEMENTWISE,
    )
)
