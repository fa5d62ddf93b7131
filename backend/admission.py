"""Admission groups: the engine requests of one client request (a batch of prompts) are admitted as one.

The engine refuses a request when its queue is full (`max_waiting_seqs`). A client request with many
prompts arrives as one engine request per prompt; judged one by one, a batch would be cut part way,
or, waved through after its first member, would overrun the bound and starve other clients. So the
bound judges a group's first member for the whole group (all its sequences must fit); once it is
admitted, the later members join without the check, and once it is refused, the later members are
refused with the same error without being judged again (a batch is one unit of work).

Members that never come (their client went away mid-batch, or a server pool sent them elsewhere) are
forgotten GROUP_TTL_S after the group's last arrival.
"""

from __future__ import annotations

import time

from protocol import AdmissionGroup, InvalidRequestError

GROUP_TTL_S = 60.0
# Expired groups are looked for once this many are open (a few at a time is the usual case).
_SWEEP_AT = 64


class AdmissionGroups:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        # key -> (members still to come, forgotten after, the refusal of a refused group or None)
        self._open: dict[str, tuple[int, float, InvalidRequestError | None]] = {}

    def joins_admitted(self, group: AdmissionGroup | None) -> bool:
        """Whether `group` had a member admitted already (and so this one skips the queue bound)."""
        entry = self._entry(group)
        return entry is not None and entry[2] is None

    def refusal(self, group: AdmissionGroup | None) -> InvalidRequestError | None:
        """The error `group`'s first member was refused with, if it was: this member gets it too."""
        entry = self._entry(group)
        return None if entry is None else entry[2]

    def admitted(self, group: AdmissionGroup | None) -> None:
        """Counts one of `group`'s members in."""
        self._arrived(group, None)

    def refused(self, group: AdmissionGroup | None, error: InvalidRequestError) -> None:
        """Counts one of `group`'s members out; the members still to come are refused with `error`."""
        error.__traceback__ = None  # (kept for the group's other members, without this call's frames)
        self._arrived(group, error)

    def _arrived(self, group: AdmissionGroup | None, error: InvalidRequestError | None) -> None:
        if group is None or group.size <= 1:
            return
        now = self._clock()
        entry = self._entry(group)
        to_come, error = (group.size, error) if entry is None else (entry[0], entry[2])
        if to_come - 1 <= 0:
            self._open.pop(group.key, None)
        else:
            self._open[group.key] = (to_come - 1, now + GROUP_TTL_S, error)
        if len(self._open) >= _SWEEP_AT:
            self._open = {k: v for k, v in self._open.items() if v[1] > now}

    def _entry(self, group: AdmissionGroup | None) -> tuple[int, float, InvalidRequestError | None] | None:
        """The group's open, unexpired entry, if it has one."""
        if group is None:
            return None
        entry = self._open.get(group.key)
        return entry if entry is not None and entry[1] > self._clock() else None

    def __len__(self) -> int:
        return len(self._open)
