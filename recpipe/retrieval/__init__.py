"""The retrieval stage: user tower -> query embedding -> FAISS / exact top-k.

Its files: spec.py (what the serving machinery reads), options.py (its own settings, if any),
contract.py, core.py, servicer.py, artifacts.py; config.py and folded.py
(the model config and the numpy user tower: what the CPU path reads, without torch)."""

#: The stage's name: its process, its flags' group, its metrics label.
NAME = "retrieval"
