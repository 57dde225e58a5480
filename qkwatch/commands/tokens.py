"""``qkwatch token create|list|revoke``: API tokens, straight on the collector's database.

A secret is printed once, on stdout (so it pipes), with what it may do on stderr; the store keeps
only its hash.
"""

from __future__ import annotations

import argparse
import sys

from qkwatch.commands.database import database_arg, open_store
from qkwatch.commands.errors import one_line_errors
from qkwatch.commands.tables import table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("token", help="mint, list or revoke API tokens")
    tsub = p.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    c = tsub.add_parser("create", help="mint a token (printed once; only its hash is stored)")
    c.add_argument("--project", required=True, help="project the token acts on ('*' for all projects)")
    c.add_argument(
        "--scope",
        action="append",
        choices=["ingest", "read", "control"],
        required=True,
        help="repeat for several scopes",
    )
    c.add_argument("--name", default=None, help="a name for the audit trail (default: the token id)")
    database_arg(c)
    c.set_defaults(handler=cmd_token_create)
    ls = tsub.add_parser("list", help="list tokens (never their secrets)")
    database_arg(ls)
    ls.set_defaults(handler=cmd_token_list)
    rv = tsub.add_parser("revoke", help="revoke a token by id")
    rv.add_argument("id", help="the token's id (first column of `qkwatch token list`)")
    database_arg(rv)
    rv.set_defaults(handler=cmd_token_revoke)


@one_line_errors("token create")
def cmd_token_create(args: argparse.Namespace) -> int:
    store = open_store(args)
    try:
        row, secret = store.create_token(args.project, sorted(set(args.scope)), args.name)
    finally:
        store.close()
    print(secret)
    print(
        f"token {row.id} ({row.name}) for project {row.project!r} with scopes {', '.join(sorted(row.scopes))}; "
        "it is shown only this once",
        file=sys.stderr,
    )
    return 0


@one_line_errors("token list")
def cmd_token_list(args: argparse.Namespace) -> int:
    store = open_store(args)
    try:
        tokens = store.list_tokens()
    finally:
        store.close()
    rows = [
        [t.id, t.name, t.project, ",".join(sorted(t.scopes)), "revoked" if t.revoked_at else "active"] for t in tokens
    ]
    print(table(["id", "name", "project", "scopes", "state"], rows))
    return 0


@one_line_errors("token revoke")
def cmd_token_revoke(args: argparse.Namespace) -> int:
    store = open_store(args)
    try:
        ok = store.revoke_token(args.id)
    finally:
        store.close()
    if not ok:
        print(f"no token {args.id}", file=sys.stderr)
    return 0 if ok else 1
