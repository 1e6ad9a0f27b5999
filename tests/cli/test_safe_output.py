"""No command of hflow deletes or overwrites what it was asked to read (issue 39, build item 1).

Every tool that takes an output path is run with that output pointed at its own input and at a parent of
its input (with `--overwrite` where the tool has it): each must stop with one `hflow: error:` paragraph
naming the argument, exit 2, and leave every input file byte for byte. The checkpoint converter's own row of
the issue -- output = the experiment folder holding global_step_1/actor, a user's file and
latest_checkpointed_iteration.txt, or `.` inside it -- is replayed on a real two-rank checkpoint (one per
module, saved as tests/cli/test_convert_checkpoint.py saves it); an overwrite of an earlier output still works
and is atomic (a failure part way leaves the old output and no temporary folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hflow.cli import convert_checkpoint as converter
from hflow.cli import memory_plan, plot
from hflow.reward import audit
from hflow.tasks import agent_task, builtin_task
from hflow.tasks.tiny_models import build_causal_lm
from hflow.utils.safe_output import LATEST, MANIFEST, OutputError
from tests.cli.test_convert_checkpoint import WORLD, _save_main
from tests.ranks import free_port, spawn_ranks

REPO = Path(__file__).resolve().parents[2]


def tree_hash(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `root` (folders by their presence)."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        found[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return found


def refused(code: int, err: str, arg: str) -> None:
    """One `hflow: error:` paragraph that names `arg`, status 2, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hflow: error: "), err
    assert arg in lines[0], err


@pytest.fixture(scope="module")
def experiment(tmp_path_factory) -> Path:
    """<exp>/global_step_1/actor: a LoRA actor's checkpoint saved by two ranks, plus the trainer's
    latest_checkpointed_iteration.txt and a user's file beside it."""
    root = tmp_path_factory.mktemp("safe_output")
    model = build_causal_lm(root / "qwen2-tied", tie_word_embeddings=True)
    spawn_ranks(_save_main, WORLD, free_port(), {"lora": str(model)}, str(root))
    exp = root / "lora"
    (exp / LATEST).write_text("1")
    (exp / "my_notes.txt").write_text("the user's own file: never to be deleted\n")
    return exp


def _checkpoint(exp: Path) -> Path:
    return exp / "global_step_1" / "actor"


# ---- every tool, its output at its own input and at a parent of it --------------------------------------------


def _plot_case(tmp: Path):
    metrics = tmp / "run_a" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    return tmp, lambda out: plot.main([str(metrics), "-o", str(out)]), [metrics, metrics.parent], "--output"


def _memory_plan_case(tmp: Path):
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    run = lambda out: memory_plan.main([f"actor_rollout_ref.model.path={model}", "--out", str(out)])  # noqa: E731
    return tmp, run, [model / "config.json", model], "--out"


def _audit_case(tmp: Path):
    data = tmp / "data" / "train.parquet"
    data.parent.mkdir()
    data.write_bytes(b"PAR1 not read: the output is refused first PAR1")
    reward = tmp / "data" / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    run = lambda out: audit.main(["--data", str(data), "--reward", f"{reward}:compute_score",  # noqa: E731
                                  "--out", str(out), "--timeout-s", "0"])
    return tmp, run, [data, data.parent, reward], "--out"


TOOLS = {"plot": _plot_case, "memory_plan": _memory_plan_case, "reward_audit": _audit_case}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_file_tool_refuses_its_input_and_a_parent_of_it(tool, tmp_path, capsys):
    root, run, outputs, arg = TOOLS[tool](tmp_path)
    before = tree_hash(root)
    for out in outputs:
        code = run(out)
        refused(code, capsys.readouterr().err, arg)
        assert tree_hash(root) == before, (tool, out)


def test_converter_refuses_its_input_and_its_parents_with_overwrite(experiment, capsys):
    ckpt = _checkpoint(experiment)
    before = tree_hash(experiment.parent)
    for out in (ckpt, ckpt / "huggingface", ckpt.parent, experiment, experiment.parent):
        code = converter.main([str(ckpt), str(out), "--overwrite"])
        err = capsys.readouterr().err
        refused(code, err, "OUT_DIR")
        assert tree_hash(experiment.parent) == before, out
    # the step folder as input: its actor/ is read, the step folder and the experiment are its parents
    for out in (ckpt.parent, experiment):
        refused(converter.main([str(ckpt.parent), str(out), "--overwrite"]), capsys.readouterr().err, "OUT_DIR")
    assert tree_hash(experiment.parent) == before
    # --model-path is read too
    model = experiment.parent / "qwen2-tied"
    refused(converter.main([str(ckpt), str(model), "--model-path", str(model), "--overwrite"]),
            capsys.readouterr().err, "--model-path")
    assert tree_hash(experiment.parent) == before


def test_task_builders_refuse_a_cache_in_a_checkpoint_or_a_file(experiment, tmp_path, capsys):
    before = tree_hash(experiment)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for main in (builtin_task._main, agent_task._main):
        for cache in (experiment, _checkpoint(experiment), a_file):
            refused(main(["--cache-dir", str(cache), "--quick"]), capsys.readouterr().err, "--cache-dir")
    assert tree_hash(experiment) == before and a_file.read_text() == "x"


# ---- the issue's row -----------------------------------------------------------------------------------------


def test_issue_row_output_is_the_experiment_folder(experiment, capsys):
    ckpt = _checkpoint(experiment)
    before = tree_hash(experiment)
    assert (experiment / "my_notes.txt").is_file() and (experiment / LATEST).is_file()
    code = converter.main([str(ckpt), str(experiment), "--overwrite"])
    err = capsys.readouterr().err
    refused(code, err, "OUT_DIR")
    assert "contains the checkpoint" in err and str(ckpt) in err
    assert tree_hash(experiment) == before
    assert not [p for p in experiment.parent.iterdir() if "hflow-tmp" in p.name or p.name.endswith(".incomplete")]


# The converter's command line in a fresh interpreter, the cases one after another, each in its working
# folder (one interpreter for them all: each start costs seconds of importing torch).
_COMMAND_LINES = """
import contextlib, io, json, os, sys
from hflow.cli import convert_checkpoint
for cwd, argv in json.loads(sys.argv[1]):
    os.chdir(cwd)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = convert_checkpoint.main(argv)
    print(json.dumps([code, err.getvalue()]))
"""


def test_output_dot_inside_the_experiment_is_refused_without_a_traceback(experiment):
    """`.` as given on a command line, in a fresh interpreter: before, a traceback (Path('.').name is '')."""
    ckpt = _checkpoint(experiment)
    before = tree_hash(experiment)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cases = [(str(experiment), [str(ckpt), ".", "--overwrite"]), (str(experiment), [str(ckpt), "."]),
             (str(ckpt), [str(ckpt), ".", "--overwrite"])]
    proc = subprocess.run([sys.executable, "-c", _COMMAND_LINES, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(cases), proc.stdout
    for code, err in results:
        refused(code, err, "OUT_DIR .")
    assert tree_hash(experiment) == before


def test_output_holding_or_inside_another_checkpoint_is_refused(experiment, tmp_path, capsys):
    """Not the input, but a run's checkpoints all the same: an experiment root, a folder holding one deeper,
    a folder inside one; and a folder of the user's that is not an earlier output of the converter."""
    ckpt = _checkpoint(experiment)
    other = tmp_path / "other_exp"
    (other / "global_step_7" / "actor").mkdir(parents=True)
    (other / "global_step_7" / "actor" / "weights").write_text("another run's checkpoint")
    holder = tmp_path / "holder"
    (holder / "runs" / "exp" / "global_step_2").mkdir(parents=True)
    (holder / "config.json").write_text("{}")
    models = tmp_path / "my_models"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "config.json").write_text("{}")
    (models / "README.md").write_text("mine")
    before = tree_hash(tmp_path)
    for out, words in ((other, "training checkpoint folder"), (other / "hf", "training checkpoint folder"),
                       (holder, "holds the training checkpoint folder"), (models, "was not written by hflow")):
        code = converter.main([str(ckpt), str(out), "--overwrite"])
        err = capsys.readouterr().err
        refused(code, err, "OUT_DIR")
        assert words in err, err
    assert tree_hash(tmp_path) == before


def test_path_arguments_end_in_one_paragraph(experiment, tmp_path, capsys):
    ckpt = _checkpoint(experiment)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [([str(tmp_path / "missing"), str(tmp_path / "o")], "does not exist"),
             ([str(a_file), str(tmp_path / "o")], "is not a folder"),
             ([".", str(tmp_path / "o")], "not a checkpoint folder"),
             ([str(ckpt), str(a_file), "--overwrite"], "is a file"),
             ([str(ckpt), str(a_file / "hf")], "is a file, not a folder")]
    for argv, words in cases:
        code = converter.main(argv)
        err = capsys.readouterr().err
        assert code == 2 and words in err and "Traceback" not in err, (argv, err)
        assert err.startswith("hflow: error: ") and len(err.strip().splitlines()) == 1, err
    assert a_file.read_text() == "x"
    assert plot.main([str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "p.png")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert plot.main([str(a_file), "-o", str(tmp_path / "p.png")]) == 2  # not JSON lines
    assert capsys.readouterr().err.startswith("hflow: error: ")
    refused(memory_plan.main(["--out", str(tmp_path)]), capsys.readouterr().err, "--out")
    refused(audit.main(["--data", str(a_file), "--out", str(a_file)]), capsys.readouterr().err, "--out")
    from hflow.sandbox.__main__ import main as sandbox_main

    with pytest.raises(SystemExit) as stop:
        sandbox_main([str(tmp_path)])
    assert stop.value.code == 2 and "cannot read file" in capsys.readouterr().err


# ---- --overwrite deletes only what hflow wrote (issue 53) ----------------------------------------------------


def test_overwrite_never_deletes_a_file_the_converter_did_not_write(experiment, tmp_path, capsys):
    """The issue's row: `mydocs` holds a config.json and the user's thesis.txt (and no subfolder, which is what
    the converter took for its own earlier output): --overwrite refuses it. So does an earlier output of the
    converter into which the user has put a file: the manifest lists what the converter wrote, and the message
    names the rest. Nothing is deleted; once the user's file is moved out, --overwrite works."""
    ckpt = _checkpoint(experiment)
    mydocs = tmp_path / "mydocs"
    mydocs.mkdir()
    (mydocs / "config.json").write_text('{"model_type": "qwen2"}')
    (mydocs / "thesis.txt").write_text("four years of work\n")
    before = tree_hash(tmp_path)
    code = converter.main([str(ckpt), str(mydocs), "--overwrite"])
    err = capsys.readouterr().err
    refused(code, err, f"OUT_DIR {mydocs}")
    assert "was not written by hflow" in err and MANIFEST in err and "new or empty folder" in err
    assert tree_hash(tmp_path) == before

    out = tmp_path / "hf"
    assert converter.main([str(ckpt), str(out)]) == 0
    assert "config.json" in json.loads((out / MANIFEST).read_text())["files"]
    (out / "thesis.txt").write_text("four years of work\n")
    (out / "notes").mkdir()
    (out / "notes" / "a.md").write_text("mine too")
    before = tree_hash(tmp_path)
    code = converter.main([str(ckpt), str(out), "--overwrite", "--dtype", "bfloat16"])
    err = capsys.readouterr().err
    refused(code, err, f"OUT_DIR {out}")
    assert "notes/, notes/a.md, thesis.txt" in err and "Move them out" in err, err
    assert tree_hash(tmp_path) == before

    (out / "thesis.txt").rename(tmp_path / "thesis.txt")
    shutil.rmtree(out / "notes")
    assert converter.main([str(ckpt), str(out), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert (tmp_path / "thesis.txt").read_text() == "four years of work\n"


def test_hf_export_replaces_only_its_own_folder(tmp_path):
    """The trainer's Hugging Face export (`save_hf_model`: SFT / RM / DPO's trainer.hf_output_dir, the actor's
    export) replaces an earlier export, never a folder with a file it did not write."""
    from transformers import AutoModelForCausalLM

    from hflow.workers.fsdp.checkpoint import save_hf_model

    model = AutoModelForCausalLM.from_pretrained(build_causal_lm(tmp_path / "model"))
    out = tmp_path / "export"
    save_hf_model(model, out)
    save_hf_model(model, out)  # its own earlier export: replaced
    (out / "thesis.txt").write_text("mine")
    before = tree_hash(tmp_path)
    with pytest.raises(OutputError, match=r"trainer.hf_output_dir .*export holds what hflow did not write there "
                                          r"\(thesis.txt"):
        save_hf_model(model, out, arg="trainer.hf_output_dir")
    assert tree_hash(tmp_path) == before


def test_sft_refuses_an_export_folder_it_did_not_write_before_training(tmp_path):
    from hydra import compose, initialize_config_dir

    from hflow import CONFIG_DIR
    from hflow.trainer.supervised_trainer import check_stage_config
    from hflow.utils.errors import ConfigError

    mydocs = tmp_path / "mydocs"
    mydocs.mkdir()
    (mydocs / "thesis.txt").write_text("mine")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="sft_trainer", overrides=[f"trainer.hf_output_dir={mydocs}"])
    with pytest.raises(ConfigError, match=f"trainer.hf_output_dir {mydocs} is not empty and was not written by hflow"):
        check_stage_config(config, "sft")
    assert (mydocs / "thesis.txt").read_text() == "mine"


# ---- an overwrite that is asked for works, and is atomic -----------------------------------------------------


def test_overwrite_of_an_earlier_output_replaces_it_atomically(experiment, tmp_path, monkeypatch, capsys):
    ckpt = _checkpoint(experiment)
    out = tmp_path / "hf"
    assert converter.main([str(ckpt), str(out)]) == 0
    first = tree_hash(out)
    assert converter.main([str(ckpt), str(out), "--dtype", "bfloat16"]) == 2  # no --overwrite: refused
    assert "--overwrite" in capsys.readouterr().err and tree_hash(out) == first

    def dies(*args, **kwargs):
        raise OSError(28, "No space left on device", str(out))

    with monkeypatch.context() as patch:  # dies while reading the shards: the old output stays
        patch.setattr(converter, "_read", dies)
        assert converter.main([str(ckpt), str(out), "--overwrite", "--dtype", "bfloat16"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert tree_hash(out) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left beside it

    import safetensors.torch as st

    with monkeypatch.context() as patch:  # dies after the first file of the new folder was written
        patch.setattr(st, "save_file", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            converter.convert_checkpoint(ckpt, out, dtype="bfloat16", overwrite=True)
    assert tree_hash(out) == first and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]

    assert converter.main([str(ckpt), str(out), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert (out / "config.json").is_file() and (out / MANIFEST).is_file()
    assert tree_hash(out)["model.safetensors"] != first["model.safetensors"]  # bf16 now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_file_outputs_are_replaced_atomically(tmp_path, monkeypatch, capsys):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 1, "critic/score/mean": 0.5}\n{"step": 2, "critic/score/mean": 0.7}\n')
    png = tmp_path / "curves.png"
    png.write_bytes(b"an earlier plot")

    def half_written(files, output, labels=None):
        Path(output).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device", str(output))

    with monkeypatch.context() as patch:
        patch.setattr(plot, "plot_runs", half_written)
        assert plot.main([str(metrics), "-o", str(png)]) == 2
    assert png.read_bytes() == b"an earlier plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "run"]
    assert plot.main([str(metrics), "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and oct(png.stat().st_mode & 0o777) != "0o600"
