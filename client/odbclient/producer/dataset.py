"""Loading the user's dataset from `--dataset MODULE:FACTORY` and `--dataset-arg KEY=VALUE`.

MODULE is a dotted module name (importable from sys.path) or a path to a `.py` file;
FACTORY is an attribute of it (dots allowed: `Class.from_config`), called as
`FACTORY(**dataset_args)`; the result must be map-style: `len(ds)` and `ds[i]`.
Every failure is a DatasetLoadError whose one-line message names the input and the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from odbclient.errors import DatasetLoadError


def parse_dataset_args(pairs: Sequence[str]) -> dict[str, int | float | str]:
    """`["n=10", "scale=0.5", "name=x"]` -> `{"n": 10, "scale": 0.5, "name": "x"}`."""
    args: dict[str, int | float | str] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise DatasetLoadError(
                f"--dataset-arg {pair!r} is not KEY=VALUE with KEY a Python identifier; "
                "write e.g. --dataset-arg num_samples=1000"
            )
        if key in args:
            raise DatasetLoadError(f"--dataset-arg {key} is given twice; pass each key once")
        args[key] = parse_value(text)
    return args


def parse_value(text: str) -> int | float | str:
    """An int if it reads as one, else a float if it reads as a number, else the string."""
    try:
        return int(text)
    except ValueError:
        pass
    if any(ch.isdigit() for ch in text):  # "nan"/"inf" stay strings: likely meant as words
        try:
            return float(text)
        except ValueError:
            pass
    return text


def load_dataset(spec: str, args: Mapping[str, Any]) -> Any:
    """`FACTORY(**args)` of `spec` = "MODULE:FACTORY", checked to be a map-style dataset."""
    factory = load_factory(spec)
    try:
        dataset = factory(**args)
    except Exception as exc:
        raise DatasetLoadError(
            f"--dataset {spec}: {_call_text(spec, args)} raised {type(exc).__name__}: {exc}"
        ) from exc
    _check_map_style(spec, dataset)
    return dataset


def load_factory(spec: str) -> Any:
    module_name, sep, attr_path = spec.rpartition(":")
    if not sep or not module_name or not attr_path:
        raise DatasetLoadError(
            f"--dataset {spec!r} is not MODULE:FACTORY; write e.g. --dataset my_pkg.data:build "
            "or --dataset ./data.py:build"
        )
    target: Any = _import(module_name)
    for attr in attr_path.split("."):
        if not hasattr(target, attr):
            raise DatasetLoadError(
                f"--dataset {spec}: module {module_name} has no attribute {attr_path!r}; "
                "check the name after the colon"
            )
        target = getattr(target, attr)
    if not callable(target):
        raise DatasetLoadError(
            f"--dataset {spec}: {attr_path} is a {type(target).__name__}, not callable; name a "
            "function or class that returns the dataset"
        )
    return target


def _import(module_name: str) -> ModuleType:
    if module_name.endswith(".py") or os.sep in module_name:
        return _import_file(module_name)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise DatasetLoadError(
                f"--dataset: no module named {module_name!r} (sys.path starts {sys.path[:3]}); "
                "add its directory to PYTHONPATH or pass the path to its .py file"
            ) from None
        raise DatasetLoadError(f"--dataset: importing {module_name} failed: {exc}") from exc
    except Exception as exc:
        raise DatasetLoadError(
            f"--dataset: importing {module_name} raised {type(exc).__name__}: {exc}"
        ) from exc


def _import_file(path_text: str) -> ModuleType:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise DatasetLoadError(f"--dataset: file {path_text} does not exist (resolved {path})")
    name = f"odbd_dataset_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise DatasetLoadError(f"--dataset: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # like `python file.py`: siblings import
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise DatasetLoadError(
            f"--dataset: running {path} raised {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _check_map_style(spec: str, dataset: Any) -> None:
    refusal = _not_rows(spec, dataset)
    if refusal is not None:
        raise DatasetLoadError(refusal)
    try:
        len(dataset)
        has_getitem = hasattr(dataset, "__getitem__")
    except Exception:
        has_getitem = False
    if not has_getitem:
        raise DatasetLoadError(
            f"--dataset {spec} returned {_a(type(dataset).__name__)}, which is not a map-style "
            "dataset (len(ds) and ds[i]); samples are leased by index, so an iterable-only "
            "dataset cannot be served; wrap it in a map-style one (a streamed Hugging Face "
            "dataset: load it without streaming=True, or Dataset.from_generator)"
        )


def _not_rows(spec: str, dataset: Any) -> str | None:
    """Why a result with len() and [] is still not indexable by sample: a mapping (a
    DatasetDict of splits, a dict of columns), whose len() counts its keys and whose ds[0]
    raises KeyError; or a torch IterableDataset, whose inherited __getitem__ raises. Either
    used to start a job in which every sample was rejected as preprocess_error."""
    kind = type(dataset).__name__
    if isinstance(dataset, Mapping):
        keys = [str(k) for k in list(dataset.keys())[:6]]
        return (
            f"--dataset {spec} returned {_a(kind)} with keys {keys}, a mapping (of splits or "
            "columns), not a dataset of rows: len() would count its keys and ds[i] fail for "
            "every sample; return one split (e.g. ds['train'], or load_dataset(..., "
            "split='train')) or a datasets.Dataset of the rows"
        )
    if any(
        c.__name__ == "IterableDataset" and c.__module__.startswith("torch.utils.data")
        for c in type(dataset).__mro__
    ):
        return (
            f"--dataset {spec} returned {_a(kind)}, a torch IterableDataset: it is read by "
            "iteration only (its ds[i] raises NotImplementedError, even with a __len__), but "
            "samples are leased by index; subclass torch.utils.data.Dataset with __getitem__ "
            "instead (a streamed Hugging Face dataset: load it without streaming=True, or "
            "build a datasets.Dataset with Dataset.from_generator)"
        )
    return None


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _call_text(spec: str, args: Mapping[str, Any]) -> str:
    factory = spec.rpartition(":")[2]
    return f"{factory}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
