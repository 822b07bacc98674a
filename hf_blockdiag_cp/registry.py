"""One registry of named records: attention kernels, mixer kernels, exchanges and layout strategies.

A record is a frozen dataclass with a `name`, and optionally `aliases` (more accepted spellings)
and `auto_priority` (its place in `auto`, lowest first; None: only when named). A `Registry` holds
the records of one setting (`attn_backend`, `mixer_backend`, `kv_exchange`, `layout`): it maps
every spelling (case and '-'/'_' insensitive; "auto" is reserved for the choice) to its record,
orders `auto`, and chooses, saying why each record it passed over cannot run. Availability is the
record's own check (package imports, device, dtype, the set it was verified on), given to `choose`;
on top of it every record can be switched off from the environment: `BDCP_DISABLE_<NAME>=1`
(e.g. `BDCP_DISABLE_FLA=1`) makes `auto` skip every record of that name and a request for it
raise, naming the variable. One error type, `UnavailableError`, says a choice cannot run here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from typing import Any, Callable, Generic, TypeVar

AUTO = "auto"
R = TypeVar("R")
_TRUE = ("1", "true", "yes", "on")


class UnavailableError(ValueError):
    """The configured record (or every one `auto` tries) cannot run here: its package does not import,
    it is switched off, or the device, dtype, shapes or features are not ones it was verified on.
    Fixed by the user (another choice, an install, a dtype), so scripts may report it as one line."""


def spelling_key(spelling: str) -> str:
    """The form spellings are compared in: stripped, lower case, '-' read as '_'."""
    return spelling.strip().lower().replace("-", "_")


def disable_variable(name: str) -> str:
    """The environment variable that switches off every record called `name`: `BDCP_DISABLE_<NAME>`."""
    return "BDCP_DISABLE_" + spelling_key(name).upper()


def disabled_reason(name: str) -> str | None:
    """Why records called `name` are off (their `BDCP_DISABLE_<NAME>` is set true), or None."""
    variable = disable_variable(name)
    value = os.environ.get(variable, "")
    return f"switched off by {variable}={value}" if value.strip().lower() in _TRUE else None


@functools.cache
def optional_import(module: str, attribute: str | None = None) -> tuple[Any, str | None]:
    """(`module` or its `attribute`, None), or (None, why it does not import here): "not installed", or the
    error an installed package raised (kept, so a broken install is told apart from a missing one)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return None, "not installed"
    try:
        value = importlib.import_module(module)
        return (getattr(value, attribute) if attribute else value), None
    except Exception as exc:  # noqa: BLE001 - any failure means unavailable; its text goes into the refusal
        text = str(exc).strip().splitlines()
        return None, f"installed, but importing it raised {type(exc).__name__}" + (f": {text[0]}" if text else "")


class Registry(Generic[R]):
    """The records of one setting. `option`: the setting as users spell it (`attn_backend`); `noun`: one
    record in messages, with its article ("an exchange"; `kind` is the noun without it); `missing`: the
    message for a name with no record (fields option, name, noun, kind, available)."""

    def __init__(self, option: str, noun: str, missing: str = "{option}={name!r} is not {noun}; available: {available}"):
        self.option, self.noun, self.missing = option, noun, missing
        self.kind = noun.split(maxsplit=1)[-1]
        self._records: dict[str, R] = {}
        self._spellings: dict[str, str] = {}

    def register(self, record: R) -> R:
        """Add (or replace, by name) `record`; its name and aliases become accepted spellings. A spelling
        that already names another record (or "auto") is refused."""
        keys = {spelling_key(s) for s in (record.name, *getattr(record, "aliases", ()))}
        for key in sorted(keys):
            owner = "the per-step choice" if key == AUTO else repr(self._spellings.get(key, record.name))
            if owner != repr(record.name):
                raise ValueError(f"{self.kind.split()[-1]} {record.name!r}: the spelling {key!r} already names {owner}")
        self.unregister(record.name)
        self._records[record.name] = record
        self._spellings.update(dict.fromkeys(keys, record.name))
        return record

    def unregister(self, name: str) -> R | None:
        """Remove record `name` and its spellings; return it (None if it was not registered)."""
        record = self._records.pop(name, None)
        for key in [k for k, owner in self._spellings.items() if owner == name]:
            del self._spellings[key]
        return record

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._records)

    def records(self) -> tuple[R, ...]:
        return tuple(self._records.values())

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def get(self, name: str) -> R:
        try:
            return self._records[name]
        except KeyError:
            raise ValueError(self.missing.format(option=self.option, name=name, noun=self.noun, kind=self.kind,
                                                 available=", ".join(self._records))) from None

    def canonical(self, spelling: str) -> str:
        """The record name (or "auto") for any accepted spelling of the setting."""
        accepted = ", ".join((AUTO, *self._records))
        if not isinstance(spelling, str):
            raise TypeError(f"{self.option} must be a string, one of {accepted}; got {type(spelling).__name__}")
        key = spelling_key(spelling)
        name = AUTO if key == AUTO else self._spellings.get(key)
        if name is None:
            raise ValueError(
                f"{self.option}={spelling!r} is not supported; accepted values: {accepted} "
                f"(synonyms: {', '.join(sorted((AUTO, *self._spellings)))}; case and '-'/'_' insensitive)"
            )
        return name

    def auto_order(self, keep: Callable[[R], bool] | None = None) -> list[R]:
        """The records `auto` may take (those with an `auto_priority`, and `keep`), most preferred first."""
        ranked = [r for r in self._records.values()
                  if getattr(r, "auto_priority", None) is not None and (keep is None or keep(r))]
        return sorted(ranked, key=lambda r: r.auto_priority)

    def refusal(self, record: R, check: Callable[[R], str | None]) -> str | None:
        """Why `record` cannot run a call (switched off, or its `check`), or None."""
        return disabled_reason(record.name) or check(record)

    def choose(self, requested: str, check: Callable[[R], str | None], where: str = "here",
               keep: Callable[[R], bool] | None = None, what: str = "") -> R:
        """The record for one call: `requested` if it can run it, or for "auto" the first of `auto_order`
        (those `keep` keeps) that can; raise `UnavailableError` saying why (each refusal, for "auto").
        `what` names the call in a request's refusal ("gated_delta_rule"), `where` in auto's ("on cuda")."""
        if requested != AUTO:
            record = self.get(requested)
            reason = self.refusal(record, check)
            if reason is not None:
                raise UnavailableError(f"{self.option}={requested!r} cannot run {what + ' ' if what else ''}here: {reason}")
            return record
        reasons = []
        for record in self.auto_order(keep):
            reason = self.refusal(record, check)
            if reason is None:
                return record
            reasons.append(f"{record.name}: {reason}")
        raise UnavailableError(f"{self.option}='auto' found no {self.kind} {where}: {'; '.join(reasons)}")

    def refusals(self, check: Callable[[R], str | None]) -> dict[str, str | None]:
        """Every record and why it cannot run a call (None: it can); for logs and docs."""
        return {name: self.refusal(record, check) for name, record in self._records.items()}
