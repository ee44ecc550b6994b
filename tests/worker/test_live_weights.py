"""State snapshots on disk: a folder is whole before it is named, samplers' too."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle.worker.live_weights import LiveWeights


class Engine:
    """Writes a snapshot's files; a save can be made to fail halfway, as a crash would."""

    def __init__(self) -> None:
        self.fail_adapter = False

    def save_snapshot(self, model_id: str, out_dir: Path) -> None:
        (Path(out_dir) / "state.safetensors").write_text(model_id)

    def save_adapter(self, ref: str, out_dir: Path) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_config.json").write_text("{}")
        if self.fail_adapter:
            raise OSError("disk full")
        (out / "adapter_model.safetensors").write_text(ref)


def test_a_sampler_folder_left_by_an_uncommitted_snapshot_is_replaced_only_when_whole(tmp_path):
    engine = Engine()
    weights = LiveWeights(engine, state_root=tmp_path)
    weights.keep_snapshot("m", "m:snap-1")
    first = weights.snapshot_state("m", 1)
    folder = Path(first.samplers["m:snap-1"])
    assert (folder / "adapter_model.safetensors").read_text() == "m:snap-1"

    # a new worker (nothing persisted in its memory) writes the same ref's folder again,
    # and fails halfway: the folder that was there is untouched, no half folder is named
    again = LiveWeights(engine, state_root=tmp_path)
    again.keep_snapshot("m", "m:snap-1")
    engine.fail_adapter = True
    with pytest.raises(OSError):
        again.snapshot_state("m", 2)
    assert (folder / "adapter_model.safetensors").read_text() == "m:snap-1"
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".tmp-")]

    engine.fail_adapter = False
    second = again.snapshot_state("m", 3)
    assert second.samplers["m:snap-1"] == str(folder)
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
