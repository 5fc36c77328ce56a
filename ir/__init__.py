"""Kiln's IR: typed SSA graphs over a small closed op set, with a verifier, a text form that
round-trips exactly, and a reference interpreter that runs any graph on the CPU."""

from .dims import Dim, SymbolBound, evaluate, format_dim, parse_dim, symbol
from .dtypes import from_torch, to_torch
from .graph import Graph, GraphEditError, Node, Value
from .interpreter import InterpreterError, run_graph
from .parser import ParseError, parse_graph
from .printer import print_graph
from .registry import REQUIRED, TRAITS, OpDef, OpError, all_ops, get_op, ops_with, register
from .tensor_type import TensorType
from .verifier import VerificationError, verify

__all__ = [
    "REQUIRED",
    "TRAITS",
    "Dim",
    "Graph",
    "GraphEditError",
    "InterpreterError",
    "Node",
    "OpDef",
    "OpError",
    "ParseError",
    "SymbolBound",
    "TensorType",
    "Value",
    "VerificationError",
    "all_ops",
    "evaluate",
    "format_dim",
    "from_torch",
    "get_op",
    "ops_with",
    "parse_dim",
    "parse_graph",
    "print_graph",
    "register",
    "run_graph",
    "symbol",
    "to_torch",
    "verify",
]
