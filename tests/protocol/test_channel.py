"""The ZMQ channel between the API's hub and its workers: any thread sends on the socket
itself, and no message is left unread while senders race the IO thread for the socket."""

from __future__ import annotations

import threading
import time

import zmq

from treadle.protocol.channel import Channel


def test_many_threads_send_in_order_and_a_ping_pong_never_stalls() -> None:
    router_got: list[list[bytes]] = []
    got_all = threading.Event()
    pongs: dict[int, threading.Event] = {}
    n_threads, per_thread, rounds = 4, 300, 2000

    def on_router(frames: list[bytes]) -> None:
        identity, kind, body = frames
        if kind == b"ping":  # answered from another thread than the IO thread, as the hub's
            threading.Thread(target=router.send, args=([identity, b"pong", body],)).start()
            return
        router_got.append(frames)
        if len(router_got) == n_threads * per_thread:
            got_all.set()

    def on_dealer(frames: list[bytes]) -> None:
        pongs[int(frames[1])].set()

    # no ticks in the test's time: a message left unread would stay unread
    router = Channel(zmq.ROUTER, on_router, bind="tcp://127.0.0.1:*", tick_s=600)
    dealer = Channel(
        zmq.DEALER, on_dealer, connect=router.address, identity=b"worker-1", tick_s=600
    )
    router.start(), dealer.start()
    try:

        def burst(t: int) -> None:
            for i in range(per_thread):
                dealer.send([b"data", f"{t}:{i}".encode()])

        threads = [threading.Thread(target=burst, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        # ping-pong from this thread while the bursts run: each reply must arrive, however
        # the sends of both sides interleave with the IO threads' receives
        started = time.monotonic()
        for i in range(rounds):
            pongs[i] = threading.Event()
            dealer.send([b"ping", str(i).encode()])
            assert pongs[i].wait(5), f"pong {i} never arrived"
        for th in threads:
            th.join()
        assert got_all.wait(10)
        elapsed = time.monotonic() - started
    finally:
        dealer.stop(), router.stop()

    assert all(f[0] == b"worker-1" for f in router_got)
    by_thread: dict[str, list[int]] = {}
    for _, _, body in router_got:
        t, i = body.decode().split(":")
        by_thread.setdefault(t, []).append(int(i))
    assert by_thread == {str(t): list(range(per_thread)) for t in range(n_threads)}
    assert elapsed < 30


def test_ticks_run_while_idle_and_a_closed_channel_drops_sends() -> None:
    ticks: list[float] = []
    channel = Channel(
        zmq.ROUTER,
        lambda f: None,
        lambda: ticks.append(time.monotonic()),
        bind="tcp://127.0.0.1:*",
        tick_s=0.05,
    )
    channel.start()
    time.sleep(0.5)
    channel.stop()
    assert 5 <= len(ticks) <= 12, ticks
    channel.send([b"someone", b"late", b""])  # after stop: dropped, no error
