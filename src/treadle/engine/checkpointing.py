"""Activation checkpointing of the decoder layers, and the routing a recomputation needs.

A training call without checkpointing keeps every decoder layer's intermediate tensors
(attention inputs and outputs, the MLP's gate/up products, ...) until its backward. With it
each layer keeps only its input: its forward runs under torch.utils.checkpoint
(non-reentrant), and backward runs the layer again to rebuild what it needs, one layer at a
time. That costs about one more forward pass and cuts the activations of the call to about
H values per token per layer (treadle.engine.memory).

`LayerCheckpointing` installs, once, an instance-level forward on every decoder layer (the
classes the model names in `_no_split_modules`, as FSDP does) that checkpoints the layer
while the installer is switched on (`enabled(True)`) and the call records gradients; the
sampler's calls (no gradients) run the layer as it is.

A recomputation runs during backward, which may come after the AdapterBank's rows() context
of the forward has ended, and must route every row to the same adapter as the forward did:
`route_replay(bank)` captures the routing of the forward and puts it back around the
recomputation (torch.utils.checkpoint's context_fn).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("off", "on", "auto")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: modules of the classes it names in _no_split_modules."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in kinds]


def route_replay(bank: Any) -> Any:
    """A context_fn for torch.utils.checkpoint: the forward runs as it is; the
    recomputation in backward runs with the bank routing rows as during the forward."""
    replay = _Replay(bank, bank._route)  # the routing of this forward (AdapterBank.rows)
    return lambda: (contextlib.nullcontext(), replay)


class _Replay:
    """Puts a routing back for the length of a recomputation; re-entrant, since a graph
    kept for a second backward (retain_graph) recomputes again."""

    def __init__(self, bank: Any, route: Any):
        self.bank, self.route = bank, route
        self.previous: list[Any] = []

    def __enter__(self) -> None:
        self.previous.append(self.bank._route)
        self.bank._route = self.route

    def __exit__(self, *exc: object) -> None:
        self.bank._route = self.previous.pop()


class LayerCheckpointing:
    """Checkpoints every decoder layer of `model` while switched on (see the module doc)."""

    def __init__(self, model: nn.Module, bank: Any):
        self.bank = bank
        self.layers = decoder_layers(model)
        self.active = False
        for layer in self.layers:
            self._install(layer)

    @property
    def available(self) -> bool:
        """Whether the model names its decoder layers (checkpointing needs them)."""
        return bool(self.layers)

    @contextlib.contextmanager
    def enabled(self, on: bool) -> Iterator[None]:
        """Checkpoint the layers of the model calls in this context (or not)."""
        previous, self.active = self.active, on
        try:
            yield
        finally:
            self.active = previous

    def _install(self, layer: nn.Module) -> None:
        base_forward = type(layer).forward  # unbound: the class's own
        owner = self

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not (owner.active and torch.is_grad_enabled()):
                return base_forward(module, *args, **kwargs)
            return checkpoint(
                base_forward,
                module,
                *args,
                use_reentrant=False,
                context_fn=route_replay(owner.bank),
                **kwargs,
            )

        # bound as a method, so a deep copy of the model calls its own layers; deleting the
        # attribute lets the class's forward show through again
        layer.forward = types.MethodType(forward, layer)
