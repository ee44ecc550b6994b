"""The staleness policy on fixed schedules: exactly which groups are used, requeued, dropped;
and the loss share of a streamed group against the formula."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.cookbook.rl_overlap import GroupLedger, group_datums
from treadle.cookbook.rl_types import Trajectory, Transition
from treadle.errors import InvalidRequestError

# (group, policy version it was sampled with, trainer step that receives it)
SCHEDULE = [
    ("a", 0, 0),  # fresh
    ("b", 0, 1),  # one step old
    ("c", 0, 2),  # two steps old
    ("d", 1, 2),  # one step old
    ("e", 0, 3),  # three steps old
    ("c", 2, 2),  # c again, sampled by the step-2 policy
    ("f", 3, 3),
]


def _run(ledger: GroupLedger) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"use": [], "requeue": [], "drop": []}
    for name, version, step in SCHEDULE:
        out[ledger.decide(version, step)].append(name)
    return out


def test_k1_requeue():
    assert _run(GroupLedger(1, "requeue")) == {
        "use": ["a", "b", "d", "c", "f"],
        "requeue": ["c", "e"],
        "drop": [],
    }


def test_k1_drop():
    assert _run(GroupLedger(1, "drop")) == {
        "use": ["a", "b", "d", "c", "f"],
        "requeue": [],
        "drop": ["c", "e"],
    }


def test_k0_is_on_policy_only():
    assert _run(GroupLedger(0, "drop"))["use"] == ["a", "c", "f"]


def test_k2_keeps_two_step_old_groups():
    result = _run(GroupLedger(2, "requeue"))
    assert result["use"] == ["a", "b", "c", "d", "c", "f"] and result["requeue"] == ["e"]


def test_step_metrics_histogram_and_reset():
    ledger = GroupLedger(2, "requeue")
    for version, step in [(3, 3), (2, 3), (2, 3), (1, 3), (0, 3)]:
        ledger.decide(version, step)
    m = ledger.step_metrics()
    assert (m["train/staleness_0"], m["train/staleness_1"], m["train/staleness_2"]) == (1, 2, 1)
    assert (m["train/groups_used"], m["train/groups_requeued"]) == (4, 1)
    assert m["train/staleness_mean"] == pytest.approx((0 + 1 + 1 + 2) / 4)
    assert ledger.step_metrics()["train/groups_used"] == 0


def test_bad_settings_are_named():
    with pytest.raises(InvalidRequestError, match="stale_policy"):
        GroupLedger(1, "keep")
    with pytest.raises(InvalidRequestError, match="max_steps_off_policy"):
        GroupLedger(-1)


def test_group_datums_share_of_the_step_loss():
    def traj(reward: float, n: int) -> Trajectory:
        return Trajectory([Transition([1, 2], [3] * n, [-0.5] * n, reward, {})])

    group = [traj(1.0, 2), traj(0.0, 3)]
    datums = group_datums(group, groups_per_step=4, normalize_std=False, remove_constant=True)
    # advantages +0.5 / -0.5 (mean 0.5); 5 action tokens in the group; 4 groups per step
    scale = 1.0 / (5 * 4)
    np.testing.assert_allclose(
        datums[0].loss_fn_inputs["advantages"].tolist(), [0, 0.5 * scale, 0.5 * scale]
    )
    np.testing.assert_allclose(
        datums[1].loss_fn_inputs["advantages"].tolist()[-3:], [-0.5 * scale] * 3
    )
    assert group_datums([traj(1.0, 2), traj(1.0, 2)], 4, True, remove_constant=True) == []
