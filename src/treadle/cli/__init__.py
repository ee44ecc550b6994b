"""The `treadle` command: each subcommand parses its flags and calls one importable function.

treadle serve --model treadle/tiny-llama=.models/tiny-llama --port 8000
treadle worker --model treadle/tiny-llama=.models/tiny-llama --connect tcp://host:5555
treadle worker --model m=/models/m --connect tcp://host:5555 --device cuda --devices 4 --shard fsdp
treadle make-tiny-model .models/tiny-llama --arch llama --size tiny
treadle hf-cache --model treadle/tiny-llama=.models/tiny-llama
treadle demo
treadle plot runs/demo
treadle status
treadle estimate --recipe math_rl --config math.json
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
from pathlib import Path
from typing import NoReturn


def _exit_interrupted(message: str | None = None) -> NoReturn:
    """Ctrl-C: say so in one line and exit with status 130 (128 + SIGINT), every time.
    After `sys.exit(130)` the process was seen, now and then, to end by the signal instead
    (status -2) during the interpreter's own shutdown; so the exit hooks run here
    (sessions finished, connections closed) and the process leaves without that shutdown."""
    if message is not None:
        print(message, file=sys.stderr)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def _serve(args: argparse.Namespace) -> None:
    from pydantic import ValidationError

    from treadle.server.config import ServerConfig, flag_values, parse_model_arg
    from treadle.server.main import serve

    # A --config file gives any ServerConfig field; flags given on the command line win.
    settings = json.loads(Path(args.config).read_text()) if args.config else {}
    models = dict(settings.get("models", {}))
    models.update(parse_model_arg(m) for m in args.model)
    if not models:
        sys.exit("treadle serve: give at least one --model NAME=PATH (or --model PATH)")
    try:
        config = ServerConfig(**{**settings, **flag_values(args), "models": models})
    except ValidationError as e:  # a setting out of range: which, and why, in one line
        said = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        sys.exit(f"treadle serve: {said}")
    try:
        serve(config)
    except KeyboardInterrupt:  # before the server handles signals itself (while importing)
        _exit_interrupted()


def _worker(args: argparse.Namespace) -> None:
    from treadle.server.config import ServerConfig, flag_values, parse_model_arg
    from treadle.server.engines.supervisor import group_args, worker_config
    from treadle.server.main import configure_process
    from treadle.worker.process import run_worker

    settings = json.loads(Path(args.config).read_text()) if args.config else {}
    models = dict(settings.get("models", {}))
    models.update(parse_model_arg(m) for m in args.model)
    if len(models) != 1:
        sys.exit("treadle worker: give exactly one --model NAME=PATH")
    config = ServerConfig(**{**settings, **flag_values(args), "models": models})
    if config.devices > 1 and "WORLD_SIZE" not in os.environ:
        # `treadle worker --devices N`: this same command as N torchrun ranks on this machine
        torchrun = [sys.executable, "-m", "torch.distributed.run", *group_args(config.devices)]
        os.execv(sys.executable, [*torchrun, "-m", "treadle.cli", *args.argv])
    configure_process(config)
    (name, path), *_ = models.items()
    run_worker(worker_config(config, name, path), args.connect, replica=args.replica)


def _make_tiny_model(args: argparse.Namespace) -> None:
    from treadle.engine.tiny import make_tiny_model

    path = make_tiny_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote {path}")


def _demo(args: argparse.Namespace) -> None:
    from treadle.demo import DemoError, run_demo

    try:
        run_demo(model_dir=args.model_dir, run_dir=args.run_dir, seed=args.seed, port=args.port)
    except DemoError as e:
        sys.exit(f"treadle demo: {e}")
    except KeyboardInterrupt:
        _exit_interrupted("\ntreadle demo: interrupted; run it again to start over")


def _hf_cache(args: argparse.Namespace) -> None:
    from treadle.hf_cache import place_models
    from treadle.server.config import parse_model_arg

    if not args.model:
        sys.exit("treadle hf-cache: give at least one --model NAME=PATH")
    for path in place_models(dict(parse_model_arg(m) for m in args.model), args.cache_dir):
        print(f"wrote {path}")


def _plot(args: argparse.Namespace) -> None:
    from treadle.cookbook.plot import plot_run

    for path in plot_run(args.run_dir):
        print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the training-session server")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        help="NAME=PATH of a local HF model folder (repeatable); PATH alone names it after the folder",
    )
    p.add_argument("--config", help="a JSON file of server settings (see ServerConfig)")
    from treadle.server.config import serve_flags

    serve_flags(p)  # --host, --port, --data-dir, --db, --dtype, ...: one per ServerConfig field
    p.set_defaults(func=_serve)

    p = sub.add_parser(
        "worker", help="run the engine of one model, connected to a server's worker address"
    )
    p.add_argument("--model", action="append", default=[], help="NAME=PATH of the model")
    p.add_argument(
        "--connect", required=True, help="the server's worker address, e.g. tcp://10.0.0.5:5555"
    )
    p.add_argument(
        "--replica", type=int, default=-1, help="which replica of the model (-1: any free one)"
    )
    p.add_argument("--config", help="a JSON file of server settings (see ServerConfig)")
    serve_flags(p)  # the engine's settings: --data-dir, --dtype, --device, ... (--db unused)
    p.set_defaults(func=_worker)

    p = sub.add_parser("make-tiny-model", help="build a small random model folder offline")
    p.add_argument("dir")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen3", "gpt_oss", "qwen3_moe"])
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("demo", help="SFT warm-up then GRPO on arithmetic, through the service")
    p.add_argument("--model-dir", default=".models/tiny-llama")
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "hf-cache",
        help="put served models' tokenizers in a local Hugging Face cache under their names",
    )
    p.add_argument("--model", action="append", default=[], help="NAME=PATH (repeatable)")
    p.add_argument("--cache-dir", help="default: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache")
    p.set_defaults(func=_hf_cache)

    p = sub.add_parser("plot", help="write PNG plots of a run folder's metrics.jsonl")
    p.add_argument("run_dir")
    p.set_defaults(func=_plot)

    from treadle.cli.admin import add_parsers as add_admin_parsers

    add_admin_parsers(sub)  # treadle admin ... | treadle usage

    from treadle.cli.checkpoints import add_parser as add_checkpoints_parser

    add_checkpoints_parser(sub)  # treadle checkpoints list|show|download|delete|retain

    from treadle.cli.status import add_parser as add_status_parser

    add_status_parser(sub)  # treadle status

    from treadle.cli.estimate import add_parser as add_estimate_parser

    add_estimate_parser(sub)  # treadle estimate
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    args.func(args)


if __name__ == "__main__":
    main()
