"""Capture sessions from the SDK: record an agent's completions token-exactly while it runs
against the server's OpenAI or Anthropic endpoint, reward its trajectories, and get back
datums for forward_backward. The agent's code needs no tokenizer and no change but two
headers.

    capture = svc.create_capture_session()
    agent = openai.OpenAI(base_url=f"{url}/v1", api_key=key,
                          default_headers=capture.headers(trajectory_id="rollout-0"))
    ... run the agent (any number of turns and tool calls) ...
    capture.set_reward("rollout-0", 1.0, group="problem-3")
    datums = capture.export_datums()          # advantages: reward - its group's mean
    tc.forward_backward(datums, loss_fn="importance_sampling")

Datums hold the rendered prompts and the sampled tokens as served (weights 1 on sampled
tokens only: prompts and tool results are masked), the sampler's logprobs, advantages on the
sampled tokens, and, when a training session's weights sampled them (its model_id or one of
its sampling sessions as `model`), the provenance stable_reinforce asks for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from treadle.types import Datum

if TYPE_CHECKING:
    from treadle.client.transport import Transport

PREFIX = "/api/v1/treadle/captures"
CAPTURE_HEADER = "X-Treadle-Capture"
TRAJECTORY_HEADER = "X-Treadle-Trajectory"


class CaptureSession:
    def __init__(self, transport: Transport, capture_id: str):
        self._transport = transport
        self.capture_id = capture_id

    def _path(self, tail: str) -> str:
        return f"{PREFIX}/{quote(self.capture_id, safe='')}/{tail}"

    def headers(self, trajectory_id: str | None = None) -> dict[str, str]:
        """The headers that put a request under this capture (and, with `trajectory_id`,
        join it to that trajectory's turns); without one each completion is a trajectory
        of its own, named by its completion id."""
        out = {CAPTURE_HEADER: self.capture_id}
        if trajectory_id is not None:
            out[TRAJECTORY_HEADER] = trajectory_id
        return out

    def completions(self) -> list[dict[str, Any]]:
        """Every completion recorded, oldest first: completion_id, trajectory_id, model,
        sampler_version, sequence_id, prompt_tokens, tokens, logprobs, finish_reason."""
        t = self._transport
        return t.call(t.get(self._path("completions")))["completions"]

    def set_reward(self, trajectory_id: str, reward: float, group: str | None = None) -> None:
        """Attach a reward to a trajectory; `group`: the trajectories whose advantages are
        taken against each other (GRPO: the rollouts of one problem)."""
        self.set_rewards([(trajectory_id, reward, group)])

    def set_rewards(self, rewards: list[tuple[str, float, str | None]]) -> None:
        body = {"rewards": [{"trajectory_id": t, "reward": r, "group": g} for t, r, g in rewards]}
        t = self._transport
        t.call(t.post(self._path("rewards"), body))

    def export(
        self, trajectory_ids: list[str] | None = None, normalize_std: bool = False
    ) -> tuple[list[Datum], list[dict[str, Any]]]:
        """→ (datums, one summary per trajectory: reward, group, advantage, turns, datums)
        of the rewarded trajectories (or of those named)."""
        body: dict[str, Any] = {"normalize_std": normalize_std}
        if trajectory_ids is not None:
            body["trajectory_ids"] = list(trajectory_ids)
        t = self._transport
        reply = t.call(t.post(self._path("datums"), body))
        return [Datum.model_validate(d) for d in reply["datums"]], reply["trajectories"]

    def export_datums(
        self, trajectory_ids: list[str] | None = None, normalize_std: bool = False
    ) -> list[Datum]:
        return self.export(trajectory_ids, normalize_std)[0]


def create_capture_session(transport: Transport, capture_id: str | None = None) -> CaptureSession:
    t = transport
    reply = t.call(t.post(PREFIX, {"capture_id": capture_id} if capture_id else {}))
    return CaptureSession(transport, reply["capture_id"])
