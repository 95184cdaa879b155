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
