"""Bad inputs a new user gives the entry points (main_ppo, main_sft, main_rm, main_dpo), and how each run ends:
with one `hflow: error: ...` line, the last of stderr, naming the key, file or sample and saying what to
change; no traceback; before any worker, model or Ray starts (`train` is never reached).

The cases run in this process through each module's `main()` -- the real command line: Hydra, the
command-line check, `run_cli` -- which takes a fraction of a second where a fresh interpreter takes
seconds; `test_each_entry_point_ends_a_bad_run_with_the_message_alone` runs one case of each in a
subprocess, as a user does.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hflow.tasks.builtin_task import ensure_builtin_assets
from hflow.tasks.rlhf_task import ensure_rlhf_task_data
from tests.conftest import REPO_ROOT

PPO, SFT, RM = "hflow.trainer.main_ppo", "hflow.trainer.main_sft", "hflow.trainer.main_rm"
DPO = "hflow.trainer.main_dpo"
GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]
MULTI_TURN = "actor_rollout_ref.rollout.multi_turn.enable=true"
ENDPOINT = "actor_rollout_ref.rollout.multi_turn.endpoint"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Every bad file the cases name, written once."""
    root = tmp_path_factory.mktemp("user_errors")
    assets, stages = ensure_builtin_assets(), ensure_rlhf_task_data()
    table = pq.read_table(assets.train_file)
    rows = table.to_pylist()
    pq.write_table(table.drop(["prompt"]), root / "no_prompt.parquet")
    pq.write_table(pa.Table.from_pylist([{**row, "prompt": "What is 2 + 3?"} for row in rows]),
                   root / "text_prompt.parquet")
    pq.write_table(pa.Table.from_pylist(
        [{**row, "prompt": [{"role": "user", "content": None}]} if i == 3 else row for i, row in enumerate(rows)]),
        root / "null_content.parquet")
    pq.write_table(pa.Table.from_pylist([{**row, "prompt": [{"role": "user", "content": "word " * 300}]}
                                         for row in rows[:8]]), root / "long.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:4]), root / "four_rows.parquet")
    pq.write_table(pa.Table.from_pylist([{**row, "data_source": "openai/gsm8k"} if i % 2 else row
                                         for i, row in enumerate(rows)]), root / "two_sources.parquet")
    table.to_pandas().to_csv(root / "csv.parquet")
    (root / "json.parquet").write_text(json.dumps(rows[:3]))
    (root / "folder.parquet").mkdir()
    pq.write_table(pa.Table.from_pylist([{"prompt": "a question"}] * 8), root / "sft_no_response.parquet")
    pq.write_table(pq.read_table(stages.rm_train).drop(["rejected"]), root / "rm_no_rejected.parquet")
    pairs = pq.read_table(stages.rm_train).to_pylist()[:20]
    pq.write_table(pa.Table.from_pylist([{**row, "rejected": row["chosen"]} if i in (4, 9) else row
                                         for i, row in enumerate(pairs)]), root / "dpo_identical.parquet")
    model = Path(assets.model_path)
    for name, config_text in (("no_tokenizer", (model / "config.json").read_text()), ("bad_json", "{not json")):
        (root / name).mkdir()
        (root / name / "config.json").write_text(config_text)
        (root / name / "model.safetensors").symlink_to(model / "model.safetensors")
    from hflow.tasks.tiny_models import build_causal_lm, build_token_classification

    build_causal_lm(root / "other_vocab", preset="tiny", seed=0, tokenizer_kwargs={"vocab_size": 384})  # a teacher
    (root / "teacher").symlink_to(assets.model_path)  # a teacher with the student's vocabulary (the student)
    (root / "reward_signature.py").write_text("def compute_score(solution_str):\n    return 1.0\n")
    (root / "checkpoints" / "global_step_5").mkdir(parents=True)  # a save that died: no data/state.pt
    build_token_classification(root / "reward_model", preset="tiny", seed=0)  # a value / reward model's folder
    (root / "a_file").write_text("not a folder\n")
    grpo_step = root / "grpo_run" / "global_step_1"  # what a GRPO run leaves: the actor's checkpoint, no critic
    (grpo_step / "actor" / "huggingface").mkdir(parents=True)
    (grpo_step / "actor" / "huggingface" / "config.json").write_text((model / "config.json").read_text())
    (grpo_step / "data").mkdir()
    (grpo_step / "data" / "state.pt").write_bytes(b"")
    (root / "grpo_run" / "latest_checkpointed_iteration.txt").write_text("1")
    all_pairs = pq.read_table(stages.rm_train).to_pylist()  # enough rows for a batch: only the empty reply is wrong
    pq.write_table(pa.Table.from_pylist([{**row, "chosen": ""} if i == 3 else row for i, row in enumerate(all_pairs)]),
                   root / "dpo_empty_chosen.parquet")
    (root / "agent.py").write_text("def run_episode(base_url, episode_id, row):\n    return None\n")
    (root / "agent_two_arguments.py").write_text("def run_episode(base_url, row):\n    return None\n")
    (root / "my_tools.py").write_text("def lookup(query: str) -> str:\n    return query\n")
    (root / "bad_tools.yaml").write_text(
        "tools:\n  - function: my_tools.py:search\n    tool_schema:\n      type: function\n      function:\n"
        "        name: search\n        parameters: {type: object, properties: {query: {type: string}}}\n")
    return root


# (id, entry point, arguments with {files} for the folder above, words the message must hold)
CASES = [
    # data files
    ("missing-data-file", PPO, ["data.train_files={files}/nothere.parquet"], ["data.train_files", "nothere.parquet"]),
    ("data-file-is-a-folder", PPO, ["data.train_files={files}/folder.parquet"], ["data.train_files", "is a folder"]),
    ("csv-named-parquet", PPO, ["data.train_files={files}/csv.parquet"],
     ["data.train_files", "csv.parquet", "not a readable parquet file"]),
    ("json-named-parquet", PPO, ["data.train_files={files}/json.parquet"],
     ["data.train_files", "json.parquet", "not a readable parquet file"]),
    ("no-prompt-column", PPO, ["data.train_files={files}/no_prompt.parquet"], ["no_prompt.parquet", "data.prompt_key"]),
    ("prompt-not-a-chat", PPO, ["data.train_files={files}/text_prompt.parquet"],
     ["text_prompt.parquet", "'prompt'", "not chat messages"]),
    ("message-without-content", PPO, ["data.train_files={files}/null_content.parquet"],
     ["null_content.parquet row 3", "'content'"]),
    ("prompts-too-long-unfiltered", PPO,
     ["data.train_files={files}/long.parquet", "data.filter_overlong_prompts=false"],
     ["long.parquet row 0", "longer than data.max_prompt_length=", "data.filter_overlong_prompts=true"]),
    ("every-prompt-too-long", PPO, ["data.train_files={files}/long.parquet"],
     ["data.train_files", "all 8 prompts", "raise data.max_prompt_length"]),
    ("batch-larger-than-data", PPO, ["data.train_files={files}/four_rows.parquet"],
     ["data.train_batch_size=32", "4 rows of data.train_files"]),
    ("bad-truncation", PPO, ["data.truncation=top"], ["data.truncation='top'", "'left'"]),
    ("bad-chat-template", PPO, ["data.chat_template='{{% if %}}'"],
     ["data.chat_template", "not a valid Jinja template"]),
    # model folders
    ("model-path-missing", PPO, ["actor_rollout_ref.model.path={files}/nothere"],
     ["actor_rollout_ref.model.path=", "not a folder"]),
    ("model-without-tokenizer", PPO, ["actor_rollout_ref.model.path={files}/no_tokenizer"],
     ["actor_rollout_ref.model.path=", "no tokenizer", "actor_rollout_ref.model.tokenizer_path"]),
    ("model-config-not-json", PPO, ["actor_rollout_ref.model.path={files}/bad_json"],
     ["actor_rollout_ref.model.path=", "config.json is not readable JSON"]),
    # names and values
    ("unknown-estimator", PPO, ["algorithm.adv_estimator=foo"], ["algorithm.adv_estimator='foo'", "grpo"]),
    ("unknown-placement", PPO, ["trainer.placement=bar"], ["trainer.placement='bar'", "colocate"]),
    ("unknown-rollout", PPO, ["actor_rollout_ref.rollout.name=baz"], ["actor_rollout_ref.rollout.name='baz'", "vllm"]),
    ("unknown-kl-loss-type", PPO,
     ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=k9"],
     ["actor_rollout_ref.actor.kl_loss_type='k9'", "low_var_kl"]),
    ("unknown-reward-manager", PPO, ["reward_model.reward_manager=fancy"],
     ["reward_model.reward_manager='fancy'", "naive"]),
    ("mini-batch-does-not-divide", PPO, ["actor_rollout_ref.actor.ppo_mini_batch_size=3"],
     ["actor_rollout_ref.actor.ppo_mini_batch_size (3)", "data.train_batch_size"]),
    ("micro-batch-does-not-divide", PPO, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"],
     ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (5)"]),
    ("more-workers-than-the-node-has", PPO, ["trainer.n_gpus_per_node=1024"],
     ["trainer.n_gpus_per_node=1024", "this node has"]),
    ("negative-lr", PPO, ["actor_rollout_ref.actor.optim.lr=-1e-6"], ["actor_rollout_ref.actor.optim.lr", "> 0"]),
    ("zero-lr", PPO, ["actor_rollout_ref.actor.optim.lr=0"], ["actor_rollout_ref.actor.optim.lr", "> 0"]),
    ("unknown-warmup-style", PPO, ["actor_rollout_ref.actor.optim.warmup_style=linear"],
     ["actor_rollout_ref.actor.optim.warmup_style='linear'", "cosine"]),
    ("memory-fraction-above-one", PPO, ["actor_rollout_ref.rollout.gpu_memory_utilization=2"],
     ["actor_rollout_ref.rollout.gpu_memory_utilization", "(0, 1]"]),
    ("value-of-the-wrong-type", PPO, ["trainer.total_training_steps=abc"], ["trainer.total_training_steps", "'abc'"]),
    ("reward-function-signature", PPO, ["custom_reward_function.path={files}/reward_signature.py"],
     ["custom_reward_function.name='compute_score'", "reward_signature.py", "data_source"]),
    ("resume-from-missing-folder", PPO,
     ["trainer.resume_mode=resume_path", "trainer.resume_from_path={files}/checkpoints/global_step_9"],
     ["trainer.resume_from_path", "global_step_9 (no such folder)"]),
    ("config-file-that-does-not-exist", PPO, ["--config-name", "ppo_trainr"],
     ["--config-name ppo_trainr", "ppo_trainer"]),
    ("unknown-reward-style", PPO, ["reward_model.enable=true", "reward_model.model.path={files}/no_tokenizer", "reward_model.style=llm"],
     ["reward_model.style='llm'", "generative"]),
    ("unknown-judge-parser", PPO, ["reward_model.enable=true", "reward_model.model.path={files}/no_tokenizer",
                                   "reward_model.style=generative", "reward_model.judge.parser=grade"],
     ["reward_model.judge.parser='grade'", "yes_no"]),
    # the run's folders (issue 53): another kind of run's checkpoint, folders that cannot be made
    ("gae-resumed-into-a-grpo-folder", PPO, ["algorithm.adv_estimator=gae", "trainer.default_local_dir={files}/grpo_run"],
     ["would resume {files}/grpo_run/global_step_1", "no 'critic' checkpoint (it holds 'actor', 'data')",
      "trainer.experiment_name", "trainer.resume_mode=disable"]),
    ("dpo-resumed-into-a-ppo-folder", DPO, ["trainer.default_local_dir={files}/grpo_run"],
     ["would resume {files}/grpo_run/global_step_1", "no 'model' checkpoint", "trainer.resume_mode=disable"]),
    ("checkpoint-folder-under-a-file", PPO, ["trainer.default_local_dir={files}/a_file/checkpoints"],
     ["trainer.default_local_dir={files}/a_file/checkpoints", "{files}/a_file is a file"]),
    ("checkpoint-folder-read-only", PPO, ["trainer.default_local_dir=/sys/hflow_checkpoints"],  # root cannot write /sys
     ["trainer.default_local_dir=/sys/hflow_checkpoints", "cannot write in /sys", "a folder this user can write"]),
    ("checkpoint-folder-name-too-long", PPO, ["trainer.default_local_dir=checkpoints/" + "x" * 300],
     ["trainer.default_local_dir=checkpoints/xxx", "cannot be made", "name too long"]),
    ("dpo-model-folder-read-only", DPO, ["trainer.hf_output_dir=/sys/hflow_model"],
     ["trainer.hf_output_dir=/sys/hflow_model", "cannot write in /sys"]),
    # on-policy distillation's teacher
    ("distill-without-teacher", PPO, ["algorithm.distill.coef=0.5"],
     ["algorithm.distill.coef=0.5", "teacher.model.path is null"]),
    ("teacher-path-missing", PPO, ["algorithm.distill.coef=1", "teacher.model.path={files}/nothere"],
     ["teacher.model.path={files}/nothere", "not a folder"]),
    ("teacher-with-another-vocabulary", PPO, ["algorithm.distill.coef=1", "teacher.model.path={files}/other_vocab"],
     ["the teacher ({files}/other_vocab", "the student (", "builtin-v1/model", "different vocabularies"]),
    ("teacher-that-nothing-uses", PPO, ["teacher.model.path={files}/other_vocab"],
     ["teacher.model.path={files}/other_vocab", "algorithm.distill.coef=0", "nothing uses the teacher"]),
    ("distill-and-task-weights-both-zero", PPO, ["algorithm.distill.task_reward_coef=0"],
     ["algorithm.distill.task_reward_coef=0", "no reward to learn from"]),
    ("negative-distill-coef", PPO, ["algorithm.distill.coef=-1"], ["algorithm.distill.coef", ">= 0"]),
    ("jsd-without-teacher", PPO, ["algorithm.distill.jsd_coef=0.5"],
     ["algorithm.distill.jsd_coef=0.5", "teacher.model.path is null"]),
    ("teacher-topk-zero", PPO, ["teacher.topk=0"], ["teacher.topk", "positive integer", "got 0"]),
    ("jsd-beta-above-one", PPO, ["algorithm.distill.jsd_beta=1.5"], ["algorithm.distill.jsd_beta", "[0, 1]"]),
    ("jsd-with-fused-head", PPO, ["algorithm.distill.jsd_coef=1", "teacher.model.path={files}/teacher",
                                  "actor_rollout_ref.model.fused_lm_head=true"],
     ["algorithm.distill.jsd_coef > 0", "actor_rollout_ref.model.fused_lm_head=true"]),
    ("teacher-is-a-reward-model", PPO, ["algorithm.distill.coef=1", "teacher.model.path={files}/reward_model"],
     ["teacher.model.path={files}/reward_model", "is a Qwen2ForTokenClassification", "random", "(*ForCausalLM)"]),
    ("distill-with-remax", PPO, ["algorithm.adv_estimator=remax", "algorithm.distill.coef=1",
                                 "teacher.model.path={files}/teacher"],
     ["algorithm.adv_estimator=remax", "greedy response", "algorithm.distill.coef=1", "adv_estimator=grpo"]),
    ("teacher-topk-above-vocabulary", PPO, ["algorithm.distill.jsd_coef=1", "teacher.model.path={files}/teacher",
                                            "teacher.topk=100000"], ["teacher.topk=100000", "tokens"]),
    # the teacher's kinds: self-distillation, several teachers, a remote server
    ("teacher-source-unknown", PPO, ["algorithm.distill.coef=1", "teacher.source=policy"],
     ["teacher.source=policy is unknown", "model, self"]),
    ("self-teacher-without-template", PPO, ["algorithm.distill.coef=1", "teacher.source=self"],
     ["teacher.privileged_template=None", "non-empty string"]),
    ("self-teacher-template-field-missing", PPO, ["algorithm.distill.coef=1", "teacher.source=self",
                                                  "teacher.privileged_template='{{prompt}} Hint: {{hint}}'"],
     ["data.train_files:", "row 0 has no field 'hint'", "teacher.privileged_template"]),
    ("self-teacher-list-field-missing", PPO, ["algorithm.distill.coef=1", "teacher.source=self",
                                              "teacher.privileged_template=[ground_truth,solution]"],
     ["row 0 has no field 'solution'"]),
    ("self-teacher-with-another-model", PPO, ["algorithm.distill.coef=1", "teacher.source=self",
                                              "teacher.privileged_template=[ground_truth]",
                                              "teacher.model.path={files}/other_vocab"],
     ["teacher.source=self", "teacher.model.path={files}/other_vocab names another model"]),
    ("self-teacher-multi-turn", PPO, ["algorithm.distill.coef=1", "teacher.source=self",
                                      "teacher.privileged_template=[ground_truth]", MULTI_TURN],
     ["teacher.source=self", "multi_turn.enable=false"]),
    ("template-without-self", PPO, ["algorithm.distill.coef=1", "teacher.model.path={files}/teacher",
                                    "teacher.privileged_template=[ground_truth]"],
     ["teacher.privileged_template is read only with teacher.source=self"]),
    ("two-kinds-of-teacher", PPO, ["algorithm.distill.coef=1", "teacher.model.path={files}/teacher",
                                   "teacher.url=http://127.0.0.1:9"],
     ["teacher.model.path and teacher.url both name the teacher"]),
    ("teacher-for-an-unknown-source", PPO, ["algorithm.distill.coef=1",
                                            "+teacher.by_data_source={{nosuch: {{model: {{path: {files}/teacher}}}}}}"],
     ["teacher.by_data_source.nosuch names a data source that no training row has", "hflow/arithmetic"]),
    ("teacher-entry-without-model", PPO, ["algorithm.distill.coef=1",
                                          "+teacher.by_data_source={{hflow/arithmetic: {{path: {files}/teacher}}}}"],
     ["teacher.by_data_source.hflow/arithmetic must be {{model: {{path: <folder>}}}}"]),
    ("teacher-entry-path-missing", PPO, ["algorithm.distill.coef=1",
                                         "+teacher.by_data_source={{hflow/arithmetic: {{model: {{path: {files}/no}}}}}}"],
     ["teacher.by_data_source.hflow/arithmetic.model.path={files}/no", "not a folder"]),
    ("required-teacher-missing-for-a-source", PPO, [
        "algorithm.distill.coef=1", "data.train_files={files}/two_sources.parquet", "teacher.required=true",
        "+teacher.by_data_source={{hflow/arithmetic: {{model: {{path: {files}/teacher}}}}}}"],
     ["teacher.required=true", "data_source 'openai/gsm8k'", "has no teacher"]),
    ("remote-teacher-dead-url", PPO, ["algorithm.distill.coef=1", "teacher.url=http://127.0.0.1:9",
                                      "teacher.url_timeout_s=2"],
     ["teacher.url=http://127.0.0.1:9 does not answer", "teacher.url_timeout_s=2"]),
    ("remote-teacher-not-http", PPO, ["algorithm.distill.coef=1", "teacher.url=localhost:8000"],
     ["teacher.url=localhost:8000 must start with http://"]),
    ("remote-teacher-timeout-zero", PPO, ["algorithm.distill.coef=1", "teacher.url=http://127.0.0.1:9",
                                          "teacher.url_timeout_s=0"], ["teacher.url_timeout_s=0", "must be > 0"]),
    ("remote-teacher-temperature", PPO, ["algorithm.distill.coef=1", "teacher.url=http://127.0.0.1:9",
                                         "teacher.temperature=0.7"],
     ["teacher.temperature=0.7", "temperature 1"]),
    # multi-turn agent rollouts
    ("tool-config-missing", PPO, [MULTI_TURN, "actor_rollout_ref.rollout.multi_turn.tool_config_path={files}/no.yaml"],
     ["actor_rollout_ref.rollout.multi_turn.tool_config_path", "no.yaml", "no such file"]),
    ("tool-function-missing", PPO, [MULTI_TURN, "actor_rollout_ref.rollout.multi_turn.tool_config_path={files}/bad_tools.yaml"],
     ["bad_tools.yaml", "tools[0]", "search"]),
    ("unknown-tool-call-format", PPO, [MULTI_TURN, "actor_rollout_ref.rollout.multi_turn.format=xml"],
     ["actor_rollout_ref.rollout.multi_turn.format", "'xml'", "hermes"]),
    ("zero-parallel-calls", PPO, [MULTI_TURN, "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=0"],
     ["actor_rollout_ref.rollout.multi_turn.max_parallel_calls=0", ">= 1"]),
    ("bad-truncate-side", PPO, [MULTI_TURN, "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top"],
     ["actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side='top'", "middle"]),
    ("agent-with-another-signature", PPO, [MULTI_TURN, f"{ENDPOINT}.enable=true",
                                           f"{ENDPOINT}.agent_path={{files}}/agent_two_arguments.py"],
     [f"{ENDPOINT}.agent_name='run_episode'", "agent_two_arguments.py defines run_episode(base_url, row)",
      "run_episode(base_url, episode_id, row)", "give it those three arguments"]),
    ("agent-failed-share-above-one", PPO, [MULTI_TURN, f"{ENDPOINT}.enable=true", f"{ENDPOINT}.agent_path={{files}}/agent.py",
                                           f"{ENDPOINT}.max_failed_share=2"], [f"{ENDPOINT}.max_failed_share=2", "[0, 1]"]),
    # the supervised stages
    ("sft-zero-batch", SFT, ["data.train_batch_size=0"], ["data.train_batch_size", "positive"]),
    ("sft-negative-micro-batch", SFT, ["data.micro_batch_size_per_gpu=-2"], ["data.micro_batch_size_per_gpu"]),
    ("sft-no-response-column", SFT, ["data.train_files={files}/sft_no_response.parquet"],
     ["sft_no_response.parquet", "'response'", "data.messages_key"]),
    ("sft-missing-val-file", SFT, ["data.val_files={files}/nothere.parquet"], ["data.val_files", "nothere.parquet"]),
    ("sft-negative-lr", SFT, ["optim.lr=-1"], ["optim.lr must be > 0"]),
    ("sft-more-workers-than-the-node-has", SFT, ["trainer.n_gpus_per_node=1024", "data.train_batch_size=1024"],
     ["trainer.n_gpus_per_node=1024", "this node has"]),
    ("sft-model-without-tokenizer", SFT, ["model.path={files}/no_tokenizer"], ["model.path=", "no tokenizer"]),
    ("rm-no-rejected-column", RM, ["data.train_files={files}/rm_no_rejected.parquet"],
     ["rm_no_rejected.parquet", "'rejected'", "data.*_key"]),
    ("rm-zero-max-length", RM, ["data.max_length=0"], ["data.max_length", "positive"]),
    ("rm-model-path-missing", RM, ["model.path={files}/nothere"], ["model.path=", "not a folder"]),
    ("rm-resume-from-incomplete-checkpoint", RM,
     ["trainer.resume_mode=resume_path", "trainer.resume_from_path={files}/checkpoints/global_step_5"],
     ["trainer.resume_from_path", "no data/state.pt"]),
    ("dpo-no-rejected-column", DPO, ["data.train_files={files}/rm_no_rejected.parquet"],
     ["rm_no_rejected.parquet", "'rejected'", "data.rejected_key"]),
    ("dpo-identical-pairs", DPO, ["data.train_files={files}/dpo_identical.parquet"],
     ["dpo_identical.parquet", "2 of 20 rows", "identical (rows 4, 9)"]),
    ("dpo-empty-chosen", DPO, ["data.train_files={files}/dpo_empty_chosen.parquet"],
     ["data.train_files", "dpo_empty_chosen.parquet row 3 column 'chosen'", "the reply is empty"]),
    ("dpo-zero-beta", DPO, ["dpo.beta=0"], ["dpo.beta", "> 0"]),
    ("dpo-unknown-loss", DPO, ["dpo.loss_type=hinge"], ["dpo.loss_type", "ipo"]),
    ("dpo-smoothing-with-ipo", DPO, ["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"],
     ["dpo.label_smoothing=0.1", "loss_type=sigmoid"]),
]


def _never_trains(*args, **kwargs):
    raise AssertionError("the run reached train(): Ray, the workers and the models would start now")


def run_in_process(module: str, args: list[str], tmp_path: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """`python -m module *args`, in this process; returns (exit code, stdout + stderr, stderr)."""
    entry = importlib.import_module(module)
    main_ppo = importlib.import_module(PPO)
    monkeypatch.setattr(main_ppo, "train", _never_trains)  # every entry point trains through it
    monkeypatch.setattr(main_ppo, "install_library_filter", lambda: None)  # global; the subprocess test has it
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    # Hydra's logging and output folder would outlive the case in this process
    quiet = ["hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.output_subdir=null",
             f"hydra.run.dir={tmp_path}"]
    monkeypatch.setattr(sys, "argv", [module, *args, *quiet])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        entry.main()
    captured = capsys.readouterr()
    return exit_.value.code, captured.out + captured.err, captured.err


@pytest.mark.parametrize("module,args,named", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_a_bad_input_ends_with_one_line_naming_it_before_anything_starts(files, tmp_path, monkeypatch, capsys,
                                                                         module, args, named):
    args = [arg.format(files=files) for arg in args]
    if module == PPO and not any(arg.startswith(("algorithm.adv_estimator", "--config-name")) for arg in args):
        args = GRPO + args
    code, output, stderr = run_in_process(module, args, tmp_path, monkeypatch, capsys)
    assert code == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("hflow: error: "), output[-3000:]
    for text in named:
        assert text.format(files=files) in last, (text, last)
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()


def test_a_fixed_endpoint_port_in_use_or_shared_by_two_ranks_ends_naming_the_key(files, tmp_path, monkeypatch, capsys):
    """The agent endpoint's `port`: one that another process listens on, and one that the default two rollout
    ranks (trainer.n_gpus_per_node=2, colocated) would both listen on."""
    import socket

    endpoint = [*GRPO, MULTI_TURN, f"{ENDPOINT}.enable=true", f"{ENDPOINT}.agent_path={files}/agent.py"]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, output, stderr = run_in_process(PPO, [*endpoint, f"{ENDPOINT}.port={port}", "trainer.n_gpus_per_node=1"],
                                              tmp_path, monkeypatch, capsys)
    assert code == 1 and "Traceback" not in output, output[-3000:]
    last = stderr.strip().splitlines()[-1]
    for words in ("hflow: error: ", f"{ENDPOINT}.port={port}", f"cannot listen on 127.0.0.1:{port}", f"{ENDPOINT}.port=0"):
        assert words in last, (words, last)
    # (the port is free again now)
    code, output, stderr = run_in_process(PPO, [*endpoint, f"{ENDPOINT}.port={port}"], tmp_path, monkeypatch, capsys)
    assert code == 1 and "Traceback" not in output, output[-3000:]
    last = stderr.strip().splitlines()[-1]
    for words in ("hflow: error: ", f"{ENDPOINT}.port={port} is one port", "2 rollout ranks on a node", "set it to 0"):
        assert words in last, (words, last)


def test_each_entry_point_ends_a_bad_run_with_the_message_alone(files, tmp_path):
    """As a user runs them: a fresh interpreter each, all three at once."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    runs = {
        PPO: [*GRPO, "actor_rollout_ref.actor.optim.lr=-1e-6"],
        SFT: [f"data.train_files={files}/sft_no_response.parquet"],
        RM: [f"data.train_files={files}/rm_no_rejected.parquet"],
    }
    procs = {module: subprocess.Popen([sys.executable, "-m", module, *args], cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for module, args in runs.items()}
    for module, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, (module, err[-3000:])
        assert "Traceback" not in out + err and "Started a local Ray instance" not in out + err, (module, err[-3000:])
        assert err.strip().splitlines()[-1].startswith("hflow: error: "), (module, err[-3000:])
