"""Vision-language RL on a tiny Qwen2-VL built locally: the processor and the dataset's image rows, bad image
input stopped at load naming the row, and the actor's forward with images (packed equals padded, both equal
the model on each sample alone, gradients reach the vision tower)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from hflow.protocol import DataProto
from hflow.tasks.tiny_vision import build_vision_lm
from hflow.trainer.config import default_config
from hflow.utils.dataset import RLHFDataset, collate_fn
from hflow.utils.errors import ConfigError, DataError
from hflow.utils.packing import SDPA_VARLEN
from hflow.utils.vision import load_processor
from hflow.workers.actor import DataParallelPPOActor
from hflow.workers.common import load_tokenizer
from hflow.workers.config import resolved_copy
from hflow.workers.fsdp import load_causal_lm

RESPONSE_LEN = 6
ATOL = 1e-5


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_lm(tmp_path_factory.mktemp("qwen2-vl-tiny"))


@pytest.fixture(scope="module")
def tokenizer(vl_dir):
    return load_tokenizer(str(vl_dir))


@pytest.fixture(scope="module")
def processor(vl_dir, tokenizer):
    return load_processor(str(vl_dir), tokenizer)


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def row(text: str, images: list, index: int) -> dict:
    return {"data_source": "hflow/vision", "prompt": [{"role": "user", "content": text}], "images": images,
            "reward_model": {"ground_truth": str(index)}, "extra_info": {"index": index}}


def image(data: bytes | None = None, path: str | None = None) -> dict:
    return {"bytes": data, "path": path}  # the `datasets` Image feature's struct


def image_rows(tmp_path: Path) -> list[dict]:
    """Images of different sizes (4 to 16 tokens each), one row with two, one as a path, one row with none."""
    path = tmp_path / "picture.png"
    path.write_bytes(png(70, 70, seed=9))
    return [
        row("<image> which digits?", [image(png(56, 56, 0))], 0),
        row("look: <image> and then <image>, what differs?", [image(png(112, 84, 1)), image(png(56, 112, 2))], 1),
        row("no picture here, what is 2 + 3?", [], 2),
        row("what is in <image>?", [image(path=str(path))], 3),
        row("<image>", [image(png(84, 84, 4))], 4),
    ]


def data_config(**overrides):
    config = default_config().data
    config.max_prompt_length = 64
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def write(path: Path, records: list[dict]) -> str:
    pd.DataFrame(records).to_parquet(path, index=False)
    return str(path)


def test_processor_and_dataset_count_image_tokens(vl_dir, tokenizer, processor, tmp_path):
    from transformers import AutoModelForImageTextToText

    assert type(AutoModelForImageTextToText.from_pretrained(vl_dir)).__name__ == "Qwen2VLForConditionalGeneration"
    dataset = RLHFDataset(write(tmp_path / "train.parquet", image_rows(tmp_path)), tokenizer, data_config(),
                          processor=processor)
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for index in range(len(dataset)):
        item = dataset[index]
        ids = item["raw_prompt_ids"]
        grids = item["multi_modal_inputs"].get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
        # one pad token per merged 2x2 patch of every image: the prompt's length counts them
        assert ids.count(image_token) == int(grids.prod(-1).sum()) // 4
        assert len(grids) == len(item["multi_modal_data"].get("image", []))
    assert dataset[1]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 6, 8], [1, 8, 4]]
    assert dataset[2]["multi_modal_inputs"] == {}
    # the image tokens count against max_prompt_length: a limit one token short of the two-image row drops it
    # (20 of its tokens are image tokens), and exactly the rows longer than the limit
    full = [len(dataset[i]["raw_prompt_ids"]) for i in range(len(dataset))]
    limit = full[1] - 1
    assert full[1] - dataset[1]["raw_prompt_ids"].count(image_token) < limit - 10
    small = RLHFDataset(str(tmp_path / "train.parquet"), tokenizer, data_config(max_prompt_length=limit),
                        processor=processor)
    assert [small[i]["index"] for i in range(len(small))] == [i for i, n in enumerate(full) if n <= limit]
    assert small.num_filtered == sum(n > limit for n in full) >= 1


@pytest.mark.parametrize("case", ["missing_file", "unreadable", "too_many_placeholders", "too_few_placeholders"])
def test_bad_image_rows_stop_the_load_naming_the_row(case, tokenizer, processor, tmp_path):
    records = image_rows(tmp_path)
    if case == "missing_file":
        records[3]["images"] = [image(path=str(tmp_path / "nowhere.png"))]
    elif case == "unreadable":
        records[3]["images"] = [image(b"not a png at all")]
    elif case == "too_many_placeholders":
        records[3]["prompt"] = [{"role": "user", "content": "<image> <image> what?"}]
    else:
        records[3]["images"] = [image(png(56, 56, 5)), image(png(56, 56, 6))]
    path = write(tmp_path / "bad.parquet", records)
    with pytest.raises(DataError, match=rf"{path} row 3: .*(does not exist|not a readable image|placeholder)"):
        RLHFDataset(path, tokenizer, data_config(), processor=processor)


def test_images_for_a_model_without_image_processor(tmp_path, tokenizer, processor):
    from hflow.tasks.tiny_models import build_causal_lm

    path = write(tmp_path / "train.parquet", image_rows(tmp_path))
    text_model = build_causal_lm(tmp_path / "text-only")
    assert load_processor(str(text_model), load_tokenizer(str(text_model))) is None  # no preprocessor_config.json
    with pytest.raises(ConfigError, match="has images .* no image processor"):
        RLHFDataset(path, load_tokenizer(str(text_model)), data_config(), processor=None)
    # an image prompt is never truncated through its image tokens
    with pytest.raises(DataError, match="row 0: .*prompts with images are not truncated"):
        RLHFDataset(path, tokenizer, data_config(max_prompt_length=20, filter_overlong_prompts=False,
                                                 truncation="left"), processor=processor)


# ---- the actor's forward ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tokenizer, processor, tmp_path_factory) -> DataProto:
    """The dataset's prompts (left-padded), as the trainer hands them to the rollout."""
    tmp = tmp_path_factory.mktemp("vision-data")
    dataset = RLHFDataset(write(tmp / "train.parquet", image_rows(tmp)), tokenizer, data_config(), processor=processor)
    data = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    data.meta_info.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return data


@pytest.fixture(scope="module")
def batch(prompts) -> DataProto:
    """The prompts with random responses of different lengths (right-padded)."""
    data = prompts.select(deepcopy=True)
    n = len(data)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 1, 4, 6, 3])
    response_mask = (torch.arange(RESPONSE_LEN) < lengths[:, None]).long()
    responses = torch.randint(1, 500, (n, RESPONSE_LEN), generator=gen) * response_mask
    attention_mask = torch.cat([data.batch["attention_mask"], response_mask], dim=-1)
    data.batch["responses"] = responses
    data.batch["input_ids"] = torch.cat([data.batch["input_ids"], responses], dim=-1)
    data.batch["attention_mask"] = attention_mask
    data.batch["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    data.batch["response_mask"] = response_mask
    data.batch["advantages"] = torch.randn(n, RESPONSE_LEN, generator=gen) * response_mask
    data.meta_info.update(temperature=0.8, micro_batch_size=2)
    return data


def make_actor(vl_dir: Path, remove_padding: bool, optimizer: bool = False) -> DataParallelPPOActor:
    model = load_causal_lm(str(vl_dir), attn_implementation=SDPA_VARLEN)
    config = resolved_copy(default_config().actor_rollout_ref.actor)
    config.use_remove_padding = remove_padding
    config.ppo_mini_batch_size_per_rank, config.ppo_micro_batch_size_per_gpu = 5, 2
    config.shuffle, config.grad_clip, config.entropy_coeff = False, 1e6, 0.0
    return DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None)


def sample_alone(model, data: DataProto, i: int) -> torch.Tensor:
    """Log-probs of sample i's response, the model on the sample alone (no padding), with the positions it
    computes itself from its processor-style inputs."""
    valid = data.batch["attention_mask"][i].bool()
    ids = data.batch["input_ids"][i][valid][None]
    inputs = dict(data.non_tensor_batch["multi_modal_inputs"][i])
    mm_types = (ids == model.config.image_token_id).int()
    logits = model(input_ids=ids, mm_token_type_ids=mm_types, **inputs, use_cache=False).logits[0].float()
    length = int(data.batch["response_mask"][i].sum())
    scoring = logits[ids.shape[1] - length - 1 : ids.shape[1] - 1] / data.meta_info["temperature"]
    return torch.log_softmax(scoring, -1).gather(-1, ids[0, -length:, None])[:, 0]


def test_packed_equals_padded_and_each_sample_alone(vl_dir, batch):
    padded, _ = make_actor(vl_dir, remove_padding=False).compute_log_prob(batch)
    actor = make_actor(vl_dir, remove_padding=True)
    packed, _ = actor.compute_log_prob(batch)
    mask = batch.batch["response_mask"].bool()
    assert torch.allclose(packed[mask], padded[mask], atol=ATOL), (packed - padded).abs().max()
    with torch.no_grad():
        for i in range(len(batch)):
            alone = sample_alone(actor.actor_module, batch, i)
            assert torch.allclose(padded[i][mask[i]], alone, atol=ATOL), (i, (padded[i][mask[i]] - alone).abs().max())
    # the images matter: the same prompts with other pictures give other log-probs
    other = batch.slice(0, 2)
    other.non_tensor_batch["multi_modal_inputs"] = np.array(
        [{**m, "pixel_values": torch.randn_like(m["pixel_values"])} for m in other.non_tensor_batch["multi_modal_inputs"]],
        dtype=object)
    changed, _ = actor.compute_log_prob(other)
    assert (changed[0][mask[0]] - packed[0][mask[0]]).abs().max() > 1e-3


def test_update_reaches_the_vision_tower(vl_dir, batch):
    actor = make_actor(vl_dir, remove_padding=True, optimizer=True)
    before = {n: p.detach().clone() for n, p in actor.actor_module.named_parameters() if "visual" in n}
    metrics = actor.update_policy(batch)
    assert np.isfinite(metrics["actor/pg_loss"]).all()
    moved = [n for n, p in actor.actor_module.named_parameters() if "visual" in n and not torch.equal(p, before[n])]
    assert "model.visual.patch_embed.proj.weight" in moved and len(moved) > len(before) // 2


@pytest.mark.parametrize("remove_padding", [True, False])
def test_hf_rollout_log_probs_match_the_actor(vl_dir, prompts, remove_padding):
    """The sampler's log-probs (HF generate on the images) are the trainer's on the same samples."""
    from hflow.workers.rollout.hf_rollout import HFRollout

    config = default_config().actor_rollout_ref.rollout
    config.n, config.temperature, config.response_length, config.prompt_length = 2, 0.8, RESPONSE_LEN, 64
    actor = make_actor(vl_dir, remove_padding=remove_padding)
    torch.manual_seed(0)
    out = HFRollout(actor.actor_module, config).generate_sequences(prompts)
    assert len(out) == 2 * len(prompts) and "multi_modal_data" not in out.non_tensor_batch
    out.meta_info.update(temperature=0.8, micro_batch_size=3)
    log_probs, _ = actor.compute_log_prob(out)
    mask = out.batch["attention_mask"][:, -RESPONSE_LEN:].bool()
    assert (log_probs - out.batch["rollout_log_probs"])[mask].abs().max() < 1e-4


def test_frozen_vision_tower_fsdp_units_and_export(vl_dir, batch, tokenizer, world_of_one, tmp_path):
    """`freeze_vision_tower` leaves the encoder's weights and trains the language model; FSDP2 wraps each vision
    block as its own unit; the HF export keeps the processor files, so it loads as a vision-language model."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForImageTextToText

    from hflow.utils.vision import freeze_vision_tower
    from hflow.workers.fsdp import apply_fsdp2
    from hflow.workers.fsdp.checkpoint import save_hf_model

    model = make_actor(vl_dir, remove_padding=True).actor_module
    freeze_vision_tower(model)
    apply_fsdp2(model, world_of_one, fsdp_on_one_rank=True)
    units = {name for name, module in model.named_modules() if isinstance(module, FSDPModule)}
    assert {"model.visual.blocks.0", "model.visual.blocks.1", "model.language_model.layers.0"} <= units

    trainable = [p for p in model.parameters() if p.requires_grad]
    actor = DataParallelPPOActor(make_actor(vl_dir, True).config, model, torch.optim.SGD(trainable, lr=0.1))
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    actor.update_policy(batch)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), before[n])}
    assert changed and not any("visual" in n for n in changed)
    assert any("language_model" in n for n in changed)

    save_hf_model(model, tmp_path / "export", tokenizer=tokenizer)
    assert load_processor(str(tmp_path / "export"), tokenizer) is not None
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "export")
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    assert torch.equal(exported.state_dict()[name], model.state_dict()[name].full_tensor())


def test_geo3k_preprocessing_feeds_the_dataset(tokenizer, processor, tmp_path):
    """examples/data_preprocess/geo3k.py on Hub-shaped shards: rows the vision dataset loads, and the
    scorer its data_source names."""
    import importlib.util

    from hflow.reward.score import default_compute_score

    script = Path(__file__).resolve().parents[2] / "examples" / "data_preprocess" / "geo3k.py"
    spec = importlib.util.spec_from_file_location("geo3k", script)
    geo3k = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(geo3k)
    shards = tmp_path / "hub"
    shards.mkdir()
    write(shards / "train-00000-of-00001.parquet", [
        {"problem": "<image>Find x.", "answer": "3\\sqrt{2}", "images": [image(png(84, 56, 0))]},
        {"problem": "Find the area of the triangle.", "answer": "12", "images": [image(png(56, 56, 1))]},
    ])
    [path] = geo3k.main(["--input", str(shards), "--local_dir", str(tmp_path / "geo3k")])
    dataset = RLHFDataset(str(path), tokenizer, data_config(), processor=processor)
    assert len(dataset) == 2 and dataset[1]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert default_compute_score("hiyouga/geometry3k", "so x = \\boxed{3\\sqrt{2}}", "3\\sqrt{2}") == 1.0


def test_vllm_requests_carry_the_images(prompts, tokenizer):
    """What the vLLM rollout hands the engine (vLLM's CPU build cannot run Qwen2-VL: docs/architecture.md): each
    image's run of pad tokens collapsed to one, the images as multi_modal_data, text rows as they were."""
    from hflow.workers.rollout.base import engine_requests, refuse_images

    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    requests = engine_requests(prompts, image_token)
    for request, ids, data in zip(requests, prompts.non_tensor_batch["raw_prompt_ids"],
                                  prompts.non_tensor_batch["multi_modal_data"]):
        images = data.get("image", [])
        assert request["prompt_token_ids"].count(image_token) == len(images)
        assert [t for t in request["prompt_token_ids"] if t != image_token] == [t for t in ids if t != image_token]
        assert request.get("multi_modal_data", {}).get("image", []) == images
    assert "multi_modal_data" not in requests[2]  # the text-only row
    with pytest.raises(ValueError, match="no image token"):
        engine_requests(prompts, None)
    with pytest.raises(NotImplementedError, match="multi-turn .* do not take images"):
        refuse_images(prompts, "multi-turn rollouts")


def test_lora_adapts_the_language_model_only(vl_dir, batch):
    """LoRA on a vision-language model: adapters on the language model's linears, none in the vision tower;
    the wrapped model forwards images (B = 0 at the start: the base model's log-probs)."""
    from hflow.workers.fsdp.lora import add_lora

    base = make_actor(vl_dir, remove_padding=True)
    expected, _ = base.compute_log_prob(batch)
    lora = add_lora(base.actor_module, rank=4, alpha=8)
    adapted = {name.split(".lora_A")[0] for name, _ in lora.named_parameters() if ".lora_A." in name}
    assert adapted and not any("visual" in name for name in adapted)
    assert any("language_model.layers.0.self_attn.q_proj" in name for name in adapted)
    log_probs, _ = DataParallelPPOActor(base.config, lora).compute_log_prob(batch)
    assert torch.allclose(log_probs, expected, atol=ATOL)


def test_the_trainer_hands_the_images_to_generation(prompts):
    """The trainer's generation batch takes the images (the rollout would otherwise sample blind while the
    trainer scores with the images: seen as rollout_probs_diff 0.003 against 0.000 in a run)."""
    from hflow.trainer.ppo.rollout_source import pop_generation_inputs

    batch = prompts.select(deepcopy=True)
    generation = pop_generation_inputs(batch)
    assert {"multi_modal_data", "multi_modal_inputs"} <= set(generation.non_tensor_batch)
    assert "multi_modal_data" not in batch.non_tensor_batch  # the sampler's alone: not shipped on to training
