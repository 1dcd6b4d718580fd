"""Settings declared once: a dataclass field carries an option's type, default, flags and help, and a Typer command's
parameters are generated from the dataclass (as TRL's scripts build their argument parsers from their config
dataclasses), so an option is never written again in a signature, a constructor call or a manifest dict.

- :func:`option` declares a field and how the command line shows it.
- :func:`command` turns ``def cmd(settings: S, ...)`` into a Typer callback whose parameters are ``S``'s CLI fields
  (plus the function's own other parameters), builds ``S`` from them and hands it over; a :class:`SettingsError`
  (what ``S.validate()`` raises) becomes a usage error naming the field's flag (exit status 2). The command calls
  ``validate`` itself, where its checks belong (`polar train` lets its runner do it, as library users get it).
- :func:`manifest` is ``asdict`` with the secret fields redacted: what a run writes beside its results.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

_KEY = "polar_cli.settings"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Spec:
    """How one field appears on the command line."""

    help: str
    flags: tuple[str, ...] = ()  # click's parameter declarations ("--out", "-o"); none: --field-name
    argument: bool = False  # a positional argument rather than an option
    cli: bool = True  # False: a library-only field (not on the command line)
    secret: bool = False  # redacted in the manifest
    envvar: str | None = None
    min: float | None = None
    show_default: bool = True
    callback: Callable[[Any], Any] | None = None  # click's parameter callback (e.g. a store that must exist)


class SettingsError(ValueError):
    """A refused setting: ``field`` is the settings field at fault (its flag names it in the usage error)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def option(
    default: Any = MISSING,
    *,
    help: str = "",
    flags: Sequence[str] = (),
    default_factory: Callable[[], Any] | Any = MISSING,
    argument: bool = False,
    cli: bool = True,
    secret: bool = False,
    envvar: str | None = None,
    min: float | None = None,
    show_default: bool = True,
    callback: Callable[[Any], Any] | None = None,
) -> Any:
    """A dataclass field with its command-line declaration (no default and no factory: a required option)."""
    spec = Spec(help, tuple(flags), argument, cli, secret, envvar, min, show_default, callback)
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={_KEY: spec})
    return dataclasses.field(default=default, metadata={_KEY: spec})


def reuse(cls: type, name: str, **changes: Any) -> Any:
    """Field ``name`` of settings class ``cls`` declared again for another settings class: the same default, flags
    and help unless ``changes`` (:func:`option`'s keywords) say otherwise (`polar loop` takes rollout options)."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    declared = spec(field)
    assert declared is not None, f"{cls.__name__}.{name} is no option"
    keywords: dict[str, Any] = {
        k: getattr(declared, k)
        for k in ("help", "flags", "argument", "cli", "secret", "envvar", "min", "show_default", "callback")
    }
    if "default" not in changes and "default_factory" not in changes:
        keywords["default"], keywords["default_factory"] = field.default, field.default_factory
    return option(**(keywords | changes))


def spec(field: Field[Any]) -> Spec | None:
    """The field's command-line declaration; None for a field declared without :func:`option` (library-only)."""
    return field.metadata.get(_KEY)


def cli_fields(cls: type) -> list[Field[Any]]:
    """The fields of settings class ``cls`` that the command line sets, in declaration order."""
    return [f for f in dataclasses.fields(cls) if (s := spec(f)) is not None and s.cli]


def flag(cls: type, name: str) -> str:
    """The long flag (or the metavar of an argument) the command line sets field ``name`` with."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    declared = spec(field)
    if declared is None or declared.argument:
        return name.upper()
    longs = [d.split("/")[0].strip() for d in declared.flags if d.strip().startswith("--")]
    return longs[0] if longs else "--" + name.replace("_", "-")


def parameters(cls: type) -> list[inspect.Parameter]:
    """``cls``'s CLI fields as keyword-only parameters whose defaults are ``typer.Option``/``typer.Argument``."""
    import typer

    hints = get_type_hints(cls)
    out = []
    for field in cli_fields(cls):
        declared = spec(field)
        assert declared is not None
        if field.default is not MISSING:
            default = field.default
        elif field.default_factory is not MISSING:
            default = field.default_factory()
        else:
            default = ...  # required
        extra: dict[str, Any] = {"help": declared.help or None, "show_default": declared.show_default}
        if declared.envvar:
            extra.update(envvar=declared.envvar, show_envvar=True)
        if declared.min is not None:
            extra["min"] = declared.min
        if declared.callback is not None:
            extra["callback"] = declared.callback
        info = (
            typer.Argument(default, **extra) if declared.argument else typer.Option(default, *declared.flags, **extra)
        )
        out.append(
            inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=hints[field.name])
        )
    return out


def command(func: Callable[..., T]) -> Callable[..., T]:
    """A Typer callback from ``func(…, settings: S, …)``: ``S``'s CLI fields replace the ``settings`` parameter (the one
    annotated with a dataclass), the other parameters stay as declared (a ``typer.Context``, command-only flags); a
    :class:`SettingsError` it raises is a usage error on the field's flag."""
    import typer

    hints = get_type_hints(func)
    own = list(inspect.signature(func).parameters.values())
    slot = next(i for i, p in enumerate(own) if dataclasses.is_dataclass(hints.get(p.name)))
    name, cls = own[slot].name, hints[own[slot].name]
    generated = parameters(cls)
    clash = {p.name for p in generated} & {p.name for p in own}
    if clash:
        raise TypeError(f"{func.__name__}: parameters {sorted(clash)} are also fields of {cls.__name__}")
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[:slot] + generated + own[slot + 1 :]]
    field_names = {p.name for p in generated}

    def callback(**kwargs: Any) -> T:
        settings = cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in field_names})
        try:
            return func(**{name: settings}, **kwargs)
        except SettingsError as exc:
            hint = flag(cls, exc.field) if exc.field else None
            raise typer.BadParameter(str(exc), param_hint=hint) from exc

    callback.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    callback.__annotations__ = {p.name: hints.get(p.name, p.annotation) for p in own if p.name != name} | {
        p.name: p.annotation for p in generated
    }
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(callback, attr, getattr(func, attr))
    return callback


def manifest(config: Any) -> dict[str, Any]:
    """``asdict(config)`` as JSON values (paths as strings), every secret field replaced by ``<redacted>`` (None when
    unset): what a run records of how it was started."""
    from polar_cli.rollout.redact import REDACTED

    secret = {f.name for f in dataclasses.fields(config) if (s := spec(f)) is not None and s.secret}
    values = dataclasses.asdict(config)
    return {k: (None if v is None else REDACTED) if k in secret else _json(v) for k, v in values.items()}


def _json(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    return value
