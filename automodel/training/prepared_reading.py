"""How a recipe reads prepared data (``automodel.training.prepared``): ``data.path`` naming a prepared folder, or
``data.blend`` naming several, checked against the recipe and the model's tokenizer before training starts."""

from __future__ import annotations

import logging
import shlex
from collections.abc import Sequence

from automodel.distributed.runtime import log_rank_zero

from .blend import BlendedExamples
from .config import ConfigError, RecipeConfig
from .data import Example
from .prepared import PreparedCorpus, PreparedDataError, PreparedExamples, is_prepared, tokenizer_fingerprint

__all__ = ["RAW_TOKENS_WORTH_PREPARING", "check_prepared_data", "read_prepared", "suggest_prepare_data"]

logger = logging.getLogger(__name__)

#: Past this many tokens read in memory, the run says that ``automodel prepare-data`` should be used.
RAW_TOKENS_WORTH_PREPARING = 50_000_000
_BLEND_SHARE_ITEMS = 10_000


def read_prepared(config: RecipeConfig, tokenizer, pad_id: int) -> tuple[Sequence[Example], bool] | None:
    """The examples of the prepared data the config names and whether the loader shuffles them (a blend keeps its
    own order); ``None`` when the data is not prepared."""
    data, seq_len = config.data, config.train.seq_len
    if data.blend:
        corpora = [_corpus(config, f"data.blend[{i}].path", s.path, tokenizer) for i, s in enumerate(data.blend)]
        sources = [PreparedExamples(corpus, seq_len) for corpus in corpora]
        blend = BlendedExamples(sources, [source.weight for source in data.blend], data.seed)
        shares = blend.shares(min(_BLEND_SHARE_ITEMS, len(blend)))
        for source, share, examples in zip(data.blend, shares, sources, strict=True):
            log_rank_zero(
                logger,
                "data blend: %s weight %g, %.1f%% of the first %d sequences, %d sequences of %d tokens per pass",
                source.path,
                source.weight,
                100 * share,
                min(_BLEND_SHARE_ITEMS, len(blend)),
                len(examples),
                seq_len,
            )
        return blend, False
    if not is_prepared(data.path):
        return None
    corpus = _corpus(config, "data.path", data.path, tokenizer)
    try:
        examples = PreparedExamples(corpus, seq_len, packing=data.packing, pad_id=pad_id)
    except PreparedDataError as error:
        raise ConfigError(f"data.path={data.path}: {error}") from None
    log_rank_zero(
        logger,
        "data: %s prepared (%s documents, %s tokens): %d sequences of %d tokens, read on demand",
        data.path,
        f"{corpus.documents:,}",
        f"{corpus.tokens:,}",
        len(examples),
        seq_len,
    )
    return examples, True


def check_prepared_data(config: RecipeConfig, tokenizer) -> None:
    """Before launch and on every rank before training: each prepared folder the config names is whole, of the
    recipe's kind, and was tokenized by the model's tokenizer (unless ``data.allow_tokenizer_mismatch``)."""
    named = [("data.path", config.data.path)] if config.data.path and is_prepared(config.data.path) else []
    named += [(f"data.blend[{i}].path", source.path) for i, source in enumerate(config.data.blend)]
    for key, path in named:
        _corpus(config, key, path, tokenizer)


def _corpus(config: RecipeConfig, key: str, path: str, tokenizer) -> PreparedCorpus:
    try:
        corpus = PreparedCorpus(path)
    except PreparedDataError as error:
        raise ConfigError(f"{key}={path}: {error}") from None
    if corpus.kind != config.recipe:
        raise ConfigError(
            f"{key}={path} was prepared for {corpus.kind} (prepare-data --kind {corpus.kind}), but this is "
            f"`automodel {config.recipe}`: prepare it with --kind {config.recipe}."
        )
    if tokenizer is not None and not config.data.allow_tokenizer_mismatch:
        ours = tokenizer_fingerprint(tokenizer, chat=corpus.kind == "sft")
        theirs = corpus.manifest["tokenizer"]
        if ours != theirs["hash"]:
            raise ConfigError(
                f"{key}={path} was tokenized with {theirs['name']} (hash {theirs['hash'][:12]}), not with the "
                f"tokenizer of model.path={config.model.path} (hash {ours[:12]}): its token ids would mean other "
                "words to this model. Prepare the data with this model's tokenizer (automodel prepare-data "
                f"--tokenizer {config.model.path} ...), or set data.allow_tokenizer_mismatch=true if they agree."
            )
    return corpus


def suggest_prepare_data(config: RecipeConfig, examples: Sequence[Example]) -> None:
    """Past ``RAW_TOKENS_WORTH_PREPARING`` tokens read into memory, say that ``prepare-data`` should be used, and how."""
    tokens = sum(len(example.input_ids) for example in examples)
    if tokens <= RAW_TOKENS_WORTH_PREPARING:
        return
    command = shlex.join(
        [
            "automodel",
            "prepare-data",
            "--tokenizer",
            config.model.path,
            "--input",
            config.data.path,
            "--output",
            f"{config.data.path.rstrip('/')}.prepared",
            "--kind",
            config.recipe,
        ]
    )
    log_rank_zero(
        logger,
        "data: %s tokens read into every rank's memory and tokenized on every start; prepare them once and point "
        "data.path at the result: %s",
        f"{tokens:,}",
        command,
        level=logging.WARNING,
    )
