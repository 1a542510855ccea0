"""The ``aotc`` command line: thin click commands over the library.

Each command parses its options, calls one library function and prints. ``AotcError`` becomes a
one-line message and the error's exit code. Store commands never import torch.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from aotc.cli.bundle_commands import export_command, import_command
from aotc.cli.common import AotcClickError, AppContext, run_cli
from aotc.cli.compile_commands import register as register_compile_commands
from aotc.cli.remote_commands import pull_command, push_command
from aotc.cli.store_commands import gc_command, inspect_group, verify_command
from aotc.cli.trust_commands import keygen_command, sign_command

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--store", "store_path", default=None, metavar="DIR|s3://BUCKET/PREFIX|oci://HOST/REPO",
              help="Store directory (default: $AOTC_STORE, else $XDG_CACHE_HOME/aotc, else "
                   "~/.cache/aotc), or a remote store URL (the default directory caches it).")
@click.option("--remote", "remote_url", default=None, metavar="s3://BUCKET/PREFIX|oci://HOST/REPO",
              help="Remote store for push, pull and pull-through (default: $AOTC_REMOTE).")
@click.option("--endpoint-url", default=None, metavar="URL",
              help="S3-compatible endpoint (default: $AOTC_S3_ENDPOINT, else boto3's configuration).")
@click.option("--max-size", "max_size", default=None, metavar="SIZE",
              help="Bound the local store (e.g. 10G, 500M): after each put the least recently "
                   "used entries are evicted while it is over (default: $AOTC_MAX_SIZE, else none).")
@click.version_option(package_name="aotc")
@click.pass_context
def cli(ctx: click.Context, store_path: str | None, remote_url: str | None,
        endpoint_url: str | None, max_size: str | None) -> None:
    """aotc: compile a PyTorch model ahead of time, keep the artifacts in a store, warm-start fast."""
    from dataclasses import replace

    from aotc.errors import SettingsError
    from aotc.log import configure
    from aotc.settings import Settings, parse_max_size

    try:
        settings = Settings.from_env()  # the environment, read once for the whole command
    except SettingsError as err:  # a bad AOTC_* value: one line naming it, not a traceback
        raise AotcClickError(err) from None
    configure(settings.log or "warning")  # the library's warnings, one line each on stderr
    source = "AOTC_MAX_SIZE"
    if max_size is not None:
        try:
            settings = replace(settings, max_size=parse_max_size(max_size, "--max-size"))
        except SettingsError:
            raise click.BadParameter(f"not a size: {max_size!r} (use e.g. 500M, 10G)",
                                     param_hint="--max-size") from None
        source = "--max-size"
    ctx.obj = AppContext(store_path, remote_url, endpoint_url, settings=settings,
                         max_size_source=source)


cli.add_command(inspect_group)
cli.add_command(verify_command)
cli.add_command(gc_command)
cli.add_command(keygen_command)
cli.add_command(sign_command)
cli.add_command(export_command)
cli.add_command(import_command)
cli.add_command(push_command)
cli.add_command(pull_command)

register_compile_commands(cli)  # they import torch inside their callbacks only


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point."""
    return run_cli(cli, sys.argv[1:] if argv is None else argv)
