"""A campaign's pin: the code and machine a sweep or map folder was started with, kept in its sweep.json under
`campaign` (docs/DESIGN.md §5, "Campaigns"). A folder is resumed only by the same code (commit, the same
uncommitted changes or none, flt-diag's and torch's versions); other code is refused with one line unless the
command is given --allow-code-change, and then the change is named in `campaign.changes` (the code, the host,
when, the machine). A resume by the same code on a machine of another kind (CPU model or SIMD flags, GPU) is not
refused but named there too. Each run's own config.json names its code and CPU too (`env.code`, `env.cpu`).
Torch-free.
"""
from __future__ import annotations

import socket
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

from flt_diag.storage.code_version import code_version, describe
from flt_diag.storage.file_models import FreeFileModel
from flt_diag.storage.schema import MAX_ITEMS, StorageError, checked
from pydantic import Field, field_validator

CAMPAIGN = "campaign"  # its key in sweep.json
COMPARED = ("commit", "clean", "diff", "flt_diag", "torch")  # what makes two codes the same code
ALLOW = "--allow-code-change"


class Campaign(FreeFileModel):
    """sweep.json's `campaign`: the pinned code and the machine that started the folder, and the code changes a
    resume was allowed and the machine kinds a resume by the same code came to (each {"code", "host", "at",
    "machine"})."""

    code: dict
    machine: Optional[dict] = None
    changes: list[dict] = Field(default_factory=list, max_length=MAX_ITEMS)
    snapshot: Optional[dict] = None  # {"path", "commit"}: the code snapshot its processes run from (--snapshot)

    @field_validator("changes")
    @classmethod
    def _changes(cls, changes: list[dict]) -> list[dict]:
        """Each change as resume_campaign writes it: its code a table, its host and time text, its machine a
        table (a crafted entry is one line, never a traceback where status or a resume reads it)."""
        for i, c in enumerate(changes):
            kinds = dict(code=dict, host=str, at=str, machine=dict)
            if bad := next((k for k, t in kinds.items() if c.get(k) is not None and not isinstance(c[k], t)), None):
                raise ValueError(f"entry {i}: its {bad} is not {'a table' if kinds[bad] is dict else 'text'}")
        return changes


def torch_version() -> str | None:
    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def current_code() -> dict:
    """The code running now: code_version() and torch's version."""
    return {**code_version(), "torch": torch_version()}


def same_code(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in COMPARED)


def describe_code(code: dict | None) -> str:
    """describe(code) and torch's version; "not recorded" where a crafted change names no code table."""
    return describe(code) + (f", torch {code['torch']}" if isinstance(code, dict) and code.get("torch") else "")


def read_campaign(spec: dict, where: Path) -> Campaign | None:
    """The campaign of a sweep.json's content (None: a folder started before campaigns were pinned); a damaged one
    is one BadFile line naming the file."""
    return None if spec.get(CAMPAIGN) is None else checked(f"{where} [{CAMPAIGN}]", Campaign, spec[CAMPAIGN])


def resume_campaign(old: Campaign | None, where: Path, machine: dict, allow_change: bool,
                    snapshot: dict | None = None) -> Campaign:
    """The campaign a folder holds once this process resumes it: the same, where the code is the pinned code;
    pinned now, where it had none; with this code named in `changes` where the code differs and `allow_change`;
    else one StorageError line. `snapshot` (this process runs from a code snapshot: {"path", "commit"}) is
    recorded, where the folder names none yet or another."""
    now = current_code()
    if old is None:
        return Campaign(code=now, machine=machine, changes=[], **({"snapshot": snapshot} if snapshot else {}))
    if snapshot is not None and old.snapshot != snapshot:
        old = old.model_copy(update=dict(snapshot=snapshot))
    if same_code(old.code, now) or any(same_code(c.get("code") or {}, now) for c in old.changes):
        return _with_machine(old, now, machine)
    if not allow_change:
        raise StorageError(f"{where} was started by {describe_code(old.code)}; this is {describe_code(now)}: "
                           f"resuming would mix two codes in one campaign; run the pinned code, or give {ALLOW} "
                           "(the change is then recorded in its sweep.json)")
    return _changed(old, now, machine)


def _changed(old: Campaign, code: dict, machine: dict) -> Campaign:
    """`old` with an entry naming `code` and `machine` (this host, now) appended to its changes."""
    change = dict(code=code, host=socket.gethostname(), at=time.strftime("%Y-%m-%dT%H:%M:%S"), machine=machine)
    return old.model_copy(update=dict(changes=[*old.changes, change]))


def _with_machine(old: Campaign, code: dict, machine: dict) -> Campaign:
    """`old`, with a machine kind it has not seen yet (neither its own nor a change's) named in `changes`: the same
    code on another CPU kind is no code change and is not refused, but its float rounding differs, so the campaign
    says where each part ran (each run's env.cpu says it per run)."""
    if machine == old.machine or any(c.get("machine") == machine for c in old.changes):
        return old
    return _changed(old, code, machine)


CANARIES = "canaries"  # a baseline map's canaries, an entry per start (flt_diag.grids.baseline)
PER_START = (CAMPAIGN, CANARIES)  # what each start of a folder may add to its sweep.json


def without_campaign(spec: dict) -> dict:
    """A sweep.json's content less what each start records (its campaign's code changes, a baseline map's canaries):
    what two copies of one sweep or map (a folder and its archive) share, whatever starts each has seen since."""
    return {k: v for k, v in spec.items() if k not in PER_START}


def code_of(campaign: Campaign | None) -> str | None:
    """The pinned commit (12 hex digits), "unpinned" for a folder without a campaign, None without a commit."""
    if campaign is None:
        return "unpinned"
    commit = campaign.code.get("commit")
    return str(commit)[:12] if commit else None
