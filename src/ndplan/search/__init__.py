"""Strategy search: the space, the run (rules, memory, time, ranking) and the Pareto front."""

from ndplan.search.run import OVER_MEMORY, SearchResult, pareto_front, run_search, runtime_step_time
from ndplan.search.space import DIMENSIONS, SearchSpace, default_space

__all__ = ["DIMENSIONS", "OVER_MEMORY", "SearchResult", "SearchSpace", "default_space", "pareto_front", "run_search", "runtime_step_time"]
