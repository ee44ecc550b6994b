"""What provenance costs: a stable_reinforce call (its spans checked against the recorded
sequences, two database round trips at the edge) against importance_sampling on the same
datums, through `treadle serve` on the tiny model. The calls are forwards, so that no
gradients pile up; a forward_backward passes the same checks.

    .venv/bin/python bench/provenance.py                 # 8 datums x 16 sampled tokens, 20 rounds
    .venv/bin/python bench/provenance.py --datums 64 --rounds 10

The two calls alternate, so that a shared machine's load swings hit both alike; medians are
reported. Goal: stable_reinforce / importance_sampling round trip <= 1.2 at 8 datums (the
checks are a few array comparisons per span). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from treadle import (
    Datum,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    SamplingParams,
    ServiceClient,
)
from treadle.engine.tiny import make_tiny_model
from treadle.launch import ServerProcess

NAME = "bench/tiny-llama"


def datums(prompt: list[int], seqs) -> list[Datum]:
    out = []
    for i, seq in enumerate(seqs):
        tokens, n, k, sid = prompt + seq.tokens, len(prompt), len(seq.tokens), seq.sequence_id
        adv = (i % 2) - 0.5
        d = Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": tokens[1:],
                "logprobs": [0.0] * (n - 1) + seq.logprobs,
                "advantages": [0.0] * (n - 1) + [adv] * k,
            },
        )
        out.append(
            d.with_provenance(
                [
                    PromptProvenanceSpan(sequence_id=sid, length=n),
                    SampledProvenanceSpan(sequence_id=sid, length=k - 1),
                ],
                [
                    PromptProvenanceSpan(sequence_id=sid, offset=1, length=n - 1),
                    SampledProvenanceSpan(sequence_id=sid, length=k),
                ],
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datums", type=int, default=8, help="datums per forward_backward")
    ap.add_argument("--tokens", type=int, default=16, help="sampled tokens per datum")
    ap.add_argument("--rounds", type=int, default=20, help="alternating pairs of calls")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", arch="llama")
        server = ServerProcess({NAME: model}, Path(tmp) / "data").start()
        try:
            svc = ServiceClient(base_url=server.url)
            tc = svc.create_lora_training_client(NAME, rank=8)
            sc = tc.save_weights_and_get_sampling_client(record_stability_info=True)
            prompt = list(range(5, 37))
            params = SamplingParams(max_tokens=args.tokens, temperature=1.0, stop=[], seed=0)
            seqs = sc.sample(prompt, args.datums, params).result().sequences
            data = datums(prompt, seqs)
            times: dict[str, list[float]] = {"importance_sampling": [], "stable_reinforce": []}
            for loss in times:  # warm up both paths
                tc.forward(data, loss).result()
            for _ in range(args.rounds):
                for loss, samples in times.items():
                    t0 = time.perf_counter()
                    tc.forward(data, loss).result()
                    samples.append(time.perf_counter() - t0)
            svc.close()
        finally:
            server.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["stable_reinforce"] / med["importance_sampling"]
    print(f"{args.datums} datums x {len(prompt) + args.tokens - 1} tokens, median of {args.rounds}")
    for loss, t in med.items():
        print(f"  {loss:20s} {t * 1e3:7.2f} ms")
    print(f"  ratio {ratio:.3f} (goal <= 1.2)")
    print(json.dumps({"datums": args.datums, **{f"{k}_ms": v * 1e3 for k, v in med.items()},
                      "ratio": ratio}))  # fmt: skip


if __name__ == "__main__":
    main()
