"""Build the model a manifest names (factory or Hugging Face transformers) and its inputs.

Nothing is ever downloaded: an ``hf`` model is built from its config with random weights (seeded)
or with local weights (a ``.safetensors`` file or a model directory holding them).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from aotc.errors import ManifestError, ModelBuildError
from aotc.manifest import InputSpec, Manifest, factory_path, thaw
from aotc.model.forward import ByName, unwrap

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


def _where(manifest: Manifest) -> str:
    return str(manifest.path) if manifest.path else "<manifest>"


def _import_factory(manifest: Manifest) -> Callable[..., Any]:
    m = manifest.model
    where = f"{_where(manifest)}: model.factory"
    if m.factory_file is not None:
        path = Path(m.factory_file)
        if not path.is_file():
            raise ModelBuildError(f"{where}: file {path} does not exist")
        mod_name = f"aotc_factory_{path.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise ModelBuildError(f"{where}: cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - user code may raise anything
            sys.modules.pop(mod_name, None)
            raise ModelBuildError(f"{where}: importing {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(str(m.factory_module))
        except Exception as e:  # noqa: BLE001 - code we do not own fails in many ways; each is turned into one of ours
            raise ModelBuildError(
                f"{where}: cannot import module {m.factory_module!r} ({type(e).__name__}: {e}); "
                "check the name and that its package is installed"
            ) from e
    obj: Any = module
    for part in str(m.factory_fn).split("."):
        if not hasattr(obj, part):
            raise ModelBuildError(f"{where}: {module.__name__} has no attribute {m.factory_fn!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelBuildError(f"{where}: {m.factory!r} is not callable")
    return obj


def _build_hf(manifest: Manifest) -> torch.nn.Module:
    """As transformers' own loader builds it: ``from_pretrained(dir, dtype=…)`` for a model
    directory, else ``_from_config(config, dtype=…)`` (seeded random weights; a ``.safetensors``
    file is loaded afterwards). Either way the dtype is applied the way transformers applies it,
    so buffers it keeps in float32 (RoPE ``inv_freq``) stay float32, as in the server's model."""
    hf = manifest.model.hf
    if hf is None:
        raise ModelBuildError(f"{_where(manifest)}: model.hf: missing")
    where = f"{_where(manifest)}: model.hf"
    try:
        import transformers
    except ImportError as e:
        raise ModelBuildError(f"{where}: needs the transformers package (pip install transformers)") from e
    cls = getattr(transformers, hf.architecture, None)
    if cls is None:
        raise ModelBuildError(f"{where}.architecture: transformers has no {hf.architecture!r}")
    config_cls = getattr(cls, "config_class", None)
    if config_cls is None:
        raise ModelBuildError(f"{where}.architecture: {hf.architecture} has no config_class")
    dtype = DTYPES[manifest.dtype]
    weights = manifest.model.weights_path
    try:
        config = config_cls(**thaw(hf.config))
        config._attn_implementation = "sdpa"
        torch.manual_seed(manifest.model.seed)
        kw = {_dtype_keyword(transformers): dtype}
        if weights is not None and Path(weights).is_dir():  # safetensors only, nothing downloaded
            model = cls.from_pretrained(str(weights), config=config, use_safetensors=True,
                                        local_files_only=True, **kw)
        else:
            model = cls._from_config(config, **kw)
    except Exception as e:  # noqa: BLE001 - code we do not own fails in many ways; each is turned into one of ours
        raise ModelBuildError(f"{where}: building {hf.architecture} failed: {type(e).__name__}: {e}") from e
    return model


def _dtype_keyword(transformers: Any) -> str:
    """``dtype`` (transformers >= 4.56) or ``torch_dtype`` (older) for ``from_pretrained``."""
    try:
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    except ValueError:
        return "dtype"
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _load_weights(manifest: Manifest, model: torch.nn.Module) -> None:
    path = manifest.model.weights_path
    where = f"{_where(manifest)}: model.weights"
    if path is None or (manifest.model.hf is not None and Path(path).is_dir()):
        return  # an HF model directory was loaded by from_pretrained
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
    if not files or not all(f.is_file() for f in files):
        raise ModelBuildError(f"{where}: no .safetensors file at {path}")
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ModelBuildError(f"{where}: needs the safetensors package") from e
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing:
        raise ModelBuildError(f"{where}: {files[0].name} lacks {len(missing)} tensors, e.g. {missing[0]!r}")
    if unexpected:
        raise ModelBuildError(f"{where}: {files[0].name} has unknown tensor {unexpected[0]!r}")


def by_name(model: torch.nn.Module, manifest: Manifest) -> ByName:
    """``model`` (the user's module, or one already wrapped) called as the manifest declares;
    an input name its forward has no parameter for is a ``ManifestError`` naming both."""
    inner = unwrap(model)
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):  # a builtin forward: nothing to check against
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                         inspect.Parameter.KEYWORD_ONLY)}
    for i, spec in enumerate(manifest.inputs):
        if params and not takes_any and spec.name not in named:
            raise ManifestError(str(manifest.path or "<manifest>"), f"inputs[{i}].name",
                                f"{type(inner).__name__}.forward has no parameter {spec.name!r} "
                                f"(it takes {', '.join(params) or 'nothing'}); inputs are passed "
                                "by name")
    return ByName(inner, [s.name for s in manifest.inputs], manifest.model.output)


def build_model(manifest: Manifest) -> torch.nn.Module:
    """The model the manifest names, in eval mode on its device and dtype, built as its own
    loader builds it (HF: :func:`_build_hf`; a factory's result is cast with ``.to(dtype)``).
    This is the user's module itself: wrap it with :func:`by_name` to call it as declared."""
    m = manifest.model
    with factory_path(manifest):
        if m.hf is not None:
            model = _build_hf(manifest)
        else:
            factory = _import_factory(manifest)
            torch.manual_seed(m.seed)
            try:
                model = factory(**thaw(m.kwargs))
            except Exception as e:  # noqa: BLE001 - code we do not own fails in many ways; each is turned into one of ours
                raise ModelBuildError(
                    f"{_where(manifest)}: model.factory: {m.factory}(**kwargs) raised "
                    f"{type(e).__name__}: {e}"
                ) from e
            if not isinstance(model, torch.nn.Module):
                raise ModelBuildError(
                    f"{_where(manifest)}: model.factory: {m.factory} returned "
                    f"{type(model).__name__}, not a torch.nn.Module"
                )
    _load_weights(manifest, model)
    try:
        if m.hf is not None:
            model = model.to(device=manifest.device).eval()
        else:
            model = model.to(device=manifest.device, dtype=DTYPES[manifest.dtype]).eval()
    except (RuntimeError, AssertionError) as e:
        raise ModelBuildError(f"{_where(manifest)}: device: cannot move the model to "
                              f"{manifest.device}: {e}") from e
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def make_input(spec: InputSpec, n: int, device: str, gen: torch.Generator) -> torch.Tensor:
    """One generated input with ``n`` tokens in its ``tokens`` dim."""
    shape = [n if d == "tokens" else int(d) for d in spec.shape]
    dtype = DTYPES[spec.dtype]
    if spec.fill == "arange":
        numel = 1
        for s in shape:
            numel *= s
        t = (torch.arange(numel, dtype=torch.int64) + int(spec.low)).reshape(shape).to(dtype)
    elif spec.fill == "zeros":
        t = torch.zeros(shape, dtype=dtype)
    elif spec.fill == "ones":
        t = torch.ones(shape, dtype=dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    elif not dtype.is_floating_point:
        t = torch.randint(int(spec.low), int(spec.high or 2), shape, generator=gen, dtype=dtype)
    elif spec.high is not None:
        t = (torch.rand(shape, generator=gen) * (spec.high - spec.low) + spec.low).to(dtype)
    else:
        t = torch.randn(shape, generator=gen).to(dtype)
    return t.to(device)


def make_inputs(manifest: Manifest, n: int, seed: int = 0) -> list[torch.Tensor]:
    """The forward's inputs for ``n`` tokens in the manifest's order, deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + n)
    return [make_input(s, n, manifest.device, gen) for s in manifest.inputs]


def make_named_inputs(manifest: Manifest, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`make_inputs` by input name (``model(**inputs)``)."""
    return {s.name: t for s, t in zip(manifest.inputs, make_inputs(manifest, n, seed))}


def dynamic_dims(manifest: Manifest) -> list[int | None]:
    """The token dim of each input (None where it has none)."""
    return [s.token_dim for s in manifest.inputs]
