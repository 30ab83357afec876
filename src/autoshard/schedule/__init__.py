"""Pipeline schedules as data (docs/parallelism/pipeline.md): per pipeline rank an ordered
list of actions, the named schedules, the validator and the simulator that times them."""

from autoshard.schedule.actions import (
    COMPUTE,
    KINDS,
    Action,
    Schedule,
    ScheduleError,
    looped,
    parse_action,
    v_shape,
    with_communication,
)
from autoshard.schedule.named import SCHEDULES, list_schedule, make_schedule
from autoshard.schedule.simulate import Timed, Timeline, simulate, unit_cost, validate

__all__ = [
    "COMPUTE",
    "KINDS",
    "SCHEDULES",
    "Action",
    "Schedule",
    "ScheduleError",
    "Timed",
    "Timeline",
    "list_schedule",
    "looped",
    "make_schedule",
    "parse_action",
    "simulate",
    "unit_cost",
    "v_shape",
    "validate",
    "with_communication",
]
