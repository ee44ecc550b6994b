"""How much a server-side custom loss saves over the client-side path, per training step.

The official tinker SDK runs `forward_backward_custom(data, handle)` either on the server
(the handle has a loss_id: one forward_backward, the loss inside the model pass) or, for the
same traced loss without one, on the client (a forward, the loss and its gradients locally,
then a forward_backward with them as weights: two engine calls and a round trip between).
Both run against one server in this process on the same data (a DPO + 0.1 NLL loss over
packed pairs), alternating step by step; the figure is the ratio of their median step times
(forward_backward_custom then optim_step, waited for).

    .venv/bin/python bench/custom_loss.py                 # small model, 8 pairs of 2 x 128
    .venv/bin/python bench/custom_loss.py --quick         # tiny model, fewer steps
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def dpo_nll(logprobs, chosen_mask, rejected_mask, ref_margin):
    margin = (logprobs * chosen_mask).sum() - (logprobs * rejected_mask).sum() - ref_margin
    nll = -(logprobs * chosen_mask).sum() / chosen_mask.sum().clamp(min=1.0)
    return -F.logsigmoid(0.1 * margin) + 0.1 * nll, {"custom/nll:mean": nll}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--length", type=int, default=128, help="tokens of each answer")
    args = parser.parse_args()
    size = "tiny" if args.quick else "small"
    steps = args.steps or (4 if args.quick else 10)
    length = 32 if args.quick else args.length

    import tinker
    from _inproc import InProcessServer
    from tinker import types as T

    from treadle.engine.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-custom-loss-"))
    model_dir = make_tiny_model(work / "model", arch="llama", size=size)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    data = []
    for _ in range(args.pairs):
        seq = rng.integers(0, vocab, 2 * length + 1).tolist()
        chosen = [1.0] * length + [0.0] * length
        data.append(
            T.Datum(
                model_input=T.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={
                    "target_tokens": seq[1:],
                    "chosen_mask": T.TensorData(data=chosen, dtype="float32", shape=[2 * length]),
                    "rejected_mask": T.TensorData(
                        data=[1 - c for c in chosen], dtype="float32", shape=[2 * length]
                    ),
                    "ref_margin": T.TensorData(data=[0.0], dtype="float32", shape=[]),
                },
            )
        )
    ranks = {"logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "ref_margin": 0}
    name = "treadle/bench"
    with InProcessServer({name: model_dir}, work / "data") as server:
        svc = tinker.ServiceClient(base_url=server.url, api_key="tml-bench")
        handle = svc.create_custom_loss(dpo_nll, ranks).result()
        local = dataclasses.replace(handle, loss_id=None)
        clients = {
            how: svc.create_lora_training_client(base_model=name, rank=8, seed=0).result()
            for how in ("server", "client")
        }
        losses = {"server": handle, "client": local}
        times: dict[str, list[float]] = {"server": [], "client": []}
        adam = T.AdamParams(learning_rate=1e-4)
        for step in range(steps + 1):  # the first round warms up
            for how in ("server", "client") if step % 2 else ("client", "server"):
                tc = clients[how]
                t0 = time.perf_counter()
                tc.forward_backward_custom(data, losses[how]).result()
                tc.optim_step(adam).result()
                if step:
                    times[how].append(time.perf_counter() - t0)
        svc.close("success").result()
    server_s, client_s = (statistics.median(times[h]) for h in ("server", "client"))
    tokens = args.pairs * 2 * length
    print(f"model {size}, {args.pairs} pairs of 2 x {length} tokens, {steps} steps each")
    print(f"step with the loss on the server: {server_s * 1e3:.0f} ms (median)")
    print(f"step with the loss on the client: {client_s * 1e3:.0f} ms (median)")
    print(f"server-side / client-side step time: {server_s / client_s:.2f}")
    result = {
        "bench": "custom_loss",
        "model": size,
        "tokens_per_step": tokens,
        "server_over_client": round(server_s / client_s, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
