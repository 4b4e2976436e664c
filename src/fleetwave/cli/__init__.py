"""The ``fleetwave`` command line (Typer + Rich)."""
