"""Containment of paths and the registry, against a real `treadle serve` with tenants: what a
tenant's upload may write, what an import must be, and what a restart cleans up.

- `output_path` naming a server folder is refused on every route that takes one;
- an uploaded adapter archive is read member by member: links, folders, `..` or absolute
  paths and files that are not part of a PEFT adapter refuse the whole upload;
- an import that is not a loadable PEFT adapter is a 400 and registers nothing;
- a restart removes what interrupted writes left behind.

    .venv/bin/python -m pytest -q tests/acceptance/test_containment_paths.py
"""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from pathlib import Path

import httpx
import pytest
from _tenancy import TINY, Api, make_tenants
from _tenancy import start_server as launch

GROUPS = "/api/v1/treadle/checkpoints/groups"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("containment-paths")
    keys = make_tenants(data, {"alice": None, "bob": None})
    srv = launch({TINY: tiny_model_dir}, data, config=None)
    srv.keys = keys
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def alice(server):
    api = Api(server.url, server.keys["alice"])
    yield api
    api.close()


@pytest.fixture(scope="module")
def adapter_files(alice) -> dict[str, bytes]:
    """A real PEFT adapter of the tiny model (saved by the server, read back as a tar)."""
    sid = alice.session()
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TINY,
            "lora_config": {"rank": 4}, "model_package_group": "source"}  # fmt: skip
    model = alice.ok("create_model", body)
    alice.done(model["request_id"])
    save = {"model_id": model["model_id"], "seq_id": 1, "path": "a"}
    alice.done(alice.ok("save_weights_for_sampler", save)["request_id"])
    resp = alice.http.get("/api/v1/treadle/checkpoints/versions/source:1/archive")
    assert resp.status_code == 200, resp.text
    with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files), files.keys()
    return files


def make_tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def special(name: str, kind: bytes, target: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def adapter_tar(files: dict[str, bytes], *extra: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    return make_tar([regular(n, d) for n, d in files.items()] + list(extra))


def versions(api: Api, group: str) -> list:
    resp = api.http.get(f"{GROUPS}/{group}/versions")
    return resp.json().get("versions", []) if resp.status_code == 200 else []


def post_import(api: Api, group: str, archive: bytes, **params: str) -> httpx.Response:
    return api.http.post(f"{GROUPS}/{group}/import", content=archive, params=params)


def test_a_valid_import_is_accepted(alice, adapter_files):
    resp = post_import(alice, "good", adapter_tar(adapter_files), base_model=TINY)
    assert resp.status_code == 200, resp.text
    assert [v["version"] for v in versions(alice, "good")] == [1]


def test_output_path_to_a_server_folder_is_refused_everywhere(alice, adapter_files, tmp_path):
    target = tmp_path / "server-folder"
    resp = post_import(alice, "grp", adapter_tar(adapter_files), base_model=TINY,
                       output_path=str(target))  # fmt: skip
    assert resp.status_code == 400 and "output_path" in resp.json()["error"], resp.text
    sid = alice.session()
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TINY,
            "model_package_group": "grp", "output_path": str(target)}  # fmt: skip
    resp = alice.post("create_model", body)
    assert resp.status_code == 400 and "output_path" in resp.json()["error"], resp.text
    load = {"session_id": sid, "model_seq_id": 1, "path": "source:1",
            "model_package_group": "grp", "output_path": str(target)}  # fmt: skip
    resp = alice.post("load_weights", load)
    assert resp.status_code == 400 and "output_path" in resp.json()["error"], resp.text
    assert not target.exists()
    assert versions(alice, "grp") == []


def test_hostile_archives_are_refused_member_by_member(alice, adapter_files, tmp_path):
    outside = tmp_path / f"escaped-{uuid.uuid4().hex[:6]}"
    hostile = {
        "a symlink": special("README.md", tarfile.SYMTYPE, str(outside)),
        "a hard link": special("README.md", tarfile.LNKTYPE, "adapter_config.json"),
        "a ../ path": regular(f"../../{outside.name}", b"x"),
        "an absolute path": regular(str(outside), b"x"),
        "a nested file": regular("sub/adapter_config.json", b"{}"),
        "a folder": special("sub", tarfile.DIRTYPE),
        "a fifo": special("README.md", tarfile.FIFOTYPE),
        "a file twice": regular("adapter_config.json", b'{"r": 4}'),
    }
    for i, (what, member) in enumerate(hostile.items()):
        group = f"hostile{i}"
        resp = post_import(alice, group, adapter_tar(adapter_files, member), base_model=TINY)
        assert resp.status_code == 400, (what, resp.status_code, resp.text)
        assert "member" in resp.json()["error"], (what, resp.text)
        assert versions(alice, group) == [], what
    # a plain file beside the adapter's is passed over: never written, never stored
    resp = post_import(alice, "extra", adapter_tar(adapter_files, regular("run.sh", b"rm -rf /")))
    assert resp.status_code == 200, resp.text
    archive = alice.http.get("/api/v1/treadle/checkpoints/versions/extra:1/archive")
    assert "run.sh" not in tarfile.open(fileobj=io.BytesIO(archive.content)).getnames()
    many = [regular(f"f{i}.txt", b"x") for i in range(100)]
    resp = post_import(alice, "many", make_tar(many), base_model=TINY)
    assert resp.status_code == 400, resp.text
    assert not outside.exists()


def test_an_import_that_is_not_a_loadable_adapter_registers_nothing(alice, adapter_files):
    config = json.loads(adapter_files["adapter_config.json"])
    broken = {
        "garbage safetensors": {"adapter_model.safetensors": b"\x00garbage" * 100},
        "a truncated safetensors": {
            "adapter_model.safetensors": adapter_files["adapter_model.safetensors"][:200]
        },
        "a config that is not JSON": {"adapter_config.json": b"{not json"},
        "a config that is a list": {"adapter_config.json": b"[1, 2]"},
        "a config with a rank that is a string": {
            "adapter_config.json": json.dumps({**config, "r": "four"}).encode()
        },
        "a config with a base model that is a list": {
            "adapter_config.json": json.dumps({**config, "base_model_name_or_path": [1]}).encode()
        },
        "a rank over the model's width": {
            "adapter_config.json": json.dumps({**config, "r": 4096}).encode()
        },
        "a Treadle spec with another rank": {
            "treadle_adapter.json": json.dumps({"spec": {"rank": 2**31}}).encode()
        },
        "no weights": {"adapter_model.safetensors": None},
    }
    for i, (what, changes) in enumerate(broken.items()):
        files = {k: v for k, v in {**adapter_files, **changes}.items() if v is not None}
        group = f"broken{i}"
        resp = post_import(alice, group, adapter_tar(files))
        assert resp.status_code == 400, (what, resp.status_code, resp.text)
        assert versions(alice, group) == [], what


# ---- restart cleanup ------------------------------------------------------------------------
def plant(folder: Path, name: str = "part.bin") -> Path:
    folder.mkdir(parents=True)
    (folder / name).write_bytes(b"\0" * 1024)
    return folder


def test_a_restart_removes_what_interrupted_writes_left(start_server, tmp_path):
    data = tmp_path / "data"
    artifacts, packages, run = data / "artifacts", data / "packages", "0123abcd"
    kept = plant(artifacts / run / "weights" / "done")
    leftovers = [
        plant(artifacts / run / "weights" / ".tmp-done-1a2b3c4d"),
        plant(artifacts / run / "sampler_weights" / ".merged-s-1a2b3c4d"),
        plant(artifacts / ".refresh" / uuid.uuid4().hex),
        plant(packages / "tenant" / "group" / ".tmp-5e6f7a8b-1a2b3c4d"),
        plant(data / "cache" / uuid.uuid4().hex / "files"),
        # a state snapshot (and a sampler's folder in it) stopped before its rename
        plant(artifacts / ".state" / "s_train_0" / ".tmp-state-7-1a2b3c4d"),
        plant(artifacts / ".state" / "s_train_0" / "samplers" / ".tmp-s_snap-1a2b3c4d"),
        # one renamed but never recorded: no row names it (tests/server/core/test_state_on_disk.py)
        plant(artifacts / ".state" / "s_train_0" / "state-3-5e6f7a8b"),
    ]
    moved_aside = plant(artifacts / run / "sampler_weights" / ".old-s-1a2b3c4d", "adapter.bin")
    stale_old = plant(artifacts / run / "weights" / ".old-done-5e6f7a8b")
    server = start_server(data_dir=data)
    assert httpx.get(f"{server.url}/api/v1/healthz").status_code == 200
    for path in leftovers + [stale_old, moved_aside]:
        assert not path.exists(), path
    assert (kept / "part.bin").is_file()
    # an overwrite stopped between its two renames: the previous copy is put back
    assert (artifacts / run / "sampler_weights" / "s" / "adapter.bin").is_file()
    assert not (data / "cache").exists() or not any((data / "cache").iterdir())
