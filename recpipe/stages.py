"""The registry of recpipe's stages: the one list of which stages exist, built from their specs.

Each stage package declares itself in ``recpipe/<stage>/spec.py`` (``SPEC``: name, port, options,
thread libraries, the stages it calls, builder) and owns its contract (``contract.py``), pure core
(``core.py``), thin servicer (``servicer.py``) and artifacts (``artifacts.py``); none imports another.
``recpipe serve``, the supervisor's launch, the in-process chain, the benches and the tables read
names and options from ``registry()``; ``serving/`` knows a stage only through its spec. Importing the
specs is cheap: a stage's heavy modules are imported only when it is built.

``$RECPIPE_REGISTRY=module:attribute`` names another ``Registry`` for ``recpipe serve`` and the stage
processes it starts (an extension's own stages, or the toy stages of the tests).
"""

from __future__ import annotations

import importlib
import os

from recpipe.errors import UsageError
from recpipe.features.spec import SPEC as FEATURES
from recpipe.gateway.spec import SPEC as GATEWAY
from recpipe.ranking.spec import SPEC as RANKING
from recpipe.retrieval.spec import SPEC as RETRIEVAL
from recpipe.serving.spec import Registry

#: Upstream first: the order the supervisor starts the processes in.
REGISTRY = Registry([FEATURES, RETRIEVAL, RANKING, GATEWAY])
REGISTRY_ENV = "RECPIPE_REGISTRY"


def registry() -> Registry:
    """recpipe's stages, or the registry ``$RECPIPE_REGISTRY`` names."""
    name = os.environ.get(REGISTRY_ENV)
    if not name:
        return REGISTRY
    module, _, attr = name.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr or "REGISTRY")
    except (ImportError, AttributeError) as e:
        raise UsageError(f"${REGISTRY_ENV}={name}: {e}") from None
    if not isinstance(found, Registry):
        raise UsageError(f"${REGISTRY_ENV}={name}: not a recpipe.serving.spec.Registry")
    return found
