"""The API process never loads torch or transformers for a model folder: it imports the app,
checks the served models' paths and finds their tokenizer folders without them (their
architecture and tokenizer are checked by the worker, which loads them anyway). It starts in
a fraction of the time and memory an engine process needs."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from treadle.server.app import create_app
from treadle.server.config import ServerConfig
from treadle.server.engines.startup import check_models

config = ServerConfig(models={"m": sys.argv[1]}, data_dir=sys.argv[2])
create_app(config)
folders = check_models(config)
assert str(folders["m"]) == sys.argv[1], folders
heavy = sorted(m for m in ("torch", "transformers", "aiohttp") if m in sys.modules)
print(" ".join(heavy) or "none")
"""


def test_the_api_process_does_not_import_torch(tiny_model_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "none", done.stdout
