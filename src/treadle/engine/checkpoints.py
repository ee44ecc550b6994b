"""Adapters on disk: PEFT-format adapters, merged HF models and training state.

- PEFT adapter: adapter_config.json + adapter_model.safetensors with PEFT's key names
  (base_model.model.<module path>.lora_A.weight / lora_B.weight), so that
  peft.PeftModel.from_pretrained(base, dir) gives the engine's logprobs. Also read back,
  which imports adapters trained elsewhere (rank_pattern, alpha_pattern, rslora included).
  A MoE model's fused expert weights are peft `target_parameters`: their keys name the
  experts module, one `.base_layer` deeper per targeted parameter registered after it
  (peft nests one ParamWrapper per parameter), in peft's (r*E, in) / (out, r*E) layout.
- Merged model: a plain HF folder with W + scale * B A folded in; tokenizer files copied
  (from a GGUF base: its tokenizer written with save_pretrained).
- Training state: the PEFT adapter + AdamW state (optimizer.pt) + step (treadle_state.json);
  save -> load -> continue equals uninterrupted training bit for bit.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from treadle.engine.lora import Adapter, AdapterBank
from treadle.engine.lora_experts import (
    delta_weight,
    expert_modules,
    find_expert_params,
    from_peft,
    to_peft,
)
from treadle.engine.model_files import load_tokenizer, model_source
from treadle.engine.optim import check_optimizer_state, optimizer_of
from treadle.engine.types import LoraSpec
from treadle.errors import InvalidRequestError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TREADLE_META = "treadle_adapter.json"
OPTIMIZER = "optimizer.pt"
STATE = "treadle_state.json"
GRADS = "gradients.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(
    r"^base_model\.model\.(.+?)((?:\.base_layer)*)\.(lora_A|lora_B)(?:\.[A-Za-z0-9_\-]+)?\.weight$"
)
# peft saves the base weight of a targeted lm_head whose embedding is tied to it
# (save_embedding_layers): a copy of the base model's, which the adapter does not change
_BASE_KEY = re.compile(r"^base_model\.model\.(.+?)\.base_layer\.weight$")
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)$|.*\.safetensors\.index\.json$")


# ---- PEFT adapters ----
def save_adapter(bank: AdapterBank, adapter: Adapter, out_dir: str | Path, base_model: str) -> None:
    """Write adapter_config.json + adapter_model.safetensors (+ our spec, for seed and flags)."""
    from peft import LoraConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    experts = [p for p in adapter.layers if p in bank.experts]
    linear = [p for p in adapter.layers if p not in bank.experts]
    ranks = {path: pair.rank for path, pair in adapter.layers.items()}
    alphas = {path: pair.scale * ranks[path] for path, pair in adapter.layers.items()}
    r = Counter(ranks.values()).most_common(1)[0][0]
    alpha = Counter(alphas.values()).most_common(1)[0][0]
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=_target_modules(bank.model, linear) if linear else [],
        target_parameters=_target_parameters(bank, experts) or None,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        # full paths as pattern keys: PEFT matches them as `(.*\.)?key$`
        rank_pattern={re.escape(p): v for p, v in ranks.items() if v != r},
        alpha_pattern={re.escape(p): v for p, v in alphas.items() if v != alpha},
    )
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(out))
    tensors = {}
    for path in linear:
        pair = adapter.layers[path]
        tensors[f"{PREFIX}{path}.lora_A.weight"] = pair.A.detach().cpu().contiguous()
        tensors[f"{PREFIX}{path}.lora_B.weight"] = pair.B.detach().cpu().contiguous()
    for path, key in _expert_keys(bank, experts).items():
        lora_a, lora_b = to_peft(adapter.layers[path])
        tensors[f"{key}.lora_A.weight"] = lora_a.cpu()
        tensors[f"{key}.lora_B.weight"] = lora_b.cpu()
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / TREADLE_META).write_text(json.dumps({"spec": asdict(adapter.spec)}, indent=2))


def _target_modules(model: nn.Module, paths: list[str]) -> list[str] | str:
    """Leaf names when they select exactly these modules, else a full-path regex."""
    leaves = sorted({p.rsplit(".", 1)[-1] for p in paths})
    matched = {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in leaves
    }
    if matched == set(paths):
        return leaves
    return "^(" + "|".join(re.escape(p) for p in sorted(paths)) + ")$"


def _target_parameters(bank: AdapterBank, paths: list[str]) -> list[str]:
    """peft target_parameters for these expert weights: `mlp.experts.gate_up_proj`-like
    suffixes where they select exactly these, else the full paths (matched as equal)."""
    suffixes = sorted({".".join(p.split(".")[-3:]) for p in paths})
    matched = {q for q in bank.experts if any(q.endswith(f".{s}") for s in suffixes)}
    return suffixes if matched == set(paths) else sorted(paths)


def _expert_keys(bank: AdapterBank, paths: list[str]) -> dict[str, str]:
    """Expert weight path -> its key prefix in the adapter file (see the module docstring)."""
    keys: dict[str, str] = {}
    for module, params in expert_modules(bank.experts).items():
        targeted = [p for p in params if p in paths]
        for i, path in enumerate(targeted):
            keys[path] = PREFIX + module + ".base_layer" * (len(targeted) - 1 - i)
    return keys


def _expert_path(bank: AdapterBank, cfg: dict, module: str, depth: int) -> str | None:
    """The expert weight a key `module(.base_layer)*depth` names, from the config's
    target_parameters (None: module is no experts module, or depth names nothing)."""
    wanted = cfg.get("target_parameters") or []
    params = expert_modules(bank.experts).get(module, [])
    targeted = [p for p in params if any(p == t or p.endswith(f".{t}") for t in wanted)]
    if depth >= len(targeted):
        return None
    return targeted[len(targeted) - 1 - depth]


def read_adapter(
    in_dir: str | Path, bank: AdapterBank
) -> tuple[LoraSpec, dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float]]:
    """(spec, {module path: (A, B)}, {module path: scale}) of a PEFT LoRA adapter folder."""
    folder = Path(in_dir)
    cfg_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not cfg_file.is_file() or not weights_file.is_file():
        raise InvalidRequestError(
            f"adapter folder must hold {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; "
            f"found {sorted(p.name for p in folder.iterdir()) if folder.is_dir() else 'nothing'}"
        )
    cfg = json.loads(cfg_file.read_text())
    _check_peft_config(cfg)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        if (base := _BASE_KEY.match(key)) is not None:
            _check_base_copy(bank, base.group(1), key, tensor)
            continue
        m = _KEY.match(key)
        path = None if m is None else m.group(1)
        if m is not None and (m.group(2) or path in expert_modules(bank.experts)):
            path = _expert_path(bank, cfg, path, m.group(2).count(".base_layer"))
        if path is None:
            raise InvalidRequestError(
                f"{ADAPTER_WEIGHTS} key {key!r} is not a LoRA weight of this model; expected "
                f"'{PREFIX}<module>.lora_A.weight' or '.lora_B.weight' (for an experts module "
                "targeted by target_parameters, with one '.base_layer' per nested parameter)"
            )
        pairs.setdefault(path, {})[m.group(3)] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scales: dict[str, float] = {}
    for path, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise InvalidRequestError(f"{ADAPTER_WEIGHTS}: module {path!r} lacks lora_A or lora_B")
        if path in bank.experts:  # peft's (r*E, in), (out, r*E): ours (E, r, in), (E, out, r)
            E = bank.experts[path].num_experts
            try:
                a, b = from_peft(ab["lora_A"], ab["lora_B"], E)
            except ValueError as e:
                raise InvalidRequestError(f"{ADAPTER_WEIGHTS}: {path!r}: {e}") from None
            ab = {"lora_A": a, "lora_B": b}
        r = ab["lora_A"].shape[-2]
        alpha = float(cfg.get("lora_alpha", 8))
        for pattern, value in (cfg.get("alpha_pattern") or {}).items():
            if re.match(rf"(.*\.)?({pattern})$", path):
                alpha = float(value)
                break
        weights[path] = (ab["lora_A"], ab["lora_B"])
        scales[path] = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    if not weights:
        raise InvalidRequestError(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    spec = _spec_of(folder, cfg, weights, bank)
    return spec, weights, scales


def _check_base_copy(bank: AdapterBank, path: str, key: str, tensor: torch.Tensor) -> None:
    """A base weight saved beside the LoRA (peft does, for an lm_head tied to the input
    embedding) is taken when it is this model's own weight (as the adapter's dtype holds
    it), refused naming the key otherwise: an adapter never changes base weights here."""
    try:
        weight = bank.model.get_submodule(path).weight
    except AttributeError:
        weight = None
    same = (
        isinstance(weight, torch.Tensor)
        and weight.shape == tensor.shape
        and torch.equal(weight.detach().to("cpu", tensor.dtype), tensor)
    )
    if not same:
        raise InvalidRequestError(
            f"{ADAPTER_WEIGHTS} key {key!r} holds a base weight of {path!r} that is not this "
            "model's (an adapter may carry a copy of a base weight, as peft saves a tied "
            "lm_head's, but not change it: only LoRA weights are trained here)"
        )


def _check_peft_config(cfg: dict) -> None:
    unsupported = {
        "peft_type": (cfg.get("peft_type"), "LORA"),
        "use_dora": (cfg.get("use_dora", False), False),
        "bias": (cfg.get("bias", "none"), "none"),
        "fan_in_fan_out": (cfg.get("fan_in_fan_out", False), False),
        "lora_bias": (cfg.get("lora_bias", False), False),
    }
    for key, (got, expected) in unsupported.items():
        if got != expected:
            raise InvalidRequestError(
                f"{ADAPTER_CONFIG}: {key} must be {expected!r} for this engine, got {got!r}"
            )
    if cfg.get("modules_to_save"):
        raise InvalidRequestError(
            f"{ADAPTER_CONFIG}: modules_to_save must be empty (full-weight modules are not "
            f"supported), got {cfg['modules_to_save']!r}"
        )


def _spec_of(folder: Path, cfg: dict, weights: dict, bank: AdapterBank) -> LoraSpec:
    meta = folder / TREADLE_META
    if meta.is_file():
        return LoraSpec(**json.loads(meta.read_text())["spec"])
    kinds = {bank.targets.get(path) for path in weights}
    rank = int(cfg.get("r", next(iter(weights.values()))[0].shape[-2]))
    return LoraSpec(
        rank=rank,
        alpha=float(cfg.get("lora_alpha", rank)),
        seed=0,
        train_attn="attn" in kinds,
        train_mlp="mlp" in kinds,
        train_unembed="unembed" in kinds,
    )


# ---- merged model ----
def save_merged(model: nn.Module, adapter: Adapter, out_dir: str | Path, model_dir: Path) -> None:
    """A full HF folder: every LoRA'd weight W becomes W + scale * B A; the rest is the base.

    With tied embeddings and a LoRA on lm_head the merged lm_head differs from the input
    embedding, so the folder is saved untied (tie_word_embeddings false) and holds both.
    model_dir is what the base was loaded from: a model folder or a GGUF file.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    experts = find_expert_params(model)
    state = dict(model.state_dict())
    for path, pair in adapter.layers.items():
        if path in experts:  # a fused expert weight: its own key, one update per expert
            key, delta = path, delta_weight(pair, experts[path])
        else:
            key = f"{path}.weight"  # (out, in)
            delta = (pair.B.detach().float() @ pair.A.detach().float()) * pair.scale
        W = state[key]
        state[key] = (W.float() + delta.to(W.device)).to(W.dtype)
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    head = next((p for p, m in model.named_modules() if m is out_emb), None)
    untie = (
        out_emb is not None
        and in_emb is not None
        and out_emb.weight is in_emb.weight
        and head in adapter.layers
    )
    config = model.config
    was_tied = getattr(config, "tie_word_embeddings", False)
    try:
        if untie:
            config.tie_word_embeddings = False
        model.save_pretrained(str(out), state_dict=state)
    finally:
        config.tie_word_embeddings = was_tied
    folder, gguf = model_source(model_dir)
    if gguf is not None:  # the tokenizer lives inside the GGUF: write it out as HF files
        load_tokenizer(model_dir).save_pretrained(str(out))
        return
    for item in folder.iterdir():
        skip = item.name in ("config.json", "generation_config.json") or _WEIGHT_FILES.match(
            item.name
        )
        if item.is_file() and not skip and not (out / item.name).exists():
            shutil.copy2(item, out / item.name)


# ---- training state ----
def save_state(bank: AdapterBank, adapter: Adapter, out_dir: str | Path, base_model: str) -> None:
    """The PEFT adapter + AdamW state + step: load_state then continues bit for bit."""
    out = Path(out_dir)
    save_adapter(bank, adapter, out, base_model)
    opt = adapter.extra.get("optimizer")
    if opt is not None:
        torch.save(opt.state_dict(), out / OPTIMIZER)
    state = {"format": 1, "step": int(adapter.extra.get("step", 0))}
    (out / STATE).write_text(json.dumps(state, indent=2))


def load_state(
    bank: AdapterBank, adapter_id: str, in_dir: str | Path, with_optimizer: bool = True
) -> Adapter:
    """Create (or replace) adapter_id from save_state's folder (or any PEFT adapter folder).

    Everything is checked before an existing adapter is replaced: weights and AdamW state
    that are not finite are refused (an import of garbage must not reach a batch).
    """
    folder = Path(in_dir)
    spec, weights, scales = read_adapter(folder, bank)
    state = None
    if with_optimizer and (folder / OPTIMIZER).is_file():
        state = torch.load(folder / OPTIMIZER, map_location="cpu", weights_only=True)
        if len(state["param_groups"][0]["params"]) != 2 * len(weights):
            raise InvalidRequestError(
                f"{OPTIMIZER} holds state for {len(state['param_groups'][0]['params'])} "
                f"tensors, expected {2 * len(weights)} for this adapter"
            )
        check_optimizer_state(state, OPTIMIZER)
    adapter = bank.add(adapter_id, spec, weights, scales, replace=True)
    if with_optimizer:
        meta = json.loads((folder / STATE).read_text()) if (folder / STATE).is_file() else {}
        adapter.extra["step"] = int(meta.get("step", 0))
        if state is not None:
            optimizer_of(adapter).load_state_dict(state)
    return adapter


# ---- snapshots: training state plus the gradients accumulated since the last step ----
def save_snapshot(
    bank: AdapterBank, adapter: Adapter, out_dir: str | Path, base_model: str
) -> None:
    """save_state plus the accumulated gradients: a model restored from it continues
    exactly where it was, even between a forward_backward and its optim_step."""
    out = Path(out_dir)
    save_state(bank, adapter, out, base_model)
    grads = {
        f"{path}.{name}": t.grad.detach().cpu().contiguous()
        for path, pair in adapter.layers.items()
        for name, t in (("A", pair.A), ("B", pair.B))
        if t.grad is not None
    }
    if grads:
        save_file(grads, str(out / GRADS))


def load_snapshot(bank: AdapterBank, adapter_id: str, in_dir: str | Path) -> Adapter:
    folder = Path(in_dir)
    adapter = load_state(bank, adapter_id, folder, with_optimizer=True)
    if (folder / GRADS).is_file():
        grads = load_file(str(folder / GRADS))
        for path, pair in adapter.layers.items():
            for name, t in (("A", pair.A), ("B", pair.B)):
                g = grads.get(f"{path}.{name}")
                if g is not None:
                    t.grad = g.to(t.device, t.dtype)
    return adapter
