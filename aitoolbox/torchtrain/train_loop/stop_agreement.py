"""All processes of a distributed run stop after the same optimizer step, at almost no cost per step.

A termination signal reaches the processes of a job at different moments (or only some of them), yet they must
stop after the same step: one that stopped earlier would leave the others waiting in a gradient all-reduce. So
they agree, with an all-reduce of their stop requests over a gloo group of their own, started in the background and
read one step later: training never waits for it (and with CUDA never synchronises for it).

Exchanging at every step costs about a millisecond of CPU time a step, which small models notice (20-45 % of a
2-process CPU step). So the processes exchange only every few steps: each exchange also carries every process's
proposal for the number of steps until the next one (:data:`CHECK_INTERVAL_S` divided by its recent step time, at
most :data:`MAX_STEPS_BETWEEN_CHECKS`), and all take the smallest, so every process exchanges at the same steps.
A stop therefore lands about :data:`CHECK_INTERVAL_S` seconds plus two steps after the signal reached the last
process, and at most :data:`MAX_STEPS_BETWEEN_CHECKS` + 1 steps after it; steps longer than
:data:`CHECK_INTERVAL_S` exchange every step, as before.
"""
import datetime
import time
from typing import Any, Optional

import torch

#: Seconds of training between two exchanges (each process proposes as many steps as fit in it).
CHECK_INTERVAL_S = 0.25
#: The most steps between two exchanges, whatever the step time.
MAX_STEPS_BETWEEN_CHECKS = 256


class StopAgreement:
    """Whether to stop after this optimizer step, the same answer in every process of a distributed run.

    Call :meth:`poll` at every optimizer step of every process, and :meth:`settle` when training ends.
    """

    def __init__(self):
        self._group: Any = None
        self._exchange: Optional[torch.Tensor] = None  # [stop request, -(steps proposed until the next exchange)]
        self._work: Any = None
        self._steps_to_skip = 0  # polls without an exchange before the next one (the same in every process)
        self._launched_at: Optional[float] = None
        self._steps_since_launch = 0

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()  # a process group cannot travel: a new process starts afresh
        state.update(_group=None, _exchange=None, _work=None, _steps_to_skip=0, _launched_at=None,
                     _steps_since_launch=0)
        return state

    def poll(self, strategy: Any, requested: bool) -> bool:
        """At an optimizer step: the answer of the exchange started at the previous poll, if one was; starts the
        next exchange when it is due. True: every process stops after this step."""
        self._steps_since_launch += 1
        if self._work is not None:
            stop, steps_to_next = self._collect()
            if stop:
                return True
            self._steps_to_skip = steps_to_next - 1
        if self._steps_to_skip > 0:
            self._steps_to_skip -= 1
            return False
        self._launch(strategy, requested)
        return False

    def settle(self, requested: bool) -> bool:
        """At the end of training: whether any process was asked to stop (waits for the exchange)."""
        import torch.distributed as dist
        if self._work is not None and self._collect()[0]:
            return True
        if self._group is None:
            return requested  # no step was trained: nothing was exchanged and nothing to agree on
        flag = torch.tensor([1 if requested else 0, 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag[0].item())

    def _launch(self, strategy: Any, requested: bool) -> None:
        import torch.distributed as dist
        if self._group is None:  # every process gets here at the same step: new_group is a collective
            timeout = datetime.timedelta(seconds=getattr(strategy, "timeout_s", 600.0))
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        now = time.monotonic()
        proposal = 1
        if self._launched_at is not None:
            step_s = (now - self._launched_at) / max(1, self._steps_since_launch)
            proposal = int(max(1, min(MAX_STEPS_BETWEEN_CHECKS, CHECK_INTERVAL_S // max(step_s, 1e-6))))
        self._launched_at, self._steps_since_launch = now, 0
        # MAX of the requests, and MAX of the negated proposals: the smallest proposal.
        self._exchange = torch.tensor([1 if requested else 0, -proposal], dtype=torch.int32)
        self._work = dist.all_reduce(self._exchange, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def _collect(self):
        work, self._work = self._work, None
        work.wait()
        stop, negative_steps = self._exchange.tolist()
        return bool(stop), max(1, -negative_steps)
