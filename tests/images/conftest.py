"""The four images `make images` builds, started from their pod specs (tests/images/podman.py).

Without the images these tests skip, saying how to build them; under `make test`
(POSTTRAIN_REQUIRE_IMAGES=1, set after `make images` ran) a missing image fails instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .podman import missing_images


@pytest.fixture(scope="module")
def images_built(request: pytest.FixtureRequest) -> None:
    """The images the test module names in ``IMAGES`` exist."""
    missing = [name for name in missing_images() if name in request.module.IMAGES]
    if not missing:
        return
    why = f"images not built: {', '.join(missing)} (run `make images`; needs podman and runc)"
    if os.environ.get("POSTTRAIN_REQUIRE_IMAGES") == "1":
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """Host directories that back the containers' volumes (world-traversable for non-root)."""
    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:
        if parent == Path(os.sep):
            break
        if not os.access(parent, os.X_OK):
            pytest.skip(f"{parent} is not traversable by non-root container users")
    yield tmp_path
