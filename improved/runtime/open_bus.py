"""The embedded server's open bus (`improved run` without accounts): open to every client
but for one thing, the daemon's own inboxes.

Whoever sees a request may answer it first, and on a bus with no users everyone sees the
daemon's JetStream appends (with their reply subjects) and its API requests. So the server
is given two users in its global account: `improved`, the daemon, with a password of the
data directory's own (`<data_dir>/open-bus/improved.pw`, 0600 in a 0700 directory), and
`anyone`, the user every client without credentials is (`no_auth_user`), which may publish
and subscribe anything except under `DAEMON_INBOX`. The daemon connects as `improved` with
that inbox prefix, so an acknowledgement, a message get or a stream's info reaches it from
the server alone, by construction. Its requests to services are answered under the open
`_INBOX` (`client.answers.service_reply_prefix`): who answered those is what a service's
signature says, as before. The streams stay in the global account: a data directory run
open before keeps its loop.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from improved.client.answers import DAEMON_INBOX
from improved.runtime.accounts import password_in, private_dir, write_private

DIR = "open-bus"
SERVER_BLOCK = "nats.conf"
DAEMON_USER = "improved"
ANYONE = "anyone"  # every client that connects without credentials


def directory(data_dir: Path) -> Path:
    return Path(data_dir) / DIR


def password_file(data_dir: Path) -> Path:
    return directory(data_dir) / f"{DAEMON_USER}.pw"


def server_block(daemon_password: str, anyone_password: str) -> str:
    """The users of the open bus: the daemon, and everyone else barred from its inboxes."""
    reserved = f'"{DAEMON_INBOX}.>"'
    return ("# Written by `improved run` (the open bus) at every start: every client without\n"
            "# credentials is `anyone`, free to publish and subscribe anything but the\n"
            "# daemon's inboxes; the daemon is `improved`, password in improved.pw.\n\n"
            "authorization {\n  users: [\n"
            f'    {{user: "{DAEMON_USER}", password: "{daemon_password}"}}\n'
            f'    {{user: "{ANYONE}", password: "{anyone_password}", permissions: {{\n'
            f"      publish: {{deny: [{reserved}]}}\n"
            f"      subscribe: {{deny: [{reserved}]}}\n"
            "    }}\n  ]\n}\n"
            f'no_auth_user: "{ANYONE}"\n')


def prepare(data_dir: Path) -> str:
    """The daemon's password (made on the first start, kept after) and the server's block,
    written; the line that includes the block in the server's configuration. `anyone`'s
    password is new at every start and kept nowhere: no one logs in as `anyone`."""
    private = private_dir(directory(data_dir))
    block = server_block(password_in(password_file(data_dir)), secrets.token_urlsafe(24))
    write_private(private / SERVER_BLOCK, block)
    return f'include "{DIR}/{SERVER_BLOCK}"\n'
