"""Pipeline schedules as data: every named schedule is valid (each action once, on its stage's
rank, dependencies in order, sends and receives paired in the same order on every pair of
ranks, no deadlock, and none under NCCL's in-order point-to-point groups either), has the
bubble and the memory its paper gives at nominal costs, and the validator names what is wrong
with a broken one."""

from __future__ import annotations

import pytest

from autoshard.schedule import (
    Action,
    Schedule,
    ScheduleError,
    check_p2p_order,
    forward_only,
    make_schedule,
    p2p_groups,
    parse_action,
    simulate,
    unit_cost,
    validate,
    with_communication,
)

CASES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 12)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zbv"])
@pytest.mark.parametrize(("p", "m"), CASES)
def test_every_named_schedule_is_valid(name: str, p: int, m: int) -> None:
    schedule = make_schedule(name, p, m)
    timeline = validate(schedule)
    assert timeline.step > 0
    assert Schedule.from_json(schedule.to_json()) == schedule


@pytest.mark.parametrize(("p", "v"), [(2, 2), (2, 3), (4, 2), (4, 4), (8, 2)])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_interleaved_is_valid_and_its_bubble_is_1f1bs_over_v(p: int, v: int, k: int) -> None:
    m = k * p
    schedule = make_schedule("interleaved-1f1b", p, m, virtual=v)
    validate(schedule)
    # each of a rank's v stages is 1/v of its work
    interleaved = simulate(schedule, lambda a: unit_cost(a) / v)
    one_f_one_b = validate(make_schedule("1f1b", p, m))
    # Narayanan et al. 2021: the bubble time is divided by v (each stage 1/v of the work)
    bubble_time = interleaved.step - 3 * m
    assert bubble_time == pytest.approx((one_f_one_b.step - 3 * m) / v)
    assert interleaved.bubble < one_f_one_b.bubble
    assert interleaved.schedule.placement == tuple(s % p for s in range(p * v))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), CASES)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(
    name: str, p: int, m: int
) -> None:
    timeline = validate(make_schedule(name, p, m))
    assert timeline.bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8), (4, 12), (8, 16)])
def test_1f1b_holds_p_minus_r_micro_batches_where_gpipe_holds_m(p: int, m: int) -> None:
    gpipe = validate(make_schedule("gpipe", p, m))
    one_f_one_b = validate(make_schedule("1f1b", p, m))
    assert gpipe.in_flight == (m,) * p
    assert one_f_one_b.in_flight == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12), (8, 16), (8, 24)])
def test_zero_bubble_schedules_beat_1f1b_at_its_memory(p: int, m: int) -> None:
    one_f_one_b = validate(make_schedule("1f1b", p, m))
    h1 = validate(make_schedule("zb-h1", p, m))
    zbv = validate(make_schedule("zbv", p, m))
    assert h1.bubble < one_f_one_b.bubble
    assert zbv.bubble < h1.bubble
    # ZB-H1 keeps 1F1B's peak (the first rank's p): past the first rank one more micro-batch
    # waits for its weight half; ZB-V holds p micro-batches of two half-size stages a rank
    assert h1.in_flight[0] == one_f_one_b.in_flight[0] == p
    assert all(h <= f + 1 for h, f in zip(h1.in_flight, one_f_one_b.in_flight, strict=True))
    assert max(h1.in_flight) == max(one_f_one_b.in_flight)
    per_rank = [sum(zbv.in_flight[s] for s in zbv.schedule.stages_of(r)) for r in range(p)]
    assert max(per_rank) <= 2 * p + 1


def test_transfer_time_delays_the_stage_after() -> None:
    one = make_schedule("1f1b", 2, 1)  # F0, hop, F1 B1, hop, B0
    assert simulate(one, unit_cost, transfer=lambda send: 0.5).step == pytest.approx(7.0)
    schedule = make_schedule("1f1b", 2, 4)
    at_once = simulate(schedule, unit_cost)
    slow = simulate(schedule, unit_cost, transfer=lambda send: 0.5)
    # in the steady state each round trip between the ranks is on the critical path
    assert at_once.step + 2 * 0.5 < slow.step <= at_once.step + 4 * 2 * 0.5
    bytes_ = simulate(schedule, unit_cost, activation_bytes=lambda s: 10.0)
    assert bytes_.peak_activation_bytes == (20.0, 10.0)


def test_a_schedule_priced_again_with_the_same_costs_gets_its_timeline() -> None:
    schedule = make_schedule("zb-h1", 4, 8)
    first = simulate(schedule, unit_cost, transfer=lambda send: 0.25)
    again = simulate(schedule, lambda a: unit_cost(a), transfer=lambda send: 0.25)
    assert again is first  # kept with the schedule: the same costs are not replayed
    fresh = simulate(make_schedule("zb-h1", 4, 8), unit_cost, transfer=lambda send: 0.25)
    assert (first.step, first.bubble, first.in_flight) == (
        fresh.step,
        fresh.bubble,
        fresh.in_flight,
    )
    slower = simulate(schedule, lambda a: 2 * unit_cost(a), transfer=lambda send: 0.25)
    assert slower.step == pytest.approx(2 * first.step, rel=0.1) and slower.step > first.step


def test_every_action_has_its_place_on_the_timeline() -> None:
    # a send or a receive takes no time: it starts and ends on its rank's clock
    one = simulate(make_schedule("1f1b", 2, 1), unit_cost, transfer=lambda send: 0.5)
    assert [[(str(e.action), e.start, e.end) for e in rank] for rank in one.events] == [
        [("F0.0", 0, 1), ("SEND_F0.0>1", 1, 1), ("RECV_B0.0<1", 1, 1), ("B0.0", 5, 7),
         ("REDUCE_GRAD0", 7, 7)],
        [("RECV_F1.0<0", 0, 0), ("F1.0", 1.5, 2.5), ("B1.0", 2.5, 4.5), ("SEND_B1.0>0", 4.5, 4.5),
         ("REDUCE_GRAD1", 4.5, 4.5)],
    ]  # fmt: skip
    for name, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 1)):
        schedule = make_schedule(name, 4, 8, v)
        timeline = simulate(schedule, unit_cost, transfer=lambda send: 0.25)
        for rank, events in enumerate(timeline.events):
            assert tuple(e.action for e in events) == schedule.actions[rank]
            clock = 0.0
            for e in events:
                assert e.start >= clock and e.end == e.start + unit_cost(e.action)
                assert e.action.is_compute or e.start == clock  # posted on the rank's clock
                clock = e.end
        assert timeline.step == max(e.end for rank in timeline.events for e in rank)
        assert timeline.compute_time(0) == sum(unit_cost(a) for a in schedule.actions[0])


def test_actions_read_back_from_their_text() -> None:
    for text in ("F3.1", "SEND_F3.1>4", "RECV_B2.0<3", "REDUCE_GRAD2", "W0.11"):
        assert str(parse_action(text)) == text
    with pytest.raises(ScheduleError, match="cannot read"):
        parse_action("X1.2")


def _two_ranks(rank0: list[str], rank1: list[str], name: str = "broken") -> Schedule:
    return Schedule(
        name, 2, (0, 1), (tuple(map(parse_action, rank0)), tuple(map(parse_action, rank1)))
    )


def test_the_validator_names_a_missing_action() -> None:
    compute = [
        [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0)],
        [Action("F", 1, 0), Action("B", 1, 0), Action("F", 1, 1), Action("B", 1, 1)],
    ]
    with pytest.raises(ScheduleError, match="B0.1 is missing"):
        validate(with_communication("broken", 2, (0, 1), compute, False))


def test_the_validator_names_sends_out_of_order() -> None:
    rank0 = [
        "F0.0",
        "SEND_F0.0>1",
        "F0.1",
        "SEND_F0.1>1",
        "RECV_B0.0<1",
        "B0.0",
        "RECV_B0.1<1",
        "B0.1",
        "REDUCE_GRAD0",
    ]
    rank1 = [
        "RECV_F1.1<0",
        "RECV_F1.0<0",
        "F1.0",
        "B1.0",
        "SEND_B1.0>0",
        "F1.1",
        "B1.1",
        "SEND_B1.1>0",
        "REDUCE_GRAD1",
    ]
    with pytest.raises(ScheduleError, match="rank 0 sends to rank 1 in the order"):
        validate(_two_ranks(rank0, rank1))


def test_the_validator_names_a_deadlock() -> None:
    # rank 0 waits for micro-batch 0's gradient before sending micro-batch 1, which rank 1
    # needs before it runs micro-batch 0's backward
    compute = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
        [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)],
    ]
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 at B0.0; rank 1 at F1.1"):
        validate(with_communication("broken", 2, (0, 1), compute, False))


def test_the_validator_names_a_backward_before_its_forward_and_a_wrong_rank() -> None:
    compute = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]]
    with pytest.raises(ScheduleError, match="runs B0.0 before F0.0"):
        validate(with_communication("broken", 1, (0, 1), compute, False))
    compute = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0)], [Action("B", 1, 0)]]
    with pytest.raises(ScheduleError, match="F1.0 runs on rank 0; stage 1 is on rank 1"):
        validate(with_communication("broken", 1, (0, 1), compute, False))


def test_bad_names_and_sizes_are_clear_errors() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'"):
        make_schedule("pipedream", 2, 4)
    with pytest.raises(ScheduleError, match="not a multiple of the 4 pipeline ranks; use 8"):
        make_schedule("interleaved-1f1b", 4, 6, virtual=2)
    with pytest.raises(ScheduleError, match="no virtual stages"):
        make_schedule("1f1b", 2, 4, virtual=2)
    with pytest.raises(ScheduleError, match="at least 1"):
        make_schedule("gpipe", 2, 0)


# -- NCCL's order: a rank's point-to-point groups in the order posted, a send waits for its
# receiver --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zbv", "interleaved-1f1b"])
def test_every_schedule_and_its_forwards_keep_nccls_order(name: str) -> None:
    """1-8 pipeline ranks, 1-12 micro-batches (multiples of the ranks, 2-4 stages a rank, for
    the interleaved schedule): validate plays each under NCCL's rule; so are the forwards
    alone (an evaluation) played."""
    checked = 0
    for p in range(1, 9):
        for v in (2, 3, 4) if name == "interleaved-1f1b" else (1,):
            for m in range(p, 13, p) if v > 1 else range(1, 13):
                schedule = make_schedule(name, p, m, v)
                validate(schedule)
                check_p2p_order(forward_only(schedule))
                checked += 1
    assert checked == (3 * sum(12 // p for p in range(1, 9)) if name == "interleaved-1f1b" else 96)


def test_a_step_between_computes_is_one_group_the_forwards_send_then_the_backwards_receive():
    schedule = make_schedule("1f1b", 2, 3)
    groups = [g for g in p2p_groups(schedule.actions[0]) if isinstance(g, tuple)]
    assert [" ".join(map(str, g)) for g in groups] == [
        "SEND_F0.0>1",
        "SEND_F0.1>1 RECV_B0.0<1",  # Megatron's send_forward_recv_backward
        "SEND_F0.2>1 RECV_B0.1<1",
        "RECV_B0.2<1",
    ]
    # the gradient sums come after a group, never inside one
    for actions in schedule.actions:
        for g in p2p_groups(actions):
            assert not isinstance(g, tuple) or all("REDUCE" not in a.kind for a in g)


# each action its own call, a receive posted one compute early: the order of a runtime that
# ran on gloo only, which lets each operation complete on its own
_ONE_ACTION_A_CALL = (
    "F0.0 SEND_F0.0>1 RECV_B0.0<1 F0.1 SEND_F0.1>1 RECV_B0.1<1 B0.0 B0.1 REDUCE_GRAD0",
    "RECV_F1.0<0 F1.0 RECV_F1.1<0 B1.0 SEND_B1.0>0 F1.1 B1.1 SEND_B1.1>0 REDUCE_GRAD1",
)


def test_the_one_action_a_call_order_hangs_under_nccls_rule() -> None:
    old = _two_ranks(*[text.split() for text in _ONE_ACTION_A_CALL], name="1f1b")
    assert simulate(old, unit_cost).step > 0  # sends and receives pair, no deadlock
    # rank 0 runs its receive of B0.0 while rank 1 runs its receive of F1.1: the send each
    # waits for is posted on the other rank, behind that rank's receive
    with pytest.raises(
        ScheduleError,
        match=r"1f1b hangs under NCCL's in-order point-to-point groups: rank 0 at B0.0 runs "
        r"group \[RECV_B0.0<1\] while rank 1 runs \[RECV_F1.1<0\]; rank 1 at F1.1 runs "
        r"group \[RECV_F1.1<0\] while rank 0 runs \[RECV_B0.0<1\]",
    ):
        check_p2p_order(old, batched=False)
    # a send waits for its receiver: two ranks that each send before they receive meet as one
    # group a side (Megatron's pairing), and never as two
    crossed = _two_ranks(
        ["F0.0", "SEND_F0.0>1", "F0.1", "SEND_F0.1>1", "RECV_B0.0<1", "B0.0", "RECV_B0.1<1",
         "B0.1", "REDUCE_GRAD0"],
        ["RECV_F1.0<0", "F1.0", "B1.0", "SEND_B1.0>0", "RECV_F1.1<0", "F1.1", "B1.1",
         "SEND_B1.1>0", "REDUCE_GRAD1"],
    )  # fmt: skip
    validate(crossed)
    with pytest.raises(
        ScheduleError, match=r"rank 0 at B0.0 runs group \[SEND_F0.1>1\] while rank 1 runs "
        r"\[SEND_B1.0>0\]"
    ):  # fmt: skip
        check_p2p_order(crossed, batched=False)
