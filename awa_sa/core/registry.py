"""Where every statement is registered, memoised, and paired with its parameters and rows.

A builder registered with :func:`statement` exists once per distinct set of arguments for the
life of the process, so :mod:`awa_sa.core.compiled` compiles each once, and :func:`all_builders`
-- what ``awa-sa sql`` lists and the tests compile -- cannot miss one.

A :class:`Query` is what the flow runs: a builder, the typed value it is called with, and the
typed value its rows become. Bind and column names stay in the statement modules, beside the
SQL that defines them; the flow speaks only in fields.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial, wraps
from itertools import product
from typing import Any, Generic, Literal, ParamSpec, TypeVar, get_args, get_origin, get_type_hints

from sqlalchemy.sql.elements import ClauseElement

_P = ParamSpec("_P")
_S = TypeVar("_S")
P = TypeVar("P")
R = TypeVar("R")

Rows = Sequence[Any]
"""A statement's answer as the statements' readers take it: its rows, each a tuple with its
columns as attributes too (:func:`awa_sa.core.internals.fetched`)."""

_BUILDERS: list[Callable[..., Any]] = []
"""Every statement builder, in definition order: ``@statement`` adds it, ``all_builders`` reads."""


def statement(builder: Callable[_P, _S]) -> Callable[_P, _S]:
    """Register *builder* and memoise it on its keyword arguments, in whatever order named.

    ``functools.cache`` keys on the order too, so ``f(a=1, b=2)`` and ``f(b=2, a=1)`` would be
    two statement objects, each compiled once more.
    """
    built: dict[frozenset[tuple[str, object]], _S] = {}

    @wraps(builder)
    def memoised(*args: _P.args, **kwargs: _P.kwargs) -> _S:
        if args:
            raise TypeError(f"{builder.__name__}() takes keyword arguments only")
        key = frozenset(kwargs.items())
        found = built.get(key)
        if found is None:
            found = built[key] = builder(*args, **kwargs)
        return found

    _BUILDERS.append(memoised)
    return memoised


@dataclass(frozen=True, slots=True)
class Query(Generic[P, R]):
    """A statement with its typed parameters ``P`` and its typed result ``R``.

    ``shape`` picks the memoised statement for the parameters (the batch shape for more than
    one row), ``binds`` lays them out under the statement's bind names, and ``read`` turns the
    rows into ``R``. :func:`awa_sa.core.compiled.run` is the one place that executes one.
    """

    shape: Callable[[P], ClauseElement]
    binds: Callable[[P], Mapping[str, Any]]
    read: Callable[[Rows], R]
    by_position: bool = False
    """``read`` takes the rows by position only: they come as the driver's tuples."""


def no_binds(_: object) -> Mapping[str, Any]:
    """For a statement without parameters."""
    return {}


def all_builders() -> list[partial[Any]]:
    """Every distinct statement as a zero-argument call: what ``awa-sa sql`` lists and tests use.

    Derived from the builders: each registered one, called with every value its ``bool`` and
    ``Literal`` parameters allow, so a new builder or argument cannot be left out of either.
    """
    return [partial(builder, **args) for builder in _BUILDERS for args in _argument_sets(builder)]


def _argument_sets(builder: Callable[..., Any]) -> list[dict[str, object]]:
    func = inspect.unwrap(builder)
    hints = get_type_hints(func)
    names = list(inspect.signature(func).parameters)
    choices = []
    for name in names:
        hint = hints.get(name)
        if hint is bool:
            choices.append((False, True))
        elif get_origin(hint) is Literal:
            choices.append(get_args(hint))
        else:
            raise TypeError(f"{func.__name__}: cannot enumerate parameter {name!r}")
    return [dict(zip(names, values, strict=True)) for values in product(*choices)]
