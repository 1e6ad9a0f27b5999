"""FSDP2-wrapped critic and reward model: the same gradients as the unwrapped model, and no view outputs.

A value or reward head (`apply_fsdp2(fp32_modules=[model.score])`) is an FSDP unit of its own. A Linear
with a bias on a (B, T, H) input returns a view; FSDP2 hooks a unit's output to gather the head's weights
again before its backward, and an in-place op on a view output drops that hook (torch warns "FSDP2-wrapped
module ... returned a view tensor"; backward then fails on the freed weights). `apply_fsdp2` gives such
heads an output of its own. Here, in a process group of one (gloo), each wrapped model's gradients are
compared with those of an unwrapped copy on the same batch, also after an in-place op on the output.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from hflow.config_schema import default_config
from hflow.tasks.tiny_models import build_causal_lm
from hflow.workers.fsdp import apply_fsdp2, load_reward_model, load_value_model
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.workers.config import resolved_copy
from hflow.workers.critic.dp_critic import DataParallelPPOCritic
from hflow.workers.fsdp_workers import last_token_scores

PROMPT_LEN, RESPONSE_LEN, VOCAB = 6, 5, 100
VIEW_WARNING = "returned a view tensor"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_causal_lm(tmp_path_factory.mktemp("heads") / "qwen2", hidden_size=128, intermediate_size=256)


def make_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    prompt_mask = (torch.arange(PROMPT_LEN) >= PROMPT_LEN - torch.tensor([6, 2, 4])[:, None]).long()
    response_mask = (torch.arange(RESPONSE_LEN) < torch.tensor([5, 3, 1])[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=-1)
    input_ids = torch.randint(1, VOCAB, attention_mask.shape, generator=gen) * attention_mask
    return {"input_ids": input_ids, "attention_mask": attention_mask, "responses": input_ids[:, PROMPT_LEN:],
            "position_ids": compute_position_id_with_mask(attention_mask)}


def wrapped_and_reference(model: torch.nn.Module, mesh) -> tuple[torch.nn.Module, torch.nn.Module]:
    reference = copy.deepcopy(model)
    return apply_fsdp2(model, mesh, fp32_modules=[model.score]), reference


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for name, p in model.named_parameters()}


def assert_same_gradients(wrapped: torch.nn.Module, reference: torch.nn.Module) -> None:
    ours, theirs = gradients(wrapped), gradients(reference)
    assert ours.keys() == theirs.keys()
    assert theirs["score.weight"].abs().max() > 0  # the head is in the loss
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def view_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if VIEW_WARNING in str(w.message)]


@pytest.mark.parametrize("remove_padding", [False, True])
def test_fsdp_critic_gradients_match_the_unwrapped_critic(model_dir: Path, world_of_one, remove_padding: bool):
    """The critic's own forward (`_forward_micro_batch`, padded and packed) and a loss on its values:
    the wrapped model's gradients are the unwrapped one's, and FSDP warns of no view output."""
    wrapped, reference = wrapped_and_reference(load_value_model(str(model_dir), value_head_init="normal"),
                                               world_of_one)
    config = resolved_copy(default_config().critic)
    OmegaConf.update(config, "use_remove_padding", remove_padding)
    batch = make_batch()
    weights = torch.randn(len(batch["input_ids"]), RESPONSE_LEN, generator=torch.Generator().manual_seed(1))
    for model in (wrapped, reference):
        critic = DataParallelPPOCritic(config, model, critic_optimizer=None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values = critic._forward_micro_batch(batch)
            (values * weights * batch["attention_mask"][:, PROMPT_LEN:]).sum().backward()
        assert view_warnings(caught) == []
    assert_same_gradients(wrapped, reference)


def test_fsdp_value_head_output_takes_an_in_place_op(model_dir: Path, world_of_one):
    """An in-place op on the wrapped critic's output (what the view warning is about) keeps the gradients:
    with a view output, backward failed on the head's freed weights."""
    wrapped, reference = wrapped_and_reference(load_value_model(str(model_dir), value_head_init="normal"),
                                               world_of_one)
    batch = make_batch()
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    for model in (wrapped, reference):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values = model(**inputs, use_cache=False).logits
            values.mul_(3.0)
            (values ** 2).sum().backward()
        assert view_warnings(caught) == []
    assert_same_gradients(wrapped, reference)


def test_fsdp_reward_model_gradients_match_the_unwrapped_reward_model(model_dir: Path, world_of_one):
    """Reward-model training's path (`RewardModelTrainWorker`): the head's per-token output, captured by a
    forward hook on the head, then an in-place op on it, read at each row's last valid token. (A sequence
    classifier's head has no bias, so it returns no view; this guards the hook order with the worker's.)"""
    model = load_reward_model(str(model_dir))
    model.config.pad_token_id = 0  # as the worker sets it from the tokenizer
    wrapped, reference = wrapped_and_reference(model, world_of_one)
    batch = make_batch()
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    for model in (wrapped, reference):
        captured = {}
        model.score.register_forward_hook(lambda _m, _i, output: captured.update(scores=output))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(**inputs, use_cache=False)
            scores = captured["scores"]
            scores.mul_(2.0)
            (last_token_scores(scores, batch["attention_mask"]) * torch.tensor([1.0, -2.0, 0.5])).sum().backward()
        assert view_warnings(caught) == []
    assert_same_gradients(wrapped, reference)
