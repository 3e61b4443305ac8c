"""The package folder a look-up downloads is the one a model's MLmodel names, inside the model: the
MLmodel comes from the artifact store (outside bytes), and only that folder is fetched beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from registry.errors import ArtifactMissingError
from registry.lookup import package_in, package_path


def _model(folder: Path, path: object) -> Path:
    flavor = {"loader_module": "mlflow.pyfunc.model", "artifacts": {"package": {"path": path}}}
    (folder / "MLmodel").write_text(yaml.safe_dump({"flavors": {"python_function": flavor}}))
    return folder


def test_the_named_folder_is_read_before_it_is_downloaded(tmp_path: Path) -> None:
    model = _model(tmp_path, "artifacts/package")
    assert package_path(model) == "artifacts/package"
    with pytest.raises(ArtifactMissingError, match="missing"):
        package_in(model)  # named, not downloaded yet
    (model / "artifacts" / "package").mkdir(parents=True)
    assert package_in(model) == model / "artifacts" / "package"


@pytest.mark.parametrize("path", ["../outside", "/etc", "", ".", 7, None])
def test_a_folder_outside_the_model_or_none_is_refused(tmp_path: Path, path: object) -> None:
    with pytest.raises(ArtifactMissingError, match="package artifact"):
        package_path(_model(tmp_path, path))
