"""SandboxFusion's `run_code` API: a client backend, and a small server for the local sandbox.

    POST /run_code {"code", "language": "python", "run_timeout", "compile_timeout",
                    "memory_limit_MB", "stdin", "files": {name: base64}, "fetch_files": []}
    → {"status": "Success" | "Failed" | "SandboxError", "message",
       "compile_result": null, "run_result": {"status": "Finished" | "TimeLimitExceeded" |
       "Error", "execution_time", "return_code", "stdout", "stderr"}, "files": {}}

`FusionSandbox(url)` lets the recipe grade on a SandboxFusion container (or any server that
speaks this API); `serve_run_code(sandbox)` exposes a LocalSandbox the same way, so graders on
other machines can share one.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from treadle.sandbox.types import RunResult, Sandbox


class FusionSandbox:
    """A SandboxFusion server as a sandbox backend (`url` is its base or its /run_code)."""

    def __init__(
        self,
        url: str,
        workers: int = 4,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        http_timeout_s: float = 60.0,
    ):
        self.url = url if url.rstrip("/").endswith("/run_code") else url.rstrip("/") + "/run_code"
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self._http = httpx.Client(timeout=http_timeout_s)
        self._prefix = f"fusion-{id(self)}"
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, self._prefix)

    def run(self, code: str, files=None, stdin: str = "", timeout_s: float | None = None):
        body = {
            "code": code,
            "language": "python",
            "compile_timeout": 10,
            "run_timeout": timeout_s or self.timeout_s,
            "memory_limit_MB": self.memory_mb,
            "stdin": stdin,
            "files": {name: _b64(content) for name, content in (files or {}).items()},
            "fetch_files": [],
        }
        start = time.monotonic()
        try:
            reply = self._http.post(self.url, json=body)
            reply.raise_for_status()
            data = reply.json()
        except (httpx.HTTPError, ValueError) as exc:
            return RunResult("sandbox_error", None, "", f"{type(exc).__name__}: {exc}", 0.0)
        return _from_fusion(data, time.monotonic() - start)

    def submit(self, code: str, files=None, stdin: str = "", timeout_s=None):
        if threading.current_thread().name.startswith(self._prefix):
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(self.run(code, files, stdin, timeout_s))
            return done  # called from one of our own workers: waiting there would deadlock
        return self._pool.submit(self.run, code, files, stdin, timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()


def _b64(content: str | bytes) -> str:
    return base64.b64encode(content.encode() if isinstance(content, str) else content).decode()


def _from_fusion(data: dict, wall_s: float) -> RunResult:
    run = data.get("run_result") or {}
    rc = run.get("return_code")
    if data.get("status") == "SandboxError" or not run:
        status = "sandbox_error"
    elif run.get("status") == "TimeLimitExceeded":
        status = "timeout"
    elif run.get("status") == "Finished" and rc == 0:
        status = "ok"
    else:
        status = "error"
    return RunResult(
        status,
        rc,
        run.get("stdout") or "",
        run.get("stderr") or data.get("message") or "",
        float(run.get("execution_time") or wall_s),
    )


def _to_fusion(result: RunResult) -> dict:
    run_status = {"ok": "Finished", "timeout": "TimeLimitExceeded"}.get(result.status, "Error")
    if result.status == "error":
        run_status = "Finished"  # a non-zero exit is a finished run in SandboxFusion's terms
    return {
        "status": "Success" if result.status == "ok" else "Failed",
        "message": "" if result.ok else result.status,
        "compile_result": None,
        "run_result": {
            "status": run_status,
            "execution_time": result.wall_s,
            "return_code": result.exit_code,
            "stdout": result.stdout,
            "stderr": result.stderr,
        },
        "files": {},
        # not in SandboxFusion: our own verdict (blocked, memory, output_limit, ...)
        "treadle_status": result.status,
    }


def serve_run_code(
    sandbox: Sandbox, host: str = "127.0.0.1", port: int = 0
) -> tuple[ThreadingHTTPServer, str]:
    """Serve POST /run_code for `sandbox` on a background thread; returns (server, url).
    Stop it with `server.shutdown()`."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/") != "/run_code":
                self.send_error(404)
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if body.get("language", "python") != "python":
                    raise ValueError(f"language: expected 'python', got {body['language']!r}")
                files = {k: base64.b64decode(v) for k, v in (body.get("files") or {}).items()}
                result = sandbox.submit(
                    body["code"], files, body.get("stdin") or "", body.get("run_timeout")
                ).result()
                payload, code = _to_fusion(result), 200
            except (ValueError, KeyError, TypeError) as exc:
                payload = {"status": "SandboxError", "message": str(exc), "run_result": None}
                code = 400
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="run_code").start()
    return server, f"http://{host}:{server.server_address[1]}/run_code"


if __name__ == "__main__":
    import argparse

    from treadle.sandbox.local import LocalSandbox

    parser = argparse.ArgumentParser(description="Serve the local sandbox as SandboxFusion's API")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--unsafe_local_sandbox",
        action="store_true",
        help="run without bubblewrap, as plain processes that are NOT isolated",
    )
    args = parser.parse_args()
    sandbox = LocalSandbox(workers=args.workers, unsafe=args.unsafe_local_sandbox)
    srv, url = serve_run_code(sandbox, args.host, args.port)
    print(f"serving {url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        srv.shutdown()
