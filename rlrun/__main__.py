"""``python -m rlrun`` and ``torchrun ... -m rlrun``: the typer app in ``rlrun.cli``."""

from rlrun.cli import app

if __name__ == "__main__":
    app(prog_name="rlrun")
