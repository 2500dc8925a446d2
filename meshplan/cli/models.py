"""The models the commands plan: a factory (`MODULE:FACTORY` or `path/file.py:FACTORY`) or a Hugging Face
config (`--hf config.json --batch B --seq S`), built on the meta device."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

FACTORY_FORMS = "MODULE:FACTORY such as meshplan.models:gpt_small, or path/file.py:FACTORY"


def load_factory(target: str):
    """`MODULE:FACTORY` or `path/file.py:FACTORY` -> (model, example_inputs, example_kwargs)."""
    source, sep, attr = target.rpartition(":")
    if not sep or not source or not attr:
        raise ValueError(f"expected {FACTORY_FORMS}; got {target!r}")
    module = _load_file(source, target) if source.endswith(".py") else _import(source, target)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{source} has no callable {attr!r}; callables there: {', '.join(_callables(module)) or 'none'}")
    made = factory()
    from torch import nn

    if isinstance(made, nn.Module):
        if not callable(getattr(made, "example_inputs", None)):
            raise ValueError(f"{target} returned a model without an example_inputs() method; return (model, example_inputs) instead")
        made = (made, made.example_inputs())
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not isinstance(made[0], nn.Module):
        raise ValueError(
            f"{target} returned {type(made).__name__}; allowed: (model, example_inputs), (model, example_inputs, "
            "example_kwargs) or a model with an example_inputs() method"
        )
    model, inputs = made[0], made[1]
    kwargs = made[2] if len(made) == 3 else None
    return model, inputs if isinstance(inputs, tuple) else (inputs,), kwargs


def _import(module_name: str, target: str):
    if os.getcwd() not in sys.path:  # the console script does not put the working directory on the path
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} of {target!r}: {e}") from None
    except TypeError:  # importlib's words for a name with leading dots ('./x' is no module name)
        raise ValueError(f"{module_name!r} of {target!r} is not a module name; expected {FACTORY_FORMS}") from None


def _load_file(path: str, target: str):
    """The module of a .py file, loaded as `python file.py` would run it: its directory on the import path."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ValueError(f"no file {path!r} (from {target!r}; looked for {file})")
    taken = sys.modules.get(file.stem)
    if taken is not None and getattr(taken, "__file__", None) != str(file):
        raise ValueError(f"{path!r} has the name of module {file.stem!r}, already imported from "
                         f"{getattr(taken, '__file__', None) or 'the interpreter'}; rename the file")
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))  # so it imports the modules beside it
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module  # dataclasses and pickle look a class's module up by name
    spec.loader.exec_module(module)
    return module


def _callables(module) -> list[str]:
    return sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:12]


def hf_model(config: str, batch: int, seq: int):
    """A Hugging Face causal LM built from its `config.json` (a file, or the directory holding it) on the meta
    device in fp32 (the planner prices mixed precision itself), with `batch` x `seq` tokens as inputs and
    `labels`, so the traced step includes the loss, as a Hugging Face user trains."""
    path = Path(config)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():  # checked here: transformers would take a missing path for a Hub model name and go online
        raise ValueError(f"--hf {config!r}: no such file; give a Hugging Face config.json or the directory holding one")
    try:
        import transformers
    except ImportError:
        raise ValueError("--hf needs transformers: pip install transformers") from None
    import torch

    try:
        cfg = transformers.AutoConfig.from_pretrained(str(file), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--hf {config!r} is not a Hugging Face model config: {str(e).splitlines()[0]}") from None
    positions = getattr(cfg, "max_position_embeddings", None)
    if positions is not None and seq > positions:
        raise ValueError(f"--seq {seq} exceeds the model's max_position_embeddings {positions}; allowed: 1..{positions}")
    cfg.use_cache = False
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    except ValueError as e:
        raise ValueError(f"--hf {config!r}: {cfg.model_type!r} has no causal language model class: {str(e).splitlines()[0]}") from None
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (tokens,), {"labels": tokens}
