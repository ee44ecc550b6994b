"""The reusable RL loop (GRPO-style): sample groups, score them, train on the advantages.

One step:
  1. every env of every group gets its prompt sampled, all requests in flight at once;
  2. multi-turn envs get their next turns, again all at once, until every episode is done;
  3. advantages are group-relative: reward minus the group mean (optionally / group std);
  4. each trajectory becomes one Datum: prompt tokens masked out, the sampler's logprobs
     attached, the advantage on the action tokens;
  5. forward_backward + optim_step are sent back to back, then a fresh sampler is taken.
A held-out evaluation runs every `eval_every` steps, a checkpoint every `save_every` steps,
and a run re-opened on the same folder resumes from its last checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treadle import AdamParams, Datum, ModelInput, SamplingParams
from treadle.cookbook.estimate import announce, rl_run_plan
from treadle.cookbook.rl_types import Env, EnvGroupBuilder, RLDataset, Trajectory, Transition
from treadle.cookbook.run_dir import RunDir, open_training_client, step_bar


@dataclass
class RLConfig:
    model: str
    run_dir: str
    base_url: str | None = None
    lora_rank: int = 32
    lora_alpha: float | None = None
    learning_rate: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    grad_clip_norm: float = 1.0
    group_size: int = 8
    max_tokens: int = 64
    temperature: float = 1.0
    loss_fn: str = "ppo"  # importance_sampling | ppo | cispo
    normalize_std: bool = True
    remove_constant_reward_groups: bool = True
    max_steps: int = 20
    eval_every: int = 5
    eval_samples: int = 4
    save_every: int = 10
    seed: int = 0
    load_checkpoint_path: str | None = None  # start from these weights
    # ... and carry on its Adam moments too, as if the session went on (e.g. SFT then RL)
    load_optimizer: bool = False
    mlflow_uri: str | None = None
    wandb_project: str | None = None  # log to Weights & Biases too (tinker-cookbook's names)
    wandb_name: str | None = None
    extra: dict = field(default_factory=dict)


# ---- advantages and data ------------------------------------------------------------------


def group_advantages(rewards_G: Sequence[float], normalize_std: bool) -> np.ndarray:
    """Reward minus the group mean; divided by the group std when asked (and it is non-zero)."""
    rewards_G = np.asarray(rewards_G, dtype=np.float64)
    advantages_G = rewards_G - rewards_G.mean()
    if normalize_std:
        std = rewards_G.std()
        advantages_G = advantages_G / std if std > 1e-8 else advantages_G * 0.0
    return advantages_G


def trajectory_to_datum(trajectory: Trajectory, advantage: float, scale: float = 1.0) -> Datum:
    """One sequence for the whole episode: observations are masked (advantage 0), actions carry
    `advantage * scale` and the sampler's logprobs. Each later observation must extend the
    previous observation + action (the multi-turn contract of Env)."""
    tokens_T: list[int] = []
    logprobs_T: list[float] = []
    advantages_T: list[float] = []
    for t in trajectory.transitions:
        if tokens_T and t.observation[: len(tokens_T)] != tokens_T:
            raise ValueError("a multi-turn observation must extend the previous context")
        new_obs = t.observation[len(tokens_T) :]
        tokens_T += new_obs + t.action
        logprobs_T += [0.0] * len(new_obs) + list(t.action_logprobs)
        advantages_T += [0.0] * len(new_obs) + [advantage * scale] * len(t.action)
    # model_input[i] predicts target[i]: inputs drop the last token, targets drop the first.
    return Datum(
        model_input=ModelInput.from_ints(tokens_T[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens_T[1:], dtype=np.int64),
            "logprobs": np.asarray(logprobs_T[1:], dtype=np.float32),
            "advantages": np.asarray(advantages_T[1:], dtype=np.float32),
        },
    )


def build_datums(
    groups: list[list[Trajectory]], normalize_std: bool, remove_constant: bool
) -> tuple[list[Datum], dict[str, float]]:
    """Datums for a batch of groups; advantages are scaled by 1/(action tokens in the batch)
    so that the server's summed losses act as a per-token mean whatever the batch size."""
    kept: list[tuple[Trajectory, float]] = []
    n_constant = 0
    for trajectories_G in groups:
        rewards_G = [t.total_reward for t in trajectories_G]
        if remove_constant and max(rewards_G) - min(rewards_G) < 1e-8:
            n_constant += 1
            continue
        kept += zip(trajectories_G, group_advantages(rewards_G, normalize_std), strict=True)
    n_action = sum(len(tr.action) for t, _ in kept for tr in t.transitions)
    scale = 1.0 / max(n_action, 1)
    datums = [trajectory_to_datum(t, float(a), scale) for t, a in kept]
    stats = {"groups_constant": float(n_constant), "datums": float(len(datums))}
    return datums, stats


# ---- rollouts -----------------------------------------------------------------------------


class _Inline:
    map = staticmethod(map)


_INLINE = _Inline()


def rollout_groups(
    sampling_client,
    builders: list[EnvGroupBuilder],
    group_size: int,
    params: SamplingParams,
    step_pool: Executor | None = None,
) -> list[list[Trajectory]]:
    """Play every env of every group to the end; all samples of a turn are in flight at once.

    A group whose envs share one prompt is sampled as one request with num_samples=G, so the
    server prefills that prompt once. With `step_pool`, the envs of a request score their
    answers in parallel on it (for slow graders, e.g. a code sandbox)."""
    envs_G = [list(build(group_size)) for build in builders]
    transitions = {(g, i): [] for g, envs in enumerate(envs_G) for i in range(len(envs))}
    observations = {k: envs_G[k[0]][k[1]].initial_observation() for k in transitions}
    active = set(transitions)
    while active:
        futures = _submit_turn(sampling_client, envs_G, observations, active, params)
        for keys, future in futures:
            sequences = future.result().sequences
            envs: list[Env] = [envs_G[k[0]][k[1]] for k in keys]
            actions = [list(seq.tokens) for seq in sequences]
            step = (step_pool or _INLINE).map
            results = list(step(lambda e, a: e.step(a), envs, actions))
            for key, seq, result in zip(keys, sequences, results, strict=True):
                transitions[key].append(
                    Transition(
                        observations[key],
                        list(seq.tokens),
                        list(seq.logprobs or []),
                        result.reward,
                        result.metrics,
                    )
                )
                if result.done:
                    active.discard(key)
                else:
                    observations[key] = result.next_observation
    return [
        [Trajectory(transitions[(g, i)]) for i in range(len(envs))] for g, envs in enumerate(envs_G)
    ]


def request_seed(seed: int, group: int, prompt: Sequence[int]) -> int:
    """A seed of its own for each group and turn (the prompt grows with the turns). A server
    draws a request's randomness from its seed alone, so one seed shared by every request of
    an evaluation would give all problems the same random draws: their errors would be
    correlated and the mean far noisier than its binomial error says."""
    return int(np.random.SeedSequence([seed, group, len(prompt)]).generate_state(1)[0])


def _submit_turn(sampling_client, envs_G, observations, active, params: SamplingParams):
    by_prompt: dict[tuple[int, tuple[int, ...]], list] = {}
    for key in sorted(active):
        stop = envs_G[key[0]][key[1]].stop
        group_key = (key[0], tuple(observations[key]))
        by_prompt.setdefault(group_key, []).append((key, stop))
    futures = []
    for (g, prompt), members in by_prompt.items():
        keys = [k for k, _ in members]
        stop = members[0][1]
        turn_params = params.model_copy(update={"stop": stop}) if stop is not None else params
        if params.seed is not None:
            turn_params = turn_params.model_copy(
                update={"seed": request_seed(params.seed, g, prompt)}
            )
        future = sampling_client.sample(
            list(prompt), num_samples=len(keys), sampling_params=turn_params
        )
        futures.append((keys, future))
    return futures


# ---- evaluation ---------------------------------------------------------------------------


def evaluate(
    sampling_client,
    builders: list[EnvGroupBuilder],
    config: RLConfig,
    seed: int,
    step_pool: Executor | None = None,
) -> dict[str, float]:
    """Held-out reward at the sampling temperature (eval_samples per problem, fixed seed) and
    greedy accuracy (`correct` metric of each env, or reward > 0)."""
    sampled = SamplingParams(
        max_tokens=config.max_tokens, temperature=config.temperature, seed=seed
    )
    groups = rollout_groups(sampling_client, builders, config.eval_samples, sampled, step_pool)
    rewards = [t.total_reward for g in groups for t in g]
    greedy = rollout_groups(
        sampling_client,
        builders,
        1,
        SamplingParams(max_tokens=config.max_tokens, temperature=0),
        step_pool,
    )
    correct = [t.metrics.get("correct", float(t.total_reward > 0)) for g in greedy for t in g]
    return {
        "test/reward": float(np.mean(rewards)),
        "test/greedy_accuracy": float(np.mean(correct)),
    }


# ---- the loop -----------------------------------------------------------------------------


def open_rl_run(
    config: RLConfig, make_dataset: Callable[[Any], RLDataset], service=None
) -> tuple[RunDir, Any, int, RLDataset]:
    """The run folder, its training client (resumed, loaded or new), the first step and the
    data set: what every RL loop starts with."""
    from treadle import ServiceClient

    run = RunDir(
        config.run_dir,
        config,
        mlflow_uri=config.mlflow_uri,
        wandb_project=config.wandb_project,
        wandb_name=config.wandb_name,
    )
    svc = service or ServiceClient(base_url=config.base_url)
    training_client, start_step, _ = open_training_client(
        svc,
        run,
        config.model,
        config.lora_rank,
        config.lora_alpha,
        config.seed,
        config.load_checkpoint_path,
        config.load_optimizer,
    )
    return run, training_client, start_step, make_dataset(training_client.get_tokenizer())


def sampling_and_adam(config: RLConfig) -> tuple[SamplingParams, AdamParams]:
    params = SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature)
    adam = AdamParams(
        learning_rate=config.learning_rate,
        beta1=config.adam_beta1,
        beta2=config.adam_beta2,
        eps=1e-8,
        grad_clip_norm=config.grad_clip_norm,
    )
    return params, adam


def train_rl(
    config: RLConfig,
    make_dataset: Callable[[Any], RLDataset],
    service=None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> RunDir:
    """Run (or resume) GRPO; `make_dataset(tokenizer)` builds the data once the model's
    tokenizer is known; `on_step(step, metrics)` sees each step's metrics (e.g. to print a
    table). Returns the run folder with its metrics."""
    run, training_client, start_step, dataset = open_rl_run(config, make_dataset, service)
    announce(run.service, rl_run_plan(config, dataset))  # the run's cost, before it runs
    sampling_client = training_client.save_weights_and_get_sampling_client()
    params, adam = sampling_and_adam(config)
    bar = step_bar("rl", start_step, config.max_steps)
    for step in bar:
        metrics: dict[str, float] = {}
        if config.eval_every and step % config.eval_every == 0 and dataset.test_groups():
            metrics |= evaluate(sampling_client, dataset.test_groups(), config, config.seed)
        t0 = time.monotonic()
        groups = rollout_groups(sampling_client, dataset.get_batch(step), config.group_size, params)
        t1 = time.monotonic()
        datums, stats = build_datums(
            groups, config.normalize_std, config.remove_constant_reward_groups
        )
        if datums:
            fwd_bwd = training_client.forward_backward(datums, loss_fn=config.loss_fn)
            optim = training_client.optim_step(adam)
            fwd_bwd.result()
            optim.result()
            sampling_client = training_client.save_weights_and_get_sampling_client()
        t2 = time.monotonic()
        rewards = [t.total_reward for g in groups for t in g]
        metrics |= {
            "train/reward": float(np.mean(rewards)),
            "train/tokens": float(
                sum(len(tr.action) for g in groups for t in g for tr in t.transitions)
            ),
            "time/sample_s": t1 - t0,
            "time/train_s": t2 - t1,
            **{f"train/{k}": v for k, v in stats.items()},
        }
        record_step(run, training_client, config, step, metrics, on_step)
        bar.set_postfix(reward=f"{metrics['train/reward']:.3f}")
    final = _final_eval(sampling_client, dataset, config)
    if final:
        run.log_metrics(config.max_steps, final)
        if on_step:
            on_step(config.max_steps, final)
    run.close()
    return run


def record_step(
    run: RunDir,
    training_client,
    config: RLConfig,
    step: int,
    metrics: dict[str, float],
    on_step: Callable[[int, dict[str, float]], None] | None,
) -> None:
    """A step's metrics to the run folder and the caller, and its checkpoint when due."""
    run.log_metrics(step, metrics)
    if on_step:
        on_step(step, metrics)
    if config.save_every and (step + 1) % config.save_every == 0:
        state = training_client.save_state(f"step-{step + 1:06d}").result().path
        run.log_checkpoint(step + 1, state_path=state)


def _final_eval(sampling_client, dataset: RLDataset, config: RLConfig) -> dict[str, float]:
    if not (config.eval_every and dataset.test_groups()):
        return {}
    return evaluate(sampling_client, dataset.test_groups(), config, config.seed)
