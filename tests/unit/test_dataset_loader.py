"""--dataset MODULE:FACTORY loads from a dotted module or a .py path; every failure is one line."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from odbclient.errors import DatasetLoadError
from odbclient.producer import producer_main
from odbclient.producer.dataset import load_dataset, parse_dataset_args, parse_value

DATASET_SOURCE = textwrap.dedent(
    """
    import numpy as np

    class Lengths:
        def __init__(self, n, scale=1.0, name="x"):
            self.n, self.scale, self.name = n, scale, name

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return {"input_ids": np.arange(i + 1)}

        @classmethod
        def small(cls):
            return cls(2)

    def build(**kwargs):
        return Lengths(**kwargs)

    def broken(**kwargs):
        raise RuntimeError("no data dir")

    def iterable_only():
        return iter([])

    NOT_CALLABLE = 3
    """
)


@pytest.fixture(autouse=True)
def restore_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))


def write_module(directory: Path, source: str = DATASET_SOURCE) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "data.py"
    path.write_text(source)
    return path


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh importable package name holding data.py."""
    name = f"odbd_test_pkg_{uuid.uuid4().hex[:8]}"
    write_module(tmp_path / name)
    (tmp_path / name / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_dataset_args_parse_ints_floats_and_strings() -> None:
    args = parse_dataset_args(["n=10", "scale=0.5", "name=wiki", "path=/a=b", "neg=-3", "e=1e3"])
    assert args == {"n": 10, "scale": 0.5, "name": "wiki", "path": "/a=b", "neg": -3, "e": 1000.0}
    assert parse_value("nan") == "nan" and parse_value("") == ""


@pytest.mark.parametrize("pair", ["novalue", "=3", "bad key=1", "1x=2"])
def test_bad_dataset_args_are_errors(pair: str) -> None:
    with pytest.raises(DatasetLoadError, match="KEY=VALUE"):
        parse_dataset_args([pair])


def test_repeated_dataset_arg_is_an_error() -> None:
    with pytest.raises(DatasetLoadError, match="twice"):
        parse_dataset_args(["n=1", "n=2"])


def test_loads_from_a_dotted_module_with_args(package: str) -> None:
    dataset = load_dataset(f"{package}.data:build", {"n": 5, "scale": 0.5})
    assert len(dataset) == 5 and dataset.scale == 0.5
    assert dataset[2]["input_ids"].tolist() == [0, 1, 2]


def test_loads_a_dotted_factory_attribute(package: str) -> None:
    assert len(load_dataset(f"{package}.data:Lengths.small", {})) == 2


def test_loads_from_a_py_path(tmp_path: Path) -> None:
    path = write_module(tmp_path / "files")
    (tmp_path / "files" / "helper_for_data.py").write_text("VALUE = 1\n")
    dataset = load_dataset(f"{path}:build", {"n": 3})
    assert len(dataset) == 3
    assert str(path.parent) in sys.path  # the file can import its siblings


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "not MODULE:FACTORY"),
        ("odbd_missing_module_xyz:build", "no module named 'odbd_missing_module_xyz'"),
        ("/nonexistent/data.py:build", "does not exist"),
    ],
)
def test_bad_specs_are_errors(spec: str, message: str) -> None:
    with pytest.raises(DatasetLoadError, match=message):
        load_dataset(spec, {})


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("missing", "has no attribute 'missing'"),
        ("NOT_CALLABLE", "not callable"),
        ("broken", r"broken\(\) raised RuntimeError: no data dir"),
        ("iterable_only", "not a map-style dataset"),
    ],
)
def test_bad_factories_are_errors(package: str, factory: str, message: str) -> None:
    with pytest.raises(DatasetLoadError, match=message):
        load_dataset(f"{package}.data:{factory}", {})


def test_factory_given_unknown_args_names_the_call(package: str) -> None:
    with pytest.raises(DatasetLoadError, match=r"build\(n=1, colour='red'\) raised TypeError"):
        load_dataset(f"{package}.data:build", {"n": 1, "colour": "red"})


def test_module_that_raises_on_import_is_an_error(tmp_path: Path) -> None:
    path = write_module(tmp_path, "import odbd_missing_dependency_xyz\n")
    with pytest.raises(DatasetLoadError, match="raised ModuleNotFoundError"):
        load_dataset(f"{path}:build", {})


def test_producer_main_exits_2_with_one_line_on_a_bad_dataset(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = producer_main.main(["--dataset", "odbd_missing_module_xyz:build", "--name", "worker-3"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("worker-3: error: --dataset: no module named") and err.count("\n") == 1
