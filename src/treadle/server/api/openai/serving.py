"""What the /v1 routes share, built once at start-up (treadle.server.app): the server's
state, each served model's tokenizer, and the saved checkpoints loaded for sampling."""

from __future__ import annotations

from treadle.server.api.openai.render import Tokenizers
from treadle.server.api.openai.resolve import CheckpointSamplers
from treadle.server.core.state import ServerState


class OpenAIServing:
    def __init__(self, state: ServerState):
        self.state = state
        # the folder the tokenizer files were put in (a .gguf file's are extracted there)
        self.tokenizers = Tokenizers({name: str(d) for name, d in state.tokenizer_dirs.items()})
        self.checkpoints = CheckpointSamplers()
