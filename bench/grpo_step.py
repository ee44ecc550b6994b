"""One GRPO-shaped step through the service, driven by the official `tinker` SDK, against the
same phases written by hand with torch + peft in one process.

    python bench/grpo_step.py                 # 5 alternations after a warm-up of each
    python bench/grpo_step.py --rounds 2      # a quick look
    python bench/grpo_step.py --profile       # also cProfile one service step's client side

The workload: a 5.2M-parameter Qwen3 (hidden 256, 4 layers, vocab 8192, random weights),
LoRA rank 8 on every linear layer including the unembedding, and per step
- `sample`: 8 prompts of --prompt-len tokens x 4 samples x 32 new tokens at T=1;
- `ppo`: a PPO forward_backward over the 32 sequences (prompt masked by advantage 0), with
  group-relative advantages of a made-up reward, then `optim`: one AdamW step;
- `ce`: a cross-entropy forward_backward over 8 x 128 tokens (an SFT-shaped call);
- the service refreshes its sampler (`save_weights_and_get_sampling_client`, `refresh`);
  the hand-written loop instead needs `logprobs`: a no-grad pass over the sampled sequences
  for the old logprobs PPO needs (`generate` does not give the trainer's numbers), which the
  service's sampler returns with the tokens.
The two loops alternate step by step (service, hand, hand, service, ...) so that a shared
machine's load swings hit both alike; figures are medians of the per-phase seconds, and
every ratio is service time / hand-written time (below 1: the service is faster).
Goals: `ce` and `ppo` <= 1.05, the whole GRPO step (everything above but `ce`) <= 0.85.
Ends with one JSON line.
"""

from __future__ import annotations

import os

from treadle.server.main import OPENMP_SPIN_COUNT

if "OMP_WAIT_POLICY" not in os.environ:  # before torch loads: as `treadle serve` sets it
    os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
if "--threads" in os.sys.argv:  # before torch loads; the server inherits it too
    os.environ["OMP_NUM_THREADS"] = os.sys.argv[os.sys.argv.index("--threads") + 1]

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from treadle.engine.tiny import make_tiny_model  # noqa: E402
from treadle.launch import ServerProcess  # noqa: E402

NAME = "bench/qwen3-5m"
API_KEY = "tml-bench"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
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
PHASES = ("sample", "logprobs", "ppo", "optim", "refresh", "ce")


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

    def new_step(self) -> dict[str, float]:
        self.steps.append({})
        return self.steps[-1]

    def median(self, phase: str) -> float:
        return statistics.median(s.get(phase, 0.0) for s in self.steps)

    def median_total(self, phases: tuple[str, ...]) -> float:
        return statistics.median(sum(s.get(p, 0.0) for p in phases) for s in self.steps)


class clock:
    """with clock(step, "ppo"): ... adds the block's wall time to step["ppo"]."""

    def __init__(self, step: dict[str, float], phase: str):
        self.step, self.phase = step, phase

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.step[self.phase] = self.step.get(self.phase, 0.0) + time.perf_counter() - self.t0


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
    def __init__(self, url: str, work: Workload, rank: int):
        import tinker

        self.T = tinker.types
        self.work = work
        self.svc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        self.tc = self.svc.create_lora_training_client(base_model=NAME, rank=rank, seed=0)
        self.sc = self.tc.save_weights_and_get_sampling_client().result()
        T = self.T
        self.ce_data = [
            T.Datum(
                model_input=T.ModelInput.from_ints(row[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": T.TensorData.from_numpy(row[1:].astype(np.int64)),
                    "weights": T.TensorData.from_numpy(np.ones(len(row) - 1, np.float32)),
                },
            )
            for row in work.ce_B_T
        ]

    def step(self, step: dict[str, float]) -> None:
        T, w = self.T, self.work
        params = T.SamplingParams(max_tokens=w.new_tokens, temperature=1.0, stop=[])  # no EOS
        with clock(step, "sample"):
            futs = [
                self.sc.sample(T.ModelInput.from_ints(p.tolist()), w.samples, params)
                for p in w.prompts_G_P
            ]
            results = [f.result() for f in futs]
        with clock(step, "ppo"):
            data = self._ppo_data(results)
            self.tc.forward_backward(data, "ppo").result()
        with clock(step, "optim"):
            self.tc.optim_step(T.AdamParams(learning_rate=w.lr)).result()
        with clock(step, "refresh"):
            self.sc = self.tc.save_weights_and_get_sampling_client().result()
        with clock(step, "ce"):
            self.tc.forward_backward(self.ce_data, "cross_entropy").result()

    def _ppo_data(self, results) -> list:
        T, w = self.T, self.work
        seqs = [[s for s in r.sequences] for r in results]
        rewards = np.array([rewards_of([s.tokens for s in g]) for g in seqs])  # (G, S)
        adv_G_S = group_advantages(rewards)
        data = []
        for prompt, group, advs in zip(w.prompts_G_P, seqs, adv_G_S, strict=True):
            P = len(prompt)
            for seq, a in zip(group, advs, strict=True):
                full = np.concatenate([prompt, np.asarray(seq.tokens, np.int64)])
                n = len(full) - 1
                logprobs = np.zeros(n, np.float32)
                logprobs[P - 1 :] = seq.logprobs
                advantages = np.zeros(n, np.float32)
                advantages[P - 1 :] = a
                data.append(
                    T.Datum(
                        model_input=T.ModelInput.from_ints(full[:-1].tolist()),
                        loss_fn_inputs={
                            "target_tokens": T.TensorData.from_numpy(full[1:]),
                            "logprobs": T.TensorData.from_numpy(logprobs),
                            "advantages": T.TensorData.from_numpy(advantages),
                        },
                    )
                )
        return data


# ---- the same phases by hand: torch + peft in one process ----
class HandLoop:
    def __init__(self, model_dir: Path, work: Workload, rank: int, alpha: float):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.work = work
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        base.generation_config.eos_token_id = None  # 32 new tokens every time, as a bound
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0)
        self.model = get_peft_model(base, config)
        self.opt = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=work.lr, betas=(0.9, 0.95)
        )
        self.ce_ids = torch.as_tensor(work.ce_B_T[:, :-1])  # (B, T)
        self.ce_targets = torch.as_tensor(work.ce_B_T[:, 1:])  # (B, T)

    def step(self, step: dict[str, float]) -> None:
        w = self.work
        G, P = w.prompts_G_P.shape
        with clock(step, "sample"):
            ids = torch.as_tensor(np.repeat(w.prompts_G_P, w.samples, axis=0))  # (G*S, P)
            with torch.no_grad():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=w.new_tokens,
                    pad_token_id=0,
                )  # (G*S, P + new)
        inputs, targets = out[:, :-1], out[:, 1:]  # (N, L)
        with clock(step, "logprobs"):
            with torch.no_grad():
                old = self._logprobs(inputs, targets)  # (N, L)
        with clock(step, "ppo"):
            rewards = rewards_of(out[:, P:].tolist()).reshape(G, w.samples)
            adv = torch.as_tensor(group_advantages(rewards).reshape(-1, 1), dtype=torch.float32)
            mask = torch.zeros_like(old)
            mask[:, P - 1 :] = 1.0  # the sampled tokens
            lp = self._logprobs(inputs, targets)  # (N, L)
            ratio = torch.exp(lp - old)
            clipped = torch.clamp(ratio, 0.8, 1.2)
            loss = -(torch.minimum(ratio * adv, clipped * adv) * mask).sum()
            loss.backward()
        with clock(step, "optim"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        with clock(step, "ce"):
            lp = self._logprobs(self.ce_ids, self.ce_targets)
            (-lp.sum()).backward()

    def _logprobs(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=inputs, use_cache=False).logits  # (N, L, V)
        N, L, V = logits.shape
        lp = -F.cross_entropy(
            logits.float().view(N * L, V), targets.reshape(N * L), reduction="none"
        )
        return lp.view(N, L)


def report(svc: Phases, hand: Phases) -> dict:
    grpo = ("sample", "logprobs", "ppo", "optim", "refresh")
    out: dict = {"bench": "grpo_step", "steps": len(svc.steps)}
    print(f"{'phase':10s} {'service s':>10s} {'hand s':>10s} {'ratio':>7s}")
    for phase in PHASES:
        s, h = svc.median(phase), hand.median(phase)
        ratio = s / h if h else None
        out[f"service_{phase}_s"], out[f"hand_{phase}_s"] = round(s, 4), round(h, 4)
        if ratio is not None:
            out[f"{phase}_ratio"] = round(ratio, 3)
        shown = f"{ratio:7.3f}" if ratio is not None else "      -"
        print(f"{phase:10s} {s:10.4f} {h:10.4f} {shown}")
    for name, phases in (("grpo_step", grpo), ("step_with_ce", PHASES)):
        s, h = svc.median_total(phases), hand.median_total(phases)
        out[f"service_{name}_s"], out[f"hand_{name}_s"] = round(s, 4), round(h, 4)
        out[f"{name}_ratio"] = round(s / h, 3)
        print(f"{name:10s} {s:10.4f} {h:10.4f} {s / h:7.3f}")
    print("goals: ce, ppo <= 1.05; grpo_step <= 0.85 (ratio = service / hand-written time)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="steps of each loop after a warm-up")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ce-rows", type=int, default=8)
    ap.add_argument("--ce-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument(
        "--threads", type=int, default=0, help="OMP_NUM_THREADS of both sides (0: torch's)"
    )
    ap.add_argument("--engine-in-api", action="store_true", help="engine_processes false")
    ap.add_argument("--profile", action="store_true", help="cProfile one service step (client)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    work = Workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        config = {"engine_processes": not args.engine_in_api}
        with ServerProcess({NAME: model_dir}, Path(tmp) / "data", config=config) as server:
            service = ServiceLoop(server.url, work, args.rank)
            hand = HandLoop(model_dir, work, args.rank, SERVER_ALPHA)
            svc_phases, hand_phases = Phases(), Phases()
            service.step({}), hand.step({})  # warm-up
            for r in range(args.rounds):
                order = (service, hand) if r % 2 == 0 else (hand, service)
                for loop in order:
                    loop.step((svc_phases if loop is service else hand_phases).new_step())
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                service.step({})
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
            service.svc.close("success")
    print(json.dumps(report(svc_phases, hand_phases) | vars(args)))


if __name__ == "__main__":
    main()
