"""One GRPO-shaped step through the service, driven by the official `tinker` SDK with datums
built from Python lists and from numpy arrays, against the same phases written by hand with
torch + peft in a process of their own.

    python bench/grpo_step.py                 # 6 rounds after a warm-up of each loop
    python bench/grpo_step.py --rounds 2      # a quick look
    python bench/grpo_step.py --profile       # also cProfile one service step's client side

The workload: a 5.2M-parameter Qwen3 (hidden 256, 4 layers, vocab 8192, random weights),
LoRA rank 8 on the layers the service trains by default (attention, MLP and the
unembedding), and per step
- `sample`: 8 prompts of --prompt-len tokens x 4 samples x 32 new tokens at T=1, with the
  sampled tokens' logprobs;
- `ppo`: a PPO forward_backward over the 32 sequences (prompt masked by advantage 0), with
  group-relative advantages of a made-up reward, datums built in the phase, then `optim`:
  one AdamW step;
- `ce`: a cross-entropy forward_backward over 8 x 128 tokens (an SFT-shaped call), its
  datums built in the phase as a user's loop builds each batch;
- the service refreshes its sampler (`save_weights_and_get_sampling_client`, `refresh`).

Three loops: the service with datums built from lists (`ModelInput.from_ints(toks)`,
`"weights": [1.0] * n`, ...) and from numpy arrays, each its own training client, and the
hand-written loop (bench/baseline.py: peft on the same targets, fused cross entropy,
`generate` + `compute_transition_scores` for the old logprobs, AdamW) in a child process
that shares nothing with the client or the server but the machine. The loops take turns
step by step, each round in another of their six orders, so that a shared machine's load
swings hit all alike. Figures are medians of the per-phase seconds; a ratio is service time over
hand-written time (below 1: the service is faster), the median over rounds of each round's
own ratio. The CPU ratio compares CPU seconds (this client's process and the server's
against the hand loop's process): steadier than wall time on a busy machine.
Checks of the baseline, in its own process: its CE and PPO calls against independent plain
ones (transformers' `labels=` loss; log_softmax + gather), alternated, before the server
starts; and its CE there against its CE inside the rounds (does the harness slow it?).
Goals: `ce` and `ppo` <= 1.05, the whole GRPO step (everything above but `ce`) <= 0.85.
Ends with one JSON line.
"""

from __future__ import annotations

import os
import sys

from treadle.server.main import OPENMP_SPIN_COUNT

if "OMP_WAIT_POLICY" not in os.environ:  # before torch loads: as `treadle serve` sets it
    os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
if "--threads" in sys.argv:  # before torch loads; the server and the hand loop inherit it
    os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import argparse  # noqa: E402
import cProfile  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import baseline  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from treadle.engine.tiny import make_tiny_model  # noqa: E402
from treadle.launch import ServerProcess  # noqa: E402

NAME = "bench/qwen3-5m"
API_KEY = "tml-bench"
# hidden, layers, heads, kv heads, intermediate, vocab: 5.24M parameters with tied embeddings
SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=768,
    vocab_size=8192,
)
SERVER_ALPHA = 32.0  # the LoRA alpha the server gives a model whose SDK sends none
PHASES = ("sample", "ppo", "optim", "refresh", "ce")
GRPO = ("sample", "ppo", "optim", "refresh")
STYLES = ("lists", "numpy")


def build_model(out: Path) -> Path:
    """make-tiny-model's Qwen3 folder (tokenizer, template), its weights replaced by the
    5.2M shape above."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    make_tiny_model(out, arch="qwen3", size="tiny")
    base = json.loads((out / "config.json").read_text())
    config = Qwen3Config(
        head_dim=SHAPE["hidden_size"] // SHAPE["num_attention_heads"],
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=base["eos_token_id"],
        pad_token_id=base["pad_token_id"],
        bos_token_id=None,
        **SHAPE,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for f in out.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(out)
    return out


class Phases:
    """Seconds of each phase, one dict per step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def add(self, step: dict[str, float]) -> None:
        self.steps.append(step)

    def median(self, phase: str) -> float:
        return statistics.median(s.get(phase, 0.0) for s in self.steps)

    def totals(self, phases: tuple[str, ...]) -> list[float]:
        return [sum(s.get(p, 0.0) for p in phases) for s in self.steps]

    def median_total(self, phases: tuple[str, ...]) -> float:
        return statistics.median(self.totals(phases))


def paired_ratio(a: Phases, b: Phases, phases: tuple[str, ...]) -> float | None:
    """Median over rounds of a's time over b's in the same round (a round runs one step of
    each loop, close in time: a load swing between rounds cancels out)."""
    pairs = zip(a.totals(phases), b.totals(phases), strict=True)
    ratios = [x / y for x, y in pairs if y > 0]
    return statistics.median(ratios) if ratios else None


class clock:
    """with clock(step, "ppo", cpu): ... adds the block's wall time to step["ppo"] and the
    CPU seconds `cpu()` counts over it to step["ppo_cpu"]."""

    def __init__(self, step: dict[str, float], phase: str, cpu: Callable[[], float]):
        self.step, self.phase, self.cpu = step, phase, cpu

    def __enter__(self) -> None:
        self.c0, self.t0 = self.cpu(), time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        wall, cpu = time.perf_counter() - self.t0, self.cpu() - self.c0
        self.step[self.phase] = self.step.get(self.phase, 0.0) + wall
        self.step[f"{self.phase}_cpu"] = self.step.get(f"{self.phase}_cpu", 0.0) + cpu


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes, all their threads (Linux /proc)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (Linux /proc)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree = [pid]
    for p in tree:
        tree += [c for c, pp in parent.items() if pp == p]
    return tree


def rewards_of(tokens_N: list[list[int]]) -> np.ndarray:
    """A made-up reward: the share of even token ids (only its spread matters here)."""
    return np.array([np.mean([t % 2 == 0 for t in toks]) if toks else 0.0 for toks in tokens_N])


def group_advantages(rewards_G_S: np.ndarray) -> np.ndarray:
    return rewards_G_S - rewards_G_S.mean(axis=1, keepdims=True)  # (G, S)


class Workload:
    def __init__(self, args: argparse.Namespace, seed: int = 0):
        rng = np.random.default_rng(seed)
        V = SHAPE["vocab_size"]
        self.prompts_G_P = rng.integers(3, V, (args.prompts, args.prompt_len))  # (G, P)
        self.ce_B_T = rng.integers(3, V, (args.ce_rows, args.ce_len + 1))  # (B, T+1)
        self.samples = args.samples
        self.new_tokens = args.new_tokens
        self.lr = 1e-4


# ---- the service, through the official tinker SDK ----
class ServiceLoop:
    """One training client; its datums built from lists or from numpy arrays (`style`)."""

    def __init__(self, svc, work: Workload, rank: int, style: str, server_pids: list[int]):
        import tinker

        self.T = tinker.types
        self.work, self.style = work, style
        # the CPU of the whole service: this client's process and the server's
        self.cpu = lambda: time.process_time() + cpu_seconds(server_pids)
        self.tc = svc.create_lora_training_client(base_model=NAME, rank=rank, seed=0).result()
        self.sc = self.tc.save_weights_and_get_sampling_client().result()
        # what a user holds before building datums: lists, or arrays
        self.prompts = work.prompts_G_P.tolist() if style == "lists" else work.prompts_G_P
        self.ce_rows = work.ce_B_T.tolist() if style == "lists" else work.ce_B_T

    def step(self) -> dict[str, float]:
        T, w, step = self.T, self.work, {}
        params = T.SamplingParams(max_tokens=w.new_tokens, temperature=1.0, stop=[])  # no EOS
        with clock(step, "sample", self.cpu):
            futs = [
                self.sc.sample(T.ModelInput.from_ints(self._ints(p)), w.samples, params)
                for p in self.prompts
            ]
            results = [f.result() for f in futs]
        with clock(step, "ppo", self.cpu):
            data = self._ppo_data(results)
            self.tc.forward_backward(data, "ppo").result()
        with clock(step, "optim", self.cpu):
            self.tc.optim_step(T.AdamParams(learning_rate=w.lr)).result()
        with clock(step, "refresh", self.cpu):
            self.sc = self.tc.save_weights_and_get_sampling_client().result()
        with clock(step, "ce", self.cpu):
            self.tc.forward_backward(self._ce_data(), "cross_entropy").result()
        return step

    def _ints(self, tokens) -> list[int]:
        return tokens if self.style == "lists" else tokens.tolist()

    def _ce_data(self) -> list:
        T = self.T
        if self.style == "lists":
            return [
                T.Datum(
                    model_input=T.ModelInput.from_ints(row[:-1]),
                    loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * (len(row) - 1)},
                )
                for row in self.ce_rows
            ]
        return [
            T.Datum(
                model_input=T.ModelInput.from_ints(row[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": row[1:],
                    "weights": np.ones(len(row) - 1, np.float32),
                },
            )
            for row in self.ce_rows
        ]

    def _ppo_data(self, results) -> list:
        T = self.T
        seqs = [list(r.sequences) for r in results]
        rewards = np.array([rewards_of([s.tokens for s in g]) for g in seqs])  # (G, S)
        adv_G_S = group_advantages(rewards)
        data = []
        for prompt, group, advs in zip(self.prompts, seqs, adv_G_S, strict=True):
            P = len(prompt)
            for seq, a in zip(group, advs, strict=True):
                if self.style == "lists":
                    full = prompt + list(seq.tokens)
                    pad = [0.0] * (P - 1)
                    inputs = {
                        "target_tokens": full[1:],
                        "logprobs": pad + list(seq.logprobs),
                        "advantages": pad + [float(a)] * len(seq.tokens),
                    }
                    tokens = full[:-1]
                else:
                    full = np.concatenate([prompt, np.asarray(seq.tokens, np.int64)])
                    n = len(full) - 1
                    logprobs = np.zeros(n, np.float32)
                    logprobs[P - 1 :] = seq.logprobs
                    advantages = np.zeros(n, np.float32)
                    advantages[P - 1 :] = a
                    inputs = {
                        "target_tokens": full[1:],
                        "logprobs": logprobs,
                        "advantages": advantages,
                    }
                    tokens = full[:-1].tolist()
                data.append(
                    T.Datum(model_input=T.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)
                )
        return data


# ---- the same phases by hand: torch + peft in a process of its own ----
class HandLoop:
    def __init__(self, model_dir: Path, work: Workload, rank: int, alpha: float):
        self.work = work
        self.model = baseline.lora_model(model_dir, rank, alpha)
        self.opt = baseline.adamw(self.model, work.lr)
        self.cpu = time.process_time  # every thread of this process
        self.ce_tokens = torch.as_tensor(work.ce_B_T)  # (B, T+1)

    def step(self) -> dict[str, float]:
        w, step = self.work, {}
        G, P = w.prompts_G_P.shape
        with clock(step, "sample", self.cpu):  # the old logprobs come with the tokens
            prompts = torch.as_tensor(np.repeat(w.prompts_G_P, w.samples, axis=0))  # (N, P)
            seqs, new_lp = baseline.sample(self.model, prompts, w.new_tokens)  # (N, L+1), (N, n)
        with clock(step, "ppo", self.cpu):
            ids, targets, old, adv = self._ppo_inputs(seqs, new_lp, P)
            baseline.ppo_forward_backward(self.model, ids, targets, old, adv)
        with clock(step, "optim", self.cpu):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        with clock(step, "ce", self.cpu):
            ce = torch.as_tensor(w.ce_B_T)  # (B, T+1)
            baseline.ce_forward_backward(self.model, ce[:, :-1], ce[:, 1:])
        return step

    def _ppo_inputs(self, seqs: torch.Tensor, new_lp: torch.Tensor, P: int):
        """(ids, targets, old logprobs, advantages), each (N, L): prompt positions carry
        advantage 0, the sampled ones their group-relative advantage."""
        w = self.work
        G = w.prompts_G_P.shape[0]
        rewards = rewards_of(seqs[:, P:].tolist()).reshape(G, w.samples)
        adv_N = torch.as_tensor(group_advantages(rewards).reshape(-1, 1), dtype=torch.float32)
        ids, targets = seqs[:, :-1], seqs[:, 1:]  # (N, L)
        old = torch.zeros(targets.shape)  # (N, L)
        old[:, P - 1 :] = new_lp
        adv = torch.zeros(targets.shape)  # (N, L)
        adv[:, P - 1 :] = adv_N
        return ids, targets, old, adv

    def checks(self, rounds: int) -> dict[str, float]:
        """Median seconds of the baseline's CE and PPO calls against independent plain ones,
        alternated (the model is left as it was: gradients dropped after), and how far the
        sampled tokens' logprobs from `generate` are from the trainer's (PPO's old
        logprobs must be the policy's own)."""
        w = self.work
        P = w.prompts_G_P.shape[1]
        prompts = torch.as_tensor(np.repeat(w.prompts_G_P, w.samples, axis=0))
        seqs, new_lp = baseline.sample(self.model, prompts, w.new_tokens)
        ppo = self._ppo_inputs(seqs, new_lp, P)
        with torch.no_grad():
            trainer_lp = baseline.token_logprobs(self.model, ppo[0], ppo[1])[:, P - 1 :]
        ce = self.ce_tokens
        fns = {
            "ce": lambda: baseline.ce_forward_backward(self.model, ce[:, :-1], ce[:, 1:]),
            "ce_plain": lambda: baseline.plain_ce_forward_backward(self.model, ce),
            "ppo": lambda: baseline.ppo_forward_backward(self.model, *ppo),
            "ppo_plain": lambda: baseline.ppo_forward_backward(
                self.model, *ppo, logprobs_fn=baseline.plain_token_logprobs
            ),
        }
        times = alternate(fns, rounds)
        self.opt.zero_grad(set_to_none=True)
        return {
            "hand_ce_s": times["ce"],
            "ce_plain_s": times["ce_plain"],
            "hand_ppo_s": times["ppo"],
            "ppo_plain_s": times["ppo_plain"],
            "sample_logprobs_max_diff": float((trainer_lp - new_lp).abs().max()),
        }


def alternate(fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each function, run in turn after one warm-up each, the order
    rotating each round (no function always follows the same one)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _hand_process(conn, model_dir: Path, args: argparse.Namespace) -> None:
    """The hand-written loop's process: answers ("step",) and ("checks", rounds)."""
    warnings.filterwarnings("ignore")
    loop = HandLoop(model_dir, Workload(args), args.rank, SERVER_ALPHA)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        conn.send(loop.step() if msg[0] == "step" else loop.checks(msg[1]))


class HandProcess:
    """HandLoop in a spawned child process, driven over a pipe."""

    def __init__(self, model_dir: Path, args: argparse.Namespace):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_hand_process, args=(child, model_dir, args), daemon=True)
        self.proc.start()
        assert self.conn.recv() == "ready"

    def step(self) -> dict[str, float]:
        self.conn.send(("step",))
        return self.conn.recv()

    def checks(self, rounds: int) -> dict[str, float]:
        self.conn.send(("checks", rounds))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=30)


def report(loops: dict[str, Phases], checks: dict[str, float]) -> dict:
    """Medians of each loop's phases, and each service loop's ratio to the hand loop: the
    median of the rounds' ratios (wall time), and the ratio of the CPU seconds' medians."""
    hand = loops["hand"]
    out: dict = {"bench": "grpo_step", "steps": len(hand.steps)}
    heads = " ".join(f"{k + ' s':>9s}" for k in loops)
    print(f"{'phase':12s} {heads}   ratio lists / numpy   CPU ratio lists / numpy")
    rows = [(p, (p,)) for p in PHASES] + [("grpo_step", GRPO), ("step_with_ce", PHASES)]
    for name, phases in rows:
        cpu_phases = tuple(f"{p}_cpu" for p in phases)
        wall = {k: loop.median_total(phases) for k, loop in loops.items()}
        cpu = {k: loop.median_total(cpu_phases) for k, loop in loops.items()}
        ratio = {s: paired_ratio(loops[s], hand, phases) for s in STYLES}
        cpu_ratio = {s: cpu[s] / cpu["hand"] if cpu["hand"] else None for s in STYLES}
        for k in loops:
            out[f"{k}_{name}_s"], out[f"{k}_{name}_cpu_s"] = round(wall[k], 4), round(cpu[k], 4)
        for s in STYLES:
            if ratio[s] is not None:
                out[f"{name}_ratio_{s}"] = round(ratio[s], 3)
                out[f"{name}_ratio_of_medians_{s}"] = round(wall[s] / wall["hand"], 3)
                out[f"{name}_cpu_ratio_{s}"] = round(cpu_ratio[s], 3)
        shown = [
            " / ".join(f"{r[s]:.3f}" if r[s] is not None else "-" for s in STYLES)
            for r in (ratio, cpu_ratio)
        ]
        cells = " ".join(f"{v:9.4f}" for v in wall.values())
        print(f"{name:12s} {cells}   {shown[0]:>19s}   {shown[1]:>23s}")
    out |= {f"check_{k}": round(v, 4) for k, v in checks.items() if k.endswith("_s")}
    out["baseline_sample_logprobs_max_diff"] = checks["sample_logprobs_max_diff"]
    out["baseline_ce_vs_plain"] = round(checks["hand_ce_s"] / checks["ce_plain_s"], 3)
    out["baseline_ppo_vs_plain"] = round(checks["hand_ppo_s"] / checks["ppo_plain_s"], 3)
    out["baseline_ce_in_rounds_vs_alone"] = round(hand.median("ce") / checks["hand_ce_s"], 3)
    print(
        "baseline checks (its own process, no server running): CE "
        f"{checks['hand_ce_s']:.4f} s vs transformers' labels= loss {checks['ce_plain_s']:.4f} s"
        f" ({out['baseline_ce_vs_plain']:.3f}); PPO {checks['hand_ppo_s']:.4f} s vs "
        f"log_softmax + gather {checks['ppo_plain_s']:.4f} s ({out['baseline_ppo_vs_plain']:.3f});"
        f" its CE in the rounds / alone {out['baseline_ce_in_rounds_vs_alone']:.3f}; its "
        f"sampled logprobs vs the trainer's: max |diff| {checks['sample_logprobs_max_diff']:.1e}"
    )
    print(
        "goals: ce, ppo <= 1.05; grpo_step <= 0.85 (ratio = service / hand-written time; the "
        "CPU ratio counts the client's and the server's processes against the hand loop's)"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="steps of each loop after a warm-up (6: each order once)",
    )
    ap.add_argument("--checks", type=int, default=8, help="rounds of the baseline's checks")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ce-rows", type=int, default=8)
    ap.add_argument("--ce-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument(
        "--threads", type=int, default=0, help="OMP_NUM_THREADS of every side (0: torch's)"
    )
    ap.add_argument("--engine-in-api", action="store_true", help="engine_processes false")
    ap.add_argument("--profile", action="store_true", help="cProfile one service step (client)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import tinker

    work = Workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        hand = HandProcess(model_dir, args)
        # before the server starts: the baseline alone, against independent plain loops
        checks = hand.checks(args.checks)
        config = {"engine_processes": not args.engine_in_api}
        with ServerProcess({NAME: model_dir}, Path(tmp) / "data", config=config) as server:
            svc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
            server_pids: list[int] = []  # filled once the worker is up
            service = {s: ServiceLoop(svc, work, args.rank, s, server_pids) for s in STYLES}
            server_pids += process_tree(server.proc.pid)
            steppers = {**{s: loop.step for s, loop in service.items()}, "hand": hand.step}
            phases = {k: Phases() for k in steppers}
            for step in steppers.values():  # warm-up
                step()
            # every order of the three loops in turn: none always follows another
            orders = list(itertools.permutations(steppers))
            for r in range(args.rounds):
                for k in orders[r % len(orders)]:
                    phases[k].add(steppers[k]())
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                service["lists"].step()
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
            svc.close("success")
        hand.close()
    print(json.dumps(report(phases, checks) | vars(args)))


if __name__ == "__main__":
    main()
