"""What happens when a K/V collective fails (invariant I5, docs/design.md).

A collective that raises marks its group failed on this rank (NCCL: its communicator is
aborted) and re-raises with a note (`guarded`). A failed group refuses later steps at once
(`check_group_usable`) instead of entering collectives its peers will never match.

How the *peers* of a failing rank get out: the failing rank's exception ends its process,
which closes its gloo sockets (peers raise "Connection closed by peer" in their pending
collective) or, under NCCL, makes torchrun stop the other workers; independently, every
pending collective ends with an error after the process group's `timeout` (NCCL's watchdog
with TORCH_NCCL_ASYNC_ERROR_HANDLING, gloo's per-operation timeout).

The registry is process-wide on purpose: a group stays broken across steps, whichever step
object or thread notices it.
"""

from __future__ import annotations

import torch.distributed as dist

_FAILED_GROUPS: dict[str, str] = {}


def _group_key(group) -> str | None:
    if group is None:
        return None
    return getattr(group, "group_name", None) or str(id(group))


def fail_group(group, reason: str) -> None:
    """Mark `group` unusable on this rank after a failure inside a CP step (NCCL: abort its communicator)."""
    key = _group_key(group)
    if key is None or key in _FAILED_GROUPS:
        return
    _FAILED_GROUPS[key] = reason
    try:
        if "nccl" in str(dist.get_backend(group)).lower():
            group.abort()  # in-flight and later NCCL work on this rank fails instead of hanging at exit
    except Exception:  # noqa: BLE001 - best effort: the original error is what the user must see
        pass


def check_group_usable(group) -> None:
    """Raise if an earlier step failed on `group` (its ranks are no longer in lock step)."""
    key = _group_key(group)
    if key is not None and key in _FAILED_GROUPS:
        raise RuntimeError(
            f"blockdiag_cp: the CP process group {key!r} failed in an earlier step ({_FAILED_GROUPS[key]}); its ranks "
            "are no longer in lock step. Restart the job (or destroy and re-create the process group)"
        )


def guarded(what: str, group, fn, *args):
    """Run the collective `fn(*args)` and return its result; on failure mark `group` failed and
    re-raise with a note."""
    try:
        return fn(*args)
    except Exception as exc:
        fail_group(group, f"{what} failed")
        if hasattr(exc, "add_note"):
            exc.add_note(
                f"blockdiag_cp: the CP group's {what} failed; a peer rank of the CP group has probably raised or exited "
                "(see the other ranks' errors)"
            )
        raise
