"""RFC 6962 Merkle tree hashes over the audit log, whole or carried forward. Pure.

A checkpoint commits to every trailer there was by the Merkle tree hash of their hashes in
stream order. Recomputing it from the first leaf costs the whole history; the *frontier* — the
roots of the perfect subtrees that make up a tree of `count` leaves, largest first, one per set
bit of `count` — is all that is needed to add leaves and take the root again (the compact range
of a transparency log). A checkpoint keeps its frontier, so the next one hashes only what is new.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

Frontier = tuple[str, ...]  # hex subtree roots, largest subtree first


def leaf_hash(leaf_hex: str) -> bytes:
    return hashlib.sha256(b"\x00" + bytes.fromhex(leaf_hex)).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def merkle_root(hashes: Sequence[str]) -> str:
    """RFC 6962 Merkle tree hash over hex leaf hashes (empty tree: SHA-256 of nothing)."""
    return root(extend((), 0, hashes))


def extend(frontier: Frontier, count: int, leaves: Iterable[str]) -> Frontier:
    """The frontier of a tree of `count` leaves with `leaves` (hex) appended after them."""
    tree = Tree(frontier, count)
    for leaf in leaves:
        tree.add(leaf)
    return tree.frontier()


def root(frontier: Frontier) -> str:
    """The tree hash of the leaves a frontier stands for: RFC 6962 splits a tree at the
    largest power of two below its size, so the subtrees fold together from the right."""
    return _fold([bytes.fromhex(h) for h in frontier])


def _fold(nodes: list[bytes]) -> str:
    if not nodes:
        return hashlib.sha256(b"").hexdigest()
    acc = nodes[-1]
    for node in reversed(nodes[:-1]):
        acc = _node(node, acc)
    return acc.hex()


class Tree:
    """A tree that grows one leaf at a time, held as nothing but its frontier."""

    __slots__ = ("_nodes", "count")

    def __init__(self, frontier: Frontier = (), count: int = 0):
        self._nodes = [bytes.fromhex(h) for h in frontier]
        self.count = count

    def add(self, leaf_hex: str) -> None:
        self._nodes.append(leaf_hash(leaf_hex))
        self.count += 1
        for _ in range((self.count & -self.count).bit_length() - 1):  # subtrees it completes
            right = self._nodes.pop()
            self._nodes.append(_node(self._nodes.pop(), right))

    def frontier(self) -> Frontier:
        return tuple(n.hex() for n in self._nodes)

    def root(self) -> str:
        return _fold(self._nodes)


def leaf_of(claimed: object) -> str:
    """A trailer's claimed hash as a leaf: itself when it is 64 hex, else the empty leaf, so
    that a tampered trailer (named by its chain's check) still takes its place in the tree
    and no root it is under holds."""
    return claimed if isinstance(claimed, str) and well_formed((claimed,), 1) else ""


def well_formed(frontier: object, count: int) -> bool:
    """A frontier has one 64-hex subtree root per set bit of `count`."""
    return (isinstance(frontier, tuple | list) and len(frontier) == bin(count).count("1")
            and all(isinstance(h, str) and len(h) == 64 and _hex(h) for h in frontier))


def _hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True
