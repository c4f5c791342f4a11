"""The feature stage: Polars-encoded user and item rows gathered by position, history aggregates.

Its files: spec.py (what the serving machinery reads), contract.py, core.py, servicer.py, artifacts.py."""

#: The stage's name: its process, its flags' group, its metrics label.
NAME = "features"
