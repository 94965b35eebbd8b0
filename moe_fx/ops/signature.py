"""One Python copy of an op's signature: its registered schema, bound by name.

A moe_fx op's schema string is the only place its arguments are spelled out. The fake implementation,
the device implementations and the input checks all take ``*args, **kwargs`` and bind them with the
:class:`SchemaBinder` of the op, which reads names, defaults and keyword-only markers from the schema
``torch.library`` registered (``torch.ops.moe_fx.<name>.default._schema``). Adding an argument then
means editing the schema string and the code that reads the new name, nothing else.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["SchemaBinder", "binder"]


class SchemaBinder:
    """Binds a call in the schema's form (positional or keyword, defaults left out) to ``{name: value}``."""

    def __init__(self, schema: torch._C.FunctionSchema) -> None:
        self.op = schema.name
        args = list(schema.arguments)
        self.names = tuple(a.name for a in args)
        self.positional = tuple(a.name for a in args if not a.kwarg_only)
        self.defaults = {a.name: a.default_value for a in args if a.has_default_value()}
        self.required = tuple(a.name for a in args if not a.has_default_value())
        self._known = frozenset(self.names)

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``{argument name: value}`` for every argument of the schema (defaults filled in)."""
        if len(args) > len(self.positional):
            raise TypeError(f"{self.op}: takes {len(self.positional)} positional arguments, got {len(args)}")
        out = dict(self.defaults)
        out.update(zip(self.positional, args))
        if kwargs:
            unknown = [k for k in kwargs if k not in self._known]
            if unknown:
                raise TypeError(f"{self.op}: unexpected argument(s) {unknown}; the schema has {list(self.names)}")
            twice = [k for k in kwargs if k in self.positional[: len(args)]]
            if twice:
                raise TypeError(f"{self.op}: argument(s) {twice} given both by position and by name")
            out.update(kwargs)
        if len(out) != len(self.names):
            missing = [n for n in self.required if n not in out]
            raise TypeError(f"{self.op}: missing required argument(s) {missing}")
        return out

    def call_args(self, bound: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` that call the op with ``bound`` (the inverse of ``__call__``)."""
        args = tuple(bound[n] for n in self.positional)
        kwargs = {n: bound[n] for n in self.names if n not in self.positional}
        return args, kwargs


@functools.cache
def binder(qualname: str) -> SchemaBinder:
    """The binder of ``moe_fx::<name>``'s default overload (``qualname`` is ``"moe_fx::<name>"``)."""
    namespace, name = qualname.split("::")
    return SchemaBinder(getattr(getattr(torch.ops, namespace), name).default._schema)
