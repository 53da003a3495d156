"""The example at the head of `improved.testing` runs as it is printed: a mesh-service author
who copies it into a coroutine gets a real broker, a real daemon and a registered proposal."""

from __future__ import annotations

import textwrap

import improved.testing


def docstring_example() -> str:
    """The indented block of the module docstring, as source."""
    doc = improved.testing.__doc__ or ""
    block = doc.split(":\n\n", 1)[1].split("\n\n`nats_server`", 1)[0]
    return textwrap.dedent(block)


async def test_the_testing_docstring_example_runs_as_printed():
    code = docstring_example()
    assert "MeshClient(nc, " in code and "import" in code  # every name it uses, it imports
    body = textwrap.indent(code, "    ")
    scope: dict[str, object] = {}
    exec(compile(f"async def example():\n{body}\n", "improved.testing docstring", "exec"), scope)
    await scope["example"]()  # type: ignore[operator]
