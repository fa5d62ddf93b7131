"""Admission groups: the engine requests of one client request (a batch of prompts) are admitted as one.

The engine refuses a request when its queue is full (`max_waiting_seqs`). A client request with many
prompts arrives as one engine request per prompt; judged one by one, a batch larger than the queue
would be cut part way, on an idle server too, and told to retry a request that could never fit. So
the queue bound judges a group's first member only: once it is admitted, the group's later members
join without the check (a batch is one unit of work, as vLLM queues it whole).

Members that never come (their client went away mid-batch, or a server pool sent them elsewhere) are
forgotten GROUP_TTL_S after the group's last admission.
"""

from __future__ import annotations

import time

from protocol import AdmissionGroup

GROUP_TTL_S = 60.0
# Expired groups are looked for once this many are open (a few at a time is the usual case).
_SWEEP_AT = 64


class AdmissionGroups:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._open: dict[str, tuple[int, float]] = {}  # key -> (members still to come, forgotten after)

    def joins_admitted(self, group: AdmissionGroup | None) -> bool:
        """Whether `group` had a member admitted already (and so this one skips the queue bound)."""
        return group is not None and self._still_to_come(group.key, self._clock()) is not None

    def admitted(self, group: AdmissionGroup | None) -> None:
        """Counts one of `group`'s members in."""
        if group is None or group.size <= 1:
            return
        now = self._clock()
        to_come = self._still_to_come(group.key, now)
        left = (group.size if to_come is None else to_come) - 1
        if left <= 0:
            self._open.pop(group.key, None)
        else:
            self._open[group.key] = (left, now + GROUP_TTL_S)
        if len(self._open) >= _SWEEP_AT:
            self._open = {k: v for k, v in self._open.items() if v[1] > now}

    def _still_to_come(self, key: str, now: float) -> int | None:
        """How many of the group's members have not come yet (None: no open, unexpired group)."""
        entry = self._open.get(key)
        return entry[0] if entry is not None and entry[1] > now else None

    def __len__(self) -> int:
        return len(self._open)
