"""Entry point of the `warninglight` command: builds the Typer app from the command modules."""

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Is this run failing, and where?")


@app.callback()
def main() -> None:
    """Warning Light: per-component health traces and the forensics that read them."""
