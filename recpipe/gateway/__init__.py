"""The gateway: the chain AugmentUser -> Retrieve -> AugmentItems -> Rank behind RecommendService.

Its files: spec.py (what the serving machinery reads), options.py (its own settings, if any),
chain.py, clients.py, admission.py, readiness.py, servicer.py."""

#: The stage's name: its process, its flags' group, its metrics label.
NAME = "gateway"

#: The stages the chain calls (each reached through its target).
UPSTREAM = ("features", "retrieval", "ranking")
#: Which of them runs each timed step of a query (``recpipe.config.STEPS``).
STEP_STAGES = {"augment_user": "features", "retrieve": "retrieval", "augment_items": "features", "rank": "ranking"}
