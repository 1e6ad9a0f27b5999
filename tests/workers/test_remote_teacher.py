"""The remote teacher (`teacher.url`): a vLLM OpenAI-compatible server, started here on a tiny model, scores the
student's tokens as the colocated teacher worker does on the same folder (sampled-token log-probs and the top-k),
and the preflight probe refuses a server whose tokenizer is not the student's and a model name it does not
serve. (A dead URL is refused in tests/trainer/test_user_errors.py: `remote-teacher-dead-url`.)"""

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from hflow.config_schema import ConfigError
from hflow.tasks.tiny_models import build_causal_lm
from tests.workers.test_teacher_sources import score, student_batch, teacher_config

pytestmark = pytest.mark.slow  # a vLLM server start (about a minute on two cores)

TOPK = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model folder, URL) of `python -m vllm.entrypoints.openai.api_server` on a tiny fp32 model."""
    root = tmp_path_factory.mktemp("remote_teacher")
    model = build_causal_lm(root / "teacher", preset="tiny", seed=3)
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-logprobs", "32"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, (root / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=2).read()
                break
            except OSError:
                assert time.time() < deadline, "the vLLM server did not start in 600 s"
                time.sleep(2)
        yield model, url
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def test_remote_teacher_scores_as_the_colocated_teacher(served, tmp_path):
    from transformers import AutoTokenizer
    from hflow.workers.teacher.scorer import TeacherScorer

    model, url = served
    models = {"policy": model}  # the student shares the teacher's tokenizer (the tiny models' one)
    tokenizer = AutoTokenizer.from_pretrained(model)
    batch = student_batch(tokenizer, ["hflow/arithmetic"] * 3)
    mask = batch.batch["response_mask"].bool()

    remote_config = teacher_config(models, url=url, temperature=1.0)
    remote = TeacherScorer(remote_config, tokenizer).score(batch, TOPK)  # probes the server first
    local = score(teacher_config(models, **{"model.path": str(model)}, temperature=1.0), tokenizer, batch, TOPK)

    torch.testing.assert_close(remote.batch["teacher_log_prob"][mask], local.batch["teacher_log_prob"][mask],
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(remote.batch["teacher_topk_log_probs"][mask],
                               local.batch["teacher_topk_log_probs"][mask], atol=1e-4, rtol=0)
    # the same top-k ids wherever the colocated teacher's k values are not near-ties
    values = local.batch["teacher_topk_log_probs"][mask]
    clear = (values[:, :-1] - values[:, 1:]).min(-1).values > 1e-3
    assert clear.sum() >= clear.numel() // 2, clear
    assert torch.equal(remote.batch["teacher_topk_ids"][mask][clear], local.batch["teacher_topk_ids"][mask][clear])


def test_remote_teacher_refuses_another_tokenizer_or_model_name(served, tmp_path):
    from transformers import AutoTokenizer
    from hflow.workers.teacher.remote import check_remote_teacher

    model, url = served
    config = teacher_config({"policy": model}, url=url, temperature=1.0)
    for vocab, words in ((1024, "tokenizes 'Teacher probe"), (384, "its vocabulary is larger")):
        other = AutoTokenizer.from_pretrained(build_causal_lm(tmp_path / str(vocab), preset="tiny",
                                                              tokenizer_kwargs={"vocab_size": vocab}))
        with pytest.raises(ConfigError, match=f"{words}.* serve a model with the student's tokenizer"):
            check_remote_teacher(config.teacher, other)
    # the JSD term's k above the server's --max-logprobs (32 here)
    with pytest.raises(ConfigError, match="prompt_logprobs=64 .*teacher.topk: lower it, or start vLLM with --max"):
        check_remote_teacher(config.teacher, AutoTokenizer.from_pretrained(model), topk=64)
    config.teacher.url_model = "no-such-model"
    with pytest.raises(ConfigError, match="teacher.url_model=no-such-model is not served"):
        check_remote_teacher(config.teacher, AutoTokenizer.from_pretrained(model))
