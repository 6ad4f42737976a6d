"""The census: what real transformers training code keeps for backward, per token, per layer kind.

``ndplan.census.record`` (pure Python) holds the versioned record format the memory estimator
reads; ``run_census`` (needs the optional ``census`` extra: torch and transformers, imported only
when called) measures it. See docs/census.md.
"""

from ndplan.census.measure import EXTRA_MESSAGE, load_hf_config, run_census
from ndplan.census.record import (
    KNOWN_LAYER_KINDS,
    SCHEMA_VERSION,
    CensusRecord,
    Recompute,
    SavedOp,
    from_json,
    load_census_file,
    save_census_file,
    to_json,
)

__all__ = [
    "EXTRA_MESSAGE",
    "KNOWN_LAYER_KINDS",
    "SCHEMA_VERSION",
    "CensusRecord",
    "Recompute",
    "SavedOp",
    "from_json",
    "load_census_file",
    "load_hf_config",
    "run_census",
    "save_census_file",
    "to_json",
]
