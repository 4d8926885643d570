"""The one guard every record is taken through, flt-diag's Trainer and flt_diag.watch alike (docs/api.md, "No
record stops the training"; docs/guide.md, reliability). A record is a measurement taken inside the user's
forward, backward or training step, and no record may raise there: one that cannot be taken - its function
raised (linalg.eigh on a non-finite stream), or a value it was handed is of the wrong kind, shape, dtype or
range (`Unrecordable`: what head=, targets=, loop_step= returned) - is said once per record name on stderr,
skipped, and named with why in `Records.not_recorded` (a watch run's summary: evidence.not_recorded); the
training and the verdict go on, and the record is tried again where it is next due.

Two ways in, so that a new record cannot forget the guard: every hook the instruments register on a model or
a tensor is wrapped by `Records.hook` (or its calls go through `Records.take`), and every per-step moment of
an `Instrument` (the callbacks that record: diagnostics, loop dynamics, early warning) is wrapped when its
class is made. A `ProbeError` is no record failure but a refusal, raised on purpose (a model the hooks cannot
diagnose, docs/api.md's table): it goes through."""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

from flt_diag.instruments.callbacks import Callback
from flt_diag.records import Unrecordable  # (defined with the records, which raise it too)

F = TypeVar("F", bound=Callable[..., Any])
MOMENTS = ("before_step", "after_backward", "after_clip", "after_step", "on_rows", "on_step_end")  # (per step)


class ProbeError(ValueError):
    """A model the loop hooks cannot diagnose as given (one line, naming what to change); a refusal, which the
    record guard lets through (its kinds: flt_diag.instruments.loop_hooks)."""


class Skipped(Exception):
    """Some metrics of a record could not be taken (`whys`: metric -> why), the record's others were logged: each
    is skipped alone (Records.take)."""

    def __init__(self, whys: dict[str, str]):
        super().__init__("; ".join(f"{m}: {why}" for m, why in whys.items()))
        self.whys = whys


def why_of(error: BaseException) -> str:
    """One line for a record's failure: an Unrecordable's own text, else the error's kind and its first line."""
    first = (str(error).strip().splitlines() or [""])[0][:200]
    return first if isinstance(error, Unrecordable) else f"{type(error).__name__}: {first}".rstrip(": ")


class Records:
    """The guard of one run's records: `take(names, fn, ...)` runs a record, `hook(names, fn)` guards a hook,
    `skip(names, why)` marks records that cannot be taken. `not_recorded`: record name -> why (the first
    time); `step`: the step being recorded (set at each step's start), named in the line."""

    def __init__(self) -> None:
        self.not_recorded: dict[str, str] = {}
        self.step: int | None = None

    def skip(self, names: Sequence[str], why: str) -> None:
        """`names` are not recorded this time: said once per name on stderr, kept with why."""
        new = [n for n in names if n not in self.not_recorded]
        if not new:
            return
        at = f" (first at step {self.step})" if self.step is not None else ""
        print(f"flt_diag: {', '.join(new)} not recorded: {why}{at}; skipped where it cannot be taken, the training "
              "goes on", file=sys.stderr, flush=True)
        self.not_recorded.update(dict.fromkeys(new, why + at))

    def take(self, names: Sequence[str], fn: Callable[..., Any], *args, **kwargs) -> Any:
        """fn(*args, **kwargs), the record(s) `names`; None if it raised (skipped: `skip`). A ProbeError (a
        refusal) and what is no Exception (KeyboardInterrupt) go through."""
        failed: dict[str, list[str]] = {}
        out = self._attempt(names, fn, args, kwargs, failed)
        self._said(failed)
        return out

    def take_all(self, calls: Iterable[tuple[Sequence[str], Callable[..., Any], tuple]]) -> None:
        """Each (names, fn, args) of `calls` taken as `take` takes one, and those that fail alike said in one line
        (the records of one loop end refusing one stream: one line naming them all)."""
        failed: dict[str, list[str]] = {}
        for names, fn, args in calls:
            self._attempt(names, fn, args, {}, failed)
        self._said(failed)

    @staticmethod
    def _attempt(names: Sequence[str], fn: Callable[..., Any], args: tuple, kwargs: dict,
                 failed: dict[str, list[str]]) -> Any:
        """fn(*args, **kwargs), or None with what failed added to `failed` (why -> names)."""
        try:
            return fn(*args, **kwargs)
        except ProbeError:
            raise
        except Skipped as e:  # (the metrics named, each with its why: the others were taken)
            for name, why in e.whys.items():
                failed.setdefault(why, []).append(name)
        except Exception as e:  # (any error of the record itself: the training must not see it)
            failed.setdefault(why_of(e), []).extend(names)
        return None

    def _said(self, failed: dict[str, list[str]]) -> None:
        for why, names in failed.items():
            self.skip(names, why)

    def hook(self, names: Sequence[str], fn: F) -> F:
        """fn guarded, for a register_*hook: returns None where fn raised (the forward's output, the gradient,
        stay as they are)."""
        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            return self.take(names, fn, *args, **kwargs)
        guarded.guarded_by = self  # type: ignore[attr-defined]  # (tests: every hook on a watched model is one)
        return guarded  # type: ignore[return-value]


def names_of(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The record names of a function called inside a forward (its `records`, set by `recording`), else its
    name (a record of the user's own: probe.hooks.listeners)."""
    return getattr(fn, "records", None) or (getattr(fn, "__qualname__", None) or type(fn).__name__,)


def recording(*names: str) -> Callable[[F], F]:
    """Marks a function with the record names it takes (`names_of`)."""
    def mark(fn: F) -> F:
        fn.records = names  # type: ignore[attr-defined]
        return fn
    return mark


def _guarded_moment(moment: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(self: Instrument, *args, **kwargs):
        if moment == "before_step" and len(args) > 1 and isinstance(args[1], int):  # (trainer, step)
            self.records.step = args[1]
        names = self.RECORDS.get(moment) or (f"{type(self).__name__}.{moment}",)
        return self.records.take(names, fn, self, *args, **kwargs)
    guarded.guarded_moment = True  # type: ignore[attr-defined]
    return guarded


class Instrument(Callback):
    """A callback that records: each per-step moment (MOMENTS) a subclass defines is taken through its
    `records` guard, wrapped when the class is made. RECORDS: moment -> the record names it takes (the names
    not_recorded gets when the moment fails as a whole; default "<class>.<moment>")."""

    RECORDS: ClassVar[dict[str, tuple[str, ...]]] = {}

    @functools.cached_property
    def records(self) -> Records:
        """The guard its records are taken through (its own, unless one is shared: a Probe's sets it)."""
        return Records()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for moment in MOMENTS:
            fn = cls.__dict__.get(moment)
            if callable(fn) and not getattr(fn, "guarded_moment", False):
                setattr(cls, moment, _guarded_moment(moment, fn))
