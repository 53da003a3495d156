"""The suite's own environment, made when this module is first imported — by tests/conftest.py,
before any test module, and so in every xdist worker: HOME, XDG_STATE_HOME (where a daemon's
data directory is by default) and XDG_CONFIG_HOME in a temporary directory, and no IMPROVED_*
variable of the developer's. Nothing here may import what copies the environment first."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# What the suite itself reads of the environment, kept: CI's demand that the browser test run.
SUITE_SETTINGS = frozenset({"IMPROVED_REQUIRE_BROWSER"})


def _hermetic() -> Path:
    """The suite never reads the developer's state: HOME, XDG_STATE_HOME (where the daemon's
    data directory is by default) and XDG_CONFIG_HOME point into a temporary directory, and
    every IMPROVED_* variable the developer set is gone (a test that needs one sets its own).
    Done when this file is imported, before any test module is (tests/cli.py copies the
    environment once), and so in every xdist worker."""
    root = Path(tempfile.mkdtemp(prefix="improved-tests-home-"))
    browsers = Path.home() / ".cache" / "ms-playwright"  # a tool's cache, not our state
    if "PLAYWRIGHT_BROWSERS_PATH" not in os.environ and browsers.is_dir():
        os.environ["PLAYWRIGHT_BROWSERS_PATH"] = str(browsers)
    for name, sub in (("HOME", "home"), ("XDG_STATE_HOME", "state"),
                      ("XDG_CONFIG_HOME", "config")):
        (root / sub).mkdir()
        os.environ[name] = str(root / sub)
    for name in [n for n in os.environ if n.startswith("IMPROVED_")]:
        if name not in SUITE_SETTINGS:
            del os.environ[name]
    return root


HERMETIC_ROOT = _hermetic()
