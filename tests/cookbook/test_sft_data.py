"""Chat rendering, masks, packing and the learning-rate schedule."""

import pytest

from treadle.cookbook.sft import (
    SFTConfig,
    example_to_datum,
    learning_rate_at,
    make_batch,
    render_chat,
    render_completion,
    training_sequences,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_chat_weights_cover_exactly_the_assistant_text(tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    tokens, weights = render_chat(tokenizer, messages, 512)
    trained = tokenizer.decode([t for t, w in zip(tokens, weights, strict=True) if w])
    assert trained == "Hello there<|im_end|>"
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) else prompt
    assert not any(weights[: len(prompt)])


def test_completion_trains_on_completion_and_eos(tokenizer):
    tokens, weights = render_completion(tokenizer, "Question: 1+1?\nAnswer:", " 2", 64)
    trained = [t for t, w in zip(tokens, weights, strict=True) if w]
    assert trained[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(trained[:-1]) == " 2"


def test_datum_shifts_by_one():
    d = example_to_datum(([1, 2, 3, 4], [0, 0, 1, 1]), scale=0.5)
    assert d.model_input.to_ints() == [1, 2, 3]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]
    assert d.loss_fn_inputs["weights"].tolist() == [0.0, 0.5, 0.5]


def test_batch_weights_average_over_trained_tokens():
    batch = make_batch([([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1])])
    total = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
    assert total == pytest.approx(1.0)


def test_every_example_is_its_own_sequence():
    examples = [([1] * 5, [1.0] * 5), ([2] * 4, [1.0] * 4), ([3] * 3, [1.0] * 3)]
    sequences = training_sequences(examples, 4)
    assert [t for t, _ in sequences] == [[1] * 4, [2] * 4, [3] * 3]
    assert len(make_batch(sequences)) == 3


def test_lr_schedule_warms_up_and_decays_to_ten_percent():
    cfg = SFTConfig(model="m", run_dir="r", learning_rate=1.0, max_steps=100, warmup_frac=0.1)
    assert learning_rate_at(cfg, 0) == pytest.approx(0.1)
    assert learning_rate_at(cfg, 9) == pytest.approx(1.0)
    assert learning_rate_at(cfg, 100) == pytest.approx(0.1)
