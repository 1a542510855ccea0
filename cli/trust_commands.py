"""``aotc keygen``, ``aotc sign``: signing keys and signed entries (``aotc.fleet.trust``). No torch."""

from __future__ import annotations

import click

from aotc.cli.common import AppContext, guard, pass_app, print_json
from aotc.cli.options import json_option


@click.command("keygen")
@click.argument("path", type=click.Path(dir_okay=False))
@pass_app
@guard
def keygen_command(app: AppContext, path: str) -> None:
    """Write a new ed25519 signing key to PATH (mode 0600) and print its public key, the value
    to put in AOTC_TRUST_KEYS / --trust on the machines that load."""
    from aotc.fleet.trust import generate_key

    click.echo(generate_key(path))


@click.command("sign")
@click.argument("keys", nargs=-1)
@click.option("--key", "key_file", required=True, type=click.Path(dir_okay=False, exists=True),
              help="Private key file written by `aotc keygen`.")
@click.option("--all", "sign_all", is_flag=True, help="Sign every entry in the store.")
@json_option
@pass_app
@guard
def sign_command(app: AppContext, keys: tuple[str, ...], key_file: str, sign_all: bool,
                 as_json: bool) -> None:
    """Sign stored entries (KEYS: keys or unique prefixes of >= 8 hex chars, or --all)."""
    from aotc.fleet.trust import sign_entry
    from aotc.lookup.explain import resolve_key

    if not keys and not sign_all:
        raise click.UsageError("name the entries to sign (KEYS) or pass --all")
    app.local_only("sign")  # sign locally, then `aotc push` publishes the signatures
    store = app.store
    targets = store.keys() if sign_all else [resolve_key(store, k) for k in keys]
    signed = {k: sign_entry(store, k, key_file) for k in targets}
    if as_json:
        print_json({"signed": sorted(signed), "public_key": next(iter(signed.values()), None)})
        return
    for k, public in signed.items():
        click.echo(f"signed {k[:16]}… with {public[:16]}…")
    click.echo(f"{len(signed)} entries signed")
