"""Prepared data (``automodel prepare-data``, ``automodel.training.prepared``): the same batches as the in-memory
path, byte-identical output whatever the worker count, interrupted and appending runs, every bad input refused with
its path, blends at their weights, and a loader that resumes bitwise, also on another data-parallel size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from automodel.training import cli, prepare_data
from automodel.training.batches import DistributedBatchLoader, PrefetchingLoader
from automodel.training.blend import BlendedExamples, blend_positions
from automodel.training.config import ConfigError, load_config
from automodel.training.data import load_records, load_texts, pack_examples, tokenize_pretraining, tokenize_sft
from automodel.training.prepared import PreparedCorpus, PreparedDataError, PreparedExamples
from automodel.training.prepared_reading import check_prepared_data
from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_chat_checkpoint(tmp_path_factory.mktemp("prepared") / "model")


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Pretraining records built from the chat set's words, of varied lengths."""
    texts = []
    for line in CHAT_DATA.read_text().splitlines():
        texts += [message["content"] for message in json.loads(line).get("messages", [])]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(texts[i : i + 1 + i % 5])}) + "\n" for i in range(len(texts))))
    return path


def _prepare(model, inputs, output, *options: str) -> int:
    return cli.main(
        ["prepare-data", "--tokenizer", str(model), "--input", *map(str, inputs), "--output", str(output), *options]
    )


def _loader(examples, dp_rank=0, dp_size=1, shuffle=True, seq_len=16, global_batch=4):
    return DistributedBatchLoader(
        examples,
        global_batch_size=global_batch,
        micro_batch_size=2 if global_batch // dp_size >= 2 else 1,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seq_len=seq_len,
        pad_id=0,
        seed=3,
        shuffle=shuffle,
    )


def _same_batches(first, second, steps: int) -> None:
    for _ in range(steps):
        for a, b in zip(first.next_global_batch(), second.next_global_batch(), strict=True):
            assert a.keys() == b.keys() and all(torch_equal(a[key], b[key]) for key in a)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------- equality


def test_pretraining_windows_and_batches_equal_the_in_memory_path(model, tokenizer, corpus, tmp_path):
    assert _prepare(model, [corpus], tmp_path / "prepared", "--workers", "2") == 0
    memory = tokenize_pretraining(load_texts(corpus), tokenizer, 16)
    prepared = PreparedExamples(PreparedCorpus(tmp_path / "prepared"), 16)
    assert len(prepared) == len(memory) > 20
    assert [prepared[i] for i in range(len(prepared))] == memory
    # Past an epoch too (the loader reshuffles), every batch field equal.
    _same_batches(_loader(memory), _loader(prepared), steps=3 * len(memory) // 4)


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("seq_len", [16, 48])
def test_sft_examples_and_batches_equal_the_in_memory_path(model, tokenizer, tmp_path, packing, seq_len):
    """seq_len=16 truncates and drops the chats without a reply within it, as tokenize_sft does."""
    assert _prepare(model, [CHAT_DATA], tmp_path / "sft", "--kind", "sft", "--workers", "2") == 0
    memory = tokenize_sft(load_records(CHAT_DATA), tokenizer, seq_len)
    if packing:
        memory = pack_examples(memory, seq_len, tokenizer.pad_token_id)
    prepared = PreparedExamples(
        PreparedCorpus(tmp_path / "sft"), seq_len, packing=packing, pad_id=tokenizer.pad_token_id
    )
    assert [prepared[i] for i in range(len(prepared))] == memory
    _same_batches(_loader(memory, seq_len=seq_len), _loader(prepared, seq_len=seq_len), steps=len(memory) // 4 + 2)


# ------------------------------------------------------------------------------------------ determinism and appends


def _files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_the_same_inputs_give_the_same_bytes_whatever_the_workers(model, corpus, tmp_path):
    assert _prepare(model, [corpus], tmp_path / "one", "--workers", "1") == 0
    assert _prepare(model, [corpus], tmp_path / "three", "--workers", "3") == 0
    assert _files(tmp_path / "one") == _files(tmp_path / "three")


def test_an_interrupted_run_leaves_the_folder_as_it_was(model, corpus, tmp_path, monkeypatch):
    output = tmp_path / "prepared"
    assert _prepare(model, [corpus], output, "--workers", "1") == 0
    before = _files(output)

    def interrupted(self, chunk):
        raise KeyboardInterrupt

    more = tmp_path / "more.txt"
    more.write_text(corpus.read_text() + " more")
    monkeypatch.setattr(prepare_data._Buffers, "add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _prepare(model, [more], output, "--workers", "1")
    assert _files(output) == before, "the interrupted part is removed"
    monkeypatch.undo()
    (output / "part-00001.staging").mkdir()  # what a killed run (no exception handler ran) leaves
    assert _prepare(model, [more], output, "--workers", "1") == 0  # appends, and removes the staging part
    assert not list(output.glob("*.staging")) and len(PreparedCorpus(output).manifest["parts"]) == 2


def test_a_file_the_folder_already_holds_is_not_appended_twice(model, corpus, tmp_path, capsys):
    output = tmp_path / "prepared"
    assert _prepare(model, [corpus], output) == 0
    assert _prepare(model, [corpus], output) == 2
    assert f"already holds {corpus} (part-00000, the same size and modification time)" in capsys.readouterr().err
    assert len(PreparedCorpus(output).manifest["parts"]) == 1


def test_chat_records_without_kind_and_json_arrays(model, tmp_path, capsys):
    chats = tmp_path / "chats.json"
    chats.write_text(json.dumps([{"prompt": "hi", "completion": "hello there"}] * 3))
    assert _prepare(model, [chats], tmp_path / "a") == 2
    assert "these are SFT records: pass --kind sft" in capsys.readouterr().err
    assert _prepare(model, [chats], tmp_path / "b", "--kind", "sft") == 0
    assert PreparedCorpus(tmp_path / "b").manifest["documents"] == 3


def test_appending_continues_the_stream_and_refuses_another_tokenizer(model, tokenizer, corpus, tmp_path, capsys):
    output = tmp_path / "prepared"
    second = tmp_path / "second.txt"
    second.write_text("assistant user system " * 40)
    assert _prepare(model, [corpus], output) == 0
    assert _prepare(model, [second], output) == 0
    both = tokenize_pretraining([*load_texts(corpus), *load_texts(second)], tokenizer, 16)
    prepared = PreparedExamples(PreparedCorpus(output), 16)
    assert [prepared[i] for i in range(len(prepared))] == both, "windows cross from one part into the next"
    other = save_tiny_chat_checkpoint(tmp_path / "other")
    tokenizer_file = other / "tokenizer.json"
    definition = json.loads(tokenizer_file.read_text())
    definition["model"]["vocab"]["zzz-new-word"] = len(definition["model"]["vocab"])
    tokenizer_file.write_text(json.dumps(definition))
    capsys.readouterr()
    assert _prepare(other, [second], output) == 2
    message = capsys.readouterr().err
    assert f"--output {output} was prepared with the tokenizer {model}" in message and "appending would mix" in message
    assert len(PreparedCorpus(output).manifest["parts"]) == 2


# ------------------------------------------------------------------------------------------------------- bad input


def test_empty_sources_are_refused(model, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.jsonl").write_text("\n")
    assert _prepare(model, [tmp_path / "empty"], tmp_path / "a") == 2
    assert "is an empty folder (empty source)" in capsys.readouterr().err
    assert _prepare(model, [tmp_path / "empty.jsonl"], tmp_path / "b") == 2
    assert "no documents with tokens to prepare (empty source)" in capsys.readouterr().err
    assert not (tmp_path / "b" / "manifest.json").exists() and not list((tmp_path / "b").glob("part-*"))
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{not json\n')
    assert _prepare(model, [tmp_path / "bad.jsonl"], tmp_path / "c") == 2
    assert f"{tmp_path / 'bad.jsonl'}:2: not valid JSON (" in capsys.readouterr().err
    assert not (tmp_path / "c").exists(), "a failed run leaves no folder it created"
    splits = tmp_path / "splits"
    splits.mkdir()
    for name in ("train.jsonl", "validation.jsonl"):
        (splits / name).write_text('{"text": "a"}\n')
    assert _prepare(model, [splits], tmp_path / "d") == 2
    assert "holds the files of the splits ['train', 'validation']" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["missing", "truncated", "index", "manifest"])
def test_a_damaged_folder_is_refused_with_the_file_and_the_fix(model, corpus, tmp_path, damage):
    output = tmp_path / "prepared"
    assert _prepare(model, [corpus], output) == 0
    part = output / "part-00000"
    if damage == "missing":
        (part / "tokens.bin").unlink()
        expected = f"{part / 'tokens.bin'} is missing"
    elif damage == "truncated":
        data = (part / "tokens.bin").read_bytes()
        (part / "tokens.bin").write_bytes(data[:-10])
        expected = f"{part / 'tokens.bin'} holds {len(data) - 10} bytes where the manifest says {len(data)}"
    elif damage == "index":
        offsets = np.fromfile(part / "documents.bin", dtype=np.int64)
        offsets[-1] -= 1
        offsets.tofile(part / "documents.bin")
        expected = f"{part / 'documents.bin'} does not index {part / 'tokens.bin'}"
    else:
        (output / "manifest.json").write_text("{not json")
        expected = f"{output / 'manifest.json'} cannot be read"
    with pytest.raises(PreparedDataError, match="prepare") as info:
        PreparedCorpus(output)
    assert expected in str(info.value)


def _config(tmp_path, model, data: str, recipe="pretrain", *overrides: str):
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: {recipe}\nmodel: {{path: {model}}}\ndata: {data}\n")
    return load_config(config, list(overrides))


def test_a_tokenizer_that_is_not_the_models_is_refused_unless_allowed(model, corpus, tmp_path, tokenizer):
    output = tmp_path / "prepared"
    assert _prepare(model, [corpus], output) == 0
    other = save_tiny_chat_checkpoint(tmp_path / "other")
    definition = json.loads((other / "tokenizer.json").read_text())
    definition["model"]["vocab"]["zzz-new-word"] = len(definition["model"]["vocab"])
    (other / "tokenizer.json").write_text(json.dumps(definition))
    config = _config(tmp_path, other, f"{{path: {output}}}")
    with pytest.raises(ConfigError, match="not with the tokenizer of model.path") as info:
        check_prepared_data(config, AutoTokenizer.from_pretrained(other))
    assert f"data.path={output} was tokenized with {model}" in str(info.value)
    assert "data.allow_tokenizer_mismatch=true" in str(info.value)
    check_prepared_data(
        _config(tmp_path, other, f"{{path: {output}, allow_tokenizer_mismatch: true}}"),
        AutoTokenizer.from_pretrained(other),
    )
    with pytest.raises(ConfigError, match="was prepared for pretrain"):
        check_prepared_data(_config(tmp_path, model, f"{{path: {output}}}", "sft"), tokenizer)


def test_the_command_refuses_bad_prepared_data_before_launch(model, corpus, tmp_path, recorded_torchrun, capsys):
    output = tmp_path / "prepared"
    assert _prepare(model, [corpus], output) == 0
    (output / "part-00000" / "tokens.bin").write_bytes(b"")
    config = tmp_path / "run.yaml"
    config.write_text(f"recipe: pretrain\nmodel: {{path: {model}}}\ndata: {{path: {output}}}\n")
    capsys.readouterr()
    assert cli.main(["pretrain", "--config", str(config), "--nproc-per-node", "2"]) == 2
    error = capsys.readouterr().err
    assert (
        f"data.path={output}: {output / 'part-00000' / 'tokens.bin'} holds 0 bytes" in error and not recorded_torchrun
    )


# ---------------------------------------------------------------------------------------------------------- blends


def test_a_blend_takes_each_source_at_its_weight_deterministically(model, corpus, tmp_path):
    second = tmp_path / "second.txt"
    second.write_text("assistant user system " * 400)
    assert _prepare(model, [corpus], tmp_path / "a") == 0
    assert _prepare(model, [second], tmp_path / "b") == 0
    sources = [PreparedExamples(PreparedCorpus(tmp_path / name), 16) for name in ("a", "b")]
    blend = BlendedExamples(sources, [0.7, 0.3], seed=5)
    positions = [blend_positions(i, [0.7, 0.3]) for i in range(10_000)]
    counts = np.bincount([source for source, _ in positions], minlength=2)
    assert abs(counts[0] / 10_000 - 0.7) < 0.01 and abs(counts[1] / 10_000 - 0.3) < 0.01, counts
    prefix = np.cumsum(np.eye(2, dtype=np.int64)[[source for source, _ in positions]], axis=0)
    ideal = np.outer(np.arange(1, 10_001), [0.7, 0.3])
    assert np.abs(prefix - ideal).max() <= 1.0, "every prefix holds each source within one sample of its weight"
    for source in (0, 1):  # each source's samples are numbered 0, 1, 2 ... in blend order
        numbers = [number for which, number in positions if which == source]
        assert numbers == list(range(len(numbers)))
    again = BlendedExamples(sources, [0.7, 0.3], seed=5)
    assert [blend[i] for i in range(0, 3000, 7)] == [again[i] for i in range(0, 3000, 7)]
    three = [blend_positions(i, [2, 1, 1]) for i in range(10_000)]
    assert np.allclose(np.bincount([s for s, _ in three]) / 10_000, [0.5, 0.25, 0.25], atol=0.01)


def test_blend_config_resolves_paths_and_refuses_misuse(tmp_path, model):
    (tmp_path / "a").mkdir()
    config = _config(tmp_path, model, "{blend: [{path: a, weight: 0.7}, {path: /b, weight: 0.3}]}")
    assert config.data.blend[0].path == str(tmp_path / "a") and config.data.blend[1].weight == 0.3
    with pytest.raises(ConfigError, match="data.path and data.blend are both set"):
        _config(tmp_path, model, "{path: x, blend: [{path: a}]}")
    with pytest.raises(ConfigError, match="weight > 0"):
        _config(tmp_path, model, "{blend: [{path: a, weight: 0}]}")
    with pytest.raises(ConfigError, match="use it with `automodel pretrain`"):
        _config(tmp_path, model, "{blend: [{path: a}]}", "sft")


# ---------------------------------------------------------------------------------------------- resume and DP size


def test_a_changed_dp_size_continues_the_same_global_order(model, corpus, tmp_path):
    assert _prepare(model, [corpus], tmp_path / "prepared") == 0
    examples = PreparedExamples(PreparedCorpus(tmp_path / "prepared"), 16)
    two = [_loader(examples, rank, 2, global_batch=8) for rank in range(2)]
    for _ in range(3):
        for loader in two:
            loader.next_global_batch()
    state = two[0].state_dict()
    expected = [batch["input_ids"] for loader in two for batch in loader.next_global_batch()]
    four = [_loader(examples, rank, 4, global_batch=8) for rank in range(4)]
    for loader in four:
        loader.load_state_dict(state)
    got = [batch["input_ids"] for loader in four for batch in loader.next_global_batch()]
    import torch

    assert torch.equal(torch.cat(expected), torch.cat(got)), "4 ranks read the rows 2 ranks would have read next"


def test_the_prefetching_loader_resumes_where_training_stood(model, corpus, tmp_path):
    assert _prepare(model, [corpus], tmp_path / "prepared") == 0
    examples = PreparedExamples(PreparedCorpus(tmp_path / "prepared"), 16)
    prefetching = PrefetchingLoader(_loader(examples))
    plain = _loader(examples)
    for _ in range(5):
        _same_batches(prefetching, plain, steps=1)
    state = prefetching.state_dict()
    assert state == plain.state_dict(), "the state of the batches handed out, not of the one prefetched"
    resumed = PrefetchingLoader(_loader(examples))
    resumed.load_state_dict(state)
    _same_batches(resumed, plain, steps=len(examples))  # into the next epochs too
    prefetching.close()
    resumed.close()


def test_prepared_arrow_and_parquet_sources(model, tokenizer, corpus, tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in corpus.read_text().splitlines()]
    table = pyarrow.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "corpus.parquet", row_group_size=7)
    with pyarrow.ipc.new_stream(str(tmp_path / "corpus.arrow"), table.schema) as writer:
        writer.write_table(table)
    memory = tokenize_pretraining(load_texts(corpus), tokenizer, 16)
    for name in ("corpus.parquet", "corpus.arrow"):
        assert _prepare(model, [tmp_path / name], tmp_path / name.replace(".", "-")) == 0
        prepared = PreparedExamples(PreparedCorpus(tmp_path / name.replace(".", "-")), 16)
        assert [prepared[i] for i in range(len(prepared))] == memory, name
    shutil.rmtree(tmp_path / "corpus-arrow")


@pytest.mark.distributed
def test_pretraining_on_prepared_data_resumes_bitwise_and_blends_run(ranks2, model, corpus, tmp_path):
    """2 ranks: the losses of a run interrupted after step 4 and resumed equal an uninterrupted run's, and equal
    the in-memory path's; a blend of two prepared sources trains."""
    from tests.cases.training import train

    assert _prepare(model, [corpus], tmp_path / "prepared") == 0
    second = tmp_path / "second.txt"
    second.write_text("assistant user system " * 200)
    assert _prepare(model, [second], tmp_path / "second") == 0
    config = tmp_path / "pretrain.yaml"
    config.write_text(
        f"recipe: pretrain\nmodel: {{path: {model}}}\ndata: {{path: {tmp_path / 'prepared'}}}\n"
        "train: {max_steps: 8, global_batch_size: 4, micro_batch_size: 1, seq_len: 16, lr: 3.0e-3}\n"
    )
    full = ranks2.run(train, str(config), [])[0]["losses"]
    assert ranks2.run(train, str(config), [f"data.path={corpus}"])[0]["losses"] == full, "prepared == in memory"
    checkpoints = f"checkpoint.dir={tmp_path / 'ckpt'}"
    first = ranks2.run(train, str(config), [checkpoints, "train.stop_after_steps=4"])[0]
    resumed = ranks2.run(train, str(config), [checkpoints])[0]
    assert first["losses"] == full[:4] and resumed["resumed_from"] == 4 and resumed["losses"] == full
    blend = [
        "data.path=''",
        f"data.blend=[{{path: {tmp_path / 'prepared'}, weight: 0.7}}, {{path: {tmp_path / 'second'}, weight: 0.3}}]",
    ]
    losses = ranks2.run(train, str(config), blend)[0]["losses"]
    assert len(losses) == 8 and all(np.isfinite(losses))


# ------------------------------------------------------------------------------------------- hub datasets by name


@pytest.fixture
def cached_hub_dataset(tmp_path, monkeypatch) -> Path:
    """``someone/chats`` in a ``datasets`` cache, as an earlier online load leaves it (built here from a local parquet
    file with ``datasets``' own parquet builder, then placed at ``<cache>/someone___chats/default/0.0.0/<commit>``),
    and this process offline."""
    datasets = pytest.importorskip("datasets")
    import pyarrow
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    records = [json.loads(line) for line in CHAT_DATA.read_text().splitlines()]
    pq.write_table(pyarrow.Table.from_pylist([{"text": str(r)} | r for r in records]), tmp_path / "train.parquet")
    builder = Parquet(
        cache_dir=str(tmp_path / "build"), dataset_name="chats", data_files={"train": str(tmp_path / "train.parquet")}
    )
    builder.download_and_prepare()
    cache = tmp_path / "datasets"
    shutil.copytree(builder.cache_dir, cache / "someone___chats" / "default" / "0.0.0" / "0123abcd")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def test_a_hub_dataset_id_reads_from_the_datasets_cache_offline(
    cached_hub_dataset, model, tmp_path, recorded_torchrun, capsys
):
    from automodel.training.data import is_hub_dataset_id

    assert is_hub_dataset_id("someone/chats") and not is_hub_dataset_id("data/train.jsonl")
    records = load_records("someone/chats", cache_dir=cached_hub_dataset)
    assert [record["messages"] for record in records] == [
        json.loads(line).get("messages") for line in CHAT_DATA.read_text().splitlines()
    ]
    assert len(load_texts("someone/chats", cache_dir=cached_hub_dataset)) == len(records)
    with pytest.raises(ValueError, match="data.path=someone/missing .* could not be loaded.*datasets` cache"):
        load_records("someone/missing", cache_dir=cached_hub_dataset)
    config = tmp_path / "run.yaml"
    config.write_text(f"recipe: sft\nmodel: {{path: {model}}}\ndata: {{path: someone/missing}}\n")
    capsys.readouterr()
    assert cli.main(["sft", "--config", str(config), "--nproc-per-node", "2"]) == 2 and not recorded_torchrun
    assert "data.path=someone/missing is a hub dataset id that is not in the datasets cache" in capsys.readouterr().err
    assert cli.main(["sft", "--config", str(config), "--nproc-per-node", "2", "data.path=someone/chats"]) == 0
