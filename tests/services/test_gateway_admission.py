"""The bounded admission queue: waiting slots, 429 when full, wake-ups."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.admission import AdmissionQueue
from services.gateway.errors import Overloaded


def test_queue_bounds_and_wakeups():
    async def scenario():
        queue = AdmissionQueue(max_waiting=1, poll_interval_s=5.0)
        with queue.slot():
            assert queue.num_waiting == 1
            with pytest.raises(Overloaded) as info:
                with queue.slot():
                    pass
            assert info.value.http_status == 429 and info.value.code == "queue_full"
            waiter = asyncio.create_task(queue.wait_for_capacity())
            await asyncio.sleep(0.01)
            queue.notify_freed()
            await asyncio.wait_for(waiter, 1.0)  # woken long before the 5 s poll
        assert queue.num_waiting == 0
        with pytest.raises(Overloaded):
            with AdmissionQueue(max_waiting=0).slot():
                pass

    asyncio.run(scenario())


def test_admit_counts_running_sequences():
    queue = AdmissionQueue(max_waiting=2)
    with queue.admit(3, run_capacity=2):  # 3 in flight: 2 run, 1 waits
        assert queue.num_in_flight == 3
        with pytest.raises(Overloaded) as info:
            with queue.admit(2, run_capacity=2):  # 5 > 2 running + 2 waiting
                pass
        assert info.value.http_status == 429 and info.value.code == "queue_full"
        assert queue.num_in_flight == 3
        with queue.admit(1, run_capacity=2):
            assert queue.num_in_flight == 4
        with queue.admit(5, run_capacity=None):  # no worker known: routing answers 503 instead
            assert queue.num_in_flight == 8
    assert queue.num_in_flight == 0
