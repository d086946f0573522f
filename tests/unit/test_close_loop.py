"""A stop signal that lands while a gather runs (the warm start scripting its episodes, a step's
rollouts) leaves the gather's tasks pending; ``close_loop`` finishes them, so their clean-up runs on
an open loop and nothing is printed when they are collected."""

import asyncio
import gc

import pytest

from nemo_orchestra.train.trainer import close_loop


class Client:
    def __init__(self):
        self.deleted: list[int] = []
        self.closed = False

    async def delete_episode(self, i: int) -> None:
        await asyncio.sleep(0)  # a request: needs the loop
        self.deleted.append(i)

    async def aclose(self) -> None:
        self.closed = True


async def _episode(client: Client, i: int) -> None:
    try:
        await asyncio.sleep(60)
    finally:
        await client.delete_episode(i)


async def _episodes(client: Client) -> None:
    await asyncio.gather(*[_episode(client, i) for i in range(4)])


def _stop() -> None:  # a callback's KeyboardInterrupt leaves run_until_complete as a signal's StopNow does
    raise KeyboardInterrupt


def test_a_stop_inside_a_gather_leaves_no_task_to_clean_up_on_a_closed_loop(capfd):
    loop, client = asyncio.new_event_loop(), Client()
    loop.call_later(0.05, _stop)
    with pytest.raises(KeyboardInterrupt):
        loop.run_until_complete(_episodes(client))
    close_loop(loop, client)  # closing the client and the loop alone left all 4 clean-ups undone
    gc.collect()
    assert loop.is_closed() and client.closed
    assert sorted(client.deleted) == [0, 1, 2, 3]
    assert "Traceback" not in capfd.readouterr().err
