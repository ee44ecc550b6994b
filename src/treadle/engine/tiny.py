"""Build a small real-architecture model folder offline: `treadle make-tiny-model DIR`.

Dense (llama, qwen3) or mixture-of-experts (gpt_oss, qwen3_moe: a few experts with top-k
routing, their weights fused in 3-D parameters as transformers 5 stores them; gpt_oss with
its alternating sliding-window / full attention layers and attention sinks).
Random weights, but everything else is what a Hugging Face model folder holds: config,
safetensors, a byte-level BPE tokenizer trained here on generated text (arithmetic word
problems in the GSM8K style and short chats), special tokens and a ChatML chat template.
Digits are split one per token, which arithmetic needs. Plain
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load it.

    treadle make-tiny-model .models/tiny-llama --arch llama --size tiny
    treadle make-tiny-model .models/tiny-gpt-oss --arch gpt_oss
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from treadle.arithmetic import problem, worked_answer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS, IM_START, IM_END = SPECIAL_TOKENS

# ChatML; {% generation %} marks assistant text so that
# apply_chat_template(return_assistant_tokens_mask=True) finds what to train on.
# Tools follow the Hermes / Qwen convention: listed in a system turn, called with
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> (without tools: plain ChatML).
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    '{{ \'# Tools\nTo call a function, answer with <tool_call>{"name": <name>, '
    '"arguments": <arguments>}</tool_call>.\n<tools>\' }}'
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set args = call.function.arguments %}"
    '{{ \'<tool_call>{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{ args if args is string else (args | tojson) }}{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# (hidden, layers, heads, kv_heads, intermediate): tiny ≈ 1M parameters, small ≈ 11M.
SIZES = {
    "tiny": (128, 4, 4, 2, 512),
    "small": (384, 7, 6, 2, 1024),
}
# MoE models: (experts, experts per token, each expert's intermediate size); hidden size,
# layers and heads as SIZES. gpt_oss's sliding window is short enough that the tests'
# sequences cross it.
MOE_SIZES = {
    "tiny": (4, 2, 128),
    "small": (8, 2, 256),
}
SLIDING_WINDOW = 16
ARCHS = ("llama", "qwen3", "gpt_oss", "qwen3_moe")
VOCAB_SIZE = 1024
MAX_POSITIONS = 1024

CHATS = [
    ("Hello!", "Hi! How can I help you today?"),
    ("What is two plus three?", "Two plus three is 5."),
    ("Tell me a short fact.", "The sun is a star."),
    ("Can you help me with math?", "Yes. Tell me the problem and I will solve it step by step."),
    ("Thank you.", "You are welcome!"),
    ("What color is the sky?", "The sky is usually blue during the day."),
]


def corpus(n_problems: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n_problems):
        q, steps = problem(rng)
        a, _ = worked_answer(steps)
        texts.append(f"Question: {q}\nAnswer: {a}")
        texts.append(f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{a}{IM_END}\n")
    for user, assistant in CHATS * 50:
        texts.append(f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def make_tiny_model(
    out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0
) -> Path:
    """Write a loadable HF model folder to out_dir and return its path."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {list(ARCHS)}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(corpus(seed=seed)),
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    eos_ids = [tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(IM_END)]
    config = _config(arch, size, len(tokenizer), eos_ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = eos_ids[0]
    model.save_pretrained(out)
    return out


def _config(arch: str, size: str, vocab: int, eos_ids: list[int]):
    from transformers import GptOssConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    hidden, layers, heads, kv_heads, inter = SIZES[size]
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=None,
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[0],
    )
    if arch in ("llama", "qwen3"):
        dense = dict(common, intermediate_size=inter, tie_word_embeddings=True)
        if arch == "llama":
            return LlamaConfig(**dense)
        return Qwen3Config(head_dim=hidden // heads, **dense)
    # MoE models keep their families' untied unembedding
    experts, top_k, expert_inter = MOE_SIZES[size]
    if arch == "gpt_oss":
        return GptOssConfig(
            intermediate_size=expert_inter,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            head_dim=hidden // heads,
            sliding_window=SLIDING_WINDOW,
            # gpt-oss's YaRN, scaled down to this context: 64 trained positions x 16
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": MAX_POSITIONS / 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
            **common,
        )
    return Qwen3MoeConfig(
        intermediate_size=inter,
        moe_intermediate_size=expert_inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,  # as Qwen3-30B-A3B
        head_dim=hidden // heads,
        tie_word_embeddings=False,
        **common,
    )
