"""What the /v1 routes share, built once at start-up (treadle.server.app): the server's
state, each served model's tokenizer, the saved checkpoints loaded for sampling, and the
capture sessions' records (also served to /v1/messages and the SDK's capture routes)."""

from __future__ import annotations

from treadle.server.api.openai.render import Tokenizers
from treadle.server.api.openai.resolve import CheckpointSamplers
from treadle.server.core.captures import Captures
from treadle.server.core.state import ServerState


class OpenAIServing:
    def __init__(self, state: ServerState):
        self.state = state
        # the folder the tokenizer files were put in (a .gguf file's are extracted there)
        self.tokenizers = Tokenizers({name: str(d) for name, d in state.tokenizer_dirs.items()})
        self.checkpoints = CheckpointSamplers()
        self.captures = Captures(state.store, state.journal)  # X-Treadle-Capture's records
