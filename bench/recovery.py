"""What crash recovery costs: the durability tax on a training loop, and the time to
restore sessions after a kill.

    .venv/bin/python bench/recovery.py                 # 8 sessions of rank 8 and of rank 64
    .venv/bin/python bench/recovery.py --quick         # 4 sessions, fewer steps

1. Durability: the 10-step SFT loop of bench/service.py through two servers side by side,
   one with the op log and state snapshots (durable, the default) and one without; their
   steps interleaved so that load swings hit both alike. Goal: durable / off <= 1.05.
2. Restore: N sessions of one rank, each a few steps past its last state snapshot; the
   server and its workers are SIGKILLed and started again on the same data dir. Reported:
   the restart until healthz (process start, model load, restore), the restore itself (as
   the server logs it: snapshot loads and replays), and until every session's next
   forward has answered.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from service import NAME, Timer, make_batches, sdk_batch  # noqa: E402

from treadle import AdamParams, Datum, ModelInput, ServiceClient  # noqa: E402
from treadle.engine.tiny import make_tiny_model  # noqa: E402
from treadle.launch import ServerProcess  # noqa: E402


def durability_cost(model_dir: Path, root: Path, steps: int, batch: int, seq_len: int) -> dict:
    batches = [sdk_batch(b) for b in make_batches(steps, batch, seq_len, 400)]
    on = ServerProcess({NAME: model_dir}, root / "durable", config={"durable": True}).start()
    off = ServerProcess({NAME: model_dir}, root / "off", config={"durable": False}).start()
    try:
        clients = {}
        for label, server in (("durable", on), ("off", off)):
            svc = ServiceClient(base_url=server.url)
            tc = svc.create_lora_training_client(NAME, rank=32, alpha=32.0, seed=0)
            tc.forward_backward(batches[0]).result()  # warm-up
            tc.optim_step(AdamParams(learning_rate=1e-4)).result()
            clients[label] = (svc, tc, Timer())
        for data in batches:
            for _, tc, timer in clients.values():
                with timer:
                    fb = tc.forward_backward(data)
                    op = tc.optim_step(AdamParams(learning_rate=1e-4))
                    fb.result()
                    op.result()
        for svc, _, _ in clients.values():
            svc.close()
    finally:
        on.stop()
        off.stop()
    t_on, t_off = clients["durable"][2].total, clients["off"][2].total
    return {"durable_s": round(t_on, 3), "off_s": round(t_off, 3), "ratio": round(t_on / t_off, 3)}


def restore_time(model_dir: Path, root: Path, sessions: int, rank: int, steps: int) -> dict:
    config = {"snapshot_every_steps": max(1, steps - 2)}  # two steps to replay per session
    server = ServerProcess({NAME: model_dir}, root / f"rank{rank}", config=config).start()
    one = [
        Datum(
            model_input=ModelInput.from_ints(list(range(1, 33))),
            loss_fn_inputs={"target_tokens": list(range(2, 34)), "weights": [1.0] * 32},
        )
    ]
    clients = []
    for _ in range(sessions):
        svc = ServiceClient(base_url=server.url)
        clients.append((svc, svc.create_lora_training_client(NAME, rank=rank, alpha=rank)))
    for _ in range(steps):
        futs = [(tc.forward_backward(one), tc.optim_step(AdamParams())) for _, tc in clients]
        for fb, op in futs:
            fb.result(), op.result()
    time.sleep(1.5)  # the snapshots are written at idle moments
    server.kill()
    t0 = time.perf_counter()
    server.start()
    up = time.perf_counter() - t0
    for fut in [tc.forward(one) for _, tc in clients]:
        fut.result()
    answered = time.perf_counter() - t0
    restored = [float(x) for x in re.findall(r"restored in ([0-9.]+) s", server.log())]
    for svc, _ in clients:
        svc.close()
    server.stop()
    return {
        "sessions": sessions,
        "rank": rank,
        "restart_until_healthz_s": round(up, 2),
        "restore_s": restored[-1] if restored else None,
        "until_all_answered_s": round(answered, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="SFT steps (durability part)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.steps = 4, 6
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model(root / "model", "llama", "small")
        cost = durability_cost(model_dir, root, args.steps, 8, 128)
        print(
            f"durability: {args.steps}-step SFT loop {cost['durable_s']:.2f} s with the op log "
            f"and snapshots, {cost['off_s']:.2f} s without: ratio {cost['ratio']:.3f} "
            "(goal <= 1.05)"
        )
        restores = []
        for rank in (8, 64):
            r = restore_time(model_dir, root, args.sessions, rank, steps=6)
            restores.append(r)
            print(
                f"restore {r['sessions']} sessions of rank {rank}: restart until healthz "
                f"{r['restart_until_healthz_s']:.2f} s (restore itself {r['restore_s']} s), "
                f"every session answering after {r['until_all_answered_s']:.2f} s"
            )
    print(json.dumps({"bench": "recovery", "durability": cost, "restore": restores}))


if __name__ == "__main__":
    main()
