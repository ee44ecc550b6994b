"""`treadle estimate`: what a run will cost, before it runs, at the server's prices.

    treadle estimate --recipe math_rl --config math.json          # a recipe's config (JSON)
    treadle estimate --recipe chat_sft --config sft.json --json
    treadle estimate --model treadle/tiny-llama --dataset chats.jsonl --steps 100 --batch 32
    treadle estimate --model M --dataset prompts.jsonl --steps 50 --batch 16 \\
        --group-size 8 --max-tokens 256                              # RL: sampled, then trained

A recipe's estimate reads the data the run will read (its batches, its prompts); a bare
dataset (JSONL lines {"messages": [...]}) gives each step a batch of typical length (low:
the shortest examples, high: the longest). With --group-size the dataset's conversations
are prompts (their last assistant turn left out), each sampled group-size times.
The server is --base-url (default TREADLE_BASE_URL), its key TREADLE_API_KEY.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

RECIPES = ("math_rl", "chat_sft")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="a run's tokens and cost before it runs")
    p.add_argument("--recipe", choices=RECIPES, help="a cookbook recipe, with --config")
    p.add_argument("--config", help="the recipe's config as a JSON file (its fields)")
    p.add_argument("--model", help="the base model (without --recipe)")
    p.add_argument("--dataset", help="a JSONL file of {'messages': [...]} (without --recipe)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--batch", type=int, default=1, help="sequences (or prompts) per step")
    p.add_argument("--group-size", type=int, default=0, help="samples per prompt (RL)")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens per sample at most (RL)")
    p.add_argument("--base-url", default=None)
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from treadle import ServiceClient

    svc = ServiceClient(base_url=args.base_url)
    try:
        if args.recipe:
            if not args.config:
                sys.exit("treadle estimate: --recipe needs --config FILE.json")
            module = importlib.import_module(f"treadle.cookbook.recipes.{args.recipe}")
            cfg = module.Config(**json.loads(Path(args.config).read_text()))
            plan = module.plan_run(cfg, svc)
        else:
            if not (args.model and args.dataset):
                sys.exit("treadle estimate: give --recipe and --config, or --model and --dataset")
            plan = dataset_plan(args, svc.get_tokenizer(args.model))
        est = svc.estimate_cost(plan)
    finally:
        svc.close()
    print(json.dumps(est.to_json()) if args.json else est.summary())


def dataset_plan(args: argparse.Namespace, tokenizer):
    """A plan from a bare dataset: typical batches (mean length), bounded by the shortest and
    the longest examples."""
    from treadle.client.estimate import RunPlan, Span, sample_span

    lines = Path(args.dataset).read_text().splitlines()
    conversations = [json.loads(line)["messages"] for line in lines if line.strip()]
    if not conversations:
        sys.exit(f"treadle estimate: {args.dataset} holds no conversation")
    rl = args.group_size > 0
    lengths = []
    for messages in conversations:
        if rl and messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=rl, return_dict=True)
        lengths.append(len(ids["input_ids"]))
    n, steps = args.batch, args.steps
    mean = sum(lengths) / len(lengths)
    per_step = Span(n * min(lengths), n * mean, n * max(lengths))
    plan = RunPlan(args.model, steps)
    if not rl:
        plan.add("train", Span(*(x - n for x in vars(per_step).values())).scaled(steps))
        plan.notes.append("each step: a batch of typical length (shortest to longest examples)")
        return plan
    g, m = args.group_size, args.max_tokens
    plan.add("prefill", per_step.scaled(steps))
    plan.add("sample", sample_span(n, g, m).scaled(steps))
    trained = Span(0, g * (per_step.expected + n * (m / 2 - 1)), g * (per_step.high + n * (m - 1)))
    plan.add("train", trained.scaled(steps))
    plan.notes.append(
        f"completions: 1 to {m} tokens (expected half); a group of equal rewards trains nothing"
    )
    return plan
