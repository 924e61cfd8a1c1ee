"""The `tiletune` command line: one thin function per verb, each calling a module below.

A `UserError` anywhere becomes one line on stderr and exit code 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import sys

import click

from tiletune.errors import UserError


class _Group(click.Group):
    """A click group that turns a UserError into one line and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as err:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"tiletune: error: {err}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.version_option(package_name="tiletune")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Fine-tune LLMs with LLaMA-Factory configs and verified TileLang kernels."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


# ---- train (issue: tiletune train) ------------------------------------------------------------


@main.command(context_settings={"ignore_unknown_options": False})
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--dry-run", is_flag=True, help="Validate the config, load the model and tokenize the data; do not train.")
def train(config: str, overrides: tuple[str, ...], dry_run: bool) -> None:
    """Fine-tune from a LLaMA-Factory-style CONFIG (YAML/JSON), with key=value OVERRIDES."""
    from tiletune.config import load_config
    from tiletune.train import run_train

    run_train(load_config(config, overrides), dry_run=dry_run)
