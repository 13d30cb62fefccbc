"""The stop agreement of a distributed run, with real processes over gloo: every process gets the same answer at
the same step, a request lands within the documented bound (about ``CHECK_INTERVAL_S`` of training plus two
steps, at most ``MAX_STEPS_BETWEEN_CHECKS`` + 1 steps), and an exchange happens only every few steps when steps are
short (issue 33 item 11: exchanging at every step cost 0.5-1.3 ms a step)."""
import time

import pytest

from aitoolbox.torchtrain.train_loop import stop_agreement
from aitoolbox.torchtrain.train_loop.stop_agreement import StopAgreement
from tests.distributed_helpers import run_distributed

pytestmark = pytest.mark.slow  # processes over gloo: about 15 s a test


class _Strategy:
    timeout_s = 60.0


def poll_steps(rank: int, world_size: int, step_s: list, request_at: list, steps: int) -> dict:
    """Poll at ``steps`` steps of ``step_s[rank]`` seconds; this rank requests a stop from step ``request_at[rank]``
    (-1: never). Returns the step the agreement said stop (None: never), how many exchanges were started, and what
    the agreement said when training ended."""
    request_at = request_at[rank]
    import torch.distributed as dist
    agreement = StopAgreement()
    launches = 0
    launch = agreement._launch

    def counting_launch(*args):
        nonlocal launches
        launches += 1
        launch(*args)

    agreement._launch = counting_launch
    stopped_at = None
    for step in range(steps):
        time.sleep(step_s[rank])
        if agreement.poll(_Strategy(), 0 <= request_at <= step):
            stopped_at = step
            break
    settled = agreement.settle(0 <= request_at < steps)
    dist.barrier()
    return {"stopped_at": stopped_at, "launches": launches, "settled": settled}


def test_fast_steps_exchange_rarely_and_a_request_lands_in_every_process_at_the_same_step_within_the_bound():
    step_s = [0.002, 0.004]  # rank 1 is the slower: its proposal (the smaller) sets the interval
    request_at = 150
    results = run_distributed(poll_steps, 2, args=(step_s, [-1, request_at], 400))
    stops = [result["stopped_at"] for result in results]
    assert stops[0] == stops[1] is not None  # the same step in every process
    # Bound: the interval the slowest process proposes, plus the step the exchange is read at.
    interval = int(stop_agreement.CHECK_INTERVAL_S // max(step_s))
    assert request_at <= stops[0] <= request_at + interval + 2, stops
    # Exchanged every few steps, not at every one (the first exchanges, with no step time known yet, are closer).
    assert results[0]["launches"] == results[1]["launches"] < stops[0] / 10


def test_a_request_of_one_process_stops_every_process_and_steps_longer_than_the_interval_exchange_every_step():
    results = run_distributed(poll_steps, 2, args=([0.3, 0.3], [3, -1], 10))
    assert [result["stopped_at"] for result in results] == [4, 4]  # requested at step 3, read at the next
    assert all(result["launches"] == 4 for result in results)  # every step: a step is longer than the interval


def test_a_request_after_the_last_step_is_agreed_when_training_ends():
    results = run_distributed(poll_steps, 2, args=([0.0, 0.0], [-1, -1], 5))
    assert [r["stopped_at"] for r in results] == [None, None] and [r["settled"] for r in results] == [False, False]
    # Requested at the last step, by rank 1 only: no exchange is due any more (short steps); training ends, and
    # every process learns it there.
    results = run_distributed(poll_steps, 2, args=([0.0, 0.0], [-1, 4], 5))
    assert [r["settled"] for r in results] == [True, True]
