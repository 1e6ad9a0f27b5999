"""`use_remove_padding`: the actor's, reference's and critic's forwards on one packed row of valid tokens give
the padded path's log-probs, entropies, values and gradients, and no token attends across sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

from hflow.trainer.config import default_config
from hflow.protocol import DataProto
from hflow.workers.fsdp import load_causal_lm, load_value_model
from hflow.utils.packing import SDPA_VARLEN, SEQUENCE_BOUNDS, pack_micro_batch
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.workers.actor import DataParallelPPOActor
from hflow.workers.config import normalize_actor_rollout_ref, resolved_copy
from hflow.workers.critic.config import normalize_critic
from hflow.workers.critic.dp_critic import DataParallelPPOCritic

PROMPT_LEN, RESPONSE_LEN, VOCAB = 12, 9, 100
# Very different prompt and response lengths, among them a 1-token response and a 1-token prompt.
PROMPT_LENS = [12, 1, 5, 3, 9, 2, 7, 12]
RESPONSE_LENS = [1, 9, 4, 1, 9, 6, 2, 3]
ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("qwen2-remove-padding")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def make_batch(seed: int = 0) -> DataProto:
    """Left-padded prompts and right-padded responses of the lengths above, with a response mask that has a
    hole (a multi-turn observation token) in the longest responses, advantages and returns."""
    gen = torch.Generator().manual_seed(seed)
    n = len(PROMPT_LENS)
    prompt_mask = (torch.arange(PROMPT_LEN) >= PROMPT_LEN - torch.tensor(PROMPT_LENS)[:, None]).long()
    attended = (torch.arange(RESPONSE_LEN) < torch.tensor(RESPONSE_LENS)[:, None]).long()
    response_mask = attended.clone()
    response_mask[torch.tensor(RESPONSE_LENS) > 5, 2] = 0
    prompts = torch.randint(1, VOCAB, (n, PROMPT_LEN), generator=gen) * prompt_mask
    responses = torch.randint(1, VOCAB, (n, RESPONSE_LEN), generator=gen) * attended
    attention_mask = torch.cat([prompt_mask, attended], dim=-1)
    tensors = {
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "responses": responses,
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
        "advantages": torch.randn(n, RESPONSE_LEN, generator=gen) * response_mask,
        "returns": torch.randn(n, RESPONSE_LEN, generator=gen) * response_mask,
    }
    return DataProto.from_dict(tensors, meta_info={"temperature": 0.7, "micro_batch_size": 3})


def worker_config(section: DictConfig, **overrides) -> DictConfig:
    """A schema subtree as a worker normalises it, with one 8-sequence mini-batch and plain SGD-friendly settings."""
    config = resolved_copy(section)
    settings = {"ppo_mini_batch_size_per_rank": 8, "ppo_micro_batch_size_per_gpu": 3, "shuffle": False,
                "grad_clip": 1e6}
    for key, value in {**settings, **overrides}.items():
        OmegaConf.update(config, key, value)
    return config


def make_actor(model_dir: Path, remove_padding: bool, attn: str = SDPA_VARLEN, lr: float = 0.5, **overrides):
    model = load_causal_lm(str(model_dir), attn_implementation=attn)
    config = worker_config(default_config().actor_rollout_ref.actor, use_remove_padding=remove_padding, **overrides)
    return DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=lr))


def make_critic(model_dir: Path, remove_padding: bool, lr: float = 0.5, **overrides):
    model = load_value_model(str(model_dir), value_head_init="normal")  # seeded: both critics start equal
    config = worker_config(default_config().critic, use_remove_padding=remove_padding, **overrides)
    return DataParallelPPOCritic(config, model, torch.optim.SGD(model.parameters(), lr=lr))


def masked(x: torch.Tensor, data: DataProto) -> torch.Tensor:
    return x * data.batch["attention_mask"][:, -RESPONSE_LEN:]


# ------------------------------------------------------------------ packing


def test_pack_micro_batch_layout():
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0], [0, 0, 3, 4, 9, 0, 0]])
    attention_mask = (input_ids != 0).long()
    packed = pack_micro_batch(input_ids, attention_mask, response_length=3)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 3, 4, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    # responses: row 0 -> tokens 7 8 (packed 2, 3), row 1 -> token 9 (packed 6); each scored one position earlier
    assert packed.scoring_positions.tolist() == [1, 2, 5]
    assert packed.response_slots.tolist() == [0, 1, 3]
    assert packed.unpack_response(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]
    assert packed.sequence_starts.tolist() == [0, 4, 7] and packed.longest == 4


def test_pack_rejects_a_row_without_prompt():
    input_ids = torch.tensor([[0, 0, 5, 6]])
    with pytest.raises(ValueError, match="empty prompt"):
        pack_micro_batch(input_ids, (input_ids != 0).long(), response_length=2)


# ------------------------------------------------------------------ actor


@pytest.mark.parametrize("attn", [SDPA_VARLEN, "sdpa", "eager"])  # per-sequence SDPA; block-diagonal masks
def test_actor_log_probs_and_entropy_match_padded_path(model_dir: Path, attn: str):
    data = make_batch()
    padded = make_actor(model_dir, remove_padding=False, attn=attn).compute_log_prob(data, calculate_entropy=True)
    packed = make_actor(model_dir, remove_padding=True, attn=attn).compute_log_prob(data, calculate_entropy=True)
    for ours, reference in zip(packed, padded):
        assert ours.shape == reference.shape == (len(PROMPT_LENS), RESPONSE_LEN)
        torch.testing.assert_close(ours, masked(reference, data), atol=ATOL, rtol=0)
    assert (packed[0] * (1 - data.batch["attention_mask"][:, -RESPONSE_LEN:])).abs().sum() == 0


def test_no_attention_across_sequences(model_dir: Path):
    actor = make_actor(model_dir, remove_padding=True)
    data = make_batch()
    before, _ = actor.compute_log_prob(data)
    changed = make_batch()
    row = 2  # a middle row: sequences both before and after it in the packed row
    valid = changed.batch["attention_mask"][row].bool()
    changed.batch["input_ids"][row, valid] = (changed.batch["input_ids"][row, valid] + 17) % (VOCAB - 1) + 1
    changed.batch["responses"] = changed.batch["input_ids"][:, -RESPONSE_LEN:]
    after, _ = actor.compute_log_prob(changed)
    others = torch.arange(len(PROMPT_LENS)) != row
    torch.testing.assert_close(after[others], before[others], atol=1e-6, rtol=0)
    assert (after[row] - before[row]).abs().max() > 1e-2  # the change itself is seen


def test_actor_update_matches_padded_path(model_dir: Path):
    """One optimizer step with the pg, entropy and KL losses, micro-batches cut by a token budget (valid tokens:
    `rearrange_micro_batches` sums the attention mask); SGD moves each parameter by lr x its gradient."""
    data = make_batch()
    reference = load_causal_lm(str(model_dir)).state_dict()
    old, _ = make_actor(model_dir, remove_padding=False).compute_log_prob(data)
    gen = torch.Generator().manual_seed(1)
    data.batch["old_log_probs"] = old + 0.1 * torch.randn(old.shape, generator=gen)
    data.batch["ref_log_prob"] = old + 0.1 * torch.randn(old.shape, generator=gen)
    settings = {"use_kl_loss": True, "kl_loss_coef": 0.3, "entropy_coeff": 0.01, "use_dynamic_bsz": True,
                "ppo_max_token_len_per_gpu": 40}
    params, metrics = {}, {}
    for remove_padding in (False, True):
        actor = make_actor(model_dir, remove_padding=remove_padding, **settings)
        metrics[remove_padding] = actor.update_policy(data)
        params[remove_padding] = {k: v.detach().clone() for k, v in actor.actor_module.state_dict().items()}
    assert max((params[True][k] - reference[k]).abs().max().item() for k in reference) > 1e-3  # not vacuous
    for key in reference:
        torch.testing.assert_close(params[True][key], params[False][key], atol=ATOL, rtol=0, msg=key)
    for name in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        assert metrics[True][name] == pytest.approx(metrics[False][name], abs=ATOL), name


def test_actor_gradients_match_padded_path(model_dir: Path):
    """The gradients themselves, of a loss on every valid response token's log-prob and entropy."""
    data = make_batch()
    weights = torch.randn(len(PROMPT_LENS), RESPONSE_LEN, generator=torch.Generator().manual_seed(2))
    grads = {}
    for remove_padding in (False, True):
        actor = make_actor(model_dir, remove_padding=remove_padding)
        log_probs, entropy = actor._forward_micro_batch(data.batch, temperature=0.7, calculate_entropy=True)
        (masked((log_probs + 0.5 * entropy) * weights, data).sum()).backward()
        grads[remove_padding] = {name: p.grad.clone() for name, p in actor.actor_module.named_parameters()}
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, atol=ATOL, rtol=0, msg=name)


# ------------------------------------------------------------------ critic


def test_critic_values_and_update_match_padded_path(model_dir: Path):
    data = make_batch()
    padded, packed = make_critic(model_dir, remove_padding=False), make_critic(model_dir, remove_padding=True)
    values = padded.compute_values(data)
    torch.testing.assert_close(packed.compute_values(data), values, atol=ATOL, rtol=0)
    data.batch["values"] = values
    before = {k: v.detach().clone() for k, v in padded.critic_module.state_dict().items()}
    metrics = {False: padded.update_critic(data), True: packed.update_critic(data)}
    after = {flag: critic.critic_module.state_dict() for flag, critic in ((False, padded), (True, packed))}
    assert max((after[True][k] - before[k]).abs().max().item() for k in before) > 1e-3
    for key in before:
        torch.testing.assert_close(after[True][key], after[False][key], atol=ATOL, rtol=0, msg=key)
    assert metrics[True]["critic/vf_loss"] == pytest.approx(metrics[False]["critic/vf_loss"], abs=ATOL)


def test_default_attention_attends_per_sequence_not_over_the_packed_row(model_dir: Path, monkeypatch):
    """With the default implementation on CPU (`SDPA_VARLEN`), every attention call of a packed forward
    covers exactly one sequence: no N x N attention over the packed row, for the actor and the critic."""
    query_lengths: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(query, key, value, *args, **kwargs):
        query_lengths.append(query.shape[-2])
        assert kwargs.get("attn_mask") is None and kwargs.get("is_causal")  # causal, no mask to build
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    data = make_batch()
    lengths = data.batch["attention_mask"].sum(-1).tolist()
    make_actor(model_dir, remove_padding=True).compute_log_prob(data)
    make_critic(model_dir, remove_padding=True).compute_values(data)
    layers = 2
    assert sorted(query_lengths) == sorted(lengths * layers * 2)


# ------------------------------------------------------------------ configuration


def test_workers_pass_the_model_flag_to_actor_ref_and_critic(model_dir: Path):
    config = default_config()
    # null: by the device (hflow.trainer.memory.defaults); a worker on CPU left with null packs nothing
    assert config.actor_rollout_ref.model.use_remove_padding is None and config.critic.model.use_remove_padding is None
    config.actor_rollout_ref.model.path = config.critic.model.path = str(model_dir)
    assert normalize_critic(config.critic, world_size=1).use_remove_padding is False
    assert normalize_actor_rollout_ref(config.actor_rollout_ref, "actor_rollout_ref", 1).actor.use_remove_padding is False
    config.actor_rollout_ref.model.use_remove_padding = True
    actor_rollout_ref = normalize_actor_rollout_ref(config.actor_rollout_ref, "actor_rollout_ref", world_size=1)
    assert actor_rollout_ref.actor.use_remove_padding is True and actor_rollout_ref.ref.use_remove_padding is True
    assert normalize_critic(config.critic, world_size=1).use_remove_padding is True  # follows the policy's
    config.critic.model.use_remove_padding = False
    assert normalize_critic(config.critic, world_size=1).use_remove_padding is False


# ------------------------------------------------------------------ long packed rows: no N x N mask, no per-layer reads

LONG_ROWS, LONG_PROMPT, LONG_RESPONSE = 16, 64, 64  # up to 16 x 128 packed tokens (about 1250 here)


@pytest.fixture(scope="module")
def long_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Tiny Qwen2 models for 256-token rows, one with 2 layers and one with 4 (same widths)."""
    paths = {}
    for layers in (2, 4):
        torch.manual_seed(0)
        config = Qwen2Config(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=256)
        paths[layers] = tmp_path_factory.mktemp(f"qwen2-long-{layers}")
        Qwen2ForCausalLM(config).save_pretrained(paths[layers])
    return paths


def make_long_batch() -> DataProto:
    gen = torch.Generator().manual_seed(3)
    prompt_lens = torch.randint(LONG_PROMPT // 2, LONG_PROMPT + 1, (LONG_ROWS,), generator=gen)
    response_lens = torch.randint(1, LONG_RESPONSE + 1, (LONG_ROWS,), generator=gen)
    prompt_mask = (torch.arange(LONG_PROMPT) >= LONG_PROMPT - prompt_lens[:, None]).long()
    attended = (torch.arange(LONG_RESPONSE) < response_lens[:, None]).long()
    responses = torch.randint(1, VOCAB, (LONG_ROWS, LONG_RESPONSE), generator=gen) * attended
    prompts = torch.randint(1, VOCAB, (LONG_ROWS, LONG_PROMPT), generator=gen) * prompt_mask
    attention_mask = torch.cat([prompt_mask, attended], dim=-1)
    tensors = {"input_ids": torch.cat([prompts, responses], dim=-1), "responses": responses,
               "attention_mask": attention_mask, "position_ids": compute_position_id_with_mask(attention_mask),
               "response_mask": attended}
    return DataProto.from_dict(tensors, meta_info={"temperature": 1.0, "micro_batch_size": LONG_ROWS})


class _LargestNewTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the largest storage any op creates (an output that is not one of its inputs' storages)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                if t.untyped_storage().nbytes() > self.largest:
                    self.largest, self.op = t.untyped_storage().nbytes(), func
        return out


@pytest.mark.parametrize("attn", [SDPA_VARLEN, "sdpa"])
def test_packed_forward_allocates_no_n_by_n_mask(long_model_dirs: dict[int, Path], attn: str):
    """Actor log-probs and critic values of a ~1.2k-token packed row: with the default `SDPA_VARLEN` no op
    creates a tensor of N x N / 2 bytes or more (transformers' packed mask is a (1, 1, N, N) bool, N^2 bytes;
    the largest real tensor here, an MLP activation, is N x 64 fp32, about N^2 / 5 bytes), and the results
    are still the padded path's. An explicitly
    named `sdpa` does build it (documented), which shows the probe sees such a mask."""
    data = make_long_batch()
    n = int(data.batch["attention_mask"].sum())
    assert n > 1000
    model_dir = long_model_dirs[2]
    padded_actor = make_actor(model_dir, remove_padding=False, attn=attn)
    packed_actor = make_actor(model_dir, remove_padding=True, attn=attn)
    padded_critic, packed_critic = make_critic(model_dir, remove_padding=False), make_critic(model_dir, remove_padding=True)
    if attn != SDPA_VARLEN:
        for critic in (padded_critic, packed_critic):
            critic.critic_module.config._attn_implementation = attn
    with _LargestNewTensor() as probe:
        log_probs, _ = packed_actor.compute_log_prob(data)
        values = packed_critic.compute_values(data)
    if attn == SDPA_VARLEN:
        assert probe.largest < n * n // 2, (probe.largest, probe.op)
    else:
        assert probe.largest >= n * n, (probe.largest, probe.op)
    mask = data.batch["attention_mask"][:, -LONG_RESPONSE:]
    torch.testing.assert_close(log_probs, padded_actor.compute_log_prob(data)[0] * mask, atol=ATOL, rtol=0)
    torch.testing.assert_close(values, padded_critic.compute_values(data) * mask, atol=ATOL, rtol=0)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read a tensor's values back to Python (a device synchronisation on a GPU):
    `.item()`, `bool()`, `int()` (`_local_scalar_dense`), `nonzero`; `.tolist()`, which on CPU dispatches
    nothing, is counted by the test's patch of `torch.Tensor.tolist`."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def test_packed_forward_reads_the_sequence_bounds_once_not_per_layer(long_model_dirs: dict[int, Path], monkeypatch):
    """The packed forward's reads of device values do not grow with the number of layers: the bounds are
    read once, in `pack_micro_batch`, and reach every layer as ints."""
    data = make_long_batch()
    packed = pack_micro_batch(data.batch["input_ids"], data.batch["attention_mask"], LONG_RESPONSE)
    probe = _HostReads()
    tolist = torch.Tensor.tolist

    def counting_tolist(self):
        probe.count += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    reads = {}
    for layers, model_dir in long_model_dirs.items():
        model = load_causal_lm(str(model_dir), attn_implementation=SDPA_VARLEN)
        probe.count = 0
        with torch.no_grad(), probe:
            packed.forward(model, use_cache=False, logits_to_keep=packed.scoring_positions)
        reads[layers] = probe.count
    assert reads[2] == reads[4] <= 1, reads  # transformers' packed-sequence check, once per forward


def test_packed_forward_without_bounds_fails_instead_of_attending_across_sequences(model_dir: Path, monkeypatch):
    """Inside `PackedMicroBatch.forward` no mask is built, so the attention must get the bounds: without
    them it raises rather than attend causally over the whole packed row."""
    data = make_batch()
    packed = pack_micro_batch(data.batch["input_ids"], data.batch["attention_mask"], RESPONSE_LEN)
    inputs = packed.model_inputs()
    for key in (SEQUENCE_BOUNDS, "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        inputs.pop(key)
    monkeypatch.setattr(type(packed), "model_inputs", lambda self: inputs)
    model = load_causal_lm(str(model_dir), attn_implementation=SDPA_VARLEN)
    with pytest.raises(RuntimeError, match="without its sequence bounds"), torch.no_grad():
        packed.forward(model, use_cache=False)
