"""Mixture-of-experts in the trainer (`hflow.workers.moe`): router replay from the real vLLM sampler (and the
HF one), the replayed forward's log-probs and the update's load-balancing loss and expert-load metrics against
MoE blocks computed by hand, the dense-model preflight. A random tiny Qwen3-MoE (4 experts, 2 per token) built
in a temporary folder.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from hflow.protocol import DataProto
from hflow.tasks.tiny_models import build_causal_lm
from hflow.trainer.config import default_config
from hflow.utils.errors import ConfigError
from hflow.workers.actor import DataParallelPPOActor
from hflow.workers.actor.dp_actor import response_mask_of
from hflow.workers.config import resolved_copy
from hflow.workers.moe import RouterTrace, check_moe_settings, moe_routers, route_and_trace
from hflow.workers.rollout import HFRollout
from tests.workers.test_rollout import make_prompts, rollout_config

QUESTIONS = ["What is 7 + 5?", "What is 9 - 4?", "Tom has 3 apples and buys 4 more. How many?"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_causal_lm(tmp_path_factory.mktemp("moe") / "model", arch="qwen3_moe", num_experts=4,
                           experts_per_token=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=64,
                           initializer_range=0.2)


def load(moe_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def actor_config(**overrides):
    config = resolved_copy(default_config().actor_rollout_ref.actor)
    settings = {"ppo_mini_batch_size_per_rank": 6, "ppo_micro_batch_size_per_gpu": 3, "shuffle": False}
    for key, value in {**settings, **overrides}.items():
        OmegaConf.update(config, key, value)
    return config


def with_recording(config):
    OmegaConf.set_struct(config, False)
    config.record_routing = True
    return config


def trainer_routing(actor: DataParallelPPOActor, batch: DataProto) -> tuple[RouterTrace, torch.Tensor, torch.Tensor]:
    """The actor's own forward over the whole batch: its router trace, the valid-token mask, the replay."""
    keys = actor._forward_keys(batch)
    trace: list = []
    with torch.no_grad():
        actor._forward_micro_batch(batch.batch.select(*keys), 1.0, False, trace=trace)
    return trace[0], trace[1], trace[2]


def share_matching(trace: RouterTrace, valid: torch.Tensor, batch: DataProto) -> float:
    """The share of recorded (token, layer) pairs where the trainer routed to the sampler's experts."""
    recorded = batch.batch["routed_experts"].flatten(0, 1)
    if recorded.shape[0] != valid.shape[0]:  # a packed forward: the valid tokens only
        recorded = recorded[batch.batch["attention_mask"].flatten().bool()]
    used = torch.stack(trace.used, dim=1)  # (N, R, k)
    has = (recorded >= 0).all(-1)
    same = (used.sort(-1).values == recorded.long().sort(-1).values).all(-1)
    assert int(has.sum()) > 100
    return float(same[has].float().mean())


def perturb_routers(model: torch.nn.Module, scale: float = 0.3) -> None:
    """Move every router's weights (as an update would) so that some tokens pick other experts."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(scale * torch.randn(router.weight.shape, generator=generator))


# ---- router replay -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_sample(world, moe_dir, tiny_tokenizer):
    """One batch sampled by the real in-process vLLM engine with routing recorded (n=2 per prompt).

    The engine loads the folder itself (reloads into an MoE engine are the model matrix's check)."""
    from hflow.workers.rollout.vllm_rollout import vLLMRollout

    config = with_recording(rollout_config(n=2, temperature=1.0, load_format="auto"))
    rollout = vLLMRollout(str(moe_dir), config, tiny_tokenizer, AutoConfig.from_pretrained(moe_dir))
    prompts = make_prompts(tiny_tokenizer, QUESTIONS, context="Let's think step by step. ")
    prompts.meta_info.update(temperature=1.0, do_sample=True)
    out = rollout.generate_sequences(prompts)
    rollout.close()
    del rollout
    gc.collect()
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_router_replay_uses_the_sampler_experts(moe_dir, vllm_sample, packed):
    batch = vllm_sample
    routed = batch.batch["routed_experts"]
    assert routed.shape[:2] == batch.batch["input_ids"].shape and routed.shape[2:] == (2, 2)
    valid = batch.batch["attention_mask"].bool()
    # every valid token but each response's last (which no forward ran) was recorded
    recorded = (routed >= 0).all(-1).all(-1)
    last = valid.long().cumsum(-1).argmax(-1)
    expected = valid.clone()
    expected[torch.arange(len(last)), last] = False
    assert torch.equal(recorded, expected)

    model = load(moe_dir)
    # the same weights: the trainer's own routing is the sampler's (a forward in another batch layout)
    free = DataParallelPPOActor(actor_config(use_remove_padding=packed), model)
    assert share_matching(*trainer_routing(free, batch)[:2], batch) > 0.99

    perturb_routers(model)  # the weights moved since sampling
    free_share = share_matching(*trainer_routing(free, batch)[:2], batch)
    replay = DataParallelPPOActor(actor_config(use_remove_padding=packed, router_replay=True), model)
    trace, valid_tokens, replayed = trainer_routing(replay, batch)
    assert share_matching(trace, valid_tokens, batch) == 1.0  # every recorded token, every layer
    assert free_share < 0.9, f"the perturbation left {free_share:.3f} of the routing as sampled: the test is vacuous"
    # the replayed forward still reports where the router itself would have gone (actor/moe/routing_match)
    matching, count = trace.routing_match(replayed)
    assert float(matching / count) < 0.9


# ---- what the replayed forward computes, against the MoE blocks by hand ---------------------------


@contextmanager
def routed_by_hand(model: torch.nn.Module, pick) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Every sparse MoE block of `model` computed here instead of by transformers: router logits, softmax,
    the experts `pick(layer, probs (N, E), own top-k (N, k))` returns, their probabilities renormalised (the tiny
    model's `norm_topk_prob`), each expert's SwiGLU. Yields [(logits, own, chosen)] per block, in layer order.
    Independent of `hflow.workers.moe`: no hook, no router call."""
    blocks = [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    assert [b.gate for b in blocks] == moe_routers(model) and model.config.norm_topk_prob
    assert model.config.hidden_act == "silu"
    record: list = []

    def block_forward(layer, block):
        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            logits = x @ block.gate.weight.T
            probs = torch.softmax(logits.float(), dim=-1)
            own = probs.topk(block.gate.top_k, dim=-1).indices
            chosen = pick(layer, probs, own)
            weights = probs.gather(-1, chosen)
            weights = weights / weights.sum(-1, keepdim=True)
            gate, up = torch.einsum("nh,eoh->neo", x, block.experts.gate_up_proj).chunk(2, dim=-1)
            every = torch.einsum("nei,ehi->neh", torch.nn.functional.silu(gate) * up, block.experts.down_proj)
            out = (every.gather(1, chosen[..., None].expand(-1, -1, x.shape[-1])) * weights[..., None]).sum(1)
            record.append((logits, own, chosen))
            return out.reshape(hidden_states.shape)
        return forward

    for layer, block in enumerate(blocks):
        block.forward = block_forward(layer, block)
    try:
        yield record
    finally:
        for block in blocks:
            del block.forward  # back to the class's


def response_log_probs_by_hand(model: torch.nn.Module, data: DataProto, pick) -> tuple[torch.Tensor, list]:
    """(B, L) log-probs of the responses from one padded forward of the whole batch routed by `pick`, and
    the blocks' record (`routed_by_hand`)."""
    ids, responses = data.batch["input_ids"], data.batch["responses"]
    with torch.no_grad(), routed_by_hand(model, pick) as record:
        logits = model(input_ids=ids, attention_mask=data.batch["attention_mask"],
                       position_ids=data.batch["position_ids"]).logits
    scoring = logits[:, ids.shape[1] - responses.shape[1] - 1: -1].float()
    return torch.log_softmax(scoring, -1).gather(-1, responses[..., None]).squeeze(-1), record


@pytest.mark.parametrize("packed", [False, True])
def test_replay_computes_the_forward_of_the_recorded_experts(moe_dir, packed):
    """The actor's log-probs under replay are those of a forward whose MoE blocks use the recorded experts
    (computed by hand), not those of the router's own choice: every recorded token is given the two experts
    its router likes least, so replay changes every (token, layer) it touches."""
    from tests.workers.test_dp_actor import make_batch

    model = load(moe_dir)
    data = make_batch(6, seed=3)
    valid = data.batch["attention_mask"].flatten().bool()
    recorded = valid.clone()  # as the sampler records: no padding, no response's last token
    last = data.batch["attention_mask"].cumsum(-1).argmax(-1)
    recorded.view(len(data), -1)[torch.arange(len(data)), last] = False

    def least_liked(layer: int, probs: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        return torch.where(recorded[:, None], probs.topk(own.shape[-1], dim=-1, largest=False).indices, own)

    free_by_hand, _ = response_log_probs_by_hand(model, data, lambda layer, probs, own: own)
    forced_by_hand, record = response_log_probs_by_hand(model, data, least_liked)
    routed = torch.stack([chosen for _, _, chosen in record], dim=1).to(torch.int16)  # (B*T, R, k)
    routed[~recorded] = -1
    data.batch["routed_experts"] = routed.view(*data.batch["input_ids"].shape, *routed.shape[1:])
    data.meta_info["micro_batch_size"] = 4  # two micro-batches, the second one short

    def actor_log_probs(**overrides) -> torch.Tensor:
        actor = DataParallelPPOActor(actor_config(use_remove_padding=packed, **overrides), model)
        return actor.compute_log_prob(data)[0]

    mask = data.batch["response_mask"].bool()
    # the hand-written blocks are the model's (free routing, both ways)
    torch.testing.assert_close(actor_log_probs()[mask], free_by_hand[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actor_log_probs(router_replay=True)[mask], forced_by_hand[mask], rtol=1e-5, atol=1e-5)
    moved = (forced_by_hand - free_by_hand)[mask].abs().max()
    assert moved > 0.5, f"the recorded experts moved the log-probs by {moved:.3f} only: the test is vacuous"


def test_hf_rollout_records_routing(moe_dir, tiny_tokenizer):
    model = load(moe_dir)
    config = with_recording(rollout_config(name="hf", n=2, temperature=1.0))
    prompts = make_prompts(tiny_tokenizer, QUESTIONS)
    prompts.meta_info.update(temperature=1.0, do_sample=True)
    torch.manual_seed(0)
    batch = HFRollout(model, config).generate_sequences(prompts)
    free = DataParallelPPOActor(actor_config(), model)
    assert share_matching(*trainer_routing(free, batch)[:2], batch) > 0.99


def test_replay_without_a_recording_stops(moe_dir, vllm_sample):
    batch = vllm_sample.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids"])
    with pytest.raises(KeyError, match="routed_experts"):
        DataParallelPPOActor(actor_config(router_replay=True), load(moe_dir))._forward_keys(batch)


# ---- the load-balancing loss and the expert load --------------------------------------------------


def test_aux_loss_by_hand():
    # one layer, 2 experts, top-1; probabilities (.25, .75), (.25, .75), (.75, .25): experts 1, 1, 0
    logits = torch.log(torch.tensor([[0.25, 0.75], [0.25, 0.75], [0.75, 0.25]]))
    trace = RouterTrace(logits=[logits], used=[logits.argmax(-1, keepdim=True)], own=[logits.argmax(-1, keepdim=True)])
    # f = (1/3, 2/3), P = (1.25/3, 1.75/3): 2 * (1/3 * 1.25/3 + 2/3 * 1.75/3)
    assert math.isclose(float(trace.aux_loss(torch.ones(3, dtype=torch.bool))), 2 * (1.25 + 3.5) / 9, rel_tol=1e-6)
    # the third token is padding: f = (0, 1), P = (.25, .75)
    assert math.isclose(float(trace.aux_loss(torch.tensor([True, True, False]))), 1.5, rel_tol=1e-6)
    load = trace.expert_load(torch.ones(3, dtype=torch.bool))
    assert math.isclose(float(load["expert_load_max"]), 4 / 3, rel_tol=1e-6)
    assert math.isclose(float(load["expert_load_min"]), 2 / 3, rel_tol=1e-6)


def test_aux_loss_is_the_models(moe_dir):
    """On the tiny MoE, the traced loss equals transformers' own load_balancing_loss_func (with padding)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = load(moe_dir)
    ids = torch.randint(10, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with route_and_trace(model) as trace:
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    expected = load_balancing_loss_func(out.router_logits, 4, 2, mask)
    torch.testing.assert_close(trace.aux_loss(mask.reshape(-1).bool()), expected.float())


def moe_metrics_by_hand(model: torch.nn.Module, batch: DataProto, micro_batch_size: int) -> dict[str, float]:
    """`actor/moe/*` of one update over `batch` that replays its `routed_experts`, from their definitions
    (`hflow.workers.moe`'s docstring) on the hand-routed forward: per micro-batch over its valid tokens (R
    layers, E experts), then weighted by the micro-batch's share of the response tokens."""
    num_experts = model.config.num_experts
    response_tokens = response_mask_of(batch.batch).sum()
    totals = {"aux_loss": 0.0, "expert_load_max": 0.0, "expert_load_min": 0.0, "routing_match": 0.0}
    for start in range(0, len(batch), micro_batch_size):
        part = batch[start:start + micro_batch_size]
        recorded = part.batch["routed_experts"].flatten(0, 1).long()  # (N, R, k)
        has = (recorded >= 0).all(-1)  # (N, R): the sampler ran this token

        def replayed(layer: int, probs: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
            return torch.where(has[:, layer, None], recorded[:, layer], own)

        _, record = response_log_probs_by_hand(model, part, replayed)
        valid = part.batch["attention_mask"].flatten().bool()
        slots = [torch.bincount(chosen[valid].flatten(), minlength=num_experts).double() for _, _, chosen in record]
        shares = [count / count.sum() for count in slots]
        per_slot = valid.sum().double() * len(record)  # valid tokens x layers
        f = sum(slots) / per_slot  # sums to k
        p = sum(torch.softmax(logits.double(), -1)[valid].sum(0) for logits, _, _ in record) / per_slot
        same = [(own.sort(-1).values == recorded[:, layer].sort(-1).values).all(-1) & has[:, layer]
                for layer, (_, own, _) in enumerate(record)]
        values = {"aux_loss": num_experts * (f * p).sum(),
                  "expert_load_max": sum(num_experts * share.max() for share in shares) / len(shares),
                  "expert_load_min": sum(num_experts * share.min() for share in shares) / len(shares),
                  "routing_match": sum(s.sum() for s in same) / has.sum()}
        weight = response_mask_of(part.batch).sum() / response_tokens
        for name, value in values.items():
            totals[name] += float(value * weight)
    return totals


def test_update_reports_expert_load_and_adds_the_aux_loss(moe_dir, vllm_sample):
    """The update's `actor/moe/*` are the hand-computed values of its replayed forward. The routers are moved
    first, so the replayed experts (which the load and the aux loss count) are not the router's own (which
    routing_match compares): counting the wrong ones, or padding, or one layer, changes the numbers."""
    batch = vllm_sample
    batch.meta_info["temperature"] = 1.0
    batch.batch["advantages"] = torch.zeros_like(batch.batch["responses"], dtype=torch.float32)
    micro_batch_size = 3

    def router_step(coef: float) -> tuple[dict, dict, torch.Tensor]:
        """The metrics of one update, their values by hand, and how far the update moved the first router."""
        model = load(moe_dir)
        perturb_routers(model)
        by_hand = moe_metrics_by_hand(model, batch, micro_batch_size)
        before = moe_routers(model)[0].weight.detach().clone()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        actor = DataParallelPPOActor(actor_config(router_replay=True, router_aux_loss_coef=coef,
                                                  ppo_micro_batch_size_per_gpu=micro_batch_size), model, optimizer)
        metrics = actor.update_policy(batch)
        return metrics, by_hand, (moe_routers(model)[0].weight.detach() - before).abs().max()

    metrics, by_hand, moved = router_step(0.5)
    assert len(batch) == 6  # two micro-batches
    for name, value in by_hand.items():
        assert metrics[f"actor/moe/{name}"] == [pytest.approx(value, rel=1e-5)], name
    assert by_hand["routing_match"] < 0.9  # the moved routers' own choice is often not the sampler's
    assert by_hand["expert_load_max"] > 1.05  # not balanced: a count that ignored the routing would show 1
    # zero advantages: the routers move by the aux loss alone, and not at all at coef 0
    assert moved > 1e-4
    assert router_step(0.0)[2] == 0


# ---- preflight ------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, value", [("router_replay", True), ("router_aux_loss_coef", 0.01)])
def test_moe_keys_on_a_dense_model_stop(tiny_model_dir, key, value):
    config = default_config()
    config.actor_rollout_ref.model.path = str(tiny_model_dir)
    OmegaConf.update(config, f"actor_rollout_ref.actor.{key}", value)
    with pytest.raises(ConfigError, match=f"actor_rollout_ref.actor.{key} is for mixture-of-experts"):
        check_moe_settings(config)


def test_router_replay_with_multi_turn_stops(moe_dir):
    config = default_config()
    config.actor_rollout_ref.model.path = str(moe_dir)
    config.actor_rollout_ref.actor.router_replay = True
    check_moe_settings(config)  # an MoE model, one-turn generation: fine
    config.actor_rollout_ref.rollout.multi_turn.enable = True
    with pytest.raises(ConfigError, match="multi_turn.enable"):
        check_moe_settings(config)
