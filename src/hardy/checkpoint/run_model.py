"""A training run directory as a model: its config, the newest complete checkpoint's weights and the
dataset's tokenizer (what `--model RUN_DIR` loads)."""
from __future__ import annotations

import json
from pathlib import Path

from hardy.errors import HardyError
from hardy.formats.tokenizer import HardyTokenizer
from hardy.model.config import ModelConfig
from hardy.model.transformer import meta_transformer


def newest_checkpoint(run_dir: Path) -> Path:
    # start-up: the checkpoint manager imports torch.distributed.checkpoint (DTensor, sympy: ~0.85 s and
    # ~50 MB), which loading a GGUF or Hugging Face model for inference never needs
    from hardy.checkpoint.manager import step_dirs

    dirs = step_dirs(Path(run_dir) / "checkpoints")
    if not dirs:
        raise HardyError(f"{run_dir}: no complete checkpoint in this run directory")
    return dirs[0][1]


def run_config(run_dir: Path) -> tuple[ModelConfig, Path]:
    """A run directory's model config and the dataset (whose tokenizer it trained with)."""
    config_file = Path(run_dir) / "config.json"
    try:
        resolved = json.loads(config_file.read_text())["resolved"]
        return ModelConfig.from_dict(resolved["model"]), Path(resolved["dataset"])
    except OSError as e:
        raise HardyError(f"{config_file}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise HardyError(f"{config_file}: malformed JSON ({e})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise HardyError(f"{config_file}: not a hardy run config ({type(e).__name__}: {e})") from None


def load_run_model(run_dir: Path):
    """(config, model with the newest complete checkpoint's weights, tokenizer) of a run directory."""
    mcfg, dataset = run_config(run_dir)
    model = meta_transformer(mcfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    from hardy.checkpoint.manager import load_model_weights  # start-up: see newest_checkpoint

    load_model_weights(newest_checkpoint(run_dir), model)
    model.reset_rope()
    return mcfg, model.eval(), HardyTokenizer.from_hf_dir(dataset)
