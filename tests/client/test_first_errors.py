"""The mistakes a newcomer makes in the first hour end with one line that says what happened
and what to do, never a traceback; and a script that ends without closing its clients exits
quietly. Each path is a real process (a script, a `treadle` command) against a real server.

(`treadle serve` with a wrong model path or without a tokenizer: tests/server/
test_startup_failures.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

from treadle.launch import free_port

TINY = "treadle/tiny-llama"
NOISE = ("Traceback", "Unclosed", "Task was destroyed", "Exception ignored", "ResourceWarning")


def run_script(tmp_path: Path, code: str, *args: str, timeout: float = 120):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, "-W", "default", str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line(result: subprocess.CompletedProcess) -> str:
    """The error the process ended with: its stderr's last line, after checking that
    nothing before it is a traceback."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


CONNECT = """
    import sys
    from treadle import ServiceClient
    ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2] if len(sys.argv) > 2 else None)
"""


def test_no_server_running(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line(run_script(tmp_path, CONNECT, url))
    assert line.startswith("APIConnectionError: ")
    assert f"no treadle server answers at {url}: start one with `treadle serve" in line
    assert line.endswith("(at script.py:4)")


def test_a_wrong_url(tmp_path, server_url):
    line = one_line(run_script(tmp_path, CONNECT, server_url + "/v1"))
    assert line.startswith("NotFoundError: HTTP 404")
    assert "does not look like a treadle server's address" in line


def test_a_base_model_that_is_not_served(tmp_path, server_url):
    code = """
        import sys
        from treadle import ServiceClient
        svc = ServiceClient(base_url=sys.argv[1])
        svc.create_lora_training_client("Qwen/Qwen3-8B", rank=4)
    """
    line = one_line(run_script(tmp_path, code, server_url))
    assert line.startswith("BadRequestError: HTTP 400: base_model: model 'Qwen/Qwen3-8B'")
    assert f"is not served here; served: ['{TINY}']; pass one of the served names" in line
    assert line.endswith("(at script.py:5)")


def test_a_wrong_api_key(tmp_path, start_server):
    data = tmp_path / "data"
    cli = [sys.executable, "-m", "treadle.cli", "admin"]
    subprocess.run([*cli, "create-tenant", "acme", "--data-dir", str(data)], check=True)
    server = start_server(data_dir=data)
    line = one_line(run_script(tmp_path, CONNECT, server.url, "tml-not-a-key"))
    assert line.startswith("AuthenticationError: HTTP 401: API key tml-not-a")
    assert "is not recognised by this server; pass api_key= to ServiceClient" in line
    line = one_line(run_script(tmp_path, CONNECT, server.url))
    assert "missing API key" in line and "treadle admin create-key TENANT" in line


def test_treadle_status_with_no_server(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "status", "--base-url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    line = one_line(result)
    assert line.startswith(f"treadle status: cannot reach {url}")
    assert "treadle serve" in line


def test_treadle_serve_on_a_port_in_use(tmp_path, tiny_model_dir, treadle_server):
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "serve", "--port", str(treadle_server.port)]
        + ["--data-dir", str(tmp_path), "--model", f"{TINY}={tiny_model_dir}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    line = one_line(result)
    assert line == (
        f"treadle serve: port {treadle_server.port} on 127.0.0.1 is in use (another treadle "
        "serve?); stop what holds it, or pick another one with --port"
    )
    assert time.monotonic() - started < 60  # said before any model loads
    assert not (tmp_path / "treadle.db").exists()


# ---- exit without closing -------------------------------------------------------------------


def test_a_script_that_never_closes_its_clients_exits_quietly(tmp_path, server_url):
    """Clients left open (a training client, a sampling client, one ServiceClient dropped
    unclosed and collected, one alive at exit): no asyncio or aiohttp noise, and the
    session still open at exit is finished."""
    code = """
        import gc, sys
        from treadle import AdamParams, ServiceClient

        def dropped():
            svc = ServiceClient(base_url=sys.argv[1])
            svc.create_lora_training_client("treadle/tiny-llama", rank=4)

        dropped()
        gc.collect()
        svc = ServiceClient(base_url=sys.argv[1])
        tc = svc.create_lora_training_client("treadle/tiny-llama", rank=4)
        tc.optim_step(AdamParams(learning_rate=1e-3)).result()
        sc = tc.save_weights_and_get_sampling_client("quiet")
        print(svc.session_id)
    """
    result = run_script(tmp_path, code, server_url)
    assert result.returncode == 0, result.stderr
    for noise in NOISE:
        assert noise not in result.stderr, result.stderr
    session_id = result.stdout.strip().splitlines()[-1]
    row = httpx.get(f"{server_url}/api/v1/treadle/console/sessions/{session_id}").json()
    assert row["status"] == "finished", row


# ---- the demo, interrupted ------------------------------------------------------------------


def _demo(tmp_path: Path, model_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "treadle.cli", "demo", "--model-dir", str(model_dir)]
        + ["--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _servers(pid: int) -> int:
    """How many `treadle serve` processes the process `pid` has started (and not reaped)."""
    count = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            count += b"serve" in cmdline and b"treadle.cli" in cmdline
    return count


def _interrupt_after(proc: subprocess.Popen, text: str, timeout_s: float = 240) -> tuple:
    """Ctrl-C (SIGINT to the demo's process) once stdout says `text`; → (status, stdout,
    stderr, how many servers the demo was running then)."""
    seen = []
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            break
        assert time.monotonic() < deadline, "".join(seen)
    servers = _servers(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + out, err, servers


def test_make_demo_interrupted_and_run_again(tmp_path):
    model_dir = tmp_path / "tiny-llama"
    # interrupted while it builds its model: nothing half-built is left behind
    status, out, err, _ = _interrupt_after(_demo(tmp_path, model_dir), "building the tiny model")
    assert status == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "treadle demo: interrupted; run it again to start over"
    assert not (model_dir / "config.json").exists() or any(model_dir.glob("*.safetensors"))
    # run again: it builds what it needs, starts its server, and is interrupted once training
    status, out, err, servers = _interrupt_after(_demo(tmp_path, model_dir), "SFT warm-up")
    assert "server up at" in out, out + err
    assert servers == 1
    assert status == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "treadle demo: interrupted; run it again to start over"
    assert (model_dir / "config.json").exists()


def test_treadle_serve_with_a_setting_out_of_range(tmp_path, tiny_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "serve", "--worker-start-tries", "0"]
        + ["--data-dir", str(tmp_path), "--model", f"{TINY}={tiny_model_dir}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert one_line(result) == (
        "treadle serve: worker_start_tries: Value error, worker_start_tries must be >= 1, got 0"
    )
