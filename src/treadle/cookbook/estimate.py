"""What a cookbook run will cost, before it runs, and what it costs as it goes.

- `sft_run_plan` / `rl_run_plan`: the tokens of a recipe's run, read off the same data the
  loop will use (the SFT batches and evaluations exactly; the RL prompts exactly, with the
  completions bounded by max_tokens), as a RunPlan of the SDK (treadle.client.estimate);
- `announce(svc, plan)`: the plan priced with the server's table, printed (and returned);
- `CostMeter`: the run's metered cost from the usage API (its session's row), each step's
  and the total, as metrics `cost/step_usd` and `cost/total_usd`.

    treadle estimate --recipe math_rl --config math.json        # the estimate alone
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from treadle.client.estimate import CostEstimate, RunPlan, exact, rl_plan, sft_plan
from treadle.cookbook.rl_types import RLDataset

log = logging.getLogger("treadle.cookbook")


def sft_run_plan(config: Any, sequences: Sequence, test: Sequence = ()) -> RunPlan:
    """The tokens of train_sft's run (SFTConfig): each step's batch, drawn as the loop draws
    it, and its held-out forward passes (eval_every)."""
    from treadle.cookbook.run_dir import step_rng  # (run_dir imports this module)
    from treadle.cookbook.sft import example_to_datum

    batches_S_B = []
    for step in range(config.max_steps):
        rng = step_rng(config.seed, step)
        batch = rng.sample(list(sequences), min(config.batch_size, len(sequences)))
        batches_S_B.append([example_to_datum(e).model_input.length for e in batch])
    plan = sft_plan(config.model, batches_S_B)
    if test and config.eval_every:
        evals = sum(1 for s in range(config.max_steps) if (s + 1) % config.eval_every == 0)
        per_eval = sum(len(tokens_T) - 1 for tokens_T, _ in test)
        plan.add("train", exact(evals * per_eval))  # forward passes are metered as train
    return plan


def rl_run_plan(config: Any, dataset: RLDataset) -> RunPlan:
    """The tokens of train_rl's run (RLConfig): each step's prompts as the dataset draws
    them, completions of 1 to max_tokens, and its evaluations (eval_every, and a last one)."""

    def prompt_len(build: Any) -> int:
        return len(list(build(1))[0].initial_observation())

    prompts_S_P = [
        [prompt_len(b) for b in dataset.get_batch(step)] for step in range(config.max_steps)
    ]
    test = dataset.test_groups() if config.eval_every else []
    evals = 0
    if test:
        evals = sum(1 for s in range(config.max_steps) if s % config.eval_every == 0) + 1
    return rl_plan(
        config.model,
        prompts_S_P,
        config.group_size,
        config.max_tokens,
        eval_prompts_P=[prompt_len(b) for b in test],
        evals=evals,
        eval_samples=config.eval_samples,
    )


def announce(service: Any, plan: RunPlan) -> CostEstimate | None:
    """Print the plan's cost at the server's prices (a server without a price route, e.g.
    another Tinker server: nothing)."""
    estimate = getattr(service, "estimate_cost", None)
    if estimate is None:
        return None
    try:
        est = estimate(plan)
    except Exception as e:  # noqa: BLE001 - an estimate never stops a run
        log.warning("no cost estimate: %s", e)
        return None
    print(est.summary(), flush=True)
    return est


class CostMeter:
    """The run's metered cost so far (its session's row of the usage report), per step."""

    def __init__(self, service: Any):
        self.service = service
        self.total = 0.0
        self._working = callable(getattr(service, "get_usage", None))

    def step(self) -> dict[str, float]:
        """{cost/step_usd, cost/total_usd} since the last call (empty without a usage API)."""
        if not self._working:
            return {}
        try:
            rows = self.service.get_usage(by="session")["rows"]
        except Exception as e:  # noqa: BLE001 - the run goes on without its cost
            log.warning("no metered cost (%s); not asking again", e)
            self._working = False
            return {}
        session = getattr(self.service, "session_id", None)
        total = sum(r.get("cost_usd") or 0.0 for r in rows if r.get("key") == session)
        step, self.total = total - self.total, total
        return {"cost/step_usd": step, "cost/total_usd": total}
