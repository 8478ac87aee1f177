"""``python -m awa_sa`` runs the ``awa-sa`` command, for when the script is not on PATH."""

from awa_sa.tools.cli import main

if __name__ == "__main__":
    main(prog_name="awa-sa")
