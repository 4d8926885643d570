"""A sweep's or map's folder as a campaign (docs/DESIGN.md §5, "Campaigns"): made or resumed with its spec and
its pinned code (flt_diag.storage.campaign), and, with --archive-to, archived as it goes: each run's record
written once, when it finishes, by the archiver the command hands in (flt_diag.results.run_archiver; this layer
only calls it), and resumed from that archive on a fresh machine.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

from flt_diag.storage.archive import records_in
from flt_diag.storage.code_snapshot import running_snapshot
from flt_diag.storage.campaign import CAMPAIGN, read_campaign, resume_campaign
from flt_diag.storage.errors import first_line
from flt_diag.storage.folders import (CELLS, SWEEP_SPEC, StorageError, check_cells, has_content, load_spec,
                                      load_summary, make_folder, read_json, refuse_links, write_json)
from flt_diag.storage.machine import machine_kind
from flt_diag.storage.pooling import without_grid_fields


class Archiver(Protocol):
    """What a folder's runs are archived by as they finish (flt_diag.results.run_archiver.FolderArchive)."""

    def spec(self, out: Path) -> dict | None:
        """The archived folder's sweep.json, where the archive holds one."""

    def start(self, out: Path) -> None:
        """Before the work: the folder's sweep.json into the archive, the archive's records into the folder,
        its finished runs not archived yet archived."""

    def finished(self, out: Path, name: str) -> None:
        """Archive run `name` of the folder, just finished."""


@dataclass(frozen=True)
class CampaignOptions:
    """How a grid command treats its folder: `allow_code_change` (resume under other code, recorded), `archive`
    (archive each run as it finishes; resume from what it holds)."""

    allow_code_change: bool = False
    archive: Optional[Archiver] = None


def this_machine(device: str) -> dict:
    """machine_kind() with the GPU's name where the runs train on a GPU."""
    gpu = None
    if device != "cpu":
        import torch  # (as in run_cell: only when a folder is prepared)
        if (device == "auto" or device.startswith("cuda")) and torch.cuda.is_available():
            with contextlib.suppress(RuntimeError, AssertionError):
                gpu = torch.cuda.get_device_name(0 if device in ("auto", "cuda") else device)
    return machine_kind(gpu)


def refuse_archived(out: Path) -> None:
    """An archived sweep or map (sweep.json and records, no cells/) as --out: one line, never cells written into
    it (after which it is no archive)."""
    if (out / SWEEP_SPEC).is_file() and not (out / CELLS).exists() and records_in(out):
        raise StorageError(f"{out} is an archived sweep or map; runs are not written into an archive: resume it into "
                           f"a work folder of the same name with --out <folder>/{out.name} --archive-to {out.parent}")


def prepare_spec_folder(out: Path, new: dict, what: str, grid_fields: dict, device: str = "cpu",
                        options: CampaignOptions = CampaignOptions()) -> None:
    """Create a sweep or map folder holding spec `new` (sweep.json) and its campaign, or check that an existing one
    (or the archive it resumes from) holds the same spec and was started by the same code (`what` names it in the
    messages; the bases are compared without the `grid_fields` that every cell sets)."""
    out = Path(out)
    refuse_archived(out)
    here = (out / SWEEP_SPEC).exists()
    old = load_spec(out).as_written() if here else options.archive.spec(out) if options.archive else None
    if here:  # (a damaged spec is one line, never compared field by field)
        refuse_links(out / CELLS, out)  # a linked cells/ would train every cell elsewhere
        check_cells(out)  # a file there would fail every cell in turn: one line instead
    elif has_content(out):
        raise StorageError(f"{out} exists, is not empty and is not a {what} folder; use another --out")
    if old is not None:
        _same_spec(out, old, new, grid_fields)
    campaign = resume_campaign(read_campaign(old or {}, out / SWEEP_SPEC), out, this_machine(device),
                               options.allow_code_change, running_snapshot(out)).as_written()
    if not here:
        try:
            make_folder(out / CELLS, out)
        except OSError as e:
            raise StorageError(f"cannot create {what} folder {out}: {e.strerror}") from None
        if not os.access(out, os.W_OK):
            raise StorageError(f"cannot write to {out}")
    if not here or (old or {}).get(CAMPAIGN) != campaign:
        write_json(out / SWEEP_SPEC, {**(old if old is not None else new), CAMPAIGN: campaign})
    if options.archive is not None:
        options.archive.start(out)


def _same_spec(out: Path, old: dict, new: dict, grid_fields: dict) -> None:
    def differs(k):
        return without_grid_fields(old.get(k), grid_fields) != without_grid_fields(new[k], grid_fields) if k == "base" \
            else old.get(k) != new[k]
    keys = [k for k in new if differs(k)]
    if keys:
        raise StorageError(f"{out} holds a {'map' if old.get('kind') == 'map' else 'sweep'} with a different "
                           f"spec (differs in: {', '.join(keys)}); use another --out, or the original options")


@dataclass(frozen=True)
class Archiving:
    """A cell runner (run_cell's signature) that archives each run it finishes (picklable: spawned workers get
    it). A record that cannot be written leaves the run finished, says why, and is written when the folder is
    next started."""

    runner: Callable
    archive: Archiver

    def __call__(self, cfg, cell, out, *args, **kwargs) -> str:
        result = self.runner(cfg, cell, out, *args, **kwargs)
        if load_summary(Path(out) / CELLS / cell.name) is not None:
            try:
                self.archive.finished(Path(out), cell.name)
            except (OSError, StorageError) as e:
                return f"{result}; not archived ({first_line(e)}): it is archived when the folder is next run"
        return result


def archiving(runner: Callable, options: CampaignOptions) -> Callable:
    return runner if options.archive is None else Archiving(runner, options.archive)
