"""The vLLM process: one vLLM engine driven over a zmq socket by a Treadle worker.

Runs under the vLLM virtualenv's python (its pinned torch, transformers and vLLM), never
under Treadle's own: it imports nothing of treadle, only the standard library, zmq (a vLLM
dependency) and vLLM. Started by treadle.worker.vllm.process:

    .venv-vllm/bin/python driver.py --socket ipc://... --settings '{"model": ..., ...}'

One PAIR socket, JSON messages both ways (floats round-trip exactly through Python's json):
worker → driver  {"op": "add_lora", "name", "id", "path"} | {"op": "remove_lora", "id"}
                 {"op": "generate", "rid", "prompt", "params", "lora": id | null, "stream",
                  "salt": the prefix cache's scope | null}
                 {"op": "abort", "rids"} | {"op": "stop"}
driver → worker  {"ev": "ready", "startup_s"} | {"ev": "ack", "op", "id", "ok", "error"}
                 {"ev": "tokens", "rid", "tokens", "logprobs", "topk"} (streamed requests)
                 {"ev": "done", "rid", "tokens", "logprobs", "topk", "finish", "cached"}
                 {"ev": "error", "rid", "error"}
A request is one sample (n=1): the worker fans a request's num_samples out itself, seeds
seed + j as vLLM's own fan-out does, and the prefix cache shares the prompt's prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True, help="the worker's zmq address (it binds)")
    p.add_argument("--settings", required=True, help="JSON: EngineArgs fields")
    args = p.parse_args()
    # one process: the engine core in this one, so that a crash is one process ending
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.socket)
    t0 = time.monotonic()
    try:
        engine = _engine(json.loads(args.settings))
    except Exception:
        sock.send_json({"ev": "failed", "error": traceback.format_exc()[-4000:]})
        sys.exit(1)
    sock.send_json({"ev": "ready", "startup_s": time.monotonic() - t0})
    Driver(engine, sock).run()


def _engine(settings: dict):
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(**settings))


class Driver:
    def __init__(self, engine, sock):
        from vllm.lora.request import LoRARequest

        self.engine = engine
        self.sock = sock
        self.loras: dict[int, LoRARequest] = {}
        self.stream: dict[str, int] = {}  # streamed rid → tokens sent so far
        self._LoRARequest = LoRARequest

    def run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        parent = os.getppid()
        while os.getppid() == parent:  # orphaned (the worker died): end with it
            busy = self.engine.has_unfinished_requests()
            # between steps: take every waiting message; idle: block until one comes
            while poller.poll(0 if busy else 1000):
                msg = self.sock.recv_json()
                if msg["op"] == "stop":
                    return
                self._handle(msg)
                busy = self.engine.has_unfinished_requests()
            if busy:
                for out in self.engine.step():
                    self._emit(out)

    def _handle(self, msg: dict) -> None:
        op = msg["op"]
        try:
            if op == "add_lora":
                lora = self._LoRARequest(msg["name"], msg["id"], msg["path"])
                if not self.engine.add_lora(lora):
                    raise RuntimeError(f"vLLM refused LoRA {msg['name']!r}")
                self.loras[msg["id"]] = lora
                self.sock.send_json({"ev": "ack", "op": op, "id": msg["id"], "ok": True})
            elif op == "remove_lora":
                self.loras.pop(msg["id"], None)
                self.engine.remove_lora(msg["id"])
                self.sock.send_json({"ev": "ack", "op": op, "id": msg["id"], "ok": True})
            elif op == "generate":
                self._generate(msg)
            elif op == "abort":
                self.engine.abort_request(list(msg["rids"]))
                for rid in msg["rids"]:
                    self.stream.pop(rid, None)
        except Exception as e:
            tb = traceback.format_exc()[-4000:]
            if op == "generate":
                self.sock.send_json({"ev": "error", "rid": msg["rid"], "error": tb})
            else:
                self.sock.send_json({"ev": "ack", "op": op, "id": msg.get("id"), "ok": False,
                                     "error": f"{type(e).__name__}: {e}"})  # fmt: skip

    def _generate(self, msg: dict) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        q = msg["params"]
        kind = RequestOutputKind.DELTA if msg["stream"] else RequestOutputKind.FINAL_ONLY
        params = SamplingParams(
            n=1,
            max_tokens=q["max_tokens"],
            temperature=q["temperature"],
            top_k=q["top_k"],
            top_p=q["top_p"],
            seed=q["seed"],
            stop=q["stop"] or None,
            stop_token_ids=q["stop_token_ids"] or None,
            ignore_eos=True,  # the worker lists the stop ids itself (stop_token_ids)
            logprobs=q["logprobs"],
            skip_special_tokens=False,  # "<|im_end|>" is a stop string, as in Treadle's
            output_kind=kind,
        )
        lora = self.loras.get(msg["lora"]) if msg["lora"] is not None else None
        if msg["lora"] is not None and lora is None:
            raise RuntimeError(f"LoRA id {msg['lora']} is not loaded")
        if msg["stream"]:
            self.stream[msg["rid"]] = 0
        prompt = {"prompt_token_ids": msg["prompt"]}
        if msg.get("salt"):
            prompt["cache_salt"] = msg["salt"]
        self.engine.add_request(msg["rid"], prompt, params, lora_request=lora)

    def _emit(self, out) -> None:
        rid = out.request_id
        c = out.outputs[0]
        tokens = list(c.token_ids)
        logprobs, topk = [], []
        for t, lps in zip(tokens, c.logprobs or [], strict=False):
            logprobs.append(lps[t].logprob)
            ranked = sorted((v.rank, k, v.logprob) for k, v in lps.items() if v.rank is not None)
            topk.append([[k, lp] for _, k, lp in ranked])
        if rid in self.stream:
            self.sock.send_json(
                {"ev": "tokens", "rid": rid, "tokens": tokens, "logprobs": logprobs, "topk": topk}
            )
            if not out.finished:
                return
            self.stream.pop(rid)
            tokens, logprobs, topk = [], [], []  # all sent already
        if out.finished:
            finish = "length" if c.finish_reason == "length" else "stop"
            self.sock.send_json(
                {
                    "ev": "done",
                    "rid": rid,
                    "tokens": tokens,
                    "logprobs": logprobs,
                    "topk": topk,
                    "finish": finish,
                    "cached": out.num_cached_tokens or 0,  # prompt tokens the prefix cache held
                }
            )


if __name__ == "__main__":
    main()
