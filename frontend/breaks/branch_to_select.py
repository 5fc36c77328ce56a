"""Rewrite a tensor-dependent `if` into a select over both arms, when both arms are pure.

    if x.sum() > 0:              def _then(x): y = x * 2; return (y,)
        y = x * 2          ->    def _else(x): y = x - 1; return (y,)
    else:                        (y,) = select_branch(x.sum() > 0, lambda: _then(x), lambda: _else(x))
        y = x - 1

`select_branch` runs both arms and picks each output with `torch.where` (the IR's `where`), so
the graph has no branch left. That is only sound when neither arm has side effects, so an arm
may hold only assignments to local names and a final `return`, and calls nothing that mutates
(in-place `*_` methods, `append`, `print`, ...). The method is rewritten from its source and
bound to the module instances that use it; the class itself is never changed.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from ..errors import KilnError
from .recording import SourceFrame

SELECT = "__kiln_select_branch"
IMPURE_CALLS = {"print", "setattr", "delattr", "exec", "eval", "open", "input", "globals", "locals", "vars"}
IMPURE_METHODS = {
    "append",
    "extend",
    "insert",
    "pop",
    "remove",
    "clear",
    "update",
    "setdefault",
    "add",
    "discard",
    "write",
    "warn",
    "info",
    "debug",
    "warning",
    "error",
    "critical",
    "log",
    "exception",
    "backward",
    "item",
    "tolist",
}


class BranchSelectError(KilnError):
    """The two arms of a rewritten branch return values that cannot be selected elementwise."""


def select_branch(pred, then_arm, else_arm):
    """Both arms evaluated, each output picked by `pred` (a 0-d tensor; a Python bool just branches)."""
    if not isinstance(pred, torch.Tensor):
        return then_arm() if pred else else_arm()
    cond = pred.reshape(()) if pred.dtype == torch.bool else (pred != 0).reshape(())
    return tree_map(lambda a, b: _select(cond, a, b), then_arm(), else_arm())


def _select(cond: torch.Tensor, a, b):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype:
        return torch.where(cond, a, b)
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a is b:
        return a
    raise BranchSelectError(
        f"The two arms of a tensor-dependent `if` give different kinds of values ({_describe(a)} vs "
        f"{_describe(b)}), so Kiln cannot select between them elementwise. Fix: make both arms "
        "return tensors of the same shape and dtype, or use `torch.cond`."
    )


def _describe(value) -> str:
    return f"tensor {list(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__


@dataclass
class BranchRewrite:
    """A method of some module instances replaced by a version whose `if` at `line` is a select."""

    function: str
    filename: str
    line: int
    instances: list[torch.nn.Module]
    attribute: str

    def undo(self) -> None:
        for instance in self.instances:
            instance.__dict__.pop(self.attribute, None)


def rewrite_branch(root: torch.nn.Module, where: SourceFrame) -> BranchRewrite | None:
    """Rewrite the `if` at `where` in a method of `root`'s modules; None when Kiln cannot
    (not a method of a module, no `if` there, an arm with side effects or control flow)."""
    found = _find_method(root, where)
    if found is None:
        return None
    attribute, function, instances = found
    rewritten = _rewrite_function(function, where.lineno)
    if rewritten is None:
        return None
    for instance in instances:
        instance.__dict__[attribute] = types.MethodType(rewritten, instance)
    return BranchRewrite(where.function, where.filename, where.lineno, instances, attribute)


def _find_method(root: torch.nn.Module, where: SourceFrame):
    """(attribute name, plain function, instances) for the method whose code holds `where`."""
    for module in root.modules():
        for cls in type(module).__mro__:
            for attribute, value in vars(cls).items():
                function = value if inspect.isfunction(value) else None  # decorated: its wrapper matters
                if function is not None and _holds(function.__code__, where):
                    instances = [m for m in root.modules() if _method_code(m, attribute) is function.__code__]
                    return attribute, function, instances
    return None


def _holds(code: types.CodeType, where: SourceFrame) -> bool:
    if code.co_filename != where.filename or code.co_name != where.function:
        return False
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return bool(lines) and min(lines) <= where.lineno <= max(lines)


def _method_code(module: torch.nn.Module, attribute: str):
    function = getattr(type(module), attribute, None)
    return function.__code__ if inspect.isfunction(function) else None


# -- the source rewrite -------------------------------------------------------------------------
def _rewrite_function(function: types.FunctionType, line: int) -> types.FunctionType | None:
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    ast.increment_lineno(tree, function.__code__.co_firstlineno - 1)
    definition = tree.body[0]
    if not isinstance(definition, ast.FunctionDef):
        return None
    definition.decorator_list = []
    if not _RewriteIf(line).rewrite(definition):
        return None
    return _compile(definition, function)


class _RewriteIf:
    """Finds the `if` whose test holds `line` and replaces it with a select."""

    def __init__(self, line: int) -> None:
        self.line = line

    def rewrite(self, definition: ast.FunctionDef) -> bool:
        for block in _blocks(definition):
            for position, statement in enumerate(block):
                if isinstance(statement, ast.If) and statement.lineno <= self.line <= statement.test.end_lineno:
                    replacement = _select_statements(statement, block[position + 1 :])
                    if replacement is None:
                        return False
                    new, consumed = replacement
                    block[position : position + 1 + consumed] = new
                    return True
        return False


def _blocks(node: ast.AST):
    """Every statement list in a function body (the function's own, not nested definitions')."""
    yield node.body
    for child in ast.walk(node):
        if child is not node and isinstance(child, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            for name in ("body", "orelse", "finalbody"):
                block = getattr(child, name, None)
                if block:
                    yield block


def _select_statements(branch: ast.If, rest: list[ast.stmt]):
    """The statements replacing `branch` (and the `rest` it consumes), or None if not pure."""
    then_arm, else_arm, consumed = list(branch.body), list(branch.orelse), 0
    if _returns(then_arm) and not else_arm and rest and _returns(rest):
        else_arm, consumed = list(rest), len(rest)  # `if c: return a` then `return b`
    if not (_pure(then_arm) and _pure(else_arm)):
        return None
    returns = _returns(then_arm), _returns(else_arm)
    if returns == (True, True):
        outputs = None
    elif returns == (False, False):
        outputs = sorted(_assigned(then_arm) | _assigned(else_arm))
        if not outputs:
            return None
    else:
        return None
    arms = [
        _arm_function(f"__kiln_{name}_{branch.lineno}", arm, outputs)
        for name, arm in (("then", then_arm), ("else", else_arm))
    ]
    call = ast.Call(ast.Name(SELECT, ast.Load()), [branch.test, *[_thunk(arm) for arm in arms]], [])
    if outputs is None:
        tail = ast.Return(call)
    else:
        target = ast.Tuple([ast.Name(n, ast.Store()) for n in outputs], ast.Store())
        tail = ast.Assign([target], call)
    statements = [definition for definition, _ in arms] + [tail]
    for statement in statements:
        ast.copy_location(statement, branch)
        ast.fix_missing_locations(statement)
    return statements, consumed


def _arm_function(name: str, arm: list[ast.stmt], outputs: list[str] | None):
    """A nested function running one arm; its parameters are the outer names it reads before
    assigning (they would otherwise become unbound locals) and the outputs it leaves unchanged."""
    body = list(arm) or [ast.Pass()]
    parameters = _read_before_assigned(arm)
    if outputs is not None:
        parameters |= set(outputs) - _assigned(arm)
        body.append(ast.Return(ast.Tuple([ast.Name(n, ast.Load()) for n in outputs], ast.Load())))
    parameters = sorted(parameters)
    arguments = ast.arguments(
        posonlyargs=[], args=[ast.arg(p) for p in parameters], kwonlyargs=[], kw_defaults=[], defaults=[]
    )
    return ast.FunctionDef(name, arguments, body, [], None), parameters


def _thunk(arm) -> ast.Lambda:
    name = arm[0].name
    no_arguments = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
    call = ast.Call(ast.Name(name, ast.Load()), [ast.Name(p, ast.Load()) for p in arm[1]], [])
    return ast.Lambda(no_arguments, call)


def _returns(arm: list[ast.stmt]) -> bool:
    return bool(arm) and isinstance(arm[-1], ast.Return)


def _pure(arm: list[ast.stmt]) -> bool:
    """Only local assignments and a final return, calling nothing that mutates or prints."""
    for position, statement in enumerate(arm):
        if isinstance(statement, ast.Return):
            if position != len(arm) - 1:
                return False
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if not all(_is_local_target(t) for t in targets):
                return False
        elif not (
            isinstance(statement, ast.Pass)
            or (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))
        ):
            return False
        if any(_impure(node) for node in ast.walk(statement)):
            return False
    return True


def _impure(node: ast.AST) -> bool:
    if isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await, ast.NamedExpr)):
        return True
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Name):
        return node.func.id in IMPURE_CALLS
    if isinstance(node.func, ast.Attribute):
        attribute = node.func.attr
        return attribute in IMPURE_METHODS or (attribute.endswith("_") and not attribute.startswith("__"))
    return False


def _is_local_target(target: ast.expr) -> bool:
    if isinstance(target, ast.Name):
        return True
    return isinstance(target, (ast.Tuple, ast.List)) and all(_is_local_target(t) for t in target.elts)


def _assigned(arm: list[ast.stmt]) -> set[str]:
    return {n.id for s in arm for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _read_before_assigned(arm: list[ast.stmt]) -> set[str]:
    """Names an arm reads before its own assignment to them (so they must be passed in)."""
    assigned_later, seen, needed = _assigned(arm), set(), set()
    for statement in arm:
        value = statement.value if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.Return)) else statement
        if value is not None:
            reads = {n.id for n in ast.walk(value) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            needed |= (reads & assigned_later) - seen
        seen |= _assigned([statement])
    return needed


def _compile(definition: ast.FunctionDef, original: types.FunctionType) -> types.FunctionType:
    """Compile the rewritten definition with the original's globals, closure and defaults."""
    free = list(original.__code__.co_freevars)
    factory = ast.FunctionDef(
        "__kiln_factory",
        ast.arguments(
            posonlyargs=[], args=[ast.arg(n) for n in [SELECT, *free]], kwonlyargs=[], kw_defaults=[], defaults=[]
        ),
        [definition, ast.Return(ast.Name(definition.name, ast.Load()))],
        [],
        None,
    )
    module = ast.fix_missing_locations(ast.Module([ast.copy_location(factory, definition)], []))
    namespace: dict = {}
    exec(compile(module, original.__code__.co_filename, "exec"), original.__globals__, namespace)
    cells = [cell.cell_contents for cell in original.__closure__ or ()]
    rewritten = namespace["__kiln_factory"](select_branch, *cells)
    rewritten.__defaults__ = original.__defaults__
    rewritten.__kwdefaults__ = original.__kwdefaults__
    return rewritten
