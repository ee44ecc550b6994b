"""Constrained decoding's grammar side: a Constraint (a JSON schema, a regular expression or
a Lark / GBNF grammar) compiled by llguidance into a matcher that says, at every step,
which tokens keep the text inside the language. No torch here: the server checks a
constraint at its edge with `check_constraint` (a 400 naming the field before anything is
queued), and the engine compiles it against its tokenizer with `matcher`
(treadle.engine.sample_controls applies the masks).

Bounds: the source is at most MAX_CONSTRAINT_CHARS characters, and llguidance's own fuel
limits (LIMITS) bound what compiling a grammar and computing one step's mask may cost, so
a hostile schema or regex is refused instead of stalling the engine thread.

JSON is generated compact (no whitespace between tokens) unless the schema's "x-guidance"
options say otherwise: a model that may pad with whitespace can spend its whole max_tokens
on it.
"""

from __future__ import annotations

import json
from typing import Any

from treadle.engine.types import Constraint
from treadle.errors import InvalidRequestError

KINDS = ("json_schema", "regex", "grammar")
MAX_CONSTRAINT_CHARS = 64 * 1024
_JSON_DEFAULTS = {"whitespace_flexible": False}


def _llg() -> Any:
    try:
        import llguidance
    except ImportError as e:  # the server extra installs it
        raise InvalidRequestError(
            "sampling_params constraints need the llguidance package on the server "
            "(pip install 'treadle[server]')"
        ) from e
    return llguidance


def limits() -> Any:
    """llguidance's resource limits: a few hundred milliseconds of compile at most
    (~50k fuel per ms), and tens of milliseconds per step's mask."""
    llg = _llg()
    return llg.LLParserLimits(
        initial_lexer_fuel=5_000_000,
        step_lexer_fuel=500_000,
        step_max_items=100_000,
        max_lexer_states=100_000,
        max_grammar_size=200_000,
        verbose_errors=False,  # messages go back to a client: no parser state in them
    )


def grammar_of(c: Constraint, field: str) -> str:
    """The llguidance grammar of a constraint (not yet checked: `check_constraint`)."""
    llg = _llg()
    if c.kind not in KINDS:
        raise InvalidRequestError(f"{field}: unknown constraint kind {c.kind!r}, expected {KINDS}")
    if not isinstance(c.source, str) or not c.source:
        raise InvalidRequestError(f"{field}: expected a non-empty {c.kind}")
    if len(c.source) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(
            f"{field}: the {c.kind} has {len(c.source)} characters, over the limit of "
            f"{MAX_CONSTRAINT_CHARS}"
        )
    try:
        if c.kind == "json_schema":
            schema = json.loads(c.source)
            if not isinstance(schema, dict | bool):
                raise ValueError(f"a JSON schema is an object or a boolean, got {schema!r}")
            return llg.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=_JSON_DEFAULTS
            )
        if c.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(c.source)
        return llg.grammar_from("grammar", c.source)  # Lark, or GBNF converted to Lark
    except Exception as e:  # noqa: BLE001 - whatever hostile input makes it raise is a 400
        raise InvalidRequestError(f"{field}: invalid {c.kind}: {e}") from e


def check_constraint(c: Constraint, field: str) -> None:
    """Raise InvalidRequestError naming `field` unless the constraint compiles within LIMITS."""
    grammar = grammar_of(c, field)
    try:
        error = _llg().LLMatcher.validate_grammar(grammar, None, limits=limits())
    except Exception as e:  # noqa: BLE001 - as above
        error = str(e) or type(e).__name__
    if error:
        raise InvalidRequestError(f"{field}: invalid {c.kind}: {error.strip()}")


# One llguidance tokenizer per (tokenizer, vocabulary, EOS ids): building one walks the
# whole vocabulary. Engines live as long as their process, so the cache stays small.
_TOKENIZERS: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any]] = {}


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> Any:
    key = (id(tokenizer), int(vocab_size), tuple(eos_ids))
    hit = _TOKENIZERS.get(key)
    if hit is None or hit[0] is not tokenizer:
        import llguidance.hf

        eos = list(eos_ids) or None
        hit = (
            tokenizer,
            llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos),
        )
        _TOKENIZERS[key] = hit
    return hit[1]


def matcher(tokenizer: Any, vocab_size: int, eos_ids: list[int], c: Constraint, field: str) -> Any:
    """A fresh llguidance LLMatcher for one row (`deep_copy` it for the row's siblings)."""
    if tokenizer is None:
        raise InvalidRequestError(f"{field}: a constraint needs a tokenizer, the model has none")
    llg = _llg()
    tok = ll_tokenizer(tokenizer, vocab_size, eos_ids)
    m = llg.LLMatcher(tok, grammar_of(c, field), log_level=0, limits=limits())
    if m.is_error():
        raise InvalidRequestError(f"{field}: invalid {c.kind}: {m.get_error().strip()}")
    return m
