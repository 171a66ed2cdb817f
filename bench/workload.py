"""What ``vmm-core bench --model`` captures: a built-in model or the user's own factory.

A *workload* is ``(fn, example_inputs)``: the function every graph captures and its
inputs at the largest batch, batch dimension first, on the benchmark's device.  Built-in
models and user factories go through the same loader and the same checks, so a factory
that works here works in every benchmark child.

The factory contract (also in docs/benchmarks.md)::

    def factory(*, device, dtype, max_batch, seed):
        ...
        return fn, example_inputs

``device`` is a ``torch.device``, ``dtype`` the ``torch.dtype`` asked for with ``--dtype``,
``max_batch`` the largest of ``--sizes`` and ``seed`` the ``--seed``.  A factory may leave
out parameters it does not use.  ``example_inputs`` is a tensor or a tuple of tensors
whose dim 0 is ``max_batch``; ``fn(*inputs[:n])`` must work for every ``n <= max_batch``
and return a tensor or a tuple of tensors with the batch first.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from typing import Any, Callable, Mapping

from .errors import EXIT_BAD_MODEL, BenchModelError

__all__ = ["Workload", "BUILTIN_MODELS", "MODEL_OPTIONS", "LLAMA_MODELS", "DTYPES",
           "EXIT_BAD_MODEL",
           "load_workload", "resolve_factory", "check_options", "llama_model",
           "check_eager", "fresh_inputs", "relative_error"]

#: the parameters a factory may take, all passed by keyword
FACTORY_PARAMETERS = ("device", "dtype", "max_batch", "seed")

#: options of the built-in models (CLI flags --layers, --hidden, ...) and their defaults
MODEL_OPTIONS = {
    "mlp": {"layers": 4, "hidden": 4096, "ffn": 14336},
    "llama": {"layers": 4, "hidden": 2048, "ffn": 5632, "heads": 32, "kv_heads": 4, "ctx": 64},
    # Llama-3-8B's shape (random init): 32 layers of about 218M parameters, about 15 GB in
    # bf16 with the KV cache of 512 sequences; --layers N shortens it
    "llama8b": {"layers": 32, "hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8,
                "ctx": 64},
}

#: the built-in models that are transformers Llama stacks (the engine-runner scenarios)
LLAMA_MODELS = ("llama", "llama8b")


#: ``--dtype`` choices (names of torch dtypes)
DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass
class Workload:
    """One benchmark model, built on one device."""

    name: str          # "mlp", "llama" or the user's "package.module:factory"
    fn: Callable
    inputs: tuple      # example inputs at the largest batch, batch first
    description: str   # one line for the report


def _mlp(*, device, dtype, max_batch, seed, layers, hidden, ffn):
    import torch

    from .models import DecodeMLP

    model = DecodeMLP(hidden, ffn, layers, dtype=dtype, device=device, seed=seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(max_batch, hidden, generator=gen).to(device, dtype)
    return model, (x,)


def _llama(*, device, dtype, max_batch, seed, layers, hidden, ffn, heads, kv_heads, ctx):
    import torch

    from .models import LlamaStack

    try:
        model = LlamaStack(layers=layers, hidden=hidden, ffn=ffn, heads=heads,
                           kv_heads=kv_heads, ctx=ctx, max_batch=max_batch, dtype=dtype,
                           device=device, seed=seed)
    except ImportError as exc:
        raise BenchModelError(f"--model llama/llama8b: {exc}") from exc
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(max_batch, hidden, generator=gen).to(device, dtype)
    return model, (x,)


BUILTIN_MODELS: dict[str, Callable] = {"mlp": _mlp, "llama": _llama, "llama8b": _llama}


def _describe_builtin(name: str, options: dict, dtype) -> str:
    bits = str(dtype).replace("torch.", "")
    if name == "mlp":
        return (f"{options['layers']}-layer {bits} SwiGLU MLP (hidden {options['hidden']}, "
                f"ffn {options['ffn']})")
    return (f"{options['layers']} transformers LlamaDecoderLayers, {bits} (hidden "
            f"{options['hidden']}, ffn {options['ffn']}, {options['heads']} heads, "
            f"{options['kv_heads']} kv heads, {options['ctx']} cached tokens per sequence)")


def resolve_factory(spec: str) -> Callable:
    """The callable ``spec`` names: ``"mlp"``, ``"llama"`` or ``"package.module:factory"``.

    The current directory is importable, as for ``python -m``: ``vmm-core`` is a console
    script whose ``sys.path`` would not otherwise contain it.
    """
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or not all(
            part.isidentifier() for part in module_name.split(".") + attr.split(".")):
        builtin = ", ".join(f"'{name}'" for name in BUILTIN_MODELS)
        raise BenchModelError(f"--model {spec!r}: expected a built-in model ({builtin}) or "
                              f"'package.module:factory' (a module path, a colon, and the "
                              f"name of a callable in that module)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise BenchModelError(f"--model {spec!r}: importing {module_name!r} failed with "
                              f"{type(exc).__name__}: {exc}. Install the package, or run "
                              f"from the directory that contains it (or set PYTHONPATH)"
                              ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BenchModelError(f"--model {spec!r}: module {module_name!r} has no "
                                  f"attribute {attr!r}") from None
    if not callable(obj):
        raise BenchModelError(f"--model {spec!r}: {attr!r} is a {type(obj).__name__}, not "
                              f"a callable factory")
    return obj


def llama_model(name: str | None, scenario: str) -> str:
    """The Llama preset a scenario that runs the transformers Llama stack builds:
    ``name``, or ``llama`` when none was given; any other model is refused."""
    name = name or "llama"
    if name not in LLAMA_MODELS:
        raise BenchModelError(f"--scenario {scenario} runs a transformers Llama stack: "
                              f"--model {' or '.join(LLAMA_MODELS)}, not {name!r}")
    return name


def check_options(spec: str, options: Mapping[str, int] | None) -> dict:
    """The options a model takes, defaults filled in: built-in models take the keys of
    ``MODEL_OPTIONS``; a factory builds its own model and takes none."""
    options = {k: v for k, v in (options or {}).items() if v is not None}
    if spec in BUILTIN_MODELS:
        unknown = sorted(set(options) - set(MODEL_OPTIONS[spec]))
        if unknown:
            flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
            takes = ", ".join("--" + k.replace("_", "-") for k in MODEL_OPTIONS[spec])
            raise BenchModelError(f"--model {spec} has no option {flags}; it takes "
                                  f"{takes}")
        return {**MODEL_OPTIONS[spec], **options}
    if options:
        flags = ", ".join("--" + k.replace("_", "-") for k in sorted(options))
        raise BenchModelError(f"--model {spec!r}: {flags} configure the built-in models "
                              f"only; a factory builds its own model")
    return {}


def _factory_kwargs(spec: str, factory: Callable, offered: dict) -> dict:
    """The subset of ``offered`` the factory's signature takes; refuse what we cannot give."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: give it everything
        return dict(offered)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    missing = [name for name, p in params.items()
               if p.default is p.empty and name not in offered
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        raise BenchModelError(
            f"--model {spec!r}: the factory needs {', '.join(map(repr, missing))}, which "
            f"vmm-core bench does not pass; it passes only {', '.join(FACTORY_PARAMETERS)} "
            f"(by keyword). Give the other parameters defaults")
    return {k: v for k, v in offered.items() if k in params}


def load_workload(spec: str, *, device, dtype, max_batch: int, seed: int = 0,
                  options: Mapping[str, int] | None = None) -> Workload:
    """Build the model ``spec`` names on ``device`` and check what the factory returned.

    :param options: overrides of the built-in models' options (``MODEL_OPTIONS``); a
        user factory takes none, since it builds its own model.
    """
    import torch

    factory = resolve_factory(spec)
    options = check_options(spec, options)
    device = torch.device(device)
    if max_batch < 1:
        raise BenchModelError(f"max_batch must be >= 1, got {max_batch}")
    offered = {"device": device, "dtype": dtype, "max_batch": max_batch, "seed": seed}
    if spec in BUILTIN_MODELS:
        kwargs = {**offered, **options}
        description = _describe_builtin(spec, options, dtype)
    else:
        kwargs = _factory_kwargs(spec, factory, offered)
        description = f"factory {spec}"
    try:
        returned = factory(**kwargs)
    except BenchModelError:
        raise
    except Exception as exc:
        raise BenchModelError(f"--model {spec!r}: the factory raised {type(exc).__name__}: "
                              f"{exc}") from exc
    fn, inputs = _check_returned(spec, returned, device=device, max_batch=max_batch)
    shapes = ", ".join(f"[{', '.join(map(str, t.shape))}] {str(t.dtype).replace('torch.', '')}"
                       for t in inputs)
    if spec not in BUILTIN_MODELS:
        description += f" (inputs {shapes})"
    return Workload(spec, fn, inputs, description)


def _check_returned(spec: str, returned, *, device, max_batch: int) -> tuple[Callable, tuple]:
    import torch

    if not isinstance(returned, (tuple, list)) or len(returned) != 2:
        raise BenchModelError(f"--model {spec!r}: the factory must return (fn, "
                              f"example_inputs); it returned {_kind(returned)}")
    fn, inputs = returned
    if not callable(fn):
        raise BenchModelError(f"--model {spec!r}: the factory returned (fn, inputs) with fn "
                              f"a {type(fn).__name__}, which is not callable")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not inputs or not all(
            isinstance(t, torch.Tensor) for t in inputs):
        raise BenchModelError(f"--model {spec!r}: example_inputs must be a tensor or a "
                              f"non-empty tuple of tensors; got {_kind(inputs)}")
    for i, t in enumerate(inputs):
        if t.dim() == 0 or t.shape[0] != max_batch:
            raise BenchModelError(
                f"--model {spec!r}: example input {i} has shape {tuple(t.shape)}; every "
                f"input needs the batch first, at max_batch={max_batch} (the largest of "
                f"--sizes)")
        if t.device != device and not (t.device.type == device.type and device.index is None):
            raise BenchModelError(f"--model {spec!r}: example input {i} lives on {t.device}, "
                                  f"the benchmark runs on {device}: build the model and its "
                                  f"inputs on the `device` the factory is given")
    return fn, tuple(inputs)


def _kind(obj) -> str:
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)}: " + \
            ", ".join(type(o).__name__ for o in obj[:4])
    return f"a {type(obj).__name__}"


def _flat(out) -> list:
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        return list(out)
    raise BenchModelError(f"the model must return a tensor or a tuple of tensors, got "
                          f"{_kind(out)}")


def check_eager(workload: Workload, n: int | None = None) -> list[tuple]:
    """Run the model eagerly at batch ``n`` (default: the largest) and check its outputs.

    Returns the output shapes.  This is what a CPU-only machine can check of a factory
    before it goes to a device.
    """
    import torch

    n = n or workload.inputs[0].shape[0]
    with torch.no_grad():
        out = workload.fn(*(t[:n] for t in workload.inputs))
    try:
        flat = _flat(out)
    except BenchModelError as exc:
        raise BenchModelError(f"--model {workload.name!r}: {exc}") from None
    for o in flat:
        if o.dim() == 0 or o.shape[0] != n:
            raise BenchModelError(f"--model {workload.name!r}: at batch {n} the model returned "
                                  f"shape {tuple(o.shape)}; outputs need the batch first")
    return [tuple(o.shape) for o in flat]


def fresh_inputs(example: tuple, n: int, seed: int) -> tuple:
    """Inputs at batch ``n`` that no capture saw: floating inputs drawn from a standard
    normal, integer and bool inputs as random rows of the example (so token ids and the
    like stay valid)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for t in example:
        if t.is_floating_point() or t.is_complex():
            out.append(torch.randn((n,) + tuple(t.shape[1:]), generator=gen)
                       .to(t.device, t.dtype))
        else:
            rows = torch.randint(0, t.shape[0], (n,), generator=gen).to(t.device)
            out.append(t[rows].clone())
    return tuple(out)


def relative_error(got, ref) -> float:
    """The largest error over the outputs: relative norm for floating outputs, the
    fraction of differing elements for the others.  NaN or inf means wrong."""

    errors = []
    for g, r in zip(_flat(got), _flat(ref), strict=True):
        if g.shape != r.shape:
            errors.append(float("inf"))
        elif r.is_floating_point() or r.is_complex():
            g, r = g.double(), r.double()
            scale = r.norm().item()
            errors.append((g - r).norm().item() / (scale if scale > 0 else 1.0))
        else:
            errors.append((g != r).double().mean().item() if r.numel() else 0.0)
    if any(e != e for e in errors):  # NaN: max() would hide it
        return float("nan")
    return max(errors)
