"""A meta-device build skips ``torch.nn.init`` on meta tensors only: real tensors are initialised as before, the model
is the same, no generator moves, and the functions are put back however the blocks open and close."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.nn import init

from automodel import NeMoAutoModelForCausalLM
from automodel.loading.meta_build import INIT_FUNCTIONS, init_skipped_on_meta
from tests.tiny_models import ARCHITECTURES, tiny_config


def _originals() -> dict[str, object]:
    return {name: getattr(init, name) for name in INIT_FUNCTIONS}


def test_meta_tensors_are_returned_untouched_and_real_ones_initialised_as_before():
    originals = _originals()
    meta = torch.empty(4, 4, device="meta")
    torch.manual_seed(0)
    expected = init.kaiming_uniform_(torch.empty(4, 4), a=5**0.5)
    with init_skipped_on_meta():
        for name in INIT_FUNCTIONS:
            assert getattr(init, name) is not originals[name], name
        assert init.kaiming_uniform_(meta, a=5**0.5) is meta
        assert init.normal_(tensor=meta, std=0.02) is meta  # by keyword, as some models call it
        torch.manual_seed(0)
        real = torch.empty(4, 4)
        assert init.kaiming_uniform_(real, a=5**0.5) is real
    torch.testing.assert_close(real, expected, rtol=0, atol=0)
    assert _originals() == originals


def test_functions_are_put_back_after_an_error_and_only_when_the_outermost_block_closes():
    originals = _originals()
    with pytest.raises(RuntimeError, match="inside"):
        with init_skipped_on_meta():
            with init_skipped_on_meta():
                wrapped = init.normal_
            assert init.normal_ is wrapped  # the outer block is still open
            raise RuntimeError("inside")
    assert _originals() == originals


def test_a_function_replaced_by_someone_else_meanwhile_is_left_in_place():
    originals = _originals()

    def replacement(tensor, *args, **kwargs):
        return tensor

    try:
        with init_skipped_on_meta():
            init.zeros_ = replacement
        assert init.zeros_ is replacement
        assert {name: fn for name, fn in _originals().items() if name != "zeros_"} == {
            name: fn for name, fn in originals.items() if name != "zeros_"
        }
    finally:
        init.zeros_ = originals["zeros_"]


def test_blocks_opened_and_closed_by_several_threads_leave_the_originals():
    originals = _originals()
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def build() -> None:
        try:
            for _ in range(20):
                barrier.wait(timeout=30)
                with init_skipped_on_meta(), torch.device("meta"):
                    nn.Linear(8, 8)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert _originals() == originals


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_the_meta_build_is_the_model_built_without_skipping_and_moves_no_generator(architecture):
    config = tiny_config(architecture)
    torch.manual_seed(123)
    built = NeMoAutoModelForCausalLM._build_on_meta(config, torch.float32, None, False)
    after = torch.rand(3)
    torch.manual_seed(123)
    with torch.device("meta"):
        plain = type(built)._from_config(config, dtype=torch.float32)
    assert torch.equal(torch.rand(3), after)

    def layout(model: nn.Module) -> list[tuple]:
        tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        return [(name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for name, t in tensors]

    assert layout(built) == layout(plain)

    # Ties as transformers makes them (tie_weights ran: the model's own init_weights is not skipped).
    def tied(model: nn.Module) -> bool:
        return model.get_output_embeddings().weight is model.get_input_embeddings().weight

    assert tied(built) == tied(plain) == bool(config.tie_word_embeddings)
