"""Multi-turn rollouts through the real engines: token in, token out, and no learning signal on tool tokens.

The random tiny model cannot write tool calls, so a test parser decides which turns "call" a tool (by a
hash of the turn's text, so some episodes end early and others run into the turn limit) and an echo
tool answers with text that includes the model's own bytes. The tokenizer is the byte-level BPE of
`hflow.tasks.tiny_models`, for which decoding sampled ids and encoding the text again gives other ids:
a trainer that re-encoded the conversation would train on tokens the sampler never produced.
"""

from __future__ import annotations

import gc
import zlib
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from hflow.agent.chat import ToolMessageEncoder
from hflow.agent.parsers import ParsedTurn, ToolCall, ToolCallParser, register_parser
from tests.workers.test_rollout import chat_prompt_ids, hf_log_probs, make_prompts, push, rollout_config

RESPONSE_LENGTH = 160
MAX_TURNS = 2
PARITY_TOL = 1e-4
QUESTIONS = ["What is 17 plus 25?", "Tom has 3 apples and buys 4 more. How many apples?", "What is 6 * 7?"]


@register_parser("test-hash-calls")
class HashCallParser(ToolCallParser):
    """Three turns in four call `echo` (chosen by the text's CRC; an empty turn answers)."""

    def parse(self, text: str) -> ParsedTurn:
        if zlib.crc32(text.encode("utf-8", "replace")) % 4 == 0:
            return ParsedTurn(content=text, calls=[], malformed=[])
        return ParsedTurn(content="", calls=[ToolCall("echo", {"text": text[:6]})], malformed=[])


ECHO_TOOLS = '''
def echo(text: str) -> str:
    return "echo 12345: " + text
'''


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir, tiny_tokenizer):
    """The random tiny model, made to end turns: its EOS logit row points along the mean final hidden
    state, so EOS has a probability of about a tenth at most positions (a random model almost never
    stops, and every episode would be one turn cut by the length limit)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return end_turns_often(model, tiny_tokenizer)


@torch.no_grad()
def end_turns_often(model, tokenizer, strength: float = 0.12):
    """Point the EOS logit row along the mean final hidden state of random inputs (in place); a larger
    `strength` ends turns sooner."""
    ids = torch.randint(10, 500, (8, 64), generator=torch.Generator().manual_seed(0))
    hidden = model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size)
    mean = hidden.mean(0)
    model.lm_head.weight[tokenizer.eos_token_id] = strength * mean / mean.norm() * hidden.norm(dim=-1).mean()
    return model


@pytest.fixture(scope="module")
def tool_config(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tools")
    (folder / "echo_tools.py").write_text(ECHO_TOOLS)
    (folder / "tools.yaml").write_text(
        "tools:\n"
        "  - function: echo_tools.py:echo\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: echo\n"
        "        description: repeat the text\n"
        "        parameters: {type: object, properties: {text: {type: string}}, required: [text]}\n"
    )
    return str(folder / "tools.yaml")


def multi_turn_config(tool_config: str, **overrides):
    return rollout_config(**{
        "response_length": RESPONSE_LENGTH,
        "multi_turn.enable": True,
        "multi_turn.format": "test-hash-calls",
        "multi_turn.tool_config_path": tool_config,
        "multi_turn.max_assistant_turns": MAX_TURNS,
        **overrides,
    })


class Recorder:
    """Wraps a TurnEngine class so the test sees every turn the engine hands back."""

    def __init__(self, monkeypatch, module, name: str):
        self.turns: dict[int, list[list[int]]] = {}
        original = getattr(module, name)
        recorder = self

        class Recording(original):
            def poll(self):
                results = super().poll()
                for r in results:
                    recorder.turns.setdefault(r.key, []).append(list(r.token_ids))
                return results

        monkeypatch.setattr(module, name, Recording)


@pytest.fixture(scope="module")
def vllm_rollout(world, tiny_model_dir, tiny_tokenizer, tool_config):
    from hflow.workers.rollout.vllm_rollout import vLLMRollout

    rollout = vLLMRollout(str(tiny_model_dir), multi_turn_config(tool_config), tiny_tokenizer,
                          AutoConfig.from_pretrained(tiny_model_dir))
    yield rollout
    del rollout
    gc.collect()


def check_token_in_token_out(output, tokenizer, prompts, turns: dict[int, list[list[int]]], n: int) -> None:
    """Each response = the sampled turns with the tool messages' own ids between them, mask 1 exactly on
    the sampled ids; and the tokenizer really is one for which re-encoding changes the ids."""
    encoder = ToolMessageEncoder(tokenizer)
    episodes = output.non_tensor_batch["episode"]
    drift_seen = False
    assert len(episodes) == len(QUESTIONS) * n
    for row, episode in enumerate(episodes):
        sampled_turns = turns[row]
        tool_messages = [m for m in episode["messages"] if m["role"] == "tool"]
        expected, mask = [], []
        for i, sampled in enumerate(sampled_turns):
            expected += sampled
            mask += [1] * len(sampled)
            if i < len(sampled_turns) - 1:  # a tool message follows every turn but the last
                tool_ids = encoder.encode([tool_messages[i]])
                expected += tool_ids
                mask += [0] * len(tool_ids)
        length = len(expected)
        assert output.batch["responses"][row, :length].tolist() == expected
        assert output.batch["response_mask"][row].tolist() == mask + [0] * (RESPONSE_LENGTH - length)
        assert output.batch["attention_mask"][row, -RESPONSE_LENGTH:].tolist() == [1] * length + [0] * (RESPONSE_LENGTH - length)
        prompt = output.batch["prompts"][row][output.batch["attention_mask"][row, : -RESPONSE_LENGTH].bool()].tolist()
        assert prompt == prompts[row // n]
        assert episode["num_turns"] == len(sampled_turns) <= MAX_TURNS
        assert mask[-1] == 1, "an episode must end on a sampled token (the reward's position)"
        sampled_ids = [t for turn in sampled_turns for t in turn]
        if tokenizer.encode(tokenizer.decode(sampled_ids), add_special_tokens=False) != sampled_ids:
            drift_seen = True
    assert drift_seen, "the tokenizer re-encodes these samples faithfully; the drift check would be vacuous"
    assert {e["ended"] for e in episodes} >= {"answer"}
    assert any(e["num_turns"] > 1 for e in episodes), "no episode called a tool: nothing multi-turn was tested"


def check_sampler_log_probs(output, model) -> None:
    """(a) The trainer's log-probs of the sampled tokens are the sampler's; tool tokens carry none."""
    mask = output.batch["response_mask"].bool()
    trainer = hf_log_probs(model, output, temperature=0.8)
    assert (trainer - output.batch["rollout_log_probs"]).abs()[mask].max().item() < PARITY_TOL
    assert (output.batch["rollout_log_probs"][~mask] == 0).all()


def test_vllm_episode_is_token_in_token_out_with_sampler_log_probs(vllm_rollout, tiny_tokenizer, hf_model, monkeypatch):
    import hflow.workers.rollout.vllm_rollout as module

    recorder = Recorder(monkeypatch, module, "_StreamingEngine")
    push(vllm_rollout, hf_model)
    prompts = make_prompts(tiny_tokenizer, QUESTIONS)
    torch.manual_seed(0)
    output = vllm_rollout.generate_sequences(prompts)

    check_token_in_token_out(output, tiny_tokenizer, chat_prompt_ids(tiny_tokenizer, QUESTIONS), recorder.turns, n=4)
    check_sampler_log_probs(output, hf_model)
    metrics = output.meta_info["metrics"]
    assert metrics["agent/num_turns/max"] <= MAX_TURNS and metrics["agent/tool_calls/mean"] > 0
    assert metrics["agent/ended/max_assistant_turns"] > 0, f"no episode reached the turn limit: {metrics} {[[len(t) for t in recorder.turns[k]] for k in recorder.turns]}"


def test_partial_rollout_continues_turns_in_flight_with_the_new_weights(vllm_rollout, tiny_tokenizer, hf_model):
    """partial_rollout in an agent loop: the turns in flight when an update arrives go on from their tokens
    with the new weights; each sampled token records its version and carries that model's log-prob, tool
    tokens none; an episode's later turns are sampled by the new weights."""
    import copy

    from tests.workers.test_rollout import UpdateAfterSteps, check_versions_and_log_probs, perturb_

    new_model = copy.deepcopy(hf_model)
    perturb_(new_model, torch.Generator().manual_seed(7), scale=0.05)
    push(vllm_rollout, hf_model)
    updates = UpdateAfterSteps(vllm_rollout, new_model, after=12, partial=True)
    torch.manual_seed(0)
    output = vllm_rollout.generate_sequences(make_prompts(tiny_tokenizer, QUESTIONS), weight_updates=updates)

    mask = output.batch["response_mask"].bool()
    old, new = check_versions_and_log_probs(output, hf_model, new_model, mask)
    assert old > 0 and new > 0, (old, new)
    assert output.meta_info["metrics"]["rollout/interrupted_requests"] > 0
    assert any(e["num_turns"] > 1 for e in output.non_tensor_batch["episode"])


def test_hf_rollout_runs_the_same_loop(tool_config, tiny_tokenizer, hf_model, monkeypatch):
    import hflow.workers.rollout.hf_rollout as module
    from hflow.workers.rollout import HFRollout

    recorder = Recorder(monkeypatch, module, "_WaveEngine")
    rollout = HFRollout(hf_model, multi_turn_config(tool_config, n=2), tiny_tokenizer)
    prompts = make_prompts(tiny_tokenizer, QUESTIONS)
    torch.manual_seed(0)
    output = rollout.generate_sequences(prompts)

    check_token_in_token_out(output, tiny_tokenizer, chat_prompt_ids(tiny_tokenizer, QUESTIONS), recorder.turns, n=2)
    check_sampler_log_probs(output, hf_model)


def test_tool_tokens_get_exactly_zero_gradient(vllm_rollout, tiny_tokenizer, tiny_model_dir: Path):
    """(a) The actor's log-probs of a real episode batch equal the sampler's; (b) one PPO update with entropy bonus and KL loss on a real episode batch: the gradient reaching
    the logits that predict tool tokens is exactly zero, the sampled tokens' is not."""
    from tests.workers.test_dp_actor import actor_config
    from hflow.workers.fsdp import load_causal_lm
    from hflow.workers.actor import DataParallelPPOActor

    model = end_turns_often(load_causal_lm(str(tiny_model_dir)), tiny_tokenizer)
    push(vllm_rollout, model)
    torch.manual_seed(0)
    data = vllm_rollout.generate_sequences(make_prompts(tiny_tokenizer, QUESTIONS))
    mask = data.batch["response_mask"]
    assert (mask == 0).logical_and(data.batch["attention_mask"][:, -RESPONSE_LENGTH:] == 1).any(), "no tool tokens"
    n = len(data)
    data.meta_info.update(temperature=0.8, micro_batch_size=n)
    actor = DataParallelPPOActor(
        actor_config(ppo_mini_batch_size_per_rank=n, ppo_micro_batch_size_per_gpu=n, entropy_coeff=0.01,
                     use_kl_loss=True, kl_loss_coef=0.1),
        model, torch.optim.SGD(model.parameters(), lr=0.1))
    old, _ = actor.compute_log_prob(data)
    # (a) through the trainer's own actor as well: its log-probs of the sampled tokens are the sampler's
    assert (old - data.batch["rollout_log_probs"]).abs()[mask.bool()].max().item() < PARITY_TOL
    gen = torch.Generator().manual_seed(0)
    data.batch["old_log_probs"] = old + 0.1 * torch.randn(old.shape, generator=gen)
    data.batch["ref_log_prob"] = old + 0.1 * torch.randn(old.shape, generator=gen)
    data.batch["advantages"] = torch.randn(old.shape, generator=gen)  # non-zero on tool tokens too

    grads = []

    def keep_logit_gradient(module, args, out):
        if out.requires_grad:
            out.register_hook(grads.append)

    handle = model.lm_head.register_forward_hook(keep_logit_gradient)
    try:
        actor.update_policy(data)
    finally:
        handle.remove()
    assert len(grads) == 1
    per_position = grads[0].abs().amax(dim=-1)  # (N, L): the largest logit gradient predicting each token
    tool = (mask == 0) & (data.batch["attention_mask"][:, -RESPONSE_LENGTH:] == 1)
    assert (per_position[tool] == 0).all(), "tool tokens received gradient"
    assert (per_position[mask.bool()] > 0).all()


def test_routed_episodes_run_whole_on_their_engine_token_in_token_out(vllm_rollout, tiny_tokenizer, hf_model,
                                                                      monkeypatch):
    """Continuous admission: the engine takes episodes from a router as the agent loop asks for them
    (`admit`), runs every turn of each, and they come back complete, in row order, token in token out. Served
    again as one of two engines (the test holds 5 episodes), each episode it runs is the same as alone: its
    turns' requests carry seeds of their own."""
    import hflow.workers.rollout.vllm_rollout as module
    from hflow.trainer.ppo.routed_rollout import assemble_routed
    from hflow.workers.rollout.base import prompt_token_ids
    from hflow.workers.rollout.router import RouterClient, RowRouter

    recorder = Recorder(monkeypatch, module, "_StreamingEngine")
    push(vllm_rollout, hf_model)
    prompts, n = make_prompts(tiny_tokenizer, QUESTIONS), 4
    stop = {"eos_token_id": prompts.meta_info["eos_token_id"], "pad_token_id": prompts.meta_info["pad_token_id"]}
    samples = [{"ids": ids, "tools_kwargs": {}} for ids in prompt_token_ids(prompts) for _ in range(n)]

    alone = RowRouter(engines=1)
    alone.submit(0, samples, {}, min_version=0)
    vllm_rollout.serve(RouterClient(alone), 0, stop)
    reference = alone.collect(0)
    output = assemble_routed(prompts, {}, n, reference, vllm_rollout.config)
    check_token_in_token_out(output, tiny_tokenizer, chat_prompt_ids(tiny_tokenizer, QUESTIONS), recorder.turns, n=n)
    check_sampler_log_probs(output, hf_model)

    shared = RowRouter(engines=2)
    shared.submit(0, samples, {}, min_version=0)
    held = shared.exchange(1, [], running=0, room=5, version=0, any_version=True)
    vllm_rollout.serve(RouterClient(shared), 0, stop)
    shared.exchange(1, [(b, r, reference["results"][r]) for b, r, *_ in held], 0, 0, 0, any_version=True)
    routed = shared.collect(0)
    assert routed["rows_per_engine"] == [7, 5]
    for row in range(len(samples)):
        if routed["engine_of"][row] == 0:
            assert routed["results"][row].response_ids == reference["results"][row].response_ids, row
            assert routed["results"][row].loss_mask == reference["results"][row].loss_mask, row
