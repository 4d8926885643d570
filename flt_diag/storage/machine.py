"""Which machine made a record: the CPU's model and its SIMD flags, read from /proc/cpuinfo (Linux; elsewhere
the platform's processor name and no flags). The same code and seed give other numbers on another CPU kind (the
kernels torch picks follow the SIMD units), so every run's `env.cpu` and a campaign's spec name it
(docs/DESIGN.md §5, "Campaigns"). Torch-free: the GPU's name is added by the layers that have torch.
"""
from __future__ import annotations

import functools
import platform
import re
from pathlib import Path

from flt_diag.storage.errors import StorageError
from flt_diag.storage.safe_files import read_bounded

CPUINFO = Path("/proc/cpuinfo")
MAX_CPUINFO_BYTES = 8 << 20  # thousands of cores' worth; never more is read
# The instruction-set extensions that choose torch's CPU kernels (x86: sse.. avx512.., fma, f16c, amx..; Arm: neon,
# asimd.., sve..): the rest of the flags (power management, virtualisation, bugs) say nothing of the numbers.
SIMD = re.compile(r"^(sse\w*|ssse3|avx\w*|fma\w*|f16c|amx\w*|neon|asimd\w*|sve\w*|sme(?!p)\w*|vsx|altivec)$")


def parse_cpuinfo(text: str) -> dict:
    """{"model": the first processor's model name, "simd": its SIMD flags, sorted} from /proc/cpuinfo's text
    (x86 names them "model name" and "flags", Arm "CPU part"/"Hardware" and "Features")."""
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    model = next((fields[k] for k in ("model name", "hardware", "cpu model", "cpu") if fields.get(k)), None)
    flags = (fields.get("flags") or fields.get("features") or "").split()
    return {"model": model or platform.processor() or platform.machine() or None,
            "simd": sorted({f for f in flags if SIMD.match(f)})}


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """This machine's CPU: {"model": name or None, "simd": [flags]} (no /proc/cpuinfo: the platform's name)."""
    try:
        text = read_bounded(CPUINFO, MAX_CPUINFO_BYTES, "cpuinfo").decode(errors="replace")
    except (OSError, StorageError):
        text = ""
    return parse_cpuinfo(text)


def machine_kind(gpu: str | None = None) -> dict:
    """What a campaign's spec records of the machine that started it: architecture, CPU model and SIMD flags,
    and the GPU's name where it trains on one."""
    return {"arch": platform.machine() or None, **cpu_info(), **({"gpu": gpu} if gpu else {})}


def describe_machine(kind: dict | None) -> str:
    """One line: "Intel(R) Xeon(R) ... (avx512f), GPU NVIDIA H100" (the CPU, its widest SIMD unit, the GPU)."""
    if not isinstance(kind, dict):
        return "not recorded"
    raw = kind.get("simd")
    simd: list | tuple = raw if isinstance(raw, (list, tuple)) else []  # (a crafted one: no unit named)
    widest = next((f for f in WIDEST if f in simd), None)
    return (f"{kind.get('model') or 'unknown CPU'}" + (f" ({widest})" if widest else "")
            + (f", GPU {kind['gpu']}" if kind.get("gpu") else ""))


WIDEST = ("amx_tile", "avx512f", "avx2", "avx", "sse4_2", "sve2", "sve", "asimd", "neon")  # the widest unit, first
