"""The ranking stage: DLRM over the candidates.

Its files: spec.py (what the serving machinery reads), options.py (its own settings, if any),
contract.py, core.py, servicer.py, artifacts.py."""

#: The stage's name: its process, its flags' group, its metrics label.
NAME = "ranking"
