"""The recipes' data pipeline: SFT loss masks, packing, pretraining chunks, loading, and the sharded resumable loader."""

from __future__ import annotations

import copy
import json
import logging
import pickle

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from automodel.training.batches import DistributedBatchLoader, _epoch_permutation
from automodel.training.data import (
    Example,
    load_records,
    load_texts,
    pack_examples,
    tokenize_pretraining,
    tokenize_sft,
)

# SmolLM2's template, with a shorter default system prompt: no {% generation %} markers.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRIMMING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n\n' + message['content'] | trim }}"
    "{{ '<|im_end|>' }}{% endfor %}"
)
SENTENCES = [
    "The assistant answers the user politely and briefly.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "You are a helpful assistant. What is two plus two? It is four.",
    "hello world, how are you today? I am fine, thank you!",
]

MULTI_TURN = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say the word assistant."},
        {"role": "assistant", "content": "assistant"},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
    ]
}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences, with ChatML special tokens and a template without markers."""
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    model.train_from_iterator(SENTENCES, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    return tok


def labelled_runs(tokenizer, example: Example) -> list[str]:
    """The decoded text of each contiguous run of labelled tokens."""
    runs, current = [], []
    for token, label in zip(example.input_ids, example.labels, strict=True):
        if label == -100:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False) for run in runs]


# ------------------------------------------------------------------------------------------------------------- SFT


def test_multi_turn_chat_labels_exactly_assistant_contents_and_end_of_turn(tokenizer):
    (example,) = tokenize_sft([MULTI_TURN], tokenizer, seq_len=512)
    expected_ids = tokenizer.apply_chat_template(MULTI_TURN["messages"], tokenize=True)["input_ids"]
    assert example.input_ids == expected_ids
    # "assistant" also occurs in the user turn and in the turn header: only the reply itself is labelled.
    assert labelled_runs(tokenizer, example) == ["assistant<|im_end|>", "Paris is the capital of France.<|im_end|>"]


def test_trimming_template_labels_trimmed_content(tokenizer):
    tokenizer = _with_template(tokenizer, TRIMMING_TEMPLATE)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "  It is four.\n"}]
    (example,) = tokenize_sft([{"messages": messages}], tokenizer, seq_len=512)
    assert example.input_ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert labelled_runs(tokenizer, example) == ["It is four.<|im_end|>"]


def test_prompt_completion_records_become_user_and_assistant_turns(tokenizer):
    records = [
        {"prompt": "What is two plus two?", "completion": "It is four."},
        {
            "prompt": [{"role": "user", "content": "hello world"}],
            "completion": [{"role": "assistant", "content": "I am fine."}],
        },
    ]
    first, second = tokenize_sft(records, tokenizer, seq_len=512)
    chat = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "It is four."}]
    assert first.input_ids == tokenizer.apply_chat_template(chat, tokenize=True)["input_ids"]
    assert labelled_runs(tokenizer, first) == ["It is four.<|im_end|>"]
    assert labelled_runs(tokenizer, second) == ["I am fine.<|im_end|>"]


def test_truncation_cuts_to_seq_len_and_drops_examples_without_assistant_tokens(tokenizer, caplog):
    (full,) = tokenize_sft([MULTI_TURN], tokenizer, seq_len=512)
    seq_len = len(full.input_ids) - 3
    (cut,) = tokenize_sft([MULTI_TURN], tokenizer, seq_len=seq_len)
    assert cut.input_ids == full.input_ids[:seq_len] and cut.labels == full.labels[:seq_len]

    prompt_only = full.labels.index(next(label for label in full.labels if label != -100))
    with caplog.at_level(logging.WARNING, logger="automodel.training.data"):
        kept = tokenize_sft([MULTI_TURN, {"prompt": "hi", "completion": "ok"}], tokenizer, seq_len=prompt_only)
    assert len(kept) == 1 and len(kept[0].input_ids) <= prompt_only
    assert (
        f"Dropped 1 of 2 SFT examples with no assistant token within seq_len={prompt_only} (the earliest is token {prompt_only + 1} of its example)"
        in caplog.text
    )
    with pytest.raises(
        ValueError, match=rf"None of the 1 SFT records .*the earliest is token {prompt_only + 1}.*Raise train\.seq_len"
    ):
        tokenize_sft([MULTI_TURN], tokenizer, seq_len=prompt_only)


def test_sft_errors_name_the_record_and_the_fix(tokenizer):
    with pytest.raises(ValueError, match=r"SFT record 1 has keys \['input', 'output'\].*'messages'.*'prompt'"):
        tokenize_sft([MULTI_TURN, {"input": "a", "output": "b"}], tokenizer, seq_len=64)
    with pytest.raises(ValueError, match=r"record 0, message 0: expected \{'role': str, 'content': str\}"):
        tokenize_sft([{"messages": [{"role": "user"}]}], tokenizer, seq_len=64)
    no_template = _with_template(tokenizer, None)
    with pytest.raises(ValueError, match="has no chat template.*set `tokenizer.chat_template`"):
        tokenize_sft([MULTI_TURN], no_template, seq_len=64)
    # Like templates that strip the reasoning of earlier assistant turns: content the mask cannot be placed on.
    last_reply_only = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="SFT record 0: the chat template does not render each assistant content"):
        tokenize_sft([MULTI_TURN], _with_template(tokenizer, last_reply_only), seq_len=64)
    with pytest.raises(ValueError, match="No SFT records"):
        tokenize_sft([], tokenizer, seq_len=64)
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        tokenize_sft([MULTI_TURN], tokenizer, seq_len=0)


def _with_template(tokenizer, template):
    copy = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    copy.chat_template = template
    return copy


# ------------------------------------------------------------------------------------------- packing, pretraining


def test_pack_examples_fills_sequences_of_exactly_seq_len_without_splitting():
    examples = [Example([i] * n, [i + 100] * n) for i, n in enumerate([3, 4, 2, 5, 1], start=1)]
    packed = pack_examples(examples, seq_len=6, pad_id=0)
    assert [len(example.input_ids) for example in packed] == [6, 6, 6]
    assert [example.input_ids for example in packed] == [
        [1, 1, 1, 0, 0, 0],
        [2, 2, 2, 2, 3, 3],
        [4, 4, 4, 4, 4, 5],
    ]
    # Each example's first token is no target (it would be the previous example's last prediction).
    assert packed[0].labels == [-100, 101, 101, -100, -100, -100]
    assert packed[1].labels == [-100, 102, 102, 102, -100, 103]
    assert packed[2].labels == [-100] + [104] * 4 + [-100]
    # Positions restart for every packed example (and for the padding): transformers masks each to itself.
    assert packed[0].position_ids == [0, 1, 2, 0, 1, 2] and packed[0].padding == 3
    assert packed[1].position_ids == [0, 1, 2, 3, 0, 1] and packed[1].padding == 0
    assert packed[2].position_ids == [0, 1, 2, 3, 4, 0]
    with pytest.raises(ValueError, match="Example 1 has 7 tokens > seq_len=6"):
        pack_examples([Example([1], [1]), Example([2] * 7, [2] * 7)], seq_len=6, pad_id=0)


def test_pretraining_concatenates_texts_with_eos_and_drops_the_partial_tail(tokenizer):
    texts = ["hello world", "Paris is the capital of France.", "It is four."]
    examples = tokenize_pretraining(texts, tokenizer, seq_len=4)
    stream = []
    for text in texts:
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    assert len(examples) == len(stream) // 4 and len(stream) % 4  # the partial tail exists and is dropped
    assert [token for example in examples for token in example.input_ids] == stream[: len(examples) * 4]
    assert all(example.labels == example.input_ids and len(example.input_ids) == 4 for example in examples)
    with pytest.raises(ValueError, match="fewer than one sequence of seq_len=1000"):
        tokenize_pretraining(texts, tokenizer, seq_len=1000)


# --------------------------------------------------------------------------------------------------------- loading


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_load_records_jsonl_file_and_folder(tmp_path):
    _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p2", "completion": "c2"}])
    _write_jsonl(tmp_path / "a.jsonl", [MULTI_TURN, {"prompt": "p1", "completion": "c1"}])
    (tmp_path / "README.md").write_text("not data")
    assert load_records(tmp_path / "a.jsonl") == [MULTI_TURN, {"prompt": "p1", "completion": "c1"}]
    assert [record.get("prompt") for record in load_records(tmp_path)] == [None, "p1", "p2"]


def test_load_records_reads_what_datasets_reads(tmp_path):
    import datasets

    records = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(3)]
    dataset = datasets.Dataset.from_list(records)
    dataset.to_parquet(str(tmp_path / "train.parquet"))
    dataset.to_csv(str(tmp_path / "train.csv"), index=False)
    dataset.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "parquet_dir").mkdir()
    dataset.to_parquet(str(tmp_path / "parquet_dir" / "train-00000.parquet"))
    cache = tmp_path / "cache"
    assert load_records(tmp_path / "train.parquet", cache_dir=cache) == records
    assert load_records(tmp_path / "train.csv", cache_dir=cache) == records
    assert load_records(tmp_path / "saved") == records
    assert load_records(tmp_path / "parquet_dir", cache_dir=cache) == records
    chats = datasets.Dataset.from_list([MULTI_TURN])
    chats.to_parquet(str(tmp_path / "chats.parquet"))
    assert load_records(tmp_path / "chats.parquet", cache_dir=cache) == [MULTI_TURN]


def test_load_records_errors_name_the_path_and_the_formats(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*missing.jsonl' does not exist; expected a .jsonl file"):
        load_records(tmp_path / "missing.jsonl")
    (tmp_path / "data.xlsx").write_text("x")
    with pytest.raises(ValueError, match=r"data.xlsx'.*unknown file type '.xlsx'; expected a .jsonl file"):
        load_records(tmp_path / "data.xlsx")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON \(Expecting property name enclosed in double "):
        load_records(tmp_path / "bad.jsonl")


def test_load_texts_from_txt_files_and_jsonl(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "2.txt").write_text("second doc\nline two")
    (tmp_path / "docs" / "1.txt").write_text("first doc")
    assert load_texts(tmp_path / "docs" / "2.txt") == ["second doc\nline two"]
    assert load_texts(tmp_path / "docs") == ["first doc", "second doc\nline two"]
    _write_jsonl(tmp_path / "texts.jsonl", [{"text": "a"}, {"text": "b"}])
    assert load_texts(tmp_path / "texts.jsonl") == ["a", "b"]
    _write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"body": "b"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: record has no string 'text' field \(keys: \['body'\]\)"):
        load_texts(tmp_path / "bad.jsonl")


# ---------------------------------------------------------------------------------------------------------- loader


def numbered_examples(count: int) -> list[Example]:
    """Example i holds token i + 1 (i % 3 + 1 times), so batches show which examples they carry."""
    return [Example([i + 1] * (i % 3 + 1), [i + 1] * (i % 3 + 1)) for i in range(count)]


def make_loader(examples, **overrides) -> DistributedBatchLoader:
    options = dict(global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=2, seq_len=4, pad_id=0, seed=3)
    return DistributedBatchLoader(examples, **{**options, **overrides})


def ids_of(micro_batches) -> list[int]:
    """The example ids of a rank's micro batches, in order."""
    return [int(row[0]) - 1 for batch in micro_batches for row in batch["input_ids"]]


def test_batches_are_padded_tensors_of_micro_batch_by_seq_len():
    loader = make_loader(numbered_examples(20))
    assert loader.steps_per_epoch == 2 and loader.grad_accumulation_steps == 2
    batches = loader.next_global_batch()
    assert len(batches) == 2
    for batch in batches:
        assert set(batch) == {"input_ids", "labels", "num_tokens"}  # no position_ids: the examples are not packed
        assert batch["input_ids"].shape == batch["labels"].shape == (2, 4)
        assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
        lengths = [(int(row_ids[0]) - 1) % 3 + 1 for row_ids in batch["input_ids"]]  # numbered_examples' rule
        assert batch["num_tokens"].item() == sum(lengths), "tokens/s counts the tokens, not the padding"
        for row_ids, row_labels, length in zip(batch["input_ids"], batch["labels"], lengths, strict=True):
            assert (row_ids[length:] == 0).all() and (row_labels[length:] == -100).all()
            assert (row_labels[:length] == row_ids[:length]).all()


def test_packed_batches_carry_their_positions_and_count_tokens_without_padding():
    packed = pack_examples(numbered_examples(6), seq_len=4, pad_id=0)
    loader = DistributedBatchLoader(
        packed, global_batch_size=2, micro_batch_size=2, dp_rank=0, dp_size=1, seq_len=4, pad_id=0
    )
    batch = loader.next_global_batch()[0]
    rows = [packed[i] for i in _epoch_permutation(len(packed), seed=0, epoch=0)[:2]]
    assert batch["position_ids"].tolist() == [row.position_ids for row in rows]
    assert batch["num_tokens"].item() == sum(len(row.input_ids) - row.padding for row in rows)


def test_same_seed_gives_same_batches_and_epochs_reshuffle():
    examples = numbered_examples(16)
    first, second = make_loader(examples), make_loader(examples)
    run = [ids_of(first.next_global_batch()) for _ in range(6)]
    assert run == [ids_of(second.next_global_batch()) for _ in range(6)]
    other = make_loader(examples, seed=4)
    assert run != [ids_of(other.next_global_batch()) for _ in range(6)]
    assert run[:2] != run[2:4]  # a new order each epoch
    assert len(set(run[0] + run[1])) == 8 and len(set(run[2] + run[3])) == 8  # no example twice within an epoch


def test_dp_ranks_get_disjoint_slices_that_make_up_the_global_batch():
    examples = numbered_examples(24)
    whole = make_loader(examples, dp_size=1, micro_batch_size=8)
    ranks = [make_loader(examples, dp_rank=rank, dp_size=4, micro_batch_size=1) for rank in range(4)]
    for _ in range(4):
        global_ids = ids_of(whole.next_global_batch())
        slices = [ids_of(loader.next_global_batch()) for loader in ranks]
        assert [len(s) for s in slices] == [2, 2, 2, 2]
        assert sum(slices, []) == global_ids and len(set(global_ids)) == 8


@pytest.mark.parametrize("resume_after", [1, 2, 3, 5])
def test_resume_from_state_dict_continues_exactly_across_epoch_boundaries(resume_after):
    examples = numbered_examples(19)  # 2 steps per epoch, 3 examples dropped each epoch
    uninterrupted = make_loader(examples, dp_rank=1)
    expected = [ids_of(uninterrupted.next_global_batch()) for _ in range(8)]

    interrupted = make_loader(examples, dp_rank=1)
    for _ in range(resume_after):
        interrupted.next_global_batch()
    state = pickle.loads(pickle.dumps(interrupted.state_dict()))
    assert all(type(value) is int for value in state.values())
    resumed = make_loader(examples, dp_rank=1, seed=99)  # the state's seed wins
    resumed.load_state_dict(state)
    assert [ids_of(resumed.next_global_batch()) for _ in range(8 - resume_after)] == expected[resume_after:]


def test_loader_drops_the_examples_of_an_incomplete_global_batch(caplog):
    with caplog.at_level(logging.WARNING, logger="automodel.training.data"):
        loader = make_loader(numbered_examples(19))
    assert "3 of 19 examples do not fill a last global batch of 8" in caplog.text
    seen = ids_of(loader.next_global_batch()) + ids_of(loader.next_global_batch())
    assert len(seen) == 8 and len(set(seen)) == 8  # rank 0's half of both global batches


def test_loader_argument_errors():
    examples = numbered_examples(16)
    with pytest.raises(
        ValueError, match=r"global_batch_size=6 is not divisible by micro_batch_size \* dp_size = 2 \* 2"
    ):
        make_loader(examples, global_batch_size=6)
    with pytest.raises(ValueError, match="4 examples are fewer than one global batch of 8"):
        make_loader(numbered_examples(4))
    with pytest.raises(ValueError, match=r"dp_rank=2 is outside \[0, dp_size=2\)"):
        make_loader(examples, dp_rank=2)
    with pytest.raises(ValueError, match="Example 0 has 5 tokens > seq_len=4"):
        make_loader([Example([1] * 5, [1] * 5)] + examples)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive integer"):
        make_loader(examples, micro_batch_size=0)
    state = make_loader(numbered_examples(24)).state_dict()
    with pytest.raises(
        ValueError,
        match=r"checkpoint's loader had 24 examples, this one has 16; resume with the same data, tokenizer, train\.seq_len and data\.packing",
    ):
        make_loader(examples).load_state_dict(state)
    other = [Example([token + 1 for token in example.input_ids], example.labels) for example in examples]
    with pytest.raises(
        ValueError, match=r"the data gives other examples than the checkpoint's \(the same number, other tokens\)"
    ):
        make_loader(other).load_state_dict(make_loader(examples).state_dict())
    make_loader(examples).load_state_dict(make_loader(list(examples)).state_dict())  # the same examples resume


@pytest.mark.parametrize(("saved_dp", "resumed_dp"), [(2, 4), (4, 2), (2, 1)])
def test_a_resume_on_another_data_parallel_size_continues_with_the_same_examples(saved_dp, resumed_dp):
    """The global order does not depend on the data-parallel size: after a resume with more or fewer ranks, the
    global batches (all ranks' rows together) are those of the uninterrupted run: none repeated, none skipped."""
    examples = numbered_examples(40)

    def loaders(dp_size):
        return [
            DistributedBatchLoader(
                examples, global_batch_size=8, micro_batch_size=1, dp_rank=r, dp_size=dp_size, seq_len=4, pad_id=0
            )
            for r in range(dp_size)
        ]

    def global_batches(ranks, steps):
        return [sorted(i for loader in ranks for i in ids_of(loader.next_global_batch())) for _ in range(steps)]

    uninterrupted = global_batches(loaders(saved_dp), 9)  # crosses an epoch boundary (5 steps an epoch)
    before = loaders(saved_dp)
    first = global_batches(before, 3)
    state = before[0].state_dict()
    after = loaders(resumed_dp)
    for loader in after:
        loader.load_state_dict(state)
    assert first + global_batches(after, 6) == uninterrupted


def test_flops_per_token_counts_the_matmuls_and_attention():
    from automodel.training.metrics import flops_per_token, model_flops_utilization
    from tests.tiny_models import build_model, tiny_config

    for architecture in ("llama", "llama_tied"):
        model = build_model(tiny_config(architecture))
        config = model.config
        embedding = config.vocab_size * config.hidden_size
        total = sum(p.numel() for p in model.parameters())
        # Untied: every parameter but the lookup table. Tied: the table counts once, as the head's matmul.
        matmul = total - embedding if not config.tie_word_embeddings else total
        attention = 12 * config.num_hidden_layers * config.hidden_size * 16
        assert flops_per_token(model, seq_len=16) == 6 * matmul + attention
    # Routed experts count at the share a token uses: 2 of 4 experts.
    model = build_model(tiny_config("qwen3_moe"))
    config = model.config
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    assert experts > 0
    matmul = sum(p.numel() for p in model.parameters()) - config.vocab_size * config.hidden_size - experts / 2
    attention = 12 * config.num_hidden_layers * config.hidden_size * 16
    assert flops_per_token(model, seq_len=16) == 6 * matmul + attention
    assert model_flops_utilization(1000.0, 2e9, peak_tflops=1.0, devices=2) == pytest.approx(1.0)
    assert model_flops_utilization(1000.0, 2e9, peak_tflops=None, devices=2) is None


def test_a_records_tools_are_rendered_and_tool_calls_are_refused(tokenizer):
    """As TRL: a record's ``tools`` go to the chat template. An assistant turn of ``tool_calls`` is refused: the mask
    covers contents, so the calls the template renders would go untrained."""
    tools_template = (
        "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t | tojson }}{% endfor %}<|im_end|>\n"
        "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = tools_template
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    chat = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "It is sunny."}]
    (example,) = tokenize_sft([{"tools": tools, "messages": chat}], templated, seq_len=512)
    assert "get_weather" in templated.decode(example.input_ids)
    assert labelled_runs(templated, example) == ["It is sunny.<|im_end|>"]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    with pytest.raises(
        ValueError, match=r"SFT record 0, message 1: an assistant turn with 'tool_calls' is not trained"
    ):
        tokenize_sft([{"messages": [chat[0], call]}], templated, seq_len=512)
