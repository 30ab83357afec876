"""Pipeline schedules as data (docs/parallelism/pipeline.md): per pipeline rank an ordered
list of actions, the named schedules, the validator and the simulator that times them."""

from autoshard.schedule.actions import (
    COMM,
    COMPUTE,
    KINDS,
    Action,
    Schedule,
    ScheduleError,
    forward_only,
    looped,
    p2p_groups,
    parse_action,
    v_shape,
    with_communication,
)
from autoshard.schedule.named import SCHEDULES, list_schedule, make_schedule
from autoshard.schedule.p2p import check_p2p_order
from autoshard.schedule.simulate import Timed, Timeline, simulate, unit_cost, validate

__all__ = [
    "COMM",
    "COMPUTE",
    "KINDS",
    "SCHEDULES",
    "Action",
    "Schedule",
    "ScheduleError",
    "Timed",
    "Timeline",
    "check_p2p_order",
    "forward_only",
    "list_schedule",
    "looped",
    "make_schedule",
    "p2p_groups",
    "parse_action",
    "simulate",
    "unit_cost",
    "v_shape",
    "validate",
    "with_communication",
]
