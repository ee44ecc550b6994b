"""GPU placement of worker groups: replicas and models get GPUs of their own while there
are enough, share them (never within one group) when there are not, and the supervisor
hands each group its GPUs through CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import pytest

from treadle.server.config import ServerConfig
from treadle.server.engines.placement import plan_gpus, visible_gpus
from treadle.server.engines.supervisor import Supervisor


def _config(**kw) -> ServerConfig:
    models = kw.pop("models", {"a": "/m/a"})
    return ServerConfig(models=models, device="cuda", **kw)


def test_replicas_of_a_group_get_disjoint_gpus():
    plan = plan_gpus(_config(devices=2, replicas=2), gpus=list("01234567"))
    assert plan == {("a", 0): ["0", "1"], ("a", 1): ["2", "3"]}


def test_models_take_the_next_gpus_in_turn():
    config = _config(models={"a": "/m/a", "b": "/m/b"}, devices=2, replicas=2)
    plan = plan_gpus(config, gpus=list("01234567"))
    assert [plan[("a", 0)], plan[("a", 1)], plan[("b", 0)], plan[("b", 1)]] == [
        ["0", "1"],
        ["2", "3"],
        ["4", "5"],
        ["6", "7"],
    ]


def test_too_few_gpus_wrap_around_but_never_twice_in_a_group(caplog):
    config = _config(models={"a": "/m/a", "b": "/m/b"}, devices=2)
    plan = plan_gpus(config, gpus=["0", "1", "2"])
    assert plan == {("a", 0): ["0", "1"], ("b", 0): ["2", "0"]}
    assert all(len(set(ids)) == len(ids) for ids in plan.values())
    assert "share GPUs" in caplog.text


def test_a_group_larger_than_the_machine_is_refused_by_name():
    with pytest.raises(ValueError, match=r"devices: 4 ranks .* 2 are visible"):
        plan_gpus(_config(devices=4), gpus=["0", "1"])


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_cpu_and_an_explicit_gpu_are_left_alone(device):
    config = ServerConfig(models={"a": "/m/a"}, device=device, devices=2)
    assert plan_gpus(config, gpus=list("0123")) == {}


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,GPU-1a2b")
    assert visible_gpus() == ["3", "5", "GPU-1a2b"]


def test_the_supervisor_hands_each_group_its_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    config = _config(devices=2, replicas=2, data_dir=str(tmp_path))
    sup = Supervisor(config, "tcp://127.0.0.1:1", "token", on_exit=lambda *a: None)
    assert sup.environment("a", 0)["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert sup.environment("a", 1)["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert sup.environment("a", 1)["TREADLE_WORKER_TOKEN"] == "token"
    cpu = Supervisor(
        ServerConfig(models={"a": "/m/a"}, data_dir=str(tmp_path)),
        "tcp://127.0.0.1:1",
        "token",
        on_exit=lambda *a: None,
    )
    assert cpu.environment("a", 0)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # inherited as is
