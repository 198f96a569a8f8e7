"""What a run computed on: the device, the torch build, Python, the host and the installed packages.

The same code, params and data can give different numbers on different hardware: the default
pipeline's digits test top-1 is 98.3 % on one 2-core AMD EPYC and 99.4 % on another that has AVX-512.
So every stage run records where it computed as ``env.*`` tags (:func:`describe`), beside the git
commit and the params, and the package list as an artifact (:func:`packages`), so two runs that
disagree can be told apart in MLflow's compare view.
"""
from __future__ import annotations

import hashlib
import os
import platform
import socket
from importlib import metadata
from pathlib import Path

import torch

ARTIFACT = "environment.txt"  # the stage run's artifact holding packages()


def packages() -> str:
    """``name==version`` of every installed distribution, sorted by name, one per line (pip freeze's form)."""
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[name.lower()] = f"{name}=={dist.version}"
    return "".join(found[k] + "\n" for k in sorted(found))


def packages_digest(listing: str) -> str:
    return hashlib.sha256(listing.encode()).hexdigest()[:12]


CGROUP_CPU_LIMITS = (Path("/sys/fs/cgroup/cpu.max"),  # cgroup v2: "<quota> <period>" or "max <period>"
                     Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"))  # v1: the quota (-1: none), cpu.cfs_period_us beside


def cpu_quota() -> float | None:
    """CPUs' worth of time the container's cgroup allows per period, or None where it sets no limit (or
    says nothing). A container can show 16 cores to ``sched_getaffinity`` yet allow 8 CPUs of time:
    loader workers past the quota then slow each other down instead of adding throughput."""
    v2, v1 = CGROUP_CPU_LIMITS
    try:
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
        else:
            quota, period = v1.read_text().strip(), (v1.parent / "cpu.cfs_period_us").read_text().strip()
        return None if quota in ("max", "-1") else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def cpu_name() -> str:
    """The CPU model, the cores this process may use (and the cgroup's CPU quota where it is lower),
    and whether the CPU has AVX-512 (its kernels round differently, which is what moves the digits
    figure above)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first processor's entries
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:  # not Linux: the model from platform, no flags
        pass
    model = info.get("model name") or platform.processor() or platform.machine()
    flags = set(info["flags"].split()) if "flags" in info else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    simd = "" if flags is None else ", AVX-512" if "avx512f" in flags else ", no AVX-512"
    quota = cpu_quota()
    limit = f", a cgroup quota of {quota:g} CPUs" if quota is not None and quota < (cores or 0) else ""
    return f"{model} ({cores} cores{limit}{simd})"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def describe(device: torch.device | None = None, listing: str | None = None) -> dict[str, str]:
    """The ``env.*`` tags of a process computing on ``device`` (default: the CPU); ``listing`` is
    :func:`packages` when the caller has it already (reading it walks every installed distribution)."""
    device = device or torch.device("cpu")
    return {
        "env.device": device_name(device),
        "env.torch": f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        "env.python": platform.python_version(),
        "env.host": socket.gethostname(),
        "env.packages": packages_digest(packages() if listing is None else listing),
    }
