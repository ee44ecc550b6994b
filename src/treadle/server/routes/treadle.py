"""Treadle's own routes, beside the Tinker protocol, under /api/v1/treadle/."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from fastapi import APIRouter, Response

from treadle.errors import NotFoundError
from treadle.server.deps import ServiceDep

router = APIRouter(prefix="/api/v1/treadle")

# What AutoTokenizer.from_pretrained needs, for the tokenizer kinds HF folders hold.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


@router.get("/models/{name:path}/tokenizer")
def get_tokenizer(name: str, svc: ServiceDep) -> Response:
    """A zip of the served model's tokenizer files, flat; AutoTokenizer loads the folder
    they unpack to. `name` is the served name (may contain '/')."""
    if name not in svc.config.models:
        raise NotFoundError(
            f"model {name!r} is not served here; served: {sorted(svc.config.models)}"
        )
    folder = Path(svc.config.models[name])
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for fname in TOKENIZER_FILES:
            if (folder / fname).is_file():
                zf.write(folder / fname, arcname=fname)
    return Response(content=buf.getvalue(), media_type="application/zip")
