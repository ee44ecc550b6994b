"""`treadle hf-cache`: a served model's tokenizer, loadable by its name with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from treadle.errors import InvalidRequestError
from treadle.hf_cache import place_in_hf_cache, repo_folder_name

NAME = "acme/tiny-chat"

LOAD_BY_NAME = """
import json, sys
from transformers import AutoConfig, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
cfg = AutoConfig.from_pretrained(sys.argv[1])
msgs = [{"role": "user", "content": "What is 2 + 3?"}]
print(json.dumps({
    "ids": tok.encode("What is 12 + 30? <|im_end|>"),
    "chat": tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
    "vocab": cfg.vocab_size,
}))
"""


def test_layout_and_revisions(tiny_model_dir, tmp_path):
    cache = tmp_path / "hub"
    snap = place_in_hf_cache(NAME, tiny_model_dir, cache)
    repo = cache / "models--acme--tiny-chat"
    assert snap.parent == repo / "snapshots"
    assert (repo / "refs" / "main").read_text() == snap.name and len(snap.name) == 40
    names = {p.name for p in snap.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
    assert not any(n.endswith(".safetensors") for n in names)  # no weights on the client side
    assert place_in_hf_cache(NAME, tiny_model_dir, cache) == snap  # same files, same revision

    changed = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, changed)
    cfg = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**cfg, "note": "retrained"}))
    snap2 = place_in_hf_cache(NAME, changed, cache)
    assert snap2 != snap and (repo / "refs" / "main").read_text() == snap2.name


def test_cli_then_offline_load_by_name(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    home = tmp_path / "hf-home"
    env = {**os.environ, "HF_HOME": str(home)}
    env.pop("HF_HUB_CACHE", None)
    cmd = [sys.executable, "-m", "treadle.cli", "hf-cache", "--model", f"{NAME}={tiny_model_dir}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert str(home / "hub" / repo_folder_name(NAME)) in out.stdout

    # a fresh interpreter: huggingface_hub reads HF_HUB_OFFLINE when it is imported
    offline = {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_BY_NAME, NAME],
        env=offline,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    assert got["ids"] == want.encode("What is 12 + 30? <|im_end|>")
    assert got["chat"] == want.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert got["vocab"] == json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]

    # a name that was never placed fails offline instead of reaching for the network
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_BY_NAME, "acme/never-placed"],
        env=offline,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0


@pytest.mark.parametrize("bad", ["", "a/b/c", "../x", "org/"])
def test_bad_names_are_refused(tiny_model_dir, tmp_path, bad):
    with pytest.raises(InvalidRequestError, match="name"):
        place_in_hf_cache(bad, tiny_model_dir, tmp_path)


def test_folder_without_tokenizer_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(InvalidRequestError, match="no tokenizer files"):
        place_in_hf_cache(NAME, tmp_path / "m", tmp_path / "hub")
