"""Admission groups (backend/admission.py): a client request's engine requests pass the queue bound as one."""

from __future__ import annotations

from backend import admission
from backend.admission import AdmissionGroups
from protocol import AdmissionGroup


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_later_members_join_until_all_came():
    groups = AdmissionGroups(Clock())
    group = AdmissionGroup("req-1", 3)
    assert not groups.joins_admitted(group)  # the first is judged by the bound
    groups.admitted(group)
    assert groups.joins_admitted(group)
    groups.admitted(group)
    assert groups.joins_admitted(group)
    groups.admitted(group)  # all three came: forgotten
    assert not groups.joins_admitted(group) and len(groups) == 0


def test_no_group_and_groups_of_one_hold_nothing():
    groups = AdmissionGroups(Clock())
    groups.admitted(None)
    groups.admitted(AdmissionGroup("single", 1))
    assert not groups.joins_admitted(None) and not groups.joins_admitted(AdmissionGroup("single", 1))
    assert len(groups) == 0


def test_members_that_never_come_are_forgotten():
    clock = Clock()
    groups = AdmissionGroups(clock)
    groups.admitted(AdmissionGroup("gone", 5))
    clock.now += admission.GROUP_TTL_S + 1
    assert not groups.joins_admitted(AdmissionGroup("gone", 5))  # expired: judged by the bound again
    groups.admitted(AdmissionGroup("gone", 5))  # a fresh start counts from the full size
    for _ in range(3):
        groups.admitted(AdmissionGroup("gone", 5))
    assert groups.joins_admitted(AdmissionGroup("gone", 5))
    for i in range(admission._SWEEP_AT):  # many open groups: the expired ones are swept
        groups.admitted(AdmissionGroup(f"g{i}", 2))
    clock.now += admission.GROUP_TTL_S + 1
    groups.admitted(AdmissionGroup("last", 2))
    assert len(groups) == 1


def test_a_refused_group_refuses_its_other_members_until_all_came():
    from protocol import EngineOverloaded

    groups = AdmissionGroups(Clock())
    group = AdmissionGroup("req-2", 3)
    error = EngineOverloaded("full", code="overloaded")
    assert groups.refusal(group) is None
    groups.refused(group, error)
    assert groups.refusal(group) is error and not groups.joins_admitted(group)
    groups.refused(group, groups.refusal(group))
    assert groups.refusal(group) is error
    groups.refused(group, error)  # all three came: forgotten
    assert groups.refusal(group) is None and len(groups) == 0
