"""The configuration a benchmark row ran in, read back from the allocator (not what the table meant to set): the
compression of the weights' backups, retained backups, the host budget, the tier and the wake's verification. A row
in the default configuration (compression as the environment has it, retained backups on, no budget, host tier,
wakes verified) says so; a row that changed any of them names what it changed.
"""

from __future__ import annotations

from typing import Any

from ..workload import WEIGHTS_TAG
from .common import fmt_bytes

#: What a user gets with nothing set: the label of the default configuration.
DEFAULT = "default"


def settings(alloc: Any, tag: str = WEIGHTS_TAG) -> dict[str, str]:
    """{"compress", "retain", "budget", "tier"} of `alloc` for backups of `tag`, each as a short word."""
    policy = alloc.tag_policy(tag)
    codec = alloc.stats()["codec"]
    mode = policy.get("compress", "auto")
    if mode == "off":
        compress = "off"
    elif codec is None:
        compress = "none (no codec)"
    else:
        compress = mode
    budget = alloc.host_budget
    tier = policy.get("backup_tier", "auto")
    if tier == "auto":
        # "auto" is the host tier until a budget sends backups to files.
        tier = "host" if budget is None or alloc.spill_dir is None else "host+file"
    # retains_backups(): the policy, host memory kept, and the fingerprint kernel loaded (what the row really got).
    return dict(compress=compress, retain="on" if alloc.retains_backups() else "off",
                budget="none" if budget is None else fmt_bytes(budget), tier=tier,
                verify="on" if alloc.verifies_wakes() else "off")


def is_default(s: dict[str, str]) -> bool:
    return s["compress"] in ("auto", "none (no codec)") and s["retain"] == "on" and s["budget"] == "none" \
        and s["tier"] == "host" and s["verify"] == "on"


def label(s: dict[str, str]) -> str:
    """"default (compress auto, retain on, no budget, host tier)" or the same words without "default" (and
    ", verify off" where wakes do not verify)."""
    words = f"compress {s['compress']}, retain {s['retain']}, budget {s['budget']}, {s['tier']} tier"
    if s["verify"] != "on":
        words += ", verify off"
    return f"{DEFAULT}: {words}" if is_default(s) else words


def describe(alloc: Any, tag: str = WEIGHTS_TAG) -> str:
    """`label(settings(alloc, tag))`."""
    return label(settings(alloc, tag))


def short(alloc: Any, tag: str = WEIGHTS_TAG) -> str:
    """A row's configuration column: "default", or only what differs from it ("retain off", "compress off,
    budget 4.00 GiB, host+file tier", ...)."""
    s = settings(alloc, tag)
    diffs = []
    if s["compress"] != "auto":
        diffs.append(f"compress {s['compress']}")
    if s["retain"] != "on":
        diffs.append("retain off")
    if s["budget"] != "none":
        diffs.append(f"budget {s['budget']}")
    if s["tier"] != "host":
        diffs.append(f"{s['tier']} tier")
    if s["verify"] != "on":
        diffs.append("verify off")
    return ", ".join(diffs) if diffs else DEFAULT
